"""One FedPM run alone against 3 stacked (one chunk, and chunks of 10) on the CPU, alternated twice in one process.

    OMP_NUM_THREADS=1 python benchmarks/stack_chunks_cpu.py

SimpleCNN, 10 clients x 100 images x 1 epoch, 3 rounds (the first untimed); seconds per round of each
(reference/benchmarks/2026-11-27-cpu/stack_chunks_cpu.log).
"""

import json
import os
import time

import numpy as np
import torch

from validation.bench_dnn import BenchRun, _stack_round_seconds

TINY = os.environ.get("FEDPM_BENCH_TINY") == "1"  # a tiny run: 3 clients x 8 images, one alternation
SIZE = (3, 8, 1, 2) if TINY else (10, 100, 1, 3)


def main():
    torch.set_num_threads(1)
    res = {"single": [], "stack3": [], "stack3_chunk10": []}
    for _ in range(1 if TINY else 2):
        run = BenchRun("cnn", "cpu", SIZE)
        res["single"] += _stack_round_seconds(run, 1)
        res["stack3"] += _stack_round_seconds(run, 3)
        res["stack3_chunk10"] += _stack_round_seconds(run.but(chunk=10), 3)
        print(json.dumps(res), flush=True)
    med = {k: float(np.median(v)) for k, v in res.items()}
    summary = {
        "median": med,
        "speedup_one_chunk": 3 * med["single"] / med["stack3"],
        "speedup_chunk10": 3 * med["single"] / med["stack3_chunk10"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
