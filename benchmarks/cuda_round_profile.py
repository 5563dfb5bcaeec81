"""Profile one vectorized FedAvg and one FedPM round (after a warm-up round) on CUDA."""

import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fedpm_dnn.simulation import run_experiment
from validation.bench_dnn import FoofTimer, _experiment

dev = os.environ.get("DEV", "cuda")
per = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
for method in ("fedavg", "fedpm"):
    exp = _experiment("cnn", method, dev, 10, per, 1, 2, "vectorized")
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    state = {}

    def on_round(row, hist):
        if len(hist) == 1:
            (torch.cuda.synchronize() if dev == "cuda" else None)
            prof.__enter__()
            state["t"] = time.perf_counter()

    with FoofTimer(dev) as timer:
        h = run_experiment(exp, on_round=on_round)
        (torch.cuda.synchronize() if dev == "cuda" else None)
    prof.__exit__(None, None, None)
    print(
        f"== {method}: round seconds {[round(r['client_seconds'] + r['server_seconds'], 3) for r in h]}, "
        f"FOOF seconds (both rounds) {timer.seconds:.3f}"
    )
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(e.count for e in ka if "Synchronize" in e.key or e.key == "cudaMemcpyAsync")
    print(f"kernel launches in profiled round: {launches}; sync/memcpy calls: {syncs}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=45))
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(ka.table(sort_by=key, row_limit=12, max_name_column_width=45))
            break
        except Exception as exc:
            print("sort", key, exc)
