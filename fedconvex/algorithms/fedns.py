"""FedNS (Li et al. 2024): Newton sketch of the client Hessians.

Client i forms A_i = diag(sqrt(s_j / M_i)) X_i with s_j = sigma(m_j)(1 - sigma(m_j)), so
A_i^T A_i is the loss part of its Hessian, draws a sketch S_i (k x M_i, E[S_i^T S_i] = I) and sends
S_i A_i and grad f_i.  When k >= M_i a sketch cannot compress, so the client sends A_i itself
(S_i = I, exact).  Server:
    H = sum_i w_i (S_i A_i)^T (S_i A_i) + lam I,   theta <- theta - lr H^{-1} g.
Sketch size k = d in the paper's Test 1 (``sketch_size=None``).

Sketches (``sketch``), as in the FedNS paper's variants:
  'gaussian'    entries N(0, 1/k).  ``gaussian_draw`` says how:
                'dense' (default) draws S_i itself, k x M_i normals (the paper's Test 1; one stream for all
                  clients, the same numbers as one draw per client; drawing them is most of a round's cost,
                  so on NumPy a helper thread draws them while the products run);
                'bartlett' draws the sketch's Gram instead: exactly the same distribution of the server's H,
                  from r(r-1)/2 normals and r chi-squares per client (r = rank A_i <= its active features a)
                  instead of k M_i normals, and a message of at most k columns; each client factors its dense a x a
                  Hessian (O(a^3): for sparse data of high dimension the dense draw is the cheaper one), and it
                  is round-off-sensitive where a client's curvature is (near-)singular, see
                  fedconvex.algorithms.wishart
  'srht'        subsampled randomized Hadamard transform sqrt(P/k) R H D (P = M_i padded to a power
                of two, D random signs, R k rows sampled without replacement): no normals to draw
  'countsketch' each row of A_i added, with a random sign, into one of k buckets: O(nnz(A_i))
  'identity'    S = I (exact)

paper symbol -> field: k -> sketch_size, eta -> lr.  S_i A_i is sent on the client's
active features only (the other columns of A_i are zero) together with their indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np
import scipy.sparse as sp

from ..blocks import ActiveBlocks
from ..mixing import simple_mix
from .base import Algorithm, RoundInfo, State, start_stack
from .drawn_ahead import DrawnAhead as _DrawnAhead
from .grids import SECOND_ORDER_LR
from .normal_memo import NORMALS
from .wishart import wishart_roots

SKETCHES = ("gaussian", "srht", "countsketch", "identity")
GAUSSIAN_DRAWS = ("dense", "bartlett")


@lru_cache(maxsize=8)
def _hadamard(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of order n (a power of two), entries +-1."""
    H = np.ones((1, 1))
    while H.shape[0] < n:
        H = np.block([[H, H], [H, -H]])
    return H


@lru_cache(maxsize=8)
def _hadamard_top(n: int, m: int) -> np.ndarray:
    """The first m rows of the order-n Sylvester Hadamard matrix, C-contiguous (read-only)."""
    H = np.ascontiguousarray(_hadamard(n)[:m])
    H.flags.writeable = False
    return H


@dataclass(frozen=True, eq=False)
class SRHTSketch:
    """One client's SRHT sketch as its random choices: S^T[l, j] = scale * signs[l] * H[l, pick[j]]
    (l < M, H the Sylvester Hadamard matrix of order P; H is symmetric, so this is the first M rows of the
    padded transform's (R H D)^T times scale).  ``problem.sketched_roots`` applies it through ``rows_product``
    (the transform's Kronecker structure), without building S^T."""

    pick: np.ndarray  # (k,) sampled rows of the P-point transform
    signs: np.ndarray  # (M,) the diagonal of D, +-1
    P: int
    scale: float

    @property
    def shape(self):
        return (len(self.signs), len(self.pick))

    def columns(self) -> np.ndarray:
        """H[:M, pick] (M x k, entries +-1, C-contiguous)."""
        return np.take(_hadamard_top(self.P, len(self.signs)), self.pick, axis=1)

    def dense(self) -> np.ndarray:
        """S^T itself (M x k)."""
        return (self.columns() * self.signs[:, None]) * self.scale

    def rows_product(self, A, w):
        """(diag(w) A)^T S^T (a x k, F-contiguous) for a dense M x a design A and row weights w, by the fast
        Walsh-Hadamard structure instead of the k dense +-1 columns.

        With P = P1 P2 (Sylvester: H_P = H_P1 kron H_P2, row l = l1 P2 + l2), the padded weighted design
        B = D diag(w) A s (P x a, rows >= M zero) goes through H_P2 on each of its L1 = ceil(M / P2) non-zero
        row groups (L1 small products P2 x P2 by P2 x a) and H_P1[:, :L1] across the groups (one product),
        and the k sampled rows of H_P B are S A.  That is a (M P2 + P L1) flops, P2 ~ sqrt(P): on w8a
        (M = 350, P = 512, k = 300) 2.3M multiply-adds in BLAS per client against nnz(A) k = 1.2M in a sparse
        product that runs ~5 times slower per flop, and no M x k copy of the sampled columns.  The sums are
        grouped differently from S^T's product, so the result equals it to round-off (tests compare)."""
        M, a = A.shape
        P = self.P
        P2 = 1 << (P.bit_length() // 2)  # 2^ceil(log2(P) / 2)
        P1, L1 = P // P2, -(-M // P2)
        B = np.zeros((L1 * P2, a))
        np.multiply(A, ((w * self.signs) * self.scale)[:, None], out=B[:M])
        G = np.matmul(_hadamard(P2), B.reshape(L1, P2, a))  # (L1, P2, a): H_P2 on each group
        W = (_hadamard(P1)[:, :L1] @ G.reshape(L1, P2 * a)).reshape(P, a)  # row q1 P2 + q2 of H_P B
        return W[self.pick].T


@dataclass(frozen=True, eq=False)
class CountSketch:
    """One client's CountSketch as its random choices: S^T[l, bucket[l]] = sign[l], every other entry 0.
    ``problem.sketched_roots`` adds each signed row of A_i into its bucket directly (one bincount), without
    building S^T as a SciPy sparse matrix and multiplying by it (per client that costs more in SciPy's
    Python layers than the product itself)."""

    bucket: np.ndarray  # (M,) the bucket of each row, in 0..k-1
    sign: np.ndarray  # (M,) +-1.0
    k: int

    @property
    def shape(self):
        return (len(self.sign), self.k)

    def sparse(self):
        """S^T as a SciPy CSR matrix (M x k)."""
        m = len(self.sign)
        return sp.csr_matrix((self.sign, (np.arange(m), self.bucket)), shape=(m, self.k))

    def dense(self) -> np.ndarray:
        """S^T itself (M x k)."""
        return self.sparse().toarray()


def _gram(R, out=None, scale=None):
    """R R^T, exactly symmetric (BLAS syrk on NumPy: half the flops of a general product); with ``out`` (an
    (n, n) C-contiguous view) written there, and with ``scale`` times scale (the product rounded first)."""
    if isinstance(R, np.ndarray) and R.dtype == np.float64 and R.size:
        from scipy.linalg.blas import dsyrk

        # upper triangle of (R^T)^T R^T = R R^T; syrk never touches the strict lower triangle of c, so it
        # stays zero and C + C^T (diagonal put back) mirrors the upper triangle exactly, without np.triu copies
        n = R.shape[0]
        # R column-major (SRHT's): syrk 'N' on R as it is, else 'T' on R^T -- no copy either way.  OpenBLAS
        # rounds the two alike (tests/test_fednl_family.py checks it), so the server's H does not depend on the
        # layout a message arrives in (Flower's records make every array row-major)
        if R.flags.f_contiguous and not R.flags.c_contiguous:
            C = dsyrk(1.0, R, trans=0, lower=0, beta=0.0, c=np.zeros((n, n), order="F"), overwrite_c=1)
        else:
            C = dsyrk(1.0, R.T, trans=1, lower=0, beta=0.0, c=np.zeros((n, n), order="F"), overwrite_c=1)
        S = np.add(C, C.T, out=out)
        np.fill_diagonal(S, np.diagonal(C))
        if scale is not None:
            S *= scale
        return S
    S = R @ R.T
    if out is None:
        return S if scale is None else S * scale
    out[...] = S  # an empty R (no sketch columns) too: the caller's buffer must hold its zeros
    if scale is not None:
        out *= scale
    return out


def _weighted_gram_sum(problem, Rs, active, sel, w):
    """sum_i w_i E_i R_i R_i^T E_i^T + (sum_i w_i) lam I as a dense (d, d) matrix.

    When every client takes part with its own active features (the full round on a NumPy problem with a
    Hessian plan), the scaled Grams w_i (R_i R_i^T) are written into the plan's packed layout and summed by its
    fixed scatter matrix: per entry the same sum, over the clients in order and starting from 0, as
    ``ActiveBlocks.weighted_sum``'s loop of scatter-adds (which the other cases still use), so the same numbers
    without 142 fancy-indexed read-modify-writes of d x d."""
    d, n = problem.d, problem.n_clients
    plan = getattr(problem, "_plan", None) if problem.xp is np else None
    sel = np.asarray(sel).reshape(-1)
    if (
        plan is not None
        and len(sel) == n
        and np.array_equal(sel, np.arange(n))
        and all(
            isinstance(R, np.ndarray)
            and R.dtype == np.float64
            and R.shape[0] == len(problem.active[c])
            and (a is problem.active[c] or np.array_equal(a, problem.active[c]))
            for c, (R, a) in enumerate(zip(Rs, active, strict=False))
        )
    ):
        layout = plan["layout"]
        buf = np.empty(layout.total)
        o = layout.offsets
        for c, R in enumerate(Rs):
            m = R.shape[0]
            if m:
                _gram(R, out=buf[o[c] : o[c + 1]].reshape(m, m), scale=w[c])
        H = np.asarray(layout.G @ buf).reshape(d, d)
        H.flat[:: d + 1] += float(w.sum()) * problem.lam
        return H
    return ActiveBlocks(tuple(_gram(R) for R in Rs), active, d, problem.lam).weighted_sum(w)


@dataclass(frozen=True)
class FedNS(Algorithm):
    name: ClassVar[str] = "fedns"
    label: ClassVar[str] = "FedNS"
    search_space: ClassVar[dict] = {"lr": SECOND_ORDER_LR}
    message_fields: ClassVar[dict] = {"grad": "update", "SAt": "data", "active": "features"}

    lr: float = 1.0
    sketch_size: int | None = None
    sketch: str = "gaussian"
    gaussian_draw: str = "dense"  # how a Gaussian sketch is drawn (module docstring)

    def __post_init__(self):
        super().__post_init__()
        if self.sketch not in SKETCHES:
            raise ValueError(f"FedNS sketch must be one of {', '.join(SKETCHES)}, got {self.sketch!r}")
        if self.gaussian_draw not in GAUSSIAN_DRAWS:
            raise ValueError(
                f"FedNS gaussian_draw must be one of {', '.join(GAUSSIAN_DRAWS)}, got {self.gaussian_draw!r}"
            )

    def sketches(self, problem, sel, k, rng):
        """Per participant S^T (M x k) or None (S = I), and the common scale of the S^T."""
        sizes = [int(problem.counts[c]) for c in sel]
        exact = [self.sketch == "identity" or k >= m for m in sizes]
        if self.sketch == "gaussian":
            # an (M x k) draw per sketched client, in order: the same numbers as one draw for all of them.  Drawing
            # them is most of a round, so on NumPy a helper thread draws them ahead while the caller computes
            # (``client_update`` joins it); other backends get them drawn here and copied over
            shapes = [None if e else (m, k) for m, e in zip(sizes, exact, strict=False)]
            if problem.xp is np:
                # a learning-rate search's runs draw the same sketches from the same seed: kept ones are recalled
                # (normal_memo: the same numbers and generator state, without drawing them again)
                kept = NORMALS.recall(rng, shapes)
                return (kept if kept is not None else _DrawnAhead(rng, shapes, NORMALS)), 1.0 / np.sqrt(k)
            return [
                None if sh is None else problem.to_backend(rng.standard_normal(sh)) for sh in shapes
            ], 1.0 / np.sqrt(k)
        out = []
        for m, e in zip(sizes, exact, strict=False):
            if e:
                out.append(None)
            elif self.sketch == "countsketch":
                bucket, sign = rng.integers(0, k, m), rng.choice((-1.0, 1.0), m)
                St = CountSketch(bucket, sign, k)
                out.append(St if problem.xp is np else problem.to_backend(St.dense()))
            else:  # srht: S^T = sqrt(P/k) (R H D)^T / sqrt(P), the first M rows of the padded transform
                P = 1 << (m - 1).bit_length()
                pick = rng.choice(P, k, replace=False)
                D = rng.choice((-1.0, 1.0), m)
                St = SRHTSketch(pick, D, P, 1.0 / np.sqrt(k))
                out.append(St if problem.xp is np else problem.to_backend(St.dense()))
        return out, 1.0

    def client_update(self, problem, down, cstate, sel, rng):
        thetas = start_stack(problem, down["theta"], len(sel))
        k = problem.d if self.sketch_size is None else self.sketch_size
        if self.sketch == "gaussian" and self.gaussian_draw == "bartlett":
            return {
                "grad": problem.gradients(thetas, sel),
                "SAt": wishart_roots(problem, thetas, sel, k, rng),
                "active": tuple(problem.active[c] for c in sel),
            }, cstate
        sketches, scale = self.sketches(problem, sel, k, rng)  # Gaussian on NumPy: being drawn in a thread
        try:
            g = problem.gradients(thetas, sel)
            # (S_i A_i)^T on the client's active features: what the client sends (and its indices)
            SAt = problem.sketched_roots(thetas, sketches, sel, scale=scale)
        finally:
            if isinstance(sketches, _DrawnAhead):
                sketches.join()
        return {"grad": g, "SAt": SAt, "active": tuple(problem.active[c] for c in sel)}, cstate

    def server_update(self, problem, state, up, info: RoundInfo) -> State:
        xp = problem.xp
        g = simple_mix(up["grad"], info.weights)
        H = _weighted_gram_sum(problem, up["SAt"], up["active"], info.sel, info.weights)
        H = 0.5 * (H + H.T)
        theta = state.theta - self.lr * xp.linalg.solve(H, g[:, None])[:, 0]
        return State(theta=theta, server=state.server, clients=state.clients, round=state.round + 1)
