"""Mean wall time of a w8a round of one method (6 rounds, their set-up included, BLAS on one thread), then a cProfile
of 6 more.  python benchmarks/convex_round_time.py '{"compressor": "natural"}' fednl
(run in two checkouts, before and after a change, to compare them)."""

import cProfile
import json
import pstats
import sys
import time

from threadpoolctl import threadpool_limits

from fedconvex.algorithms import make_algorithm
from fedconvex.data import load_dataset, paper_split_sizes, sequential_split
from fedconvex.problem import FederatedLogReg
from fedconvex.reference import initial_point, solve_optimum
from fedconvex.run import run

ds = load_dataset("w8a")
n, m = paper_split_sizes("w8a")
p = FederatedLogReg(ds.X, ds.y, sequential_split(ds.n, n, m), lam=1e-3)
ts, fs, _ = solve_optimum(p)
t0 = initial_point(p, ts, "paper", 0)
kw = json.loads(sys.argv[1])  # parameters as JSON: nothing from the command line runs as code
name = sys.argv[2] if len(sys.argv) > 2 else "fednl"
with threadpool_limits(1):
    alg = make_algorithm(name, **kw)
    run(p, alg, t0, 2)
    t = time.perf_counter()
    run(p, alg, t0, 6)
    print("6 rounds", (time.perf_counter() - t) / 6 * 1e3, "ms/round (incl init)")
    pr = cProfile.Profile()
    pr.enable()
    run(p, alg, t0, 6)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
