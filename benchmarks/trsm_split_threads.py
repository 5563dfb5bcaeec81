"""One right-side trsm with a 401 x 401 triangular factor on 120 / 600 / 2,400 rows: whole, one half alone, and
halved over two Python threads (and the same for a plain product), torch at one thread:

    python benchmarks/trsm_split_threads.py"""

import time
from concurrent.futures import ThreadPoolExecutor

import torch

torch.set_num_threads(1)
ex = ThreadPoolExecutor(1)
A = torch.randn(401, 600, dtype=torch.float64)
A = A @ A.T / 600 + 1e-2 * torch.eye(401, dtype=torch.float64)
U = torch.linalg.cholesky(A).float().T.contiguous()


def ms(f, reps=200):
    f()
    best = 9
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


for rows in (120, 600, 2400):
    T = torch.randn(rows, 401)
    h = rows // 2

    def one(X):
        return torch.linalg.solve_triangular(U, X, upper=True, left=False)

    def split():
        f = ex.submit(one, T[h:])
        one(T[:h])
        f.result()

    def mm(X):
        return X @ U

    def splitmm():
        f = ex.submit(mm, T[h:])
        mm(T[:h])
        f.result()

    print(
        rows,
        f"trsm whole {ms(lambda: one(T)):.3f} half {ms(lambda: one(T[:h])):.3f} split {ms(split):.3f} | mm "
        f"whole {ms(lambda: mm(T)):.3f} split {ms(splitmm):.3f}",
    )
