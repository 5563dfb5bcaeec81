# runs against commit 121f2b4 (fedpm_dnn.cpu_solves), which was reverted: see README.md here
"""A vectorized-engine CPU FedPM round (bench_dnn's CPU size: 10 clients x 300 images, 5 epochs, SimpleCNN) with the
per-step FOOF solves split over the torch threads (cpu_solves, the default) and kept whole on one thread, and a
FedAvg round beside them; the three alternated, median of the timed rounds:

    PYTHONPATH=. python results/cpu-bench-2026-11-26/session3/split_solves_rounds.py [threads] [repeats]
"""
import sys

import numpy as np
import torch

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
torch.set_num_threads(threads)
from fedpm_dnn import cpu_solves  # noqa: E402
from validation.bench_dnn import SIZES, _rounds  # noqa: E402

size = SIZES[("cnn", "cpu")]
default = cpu_solves.MIN_SPLIT_WORK
times = {"fedavg": [], "fedpm split": [], "fedpm whole": []}
for _ in range(repeats):
    times["fedavg"] += _rounds("cnn", "fedavg", "cpu", size, "vectorized")[0]
    cpu_solves.MIN_SPLIT_WORK = default
    times["fedpm split"] += _rounds("cnn", "fedpm", "cpu", size, "vectorized")[0]
    cpu_solves.MIN_SPLIT_WORK = float("inf")
    times["fedpm whole"] += _rounds("cnn", "fedpm", "cpu", size, "vectorized")[0]
    cpu_solves.MIN_SPLIT_WORK = default
med = {k: float(np.median(v)) for k, v in times.items()}
print(f"torch threads {threads}; {repeats} repeats x {size[3] - 1} timed rounds; median round seconds:")
for k, v in med.items():
    print(f"  {k:12s} {v:.3f} s   / fedavg {v / med['fedavg']:.3f}")
