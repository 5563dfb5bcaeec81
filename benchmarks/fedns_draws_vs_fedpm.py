"""w8a round time of FedPM and of FedNS with each Gaussian draw, alternated three times in one process (BLAS on
one thread): the median over 6 timed rounds of each run.

    python benchmarks/fedns_draws_vs_fedpm.py
"""

import os
import statistics

from threadpoolctl import threadpool_limits

from fedconvex.algorithms import make_algorithm
from fedconvex.data import load_dataset, paper_split_sizes, sequential_split
from fedconvex.problem import FederatedLogReg
from fedconvex.reference import initial_point, solve_optimum
from fedconvex.run import run

ds = load_dataset("w8a")
n, m = paper_split_sizes("w8a")
p = FederatedLogReg(ds.X, ds.y, sequential_split(ds.n, n, m), lam=1e-3)
theta_star, _, _ = solve_optimum(p)
theta0 = initial_point(p, theta_star, "paper", 0)
runs = [
    ("FedPM", "fedpm", {"lr": 1.0, "local_steps": 1}),
    ("FedNS bartlett", "fedns", {"gaussian_draw": "bartlett"}),
    ("FedNS dense", "fedns", {"gaussian_draw": "dense"}),
]
with threadpool_limits(1):
    for _rep in range(1 if os.environ.get("FEDPM_BENCH_TINY") == "1" else 3):  # tiny: one alternation
        row = []
        for label, name, kw in runs:
            _, h = run(p, make_algorithm(name, **kw), theta0, 3 if os.environ.get("FEDPM_BENCH_TINY") == "1" else 7)
            ms = 1e3 * statistics.median(h[t]["seconds"] - h[t - 1]["seconds"] for t in range(1, len(h)))
            row.append(f"{label} {ms:6.1f} ms")
        print("   ".join(row))
