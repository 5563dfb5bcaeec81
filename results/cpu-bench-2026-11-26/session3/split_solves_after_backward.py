# runs against commit 121f2b4 (fedpm_dnn.cpu_solves), which was reverted: see README.md here
"""Split vs whole solves right after a two-thread conv forward/backward, as in the vectorized engine's step."""
import sys, time, torch
torch.set_num_threads(2)
from fedpm_dnn import foof, cpu_solves
from fedpm_dnn.models import SimpleCNN
m = SimpleCNN(); x = torch.randn(640, 3, 32, 32); y = torch.randint(0, 10, (640,))
A = torch.randn(10, 401, 600, dtype=torch.float64); A = A @ A.mT / 600 + 1e-2 * torch.eye(401, dtype=torch.float64)
L = torch.linalg.cholesky(A).float(); U = L.mT.contiguous()
T = torch.randn(10, 120, 401)
def step(split):
    m.zero_grad(); torch.nn.functional.cross_entropy(m(x), y).backward()
    t = time.perf_counter()
    with foof.one_cpu_thread("cpu") as n:
        cpu_solves.MIN_SPLIT_WORK = 0 if split else float("inf")
        cpu_solves.solve_all({"fc1": (T, L, U)}, n, foof.solve_rows)
    return time.perf_counter() - t
res = {True: [], False: []}
for i in range(40):
    for s in (True, False):
        res[s].append(step(s))
import statistics
for s in (True, False):
    print("split" if s else "whole", "median solve %.2f ms min %.2f" % (1e3 * statistics.median(res[s]), 1e3 * min(res[s])))
