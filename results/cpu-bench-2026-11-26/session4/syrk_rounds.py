"""Whole FedPM rounds (bench_dnn's SimpleCNN size: 10 clients x 300 images x 5 epochs) with the FOOF Grams by
syrk and by torch's product, alternated, both engines, at the torch thread count given (default 1): the
round's seconds and its local-training part (round less FOOF statistics, factorisations and server), rounds
after the first, two runs of each.  At 2 threads fedpm_dnn.gram does not use syrk; ``syrk2`` forces it with
SciPy's BLAS on two threads (the variant measured and dropped).

    PYTHONPATH=. python results/cpu-bench-2026-11-26/session4/syrk_rounds.py [threads] [modes]"""
import sys

import torch

from fedpm_dnn import gram
from validation import bench_dnn

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["syrk", "torch"]
torch.set_num_threads(threads)
real_on, real_limit = gram.syrk_on_cpu, gram._controller().limit


def use(mode):
    gram.syrk_on_cpu = {"syrk": real_on, "torch": lambda dtype: False,
                        "syrk2": lambda dtype: dtype in gram._SYRK}[mode]
    gram._controller().limit = (lambda limits: real_limit(limits=2)) if mode == "syrk2" else real_limit


for rep in range(2):
    for engine in ("sequential", "vectorized"):
        for mode in modes:
            use(mode)
            parts, _, _ = bench_dnn._rounds("cnn", "fedpm", "cpu", (10, 300, 5, 3), engine)
            secs = [p["seconds"] for p in parts]
            train = [p["seconds"] - p["statistics"] - p["factorisations"] - p["server"] for p in parts]
            stats = [p["statistics"] for p in parts]
            print(f"run {rep} {engine:10s} {mode:5s} round " + " ".join(f"{s:.2f}" for s in secs) + " s; training "
                  + " ".join(f"{s:.2f}" for s in train) + " s; FOOF statistics " + " ".join(f"{s:.2f}" for s in stats)
                  + " s", flush=True)
