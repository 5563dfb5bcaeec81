"""torch.profiler of one vectorized FedAvg and one FedPM round (the second; the first warms up) of SimpleCNN at
bench_dnn's synthetic data: operators, CUDA kernel launches and syncs, the costliest calls by host and device time.

    python benchmarks/cuda_round_profile.py [images per client] [--device cuda|cpu] [--clients N]

On a CPU it profiles the same round (no kernel launches; the host time is the work itself)."""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from fedpm_dnn.engine.simulation import run_experiment
from validation.bench_dnn import BenchRun, FoofTimer, _experiment
from validation.common import OneLineParser

p = OneLineParser(prog="python benchmarks/cuda_round_profile.py")
p.add_argument("images", nargs="?", type=int, default=5000, help="images per client (default 5000)")
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
p.add_argument("--clients", type=int, default=10)
p.add_argument("--rows", type=int, default=22, help="rows of each table")
args = p.parse_args()
dev = args.device
cuda = dev.startswith("cuda")


def sync():
    if cuda:
        torch.cuda.synchronize()


for method in ("fedavg", "fedpm"):
    exp = _experiment(BenchRun("cnn", dev, (args.clients, args.images, 1, 2), method=method))
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    state = {}

    def on_round(row, hist):
        if len(hist) == 1:
            sync()
            prof.__enter__()
            state["t"] = time.perf_counter()

    with FoofTimer(dev) as timer:
        h = run_experiment(exp, on_round=on_round)
        sync()
    prof.__exit__(None, None, None)
    foof_seconds = ", ".join(f"{k} {v:.3f}" for k, v in timer.seconds.items())
    print(
        f"== {method}: round seconds {[round(r['client_seconds'] + r['server_seconds'], 3) for r in h]}, "
        f"FOOF seconds (both rounds): {foof_seconds}"
    )
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(e.count for e in ka if "Synchronize" in e.key or e.key == "cudaMemcpyAsync")
    ops = sum(e.count for e in ka if e.key.startswith("aten::"))
    print(f"profiled round: aten operators {ops}; kernel launches {launches}; sync/memcpy calls {syncs}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=45))
    if cuda:
        print(ka.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=45))
