"""The floor of a Gaussian FedNS round at the paper's k = d on w8a, against FedPM's round, in one process:

    python benchmarks/fedns_gaussian_round_floor.py

A Gaussian sketch S_i (k x M_i) of every client is k M_i normals: 142 x 300 x 350 = 14.9 M a round.  Prints
(min of 5) the time to draw them with NumPy's default generator (PCG64, the Test 1 stream) and with its fastest
(SFC64), on one thread and spread over two (per-client generators, NumPy releases the GIL while it fills), beside
a FedPM round and a dense Gaussian FedNS round (BLAS at one thread, as bench_convex pins it), and each / FedPM.
"""

import statistics
import threading

import numpy as np
from threadpoolctl import threadpool_limits

from fedconvex.algorithms import make_algorithm
from fedconvex.data import load_dataset, paper_split_sizes, sequential_split
from fedconvex.problem import DEFAULT_LAM, FederatedLogReg
from fedconvex.reference import initial_point, solve_optimum
from fedconvex.run import run
from validation.timing import best_seconds

ds = load_dataset("w8a")
n, m = paper_split_sizes("w8a")
problem = FederatedLogReg(ds.X, ds.y, sequential_split(ds.n, n, m), lam=DEFAULT_LAM)
theta0 = initial_point(problem, solve_optimum(problem)[0], "paper", seed=0)
k = problem.d
shapes = [(int(c), k) for c in problem.counts]


def best(f, reps=5):
    return best_seconds(f, reps)


def draw(bitgen, threads):
    def part(i):
        for c in range(i, len(shapes), threads):
            np.random.Generator(bitgen(c)).standard_normal(shapes[c])

    if threads == 1:
        return lambda: part(0)

    def spread():
        ts = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    return spread


def round_seconds(alg):
    _, h = run(problem, alg, theta0, 6)
    return statistics.median(h[t]["seconds"] - h[t - 1]["seconds"] for t in range(1, len(h)))


with threadpool_limits(1):
    fedpm = min(round_seconds(make_algorithm("fedpm", lr=1.0)) for _ in range(3))
    fedns = min(round_seconds(make_algorithm("fedns")) for _ in range(3))
    rows = [("FedPM round", fedpm), ("FedNS Gaussian round (dense draw, Test 1 stream)", fedns)]
    for name, bg in (("PCG64", np.random.PCG64), ("SFC64", np.random.SFC64)):
        for threads in (1, 2):
            rows.append(
                (
                    f"{sum(a * b for a, b in shapes) / 1e6:.1f} M normals, {name}, {threads} thread(s)",
                    best(draw(bg, threads)),
                )
            )
print(f"w8a: {len(shapes)} clients, k = d = {k}; BLAS 1 thread")
for name, s in rows:
    print(f"  {name:52s} {s * 1e3:7.1f} ms   {s / fedpm:5.2f} x FedPM")
