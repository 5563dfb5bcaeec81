"""Vectorized FedAvg vs FedPM (graphed solves, and eager) round times, alternated (CNN, paper's 10 x 5000 x 5)."""

import json
import os
import sys

import numpy as np

from validation.bench_dnn import _rounds

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 2
size = (10, 5000, 5, 3)
runs = [("fedavg", "1"), ("fedpm", "1"), ("fedpm", "0")]
t = {r: [] for r in runs}
for r in range(reps):
    for m, g in runs:
        os.environ["FEDPM_CUDA_GRAPHS"] = g
        secs, fs, mb, ch = _rounds("cnn", m, "cuda", size, "vectorized")
        t[(m, g)] += secs
        print(
            r,
            m,
            "graphs" if g == "1" else "eager",
            [round(s, 3) for s in secs],
            "foof",
            [round(f, 3) for f in fs],
            flush=True,
        )
med = {f"{m}_graphs{g}": float(np.median(v)) for (m, g), v in t.items()}
print(
    json.dumps(
        {
            "size": size,
            "repeats": reps,
            "rounds": {f"{m}_graphs{g}": v for (m, g), v in t.items()},
            "median": med,
            "fedpm_over_fedavg_graphs": med["fedpm_graphs1"] / med["fedavg_graphs1"],
            "fedpm_over_fedavg_eager": med["fedpm_graphs0"] / med["fedavg_graphs1"],
        }
    )
)
