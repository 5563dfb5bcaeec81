# runs against commit 121f2b4 (fedpm_dnn.cpu_solves), which was reverted: see README.md here
"""One fc1-sized FOOF solve (401 x 401 factor), whole vs halved over two Python threads at one torch thread each:

    python benchmarks/foof_solve_split_threads.py

rows: None = one client (120 rows, halved by rows); 10 = ten stacked clients (halved by clients)."""

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from fedpm_dnn.foof import solve_rows

torch.set_num_threads(1)
ex = ThreadPoolExecutor(1)
for B in (None, 10):
    A = torch.randn(401, 600, dtype=torch.float64)
    A = A @ A.T / 600 + 1e-2 * torch.eye(401, dtype=torch.float64)
    L = torch.linalg.cholesky(A).float()
    U = L.T.contiguous()
    T = torch.randn(120, 401) if B is None else torch.randn(B, 120, 401)
    if B:
        L, U = L.expand(B, 401, 401).contiguous(), U.expand(B, 401, 401).contiguous()
    out = torch.empty_like(T)

    def ms(f, reps=200):
        f()
        best = 9
        for _ in range(reps):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
        return best * 1e3

    def split():
        if B:
            f = ex.submit(solve_rows, T[5:], L[5:], U[5:], out[5:])
            solve_rows(T[:5], L[:5], U[:5], out[:5])
        else:
            f = ex.submit(solve_rows, T[60:], L, U, out[60:])
            solve_rows(T[:60], L, U, out[:60])
        f.result()

    half = (lambda: solve_rows(T[:60], L, U, out[:60])) if not B else (lambda: solve_rows(T[:5], L[:5], U[:5], out[:5]))
    print(
        B,
        f"whole {ms(lambda: solve_rows(T, L, U, out)):.3f}  half alone {ms(half):.3f}  split 2 threads "
        f"{ms(split):.3f}  noop submit {ms(lambda: ex.submit(int).result()):.3f}",
    )
