# python benchmarks/foof_solves_threads_after_backward.py
"""Per-step FOOF solves right after a two-thread forward/backward: at one OpenMP thread (one_cpu_thread) vs at two."""

import statistics
import time

import torch

torch.set_num_threads(2)
from fedpm_dnn import foof  # noqa: E402 (after the thread count is set)
from fedpm_dnn.models import SimpleCNN  # noqa: E402 (after the thread count is set)

torch.manual_seed(0)
for K, batch in ((1, 64), (10, 640)):
    m = SimpleCNN()
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    A = torch.randn(K, 401, 600, dtype=torch.float64)
    A = A @ A.mT / 600 + 1e-2 * torch.eye(401, dtype=torch.float64)
    L = torch.linalg.cholesky(A).float()
    U = L.mT.contiguous()
    T = torch.randn(K, 120, 401)
    if K == 1:
        L, U, T = L[0], U[0], T[0]

    def step(one):
        m.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        t = time.perf_counter()
        if one:
            with foof.one_cpu_thread("cpu"):
                foof.solve_rows(T, L, U)
        else:
            foof.solve_rows(T, L, U)
        return time.perf_counter() - t

    res = {True: [], False: []}
    for _i in range(40):
        for s in (True, False):
            res[s].append(step(s))
    for s in (True, False):
        print(
            f"K={K} {'one thread' if s else 'two threads'}: median {1e3 * statistics.median(res[s]):.3f} ms, "
            f"min {1e3 * min(res[s]):.3f}"
        )
