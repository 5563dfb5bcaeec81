"""Matrix compressors for FedNL (Safaryan et al. 2022, section 3; u-FedNL, Burlachenko et al. 2024).

Each has ``encode(xp, M, rng, support=None) -> message`` (the arrays a client actually sends for a
stack of symmetric (P, d, d) matrices), ``decode(xp, message, d) -> (P, d, d)`` (what the server,
and the client for its own estimate, reconstruct) and ``bits(message, d) -> (P,)`` (the bits each
client's part takes with the compressor's own coding: 64-bit floats, 32-bit indices, Natural's 12-bit
sign + exponent).  The entry compressors act on the d(d+1)/2 upper-triangular entries (the matrices are
symmetric) and are symmetrised on decoding.

    identity   exact                                                        64 d(d+1)/2 bits
    topk       k largest |entries|               contractive, delta = k/n   96 k
    toplek     fewest (<= k) largest entries with TopK's guarantee          96 k'  (k' <= k)
    randk      k random entries x n/k            unbiased, omega = n/k - 1   96 k
    randseqk   k consecutive entries from a random start, x n/k  (unbiased)   64 k + 32
    natural    each entry randomly rounded to a power of two (unbiased, omega = 1/8)   12 n
    rankr      r eigenpairs of largest |eigenvalue|  contractive             64 r (d + 1)

(n = d(d+1)/2.)  ``support`` (optional, per matrix the indices of the rows/columns that may be
non-zero, e.g. a client's active features; host integer indices) is read by Rank-R (on NumPy only) and
Natural, which both check it against the matrix; the other compressors ignore it.  Rank-R solves on that sub-block (on
the whole matrix if
not all of the Frobenius norm lies inside), so for it a wrong support only costs time.  For Natural it
decides which uniforms are drawn: one per upper entry inside the support, so the same matrices with
another support get other messages (from the same distribution); a matrix with a non-zero entry outside
its support draws one uniform per upper entry of the whole matrix, as without a support, so no entry is
ever dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..backend import to_numpy

FLOAT_BITS, INDEX_BITS = 64, 32


def _upper(d):
    return np.triu_indices(d)


def _upper_pos(d):
    iu, ju = _upper(d)
    return (iu * d + ju).astype(np.int64)


def upper_index(i, j, d):
    """The number of entry (i, j), i <= j, among the d(d+1)/2 upper entries in row-major order."""
    return i * d - i * (i - 1) // 2 + (j - i)


def _scatter_upper(xp, vals, idx, d):
    """(P, d, d) symmetric matrices from per-matrix upper-entry values and their upper-entry indices
    (arrays of shape (P, k), or tuples of per-matrix 1-D arrays of any lengths)."""
    iu, ju = _upper(d)
    up, lo = xp.asarray((iu * d + ju).astype(np.int64)), xp.asarray((ju * d + iu).astype(np.int64))
    n = len(vals)
    flat = xp.zeros((n, d * d), dtype=np.float64)
    # each value written to (i, j) and (j, i) (once on the diagonal): no dense symmetrisation pass
    if isinstance(vals, (tuple, list)):
        for c, (v, i) in enumerate(zip(vals, idx, strict=False)):
            i = xp.asarray(i).astype(xp.int64)
            flat[c, up[i]] = v
            flat[c, lo[i]] = v
    else:
        rows, i = xp.arange(n)[:, None], idx.astype(xp.int64)
        flat[rows, up[i]] = vals
        flat[rows, lo[i]] = vals
    return flat.reshape(n, d, d)


def _gather_upper(xp, M, idx):
    """M's upper-triangular entries number ``idx`` (P, k), without forming the (P, n) upper stack."""
    P, d = M.shape[0], M.shape[1]
    pos = xp.asarray(_upper_pos(d))[idx]
    return M.reshape(P, d * d)[xp.arange(P)[:, None], pos]


class _UpperEntries:
    """Shared decoding for compressors that send (values, index) of upper-triangular entries."""

    def decode(self, xp, msg, d):
        return _scatter_upper(xp, msg["values"], msg["index"], d)

    def bits(self, msg, d):
        return np.array([(FLOAT_BITS + INDEX_BITS) * len(v) for v in msg["values"]], dtype=np.int64)


@dataclass(frozen=True)
class Identity:
    def encode(self, xp, M, rng, support=None):
        return {"S": M}

    def decode(self, xp, msg, d):
        return msg["S"]

    def bits(self, msg, d):
        return np.full(len(msg["S"]), FLOAT_BITS * d * (d + 1) // 2, dtype=np.int64)


def _top_order(xp, U, k):
    """Per row the indices of the k largest |U|, largest first; equal magnitudes in index order.

    The tie rule matters: on binary data (w8a) many Hessian entries are exactly equal, and without a
    rule the entries kept at the k-th place would depend on the selection algorithm's internals.
    argpartition finds the k-th magnitude t; every entry above t is kept, then entries equal to t
    from the lowest index up."""
    A = xp.abs(U)
    P, n = A.shape
    if k < n:
        t = xp.take_along_axis(A, xp.argpartition(-A, k - 1, axis=1)[:, k - 1 : k], 1)
        above, tied = A > t, A == t
        room = k - above.sum(1, keepdims=True)
        keep = above | (tied & (xp.cumsum(tied, axis=1) <= room))
        part = xp.nonzero(keep)[1].reshape(P, k)  # exactly k per row, in index order
    else:
        part = xp.broadcast_to(xp.arange(n)[None], A.shape)
    order = xp.argsort(-xp.take_along_axis(A, part, 1), axis=1, kind="stable")
    return xp.take_along_axis(part, order, 1)


@dataclass(frozen=True)
class TopK(_UpperEntries):
    """Keep the k upper-triangular entries of largest magnitude (contractive)."""

    k: int

    def encode(self, xp, M, rng, support=None):
        iu, ju = _upper(M.shape[1])
        U = M[:, iu, ju]
        idx = _top_order(xp, U, min(self.k, U.shape[1]))
        return {"values": xp.take_along_axis(U, idx, 1), "index": idx.astype(xp.int32)}


@dataclass(frozen=True)
class TopLEK(_UpperEntries):
    """Top-"less or equal" K (u-FedNL): the fewest k' <= k largest entries whose error is within TopK's
    guarantee, ||u - C(u)||^2 <= (1 - k/n) ||u||^2 for the vector u of the n upper entries.  Same contraction as TopK,
    never more entries.  The count varies per client, so the message holds one array per client."""

    k: int

    def encode(self, xp, M, rng, support=None):
        iu, ju = _upper(M.shape[1])
        U = M[:, iu, ju]
        n = U.shape[1]
        k = min(self.k, n)
        idx = _top_order(xp, U, k)
        top = xp.take_along_axis(U, idx, 1)
        # the error TopK's bound allows, in the norm of the vector of upper entries
        energy = (U * U).sum(1)
        kept = xp.cumsum(top * top, axis=1)
        needed = energy - (1.0 - k / n) * energy  # energy the kept entries must carry
        counts = np.minimum(1 + (kept < needed[:, None]).sum(1), k)
        values = tuple(top[c, : counts[c]] * 1.0 for c in range(len(U)))
        index = tuple(idx[c, : counts[c]].astype(np.int32) for c in range(len(U)))
        return {"values": values, "index": index}


@dataclass(frozen=True)
class RandK(_UpperEntries):
    """k random upper-triangular entries scaled by (#entries / k): unbiased, so use alpha = k / #entries."""

    k: int

    def encode(self, xp, M, rng, support=None):
        n = M.shape[1] * (M.shape[1] + 1) // 2
        k = min(self.k, n)
        idx = xp.asarray(np.stack([np.sort(rng.choice(n, k, replace=False)) for _ in range(M.shape[0])]))
        return {"values": _gather_upper(xp, M, idx) * (n / k), "index": idx.astype(xp.int32)}


@dataclass(frozen=True)
class RandSeqK:
    """k *consecutive* upper-triangular entries (cyclically) from a uniform random start, scaled by n/k
    (u-FedNL's RandSeqK): unbiased like RandK, with one start index on the wire instead of k indices."""

    k: int

    def encode(self, xp, M, rng, support=None):
        n = M.shape[1] * (M.shape[1] + 1) // 2
        k = min(self.k, n)
        start = rng.integers(0, n, size=M.shape[0])
        idx = (start[:, None] + np.arange(k)[None, :]) % n
        return {"values": _gather_upper(xp, M, xp.asarray(idx)) * (n / k), "start": start.astype(np.int32)}

    def decode(self, xp, msg, d):
        vals = msg["values"]
        n = d * (d + 1) // 2
        idx = (np.asarray(msg["start"]).astype(np.int64)[:, None] + np.arange(vals.shape[1])[None, :]) % n
        return _scatter_upper(xp, vals, xp.asarray(idx), d)

    def bits(self, msg, d):
        return np.full(len(msg["values"]), FLOAT_BITS * msg["values"].shape[1] + INDEX_BITS, dtype=np.int64)


_EXP_BIAS = 1075  # float64 exponents -1074..1023 (+1 after rounding up) -> 1..2099: an int16 code


def natural_formula(code):
    """The value of Natural's int16 codes by definition: sign(code) 2^(|code| - bias) (code 0 -> 0)."""
    code = np.asarray(code, dtype=np.int16)
    mag = np.ldexp(1.0, np.abs(code).astype(np.int32) - _EXP_BIAS)  # code 0 -> 2^-1075 = 0.0
    return np.copysign(mag, code)


@lru_cache(maxsize=1)
def _natural_table():
    """``natural_formula`` of every int16 code, indexed by the code's 16-bit pattern (512 KiB)."""
    with np.errstate(over="ignore"):  # codes beyond any float64's (no encoder makes them) decode to +-inf
        table = natural_formula(np.arange(1 << 16, dtype=np.uint16).view(np.int16))
    table.flags.writeable = False
    return table


def natural_values(code, out=None):
    """Values of Natural's int16 codes: one table look-up each, the same numbers as ``natural_formula``."""
    bits = np.ascontiguousarray(code, dtype=np.int16).view(np.uint16)
    return np.take(_natural_table(), bits, out=out)


@dataclass(frozen=True)
class Natural:
    """Natural compression (Horvath et al. 2019) of every upper-triangular entry: t in [2^a, 2^(a+1))
    becomes 2^(a+1) with probability t / 2^a - 1, else 2^a (sign kept).  Unbiased with
    E||C(x) - x||^2 <= ||x||^2 / 8, so FedNL uses alpha = 1 / (1 + 1/8).  On the wire: a sign bit and the
    11-bit exponent, 12 bits an entry (the message holds them as int16 codes).

    The uniforms: matrix after matrix, one per upper entry that can be non-zero, in upper-index order
    (row-major upper triangle).  Without a support that is every upper entry, ``rng.random((P, n))``;
    with one, matrix c draws only for its upper entries (i, j) with i and j in ``support[c]`` (a set: order
    and repeats do not matter) -- a zero entry gets code 0 whatever its uniform, so leaving it out changes
    no distribution -- unless M[c] has a non-zero entry outside them, which then draws for all n (see the
    module docstring).  FedNL's block path (fednl_blocks.encode) draws the same numbers for the clients'
    active features."""

    def encode(self, xp, M, rng, support=None):
        d = M.shape[1]
        iu, ju = _upper(d)
        U = to_numpy(M[:, iu, ju])  # host: the randomness is NumPy's stream
        mant, ex = np.frexp(np.abs(U))  # |U| = mant 2^ex, mant in [0.5, 1)
        if support is None:
            draw = rng.random(U.shape)
        else:
            drawn = _natural_drawn(U, support, d)
            draw = np.zeros(U.shape)  # not drawn: zero entries, never rounded up
            draw[drawn] = rng.random(np.count_nonzero(drawn))  # row-major: the drawing order
        up = draw < (2.0 * mant - 1.0)  # P(round up) = |U| / 2^(ex-1) - 1
        code = (ex - 1 + up + _EXP_BIAS).astype(np.int16) * np.sign(U).astype(np.int16)
        return {"code": xp.asarray(code)}

    def decode(self, xp, msg, d):
        code = to_numpy(msg["code"])
        vals = natural_values(code)
        idx = np.broadcast_to(np.arange(code.shape[1]), code.shape)
        return xp.asarray(_scatter_upper(np, vals, idx, d))

    def bits(self, msg, d):
        return np.full(len(msg["code"]), 12 * msg["code"].shape[1], dtype=np.int64)


def _natural_drawn(U, support, d):
    """Which entries of the (P, n) upper stack ``U`` get a uniform (see Natural): those with row and column in
    the matrix's support, or every entry of a matrix with a non-zero one outside.  One pass over the stack
    for all matrices (a per-matrix loop cost ~65 ms a round for w8a's 142 clients)."""
    P = U.shape[0]
    if len(support) != P:
        raise ValueError(f"support has {len(support)} entries for {P} matrices")
    if any(np.asarray(a).dtype == bool for a in support):  # a mask would silently read as indices 0 and 1
        raise ValueError("support must hold feature indices, not a boolean mask")
    feats = [np.asarray(a, dtype=np.int64).reshape(-1) for a in support]
    owner = np.repeat(np.arange(P), [len(a) for a in feats])
    feats = np.concatenate(feats) if P else np.zeros(0, dtype=np.int64)
    if len(feats) and (feats.min() < 0 or feats.max() >= d):  # a negative index would wrap around
        raise ValueError(f"support holds features outside 0..{d - 1}")
    member = np.zeros((P, d), dtype=bool)
    member[owner, feats] = True
    iu, ju = _upper(d)
    drawn = member[:, iu] & member[:, ju]
    spilled = (U != 0) & ~drawn
    drawn[spilled.any(1)] = True  # mass outside the support: every entry, nothing dropped
    return drawn


def _full_top_abs(A, r):
    lam, V = np.linalg.eigh(A)
    pick = np.argsort(-np.abs(lam), kind="stable")[:r]
    return lam[pick], V[:, pick]


def _sorted_like_dsyevr(w, Z):
    """dsyevr's final selection sort of the pairs it found (ascending; equal values keep their places)."""
    for j in range(len(w) - 1):
        i, low = -1, w[j]
        for jj in range(j + 1, len(w)):
            if w[jj] < low:
                i, low = jj, w[jj]
        if i >= 0:
            w[i], w[j] = w[j], low
            if Z is not None:
                Z[:, [i, j]] = Z[:, [j, i]]
    return w, Z


# dsytrd's block size is its workspace / n (capped at 32).  dsyevr hands it 21n (block 21).  On one core here,
# for the 142 w8a FedNL blocks of a round (n ~ 136, up to 198): block 21 51.9 ms, 8 41.1, 6 35.0, 5 34.3,
# 4 35.0, 3 36.4; per size, blocks 6..8 slow down sharply once n * block passes ~1000 (n = 198: 5 -> 484 us,
# 6 -> 647, 8 -> 729), 5 is at or near the best for every n up to 198.  Blocks of n <= 32 are reduced
# unblocked whatever the workspace.  dormqr, which applies Q to the r eigenvectors of T, gets workspace n: with
# dsyevr's 24n it switches to its blocked path from n = 175 on, which forms 32-column triangular factors to apply
# them to r columns and is ~3x slower there (n = 198: 82 vs 25 us); below that both are the same unblocked code.
_TRD_BLOCK = 5


def top_abs_eigh(A, r, symmetric=False):
    """The r eigenpairs of the symmetric A with the largest |eigenvalue|, largest first.

    One reduction to tridiagonal form T = Q^T A Q (LAPACK dsytrd, the O(n^3) part), then bisection (dstebz)
    for the r extreme eigenvalues at one end of T's spectrum and, unless a Sturm count shows that none of
    the other end's would be picked, at the other end too (O(n r)): every wanted pair lies at one of the
    two ends, and the r of largest magnitude are picked among those 2r (equal magnitudes: the top end's
    first).  Eigenvectors only for the end(s) picked from: inverse iteration on T (dstein), then Q applied
    (dormqr on dsytrd's reflectors).  This is the sequence LAPACK's index-range solver dsyevr (range='I')
    runs for one end -- but the reduction is done once for both ends, and with a smaller block size than
    dsyevr's workspace gives dsytrd (``_TRD_BLOCK``): for n <= 32, where dsytrd does not block, each end's
    pairs are dsyevr's to the last bit; above, the blocked reduction rounds differently and the pairs agree
    with dsyevr's (and eigh's) to round-off (tests check both).  Small matrices, matrices dsyevr would
    rescale (max |a_ij| outside 1e-140 .. 1e76) and LAPACK failures use the full solver.

    ``symmetric=True`` promises that A equals A^T exactly (e.g. FedNL's block differences, built symmetric):
    then A's memory read column-major is the same matrix, and dsytrd gets a plain copy of it instead of a
    transposing one (dsytrd reads the lower triangle either way, so the same numbers).  The bookkeeping
    around the LAPACK calls is kept to a few array operations: FedNL Rank-1 on w8a calls this 142 times a round
    on blocks of ~136 rows, where NumPy's per-call costs had grown to about half the time of the reductions."""
    from scipy.linalg.lapack import dormqr, dstebz, dstein, dsytrd

    n = A.shape[0]
    r = min(r, n)
    amax = max(float(A.max()), -float(A.min())) if n else 0.0
    if n <= max(8, 3 * r) or not (amax == 0.0 or 1e-140 < amax < 1e76):  # dsyevr rescales outside ~1e-146..8e76
        return _full_top_abs(A, r)
    # f2py copies the (read-only to us) input into the column-major array dsytrd overwrites
    a = A.T if symmetric and A.flags.c_contiguous else A
    c, dd, e, tau, info = dsytrd(a, lower=1, lwork=_TRD_BLOCK * n, overwrite_a=0)
    if info:  # pragma: no cover - LAPACK failure
        return _full_top_abs(A, r)

    def end(top):
        il, iu = (n - r + 1, n) if top else (1, r)
        m, w, iblock, isplit, info = dstebz(dd, e, 2, 0.0, 0.0, il, iu, 0.0, b"B")  # range 'I', order 'B'
        return None if info or m != r else (w[:m].copy(), iblock, isplit)

    # the end that Gershgorin's discs of T reach further out is computed first; the other end only if a Sturm
    # count finds an eigenvalue there that the picking rule below would take (|.| above the first end's r-th,
    # or equal to it on the top end, which comes first on equal magnitudes).  reach_i = |e_i| + |e_(i-1)|
    # (missing terms 0): the sums of the same two numbers as np.append(|e|, 0) + np.insert(|e|, 0, 0)
    ae = np.abs(e)
    reach = np.empty(n)
    reach[:-1] = ae
    reach[-1] = 0.0
    reach[1:] += ae
    high, low = float(np.add(dd, reach).max()), float(np.subtract(dd, reach, out=reach).min())
    top_first = high >= -low
    first = end(top_first)
    if first is None:  # pragma: no cover
        return _full_top_abs(A, r)
    ends = {top_first: first}
    w = first[0]
    span = high - low + 1.0
    if top_first and w.min() > 0:  # bottom end needed iff some eigenvalue < -t
        t = float(w.min())
        m, *_, info = dstebz(dd, e, 1, low - span, np.nextafter(-t, -np.inf), 0, 0, 0.0, b"B")  # 'V': (vl, vu]
        other = info != 0 or m > 0
    elif not top_first and w.max() < 0:  # top end needed iff some eigenvalue >= t
        t = -float(w.max())
        m, *_, info = dstebz(dd, e, 1, np.nextafter(t, -np.inf), high + span, 0, 0, 0.0, b"B")
        other = info != 0 or m > 0
    else:
        other = True
    if not other and r == 1:
        # one end, one pair (Rank-1's usual case): what the general steps below come to, without their sorting
        # and picking bookkeeping (a few microseconds a call, 142 calls a round on w8a)
        w, iblock, isplit = first
        z, info = dstein(dd, e, w, iblock, isplit)
        zq, _, info2 = dormqr(b"L", b"N", c[1:, : n - 1], tau, z[1:, :], lwork=n)  # dormtr("L", "L", "N"), unblocked
        if info or info2:  # pragma: no cover
            return _full_top_abs(A, r)
        z[1:, :] = zq
        return w, z
    if other:
        ends[not top_first] = end(not top_first)
        if ends[not top_first] is None:  # pragma: no cover
            return _full_top_abs(A, r)
    order = [k for k in (True, False) if k in ends]  # [top, bottom] as far as computed
    # the eigenvalues in dsyevr's output order (ascending); dstein below takes them in dstebz's block order
    lam = (
        np.concatenate([_sorted_like_dsyevr(ends[k][0].copy(), None)[0] for k in order])
        if len(order) > 1
        else _sorted_like_dsyevr(ends[order[0]][0].copy(), None)[0]
    )
    pick = np.argsort(-np.abs(lam), kind="stable")[:r]
    vecs = []
    for at, k in enumerate(order):
        if not ((pick >= at * r) & (pick < (at + 1) * r)).any():
            vecs.append(None)
            continue
        w, iblock, isplit = ends[k]
        z, info = dstein(dd, e, w, iblock, isplit)
        zq, _, info2 = dormqr(b"L", b"N", c[1:, : n - 1], tau, z[1:, :], lwork=n)  # dormtr("L", "L", "N"), unblocked
        if info or info2:  # pragma: no cover
            return _full_top_abs(A, r)
        z[1:, :] = zq
        vecs.append(_sorted_like_dsyevr(w.copy(), z)[1])
    if len(order) == 1:
        return lam[pick], vecs[0][:, pick]
    V = np.zeros((n, r * len(order)))
    for at, z in enumerate(vecs):
        if z is not None:
            V[:, at * r : (at + 1) * r] = z
    return lam[pick], V[:, pick]


@dataclass(frozen=True)
class RankR:
    """Best rank-r approximation: the r eigenpairs of largest |eigenvalue| (contractive)."""

    r: int

    def encode(self, xp, M, rng, support=None):
        P, d = M.shape[0], M.shape[1]
        r = min(self.r, d)
        if xp is not np:
            lam, V = xp.linalg.eigh(M)
            idx = xp.argsort(-xp.abs(lam), axis=1)[:, :r]
            return {"eigvals": xp.take_along_axis(lam, idx, 1), "eigvecs": xp.take_along_axis(V, idx[:, None, :], 2)}
        vals, vecs = np.zeros((P, r)), np.zeros((P, d, r))
        norms = np.einsum("nij,nij->n", M, M)
        for c in range(P):
            a = None if support is None else np.asarray(support[c])
            if a is not None and len(a) < d:
                sub = M[c][np.ix_(a, a)]
                if abs(norms[c] - float((sub * sub).sum())) > 1e-14 * norms[c]:
                    a = None  # mass outside the support: solve on the whole matrix
            if a is None or len(a) == d:
                lam, V = top_abs_eigh(M[c], r)
                vals[c, : len(lam)], vecs[c, :, : len(lam)] = lam, V
            elif len(a):
                lam, V = top_abs_eigh(sub, r)
                vals[c, : len(lam)], vecs[c, a, : len(lam)] = lam, V  # beyond rank(sub): zero pairs
        return {"eigvals": vals, "eigvecs": vecs}

    def decode(self, xp, msg, d):
        V, lam = msg["eigvecs"], msg["eigvals"]
        if xp is not np:
            M = (V * lam[:, None, :]) @ xp.swapaxes(V, 1, 2)
            return 0.5 * (M + xp.swapaxes(M, 1, 2))
        # sum_j lam_j (v_j v_j^T): each outer product is exactly symmetric, so the sum is too (a batched
        # matmul with inner dimension r is far slower than r broadcast products here)
        M = np.zeros((V.shape[0], d, d))
        for j in range(V.shape[2]):
            v = V[:, :, j]
            M += lam[:, j, None, None] * (v[:, :, None] * v[:, None, :])
        return M

    def bits(self, msg, d):
        r = msg["eigvals"].shape[1]
        return np.full(len(msg["eigvals"]), FLOAT_BITS * r * (d + 1), dtype=np.int64)


COMPRESSORS = ("identity", "topk", "toplek", "randk", "randseqk", "natural", "rankr")


def make_compressor(name: str, k: int | None = None, rank: int | None = None):
    if name == "identity":
        return Identity()
    if name == "natural":
        return Natural()
    if name in ("topk", "randk", "toplek", "randseqk"):
        if not k or k < 1:
            raise ValueError(f"compressor {name!r} needs k >= 1")
        return {"topk": TopK, "randk": RandK, "toplek": TopLEK, "randseqk": RandSeqK}[name](k)
    if name == "rankr":
        if not rank or rank < 1:
            raise ValueError("compressor 'rankr' needs rank >= 1")
        return RankR(rank)
    raise ValueError(f"unknown compressor {name!r}; choose {', '.join(COMPRESSORS)}")
