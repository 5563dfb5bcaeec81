"""The Gaussian Newton sketch drawn through its Gram matrix (FedNS's ``gaussian_draw='bartlett'``).

FedNS needs from client i only the Gram of its sketched root, (S_i A_i)^T (S_i A_i) = A_i^T S_i^T S_i A_i,
with S_i (k x M_i) of i.i.d. N(0, 1/k) entries.  Write A_i^T A_i = R^T R with R (r x a) of full row rank r
(the client's exact loss Hessian on its a active features, factored by pivoted Cholesky).  Then A_i = Q R
for some Q (M_i x r) with orthonormal columns, and S_i Q (k x r) has i.i.d. N(0, 1/k) entries by the
rotation invariance of the Gaussian, so

    (S_i A_i)^T (S_i A_i) = R^T W R / k,   W ~ Wishart_r(k, I)    -- the same distribution, exactly.

For k >= r, Bartlett's decomposition draws W = T T^T with T lower triangular, T_jj^2 ~ chi^2_(k-j)
(j = 0..r-1) and N(0, 1) below the diagonal: r(r-1)/2 normals and r chi-squares instead of k M_i normals
(w8a: ~10^4 against 1.05 x 10^5 per client); the price is the client's dense a x a Hessian and its O(a^3)
factorisation, which the dense draw never forms.  For k < r, W = G^T G with G
(k x r) drawn directly.  The client sends R^T T / sqrt(k) (a x r; a x k when k < r): the server's Gram of it
is the sketched Hessian.  Its r columns are at most k, so it is never larger than S_i A_i.

What this costs: the message is a function of the Hessian through a root of it, and no root is Lipschitz at
a (near-)singular Hessian: a round-off change of H can move R by ~sqrt(eps) along its (near-)null directions,
or change the pivot order, which rotates R -- another sketch, equally distributed.  So two runs whose
Hessians differ by round-off (another BLAS; on a9a, Flower's server summing in another order: theta 7e-15
apart after one round, messages 4e-2 apart in the next) can follow different trajectories
of the same random algorithm, where the dense draw (S A_i, Lipschitz in A_i) stays within round-off.  That
is why 'dense' stays FedNS's default: Test 1's tables and the Flower equivalence are to round-off.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from scipy.linalg.blas import dtrmm
from scipy.linalg.lapack import dpstrf


def pivoted_root(B: np.ndarray):
    """(C, order, r): LAPACK's pivoted Cholesky (dpstrf, default tolerance n eps max(diag B)) of the symmetric
    PSD B (n x n), r its numerical rank.  U = triu(C[:r]) (r x n, upper trapezoidal) has U^T U = B[order][:, order]
    to round-off, so R with R[:, order] = U has R^T R = B.  Below the diagonal C still holds B's numbers."""
    n = B.shape[0]
    if n == 0:
        return np.zeros((0, 0)), np.zeros(0, dtype=np.int64), 0
    # B is symmetric, so its transpose is the same matrix in the column-major layout LAPACK reads
    C, piv, rank, info = dpstrf(B.T, lower=0)
    if info < 0:  # pragma: no cover - an argument error of ours, never the data's
        raise ValueError(f"dpstrf argument {-info} is illegal")
    return C, piv - 1, int(rank)


@lru_cache(maxsize=32)  # bounded: r^2 / 2 int32 each (d = 1000: 2 MB)
def _strict_lower(r: int) -> np.ndarray:
    """Flat positions of an r x r matrix's strictly lower triangle, row by row (read-only)."""
    rows, cols = np.tril_indices(r, -1)
    flat = (rows * r + cols).astype(np.int32)
    flat.flags.writeable = False
    return flat


def bartlett_factor(rng: np.random.Generator, r: int, k: int) -> np.ndarray:
    """Lower triangular T (r x r, r <= k) with T T^T ~ Wishart_r(k, I): the below-diagonal normals drawn
    row by row, then the r chi-squares of k, k-1, ..., k-r+1 degrees of freedom."""
    if r > k:
        raise ValueError(f"Bartlett's decomposition needs r <= k, got r={r}, k={k}")
    T = np.zeros(r * r)
    lower = _strict_lower(r)
    T[lower] = rng.standard_normal(lower.size)
    T[:: r + 1] = np.sqrt(rng.chisquare(k - np.arange(r)))
    return T.reshape(r, r)


def sketched_root(B: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """One client's message for the loss Hessian B on its active features: M (n x c, c <= k, C-contiguous)
    whose Gram M M^T is distributed as (S A)^T (S A) for a k-row Gaussian sketch S with E[S^T S] = I.
    A B with NaN or Inf (diverged iterate) gives a NaN message, as the dense draw's S A would: the server's
    screening rejects it instead of receiving a finite sketch of the finite part (pivoting would drop a NaN)."""
    n = B.shape[0]
    if not np.isfinite(B).all():
        return np.full((n, min(n, k)), np.nan)
    C, order, r = pivoted_root(B)
    out = np.empty((n, min(r, k)))
    if r == 0:
        return out
    s = 1.0 / np.sqrt(k)
    if r > k:
        out[order] = (rng.standard_normal((k, r)) @ np.triu(C[:r])).T * s
        return out
    T = bartlett_factor(rng, r, k)
    # V = T^T U / sqrt(k) by trmm (half the flops of a general product), rows put back in B's order: on U's
    # triangle U1 as the triangular operand (trmm reads only its upper triangle: no triu copy of C's block;
    # measured on w8a, 14 against 27 ms a round for T as the operand on a cleaned U1), then on its rectangle
    # U2 = C[:r, r:] (clean: above the diagonal) with T as the operand
    out[order[:r]] = dtrmm(s, np.asfortranarray(C[:r, :r]), np.array(T.T, order="F"), side=1, lower=0, overwrite_b=1).T
    if r < n:
        out[order[r:]] = dtrmm(s, T.T, C[:r, r:], lower=0).T  # T^T: upper, column-major without a copy
    return out


def wishart_roots(problem, thetas, sel, k: int, rng: np.random.Generator) -> tuple:
    """Per participant its message (a_c x c), in ``sel`` order: A_c^T itself where k >= M_c (a sketch cannot
    compress; as the dense draw does), else ``sketched_root`` of its exact loss Hessian, its random numbers
    drawn client by client in that order.  (Drawing the factors ahead in a helper thread, as the dense draw
    does, gained nothing measurable here: the draws are ~15 % of the round and the loop holds the GIL.)"""
    sel = np.asarray(sel)
    exact = [i for i, c in enumerate(sel) if k >= int(problem.counts[c])]
    drawn = [i for i, c in enumerate(sel) if k < int(problem.counts[c])]
    out = [None] * len(sel)
    if exact:
        for i, M in zip(exact, problem.sketched_roots(thetas[exact], [None] * len(exact), sel[exact]), strict=False):
            out[i] = M
    if drawn:
        # all participants at once when none is exact: the Hessian plan's one product for every block
        blocks = problem.hessians(thetas if len(drawn) == len(sel) else thetas[drawn], sel[drawn]).blocks
        for i, B in zip(drawn, blocks, strict=False):
            out[i] = problem.to_backend(sketched_root(problem.to_host(B), k, rng))
    return tuple(out)
