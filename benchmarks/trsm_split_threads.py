"""One right-side trsm with a 401 x 401 triangular factor on 120 / 600 / 2,400 rows: whole, one half alone, and
halved over two Python threads (and the same for a plain product), torch at one thread:

    python benchmarks/trsm_split_threads.py"""

import torch, time
from concurrent.futures import ThreadPoolExecutor

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
    one = lambda X: torch.linalg.solve_triangular(U, X, upper=True, left=False)

    def split():
        f = ex.submit(one, T[h:])
        one(T[:h])
        f.result()

    mm = lambda X: X @ U

    def splitmm():
        f = ex.submit(mm, T[h:])
        mm(T[:h])
        f.result()

    print(
        rows,
        "trsm whole %.3f half %.3f split %.3f | mm whole %.3f split %.3f"
        % (ms(lambda: one(T)), ms(lambda: one(T[:h])), ms(split), ms(lambda: mm(T)), ms(splitmm)),
    )
