"""Vectorized FedAvg against FedPM round times (FedPM with the CUDA graphs and without: FEDPM_CUDA_GRAPHS=1 and 0;
under the default --step-graph auto the graph is the whole local step, fedpm_dnn.engine.step_graph), alternated in one
process; SimpleCNN at the paper's 10 clients x 5,000 images x 5 epochs unless --sizes says otherwise.

    python benchmarks/cuda_fedavg_fedpm_round_ratio.py [repeats] [--device cuda|cpu] [--sizes C,N,E,R]

On a CPU there is no graph: both FedPM rows are the eager solves."""

import json
import os

import numpy as np
import torch

from validation.bench_dnn import BenchRun, _rounds
from validation.common import OneLineParser

p = OneLineParser(prog="python benchmarks/cuda_fedavg_fedpm_round_ratio.py")
p.add_argument("repeats", nargs="?", type=int, default=2)
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
p.add_argument("--sizes", default="10,5000,5,3", help="clients,images per client,local epochs,rounds")
args = p.parse_args()
size = tuple(int(v) for v in args.sizes.split(","))
runs = [("fedavg", "1"), ("fedpm", "1"), ("fedpm", "0")]
t = {r: [] for r in runs}
for r in range(args.repeats):
    for m, g in runs:
        os.environ["FEDPM_CUDA_GRAPHS"] = g
        parts, mb, ch, _ = _rounds(BenchRun("cnn", args.device, size, method=m))
        secs = [q["seconds"] for q in parts]
        t[(m, g)] += secs
        foof_s = [round(q["statistics"] + q["factorisations"], 3) for q in parts]
        print(r, m, "graphs" if g == "1" else "eager", [round(s, 3) for s in secs], "foof", foof_s, flush=True)
med = {f"{m}_graphs{g}": float(np.median(v)) for (m, g), v in t.items()}
print(
    json.dumps(
        {
            "device": args.device,
            "size": size,
            "repeats": args.repeats,
            "rounds": {f"{m}_graphs{g}": v for (m, g), v in t.items()},
            "median": med,
            "fedpm_over_fedavg_graphs": med["fedpm_graphs1"] / med["fedavg_graphs1"],
            "fedpm_over_fedavg_eager": med["fedpm_graphs0"] / med["fedavg_graphs1"],
        }
    )
)
