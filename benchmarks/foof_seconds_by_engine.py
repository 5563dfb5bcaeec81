"""A FedPM round and its FOOF seconds (statistics + factorisations, bench_dnn.FoofTimer) with each engine at
bench_dnn's CPU size, two alternated runs each, torch at two threads:

    python benchmarks/foof_seconds_by_engine.py

Measured 2026-11-26 on the 2-core CPU: sequential round 2.283 s, FOOF 0.248 s; vectorized round 2.028 s, FOOF 0.281
s."""

import numpy as np
import torch

torch.set_num_threads(2)
from validation.bench_dnn import SIZES, _rounds  # noqa: E402 (after the thread count is set)

size = SIZES[("cnn", "cpu")]
res = {"sequential": [], "vectorized": []}
for _rep in range(2):
    for eng in res:
        secs, fs, mb, ch = _rounds("cnn", "fedpm", "cpu", size, eng)
        res[eng].append((np.median(secs), np.median(fs)))
for eng, v in res.items():
    print(eng, f"round {np.median([a for a, b in v]):.3f} s, foof {np.median([b for a, b in v]):.3f} s")
