"""FedNL with each compressor from theta = 0 on w8a under its three step options (none, shift, project), 40 rounds
or ||grad f|| <= 1e-9, BLAS at one thread:

    python benchmarks/fednl_step_options_from_zero.py
"""

import os
import time

import numpy as np
from threadpoolctl import threadpool_limits

from fedconvex.algorithms import make_algorithm
from fedconvex.data import load_dataset, paper_split_sizes, sequential_split
from fedconvex.problem import FederatedLogReg
from fedconvex.run import Diverged, run

ds = load_dataset("w8a")
n, m = paper_split_sizes("w8a")
p = FederatedLogReg(ds.X, ds.y, sequential_split(ds.n, n, m), lam=1e-3)
d = p.d
nup = d * (d + 1) // 2
zero = np.zeros(d)
cfgs = [
    ("topk", {"compressor": "topk", "k": d}),
    ("toplek", {"compressor": "toplek", "k": d}),
    ("rank1", {"compressor": "rankr", "rank": 1}),
    ("randk", {"compressor": "randk", "k": d, "alpha": d / nup}),
    ("natural", {"compressor": "natural", "alpha": 8 / 9}),
]
rounds = 2 if os.environ.get("FEDPM_BENCH_TINY") == "1" else 40  # tiny: two rounds of two compressors
if rounds == 2:
    cfgs = cfgs[:2]
with threadpool_limits(1):
    for name, kw in cfgs:
        for opt in ("none", "shift", "project"):
            t = time.perf_counter()
            try:
                _, h = run(
                    p, make_algorithm("fednl", option=opt, **kw), zero, rounds, stop=lambda r: r["grad_norm"] <= 1e-9
                )
                print(
                    f"{name:8s} {opt:8s} rounds {h[-1]['round']:3d} grad {h[-1]['grad_norm']:.2e} "
                    f"{time.perf_counter() - t:.2f}s"
                )
            except Diverged as e:
                print(name, opt, "diverged", e)
