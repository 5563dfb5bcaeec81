"""FedNL on the clients' active blocks (NumPy fast path of fednl.py).

A client's Hessian estimate H_i starts as grad^2 f_i(x^0) = E_i B_i E_i^T + lam I (fedconvex.blocks), and
grad^2 f_i(x^k) - H_i^k vanishes off the client's active block (the lam I parts cancel), so every
compressed update C(.) of that difference lives on the block too: H_i stays "block + lam I" for ever.
Keeping H_i as one packed buffer in the layout of ``problem.hessians`` makes a round cost what the
blocks cost (w8a: 2.9M numbers instead of 142 x 300 x 300 = 12.8M) and lets every compressor work on
the block's upper entries instead of all d(d+1)/2 of them.

The messages are those of the dense path (fednl.py / compressors.py): the entry compressors still
name entries by their index among the d(d+1)/2 upper entries of the whole matrix, the random ones draw
exactly the same numbers (RandK's indices; Natural's uniforms, one per upper entry of each client's block,
which the dense path draws when it is given the clients' active features as supports, as fednl.py does),
and the server decodes them into its dense sum directly.  Only the identity compressor sends the block
itself (and its feature indices), as FedPM does.  tests/test_fednl_family.py and tests/test_natural_support.py
check this path against the dense one.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from ..blocks import ActiveBlocks, Layout
from .compressors import (
    _EXP_BIAS,
    Identity,
    Natural,
    RandK,
    RandSeqK,
    RankR,
    TopK,
    TopLEK,
    natural_values,
    top_abs_eigh,
    upper_index,
)


class PackedBlocks(tuple):
    """A message's per-client blocks (views) that remembers the packed buffer they view, so the
    server can sum them in one product; re-stacked by screening it is a plain tuple of blocks."""

    packed = None
    layout = None


class BlockState:
    """Per-client symmetric matrices B_c + shift I kept on the active blocks in one packed buffer,
    indexable by client like the (N, ...) arrays of ``State.clients`` (the round loop gathers
    ``state[sel]``, copies and writes ``state[sel] = new`` under partial participation)."""

    def __init__(self, packed, layout: Layout, active, d: int, shift: float):
        self.packed, self.layout, self.active, self.d, self.shift = packed, layout, tuple(active), d, shift

    @classmethod
    def of(cls, blocks: ActiveBlocks):
        return cls(np.array(blocks.packed), blocks.layout, blocks.active, blocks.d, blocks.shift)

    def __len__(self):
        return len(self.active)

    @property
    def nbytes(self):
        return self.packed.nbytes

    def _segments(self, sel):
        o = self.layout.offsets
        return [(int(o[c]), int(o[c + 1])) for c in np.asarray(sel).reshape(-1)]

    def __getitem__(self, sel):
        sel = np.asarray(sel).reshape(-1)
        packed = np.concatenate([self.packed[a:b] for a, b in self._segments(sel)]) if len(sel) else np.zeros(0)
        return BlockState(packed, self.layout.take(sel), [self.active[c] for c in sel], self.d, self.shift)

    def __setitem__(self, sel, other: BlockState):
        at = 0
        for a, b in self._segments(sel):
            self.packed[a:b] = other.packed[at : at + b - a]
            at += b - a

    def copy(self):
        return BlockState(self.packed.copy(), self.layout, self.active, self.d, self.shift)

    def blocks(self, shift=None) -> ActiveBlocks:
        """An ActiveBlocks view (same numbers) for products and sums."""
        flat = tuple(self.layout.flat)
        return ActiveBlocks(
            self.layout.views(self.packed),
            self.active,
            self.d,
            self.shift if shift is None else shift,
            flat,
            self.packed,
            self.layout,
        )

    def dense(self):
        return self.blocks().dense()


# ------------------------------------------------------------------ where the upper entries are
@lru_cache(maxsize=4)
def _upper_rc(d):
    """Row and column of each of the d(d+1)/2 upper entries (row-major), the global numbering."""
    iu, ju = np.triu_indices(d)
    return iu.astype(np.int64), ju.astype(np.int64)


def _upper_map(layout: Layout, active):
    """Per client, the packed positions of its block's upper entries (and their mirrors) and their
    global upper indices, concatenated; cached on the layout (the full one is reused every round).

    Each block's entries come in its row-major order, which is global upper-index order because the
    active features are increasing (checked): TopK's tie rule and Natural's draw order rely on it."""
    cached = getattr(layout, "_fednl_upper", None)
    if cached is not None:
        return cached
    d = layout.d
    pos, mir, glob = [], [], []
    for c, a in enumerate(active):
        n = len(a)
        if n > 1 and not (np.diff(a) > 0).all():
            raise ValueError(
                f"client {c}'s active features are not strictly increasing (its block's "
                "entries must come in global upper-index order)"
            )
        iu, ju = np.triu_indices(n)
        off = int(layout.offsets[c])
        pos.append(off + iu * n + ju)
        mir.append(off + ju * n + iu)
        glob.append(upper_index(a[iu], a[ju], d))
    sizes = np.array([len(a) for a in active], dtype=np.int64)
    counts = sizes * (sizes + 1) // 2
    local = np.full((len(active), d), -1, dtype=np.int64)  # feature -> position in the block
    for c, a in enumerate(active):
        local[c, a] = np.arange(len(a))

    def cat(parts):
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    owner_up = np.repeat(np.arange(len(active)), counts)
    pos, mir = cat(pos), cat(mir)
    inv = np.empty(layout.total, dtype=np.intp)  # packed position -> its upper entry (both sides)
    inv[pos] = np.arange(len(pos))
    inv[mir] = np.arange(len(pos))
    out = {
        "pos": pos,
        "mir": mir,
        "inv": inv,
        "glob": cat(glob),
        "owner_up": owner_up,
        "flat_up": owner_up * (d * (d + 1) // 2) + cat(glob),  # into a (P, d(d+1)/2) stack
        "off": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        "owner": np.repeat(np.arange(len(active)), sizes * sizes),
        "local": local,
        "sizes": sizes,
        "boff": np.asarray(layout.offsets[:-1], dtype=np.int64),
    }
    layout._fednl_upper = out
    return out


def _put(S, m, sel_entries, values):
    """S at the given block upper entries (and their mirrors) = values: exactly symmetric."""
    S[m["pos"][sel_entries]] = values
    S[m["mir"][sel_entries]] = values


def frobenius(packed, layout, active):
    """Per client ||block||_F of a packed stack."""
    m = _upper_map(layout, active)
    return np.sqrt(np.bincount(m["owner"], weights=packed * packed, minlength=len(active)))


# -------------------------------------------------------------------------------- encoding
def _gather_global(diff, m, idx, d):
    """Values of each client's matrix at global upper indices idx (P, k): zero off its block."""
    rows, cols = _upper_rc(d)
    P = idx.shape[0]
    c = np.arange(P)[:, None]
    li, lj = m["local"][c, rows[idx]], m["local"][c, cols[idx]]
    inside = (li >= 0) & (lj >= 0)
    sizes, offsets = m["sizes"][c], m["boff"][c]
    pos = np.where(inside, offsets + li * sizes + lj, 0)
    return np.where(inside, diff[pos], 0.0), inside, pos, np.where(inside, offsets + lj * sizes + li, 0)


def _top_entries(diff, m, k, d):
    """Per client the k largest |upper entries| of its matrix with compressors._top_order's rule
    (largest first, equal magnitudes by global index; the block's entries are in global index order),
    as local entry numbers (into the upper map), values and global indices.  When the k-th largest is
    zero, the zeros kept are the k - nnz lowest global indices among all zero entries, on the block or
    off it, as the dense path keeps them."""
    P = len(m["sizes"])
    n = d * (d + 1) // 2
    vals, glob, loc = np.zeros((P, k)), np.zeros((P, k), dtype=np.int64), []
    for c in range(P):
        a, b = int(m["off"][c]), int(m["off"][c + 1])
        U = diff[m["pos"][a:b]]
        A = np.abs(U)
        t = A[np.argpartition(-A, k - 1)[k - 1]] if k < len(A) else 0.0
        if t > 0:
            above = np.flatnonzero(A > t)
            take = np.concatenate([above, np.flatnonzero(A == t)[: k - len(above)]])
            take.sort()
            zeros = np.zeros(0, dtype=np.int64)
        else:  # every non-zero entry, then the lowest-index zeros of the whole matrix
            take = np.flatnonzero(A > 0)
            g = m["glob"][a:b][take]
            zeros = np.setdiff1d(np.arange(min(n, k + len(take))), g)[: k - len(take)]
        take = take[np.argsort(-A[take], kind="stable")]
        gl = np.concatenate([m["glob"][a:b][take], zeros])
        v = np.concatenate([U[take], np.zeros(len(zeros))])
        if len(zeros):  # zeros sort after every non-zero, by global index
            order = np.argsort(-np.abs(v), kind="stable")
            v, gl = v[order], gl[order]
        vals[c], glob[c] = v, gl
        loc.append(a + take)
    return vals, glob, loc


_DRAWS = threading.local()


def _uniforms(rng, shape):
    """rng.random(shape) -- the same numbers and generator state -- written into a buffer this thread keeps
    for the next call of the same shape.  Natural draws one uniform per upper entry of every participant's
    block (w8a: 1.44 M, 11.5 MB a round), and a fresh array that large can be a fresh mapping whose pages
    fault in on every round: a w8a FedNL Natural round measured 55.5 / 68.7 ms with the kept buffer against
    58.3 / 73.1 ms with fresh ones (two alternated runs, one BLAS thread).  The caller reads it before drawing
    again."""
    buf = getattr(_DRAWS, "buf", None)
    if buf is None or buf.shape != tuple(shape):
        buf = _DRAWS.buf = np.empty(shape)
    rng.random(out=buf)
    return buf


def encode(comp, diff, layout, active, d, rng, base=None, alpha=1.0):
    """(message, S) for packed differences ``diff``: the message the dense path would send and the
    decoded update S on the blocks (packed), which the client adds to its estimate.

    With ``base`` (the packed estimates H, Rank-R only) the second item is instead the new estimate
    H + alpha S, the numbers of fednl._add_scaled(base, alpha, S), formed block by block while the block of S
    is in cache instead of writing S and adding it in another pass over the whole buffer."""
    P, n = len(active), d * (d + 1) // 2
    if base is not None and not isinstance(comp, RankR):
        raise TypeError("encode forms H + alpha S itself only for Rank-R")
    if isinstance(comp, RankR):
        return _encode_rank(comp, diff, layout, active, d, base, alpha)
    m = _upper_map(layout, active)
    if isinstance(comp, Identity):
        msg = PackedBlocks(layout.views(diff))
        msg.packed, msg.layout = diff, layout
        return {"blocks": msg, "active": tuple(active)}, diff
    if isinstance(comp, Natural):
        # one uniform per block upper entry, clients in order, each block in global upper-index order (the
        # map's order): what Natural.encode draws given the active features as supports.  The blocks hold all
        # of each difference, so its fallback (mass outside the support: draw for every entry) never applies.
        draw = _uniforms(rng, (len(m["pos"]),))
        U = diff[m["pos"]]
        mant, ex = np.frexp(np.abs(U))
        up = draw < (2.0 * mant - 1.0)
        code_vals = (ex + (_EXP_BIAS - 1)).astype(np.int16)
        code_vals += up
        code_vals *= np.sign(U).astype(np.int16)
        code = np.zeros((P, n), dtype=np.int16)  # entries off the block are zero: code 0
        code.reshape(-1)[m["flat_up"]] = code_vals
        S = np.take(natural_values(code_vals), m["inv"])  # every block entry from its upper entry: symmetric
        return {"code": code}, S
    S = np.zeros_like(diff)
    if isinstance(comp, (TopK, TopLEK)):
        k = min(comp.k, n)
        vals, glob, loc = _top_entries(diff, m, k, d)
        if isinstance(comp, TopK):
            for c in range(P):
                _put(S, m, loc[c], vals[c, : len(loc[c])])
            return {"values": vals, "index": glob.astype(np.int32)}, S
        # TopLEK: the fewest entries carrying TopK's guaranteed share of the energy (dense path's rule)
        energy = np.bincount(m["owner_up"], weights=diff[m["pos"]] ** 2, minlength=P)
        kept = np.cumsum(vals * vals, axis=1)
        needed = energy - (1.0 - k / n) * energy
        counts = np.minimum(1 + (kept < needed[:, None]).sum(1), k)
        for c in range(P):
            t = loc[c][: counts[c]]
            _put(S, m, t, vals[c, : len(t)])
        return {
            "values": tuple(vals[c, : counts[c]] * 1.0 for c in range(P)),
            "index": tuple(glob[c, : counts[c]].astype(np.int32) for c in range(P)),
        }, S
    if isinstance(comp, (RandK, RandSeqK)):
        k = min(comp.k, n)
        if isinstance(comp, RandK):
            idx = np.stack([np.sort(rng.choice(n, k, replace=False)) for _ in range(P)])
        else:
            start = rng.integers(0, n, size=P)
            idx = (start[:, None] + np.arange(k)[None, :]) % n
        vals, inside, pos, mir = _gather_global(diff, m, idx, d)
        vals = vals * (n / k)
        S[pos[inside]] = vals[inside]
        S[mir[inside]] = vals[inside]
        if isinstance(comp, RandK):
            return {"values": vals, "index": idx.astype(np.int32)}, S
        return {"values": vals, "start": start.astype(np.int32)}, S
    raise TypeError(f"no block path for {type(comp).__name__}")


def _encode_rank(comp, diff, layout, active, d, base, alpha):
    """Rank-R on each client's block (see ``encode``)."""
    P, r = len(active), min(comp.r, d)
    vals, vecs = np.zeros((P, r)), np.zeros((P, d, r))
    S = np.empty_like(diff)  # every entry is written below
    views, out = layout.views(diff), layout.views(S)
    bases = layout.views(base) if base is not None else None
    for c, (B, a) in enumerate(zip(views, active, strict=False)):
        if not len(a):
            continue
        lam, V = top_abs_eigh(B, r, symmetric=True)  # the differences are exactly symmetric
        vals[c, : len(lam)], vecs[c][a, : len(lam)] = lam, V
        # sum of exactly symmetric outer products lam_j (v_j v_j^T), the first written in place (no zero
        # fill and add: the same numbers, except that an entry may now be -0.0 where 0 + -0.0 gave +0.0,
        # which leaves every estimate H + alpha S unchanged, as H never holds -0.0: it starts from sums
        # and x + y is -0.0 only when both are)
        M = out[c]
        np.multiply(V[:, 0, None], V[None, :, 0], out=M)
        M *= lam[0]
        if len(lam) > 1:
            tmp = np.empty((len(a), len(a)))
            for j in range(1, len(lam)):
                np.multiply(V[:, j, None], V[None, :, j], out=tmp)
                tmp *= lam[j]
                M += tmp
        if bases is not None:  # H + alpha S as _add_scaled forms it: H + S, or (S alpha) + H
            if alpha != 1.0:
                M *= alpha
            M += bases[c]
    return {"eigvals": vals, "eigvecs": vecs}, S


# ---------------------------------------------------------------------------- server sum
def _entry_sum(values, index, w, d):
    """sum_i w_i C_i for messages of (values, global upper index): one bincount, exactly symmetric."""
    rows, cols = _upper_rc(d)
    v = np.concatenate([w[c] * np.asarray(values[c], dtype=np.float64) for c in range(len(values))])
    i = np.concatenate([np.asarray(ix, dtype=np.int64).reshape(-1) for ix in index])
    r, c = rows[i], cols[i]
    off = r != c
    flat = np.bincount(r * d + c, weights=v, minlength=d * d)
    flat += np.bincount(c[off] * d + r[off], weights=v[off], minlength=d * d)
    return flat.reshape(d, d)


def _natural_sum(code, w, d):
    """sum_i w_i C_i for Natural's (P, d(d+1)/2) int16 codes: per upper entry the clients' w_i value_i added
    in client order from 0, as ``_entry_sum`` adds them (code 0 adds w_i 0 = +0, which changes no sum), but
    one table look-up, one scale and one add per client row instead of a scan for the non-zero codes."""
    from .compressors import _natural_table

    n = d * (d + 1) // 2
    acc, buf = np.zeros(n), np.empty(n)
    bits = np.ascontiguousarray(code, dtype=np.int16).view(np.uint16)
    scaled = {}  # few distinct weights (the paper's 1/N: one): w * table, the same products
    for c in range(code.shape[0]):
        if len(scaled) < 4 or w[c] in scaled:
            table = scaled.get(w[c])
            if table is None:
                table = scaled[w[c]] = w[c] * _natural_table()
            np.take(table, bits[c], out=buf)
        else:
            natural_values(code[c], out=buf)
            buf *= w[c]
        acc += buf
    rows, cols = _upper_rc(d)
    out = np.zeros(d * d)
    out[rows * d + cols] = acc
    out[cols * d + rows] = acc  # the same number on both sides: exactly symmetric
    return out.reshape(d, d)


def server_sum(comp, msg, w, d):
    """sum_i w_i C_i (dense d x d) from the participants' messages."""
    w = np.asarray(w, dtype=np.float64)
    n = d * (d + 1) // 2
    if isinstance(comp, Identity):
        blocks, active = msg["blocks"], msg["active"]
        packed, layout = getattr(blocks, "packed", None), getattr(blocks, "layout", None)
        if packed is None or len(layout.sizes) != len(active):  # re-stacked by screening
            sizes = [len(a) for a in active]
            packed = (
                np.concatenate([np.asarray(b, dtype=np.float64).reshape(-1) for b in blocks]) if blocks else np.zeros(0)
            )
            layout = Layout(sizes, [(a[:, None] * d + a[None, :]).reshape(-1) for a in active], d)
        return ActiveBlocks(
            layout.views(packed), tuple(active), d, 0.0, tuple(layout.flat), packed, layout
        ).weighted_sum(w)
    if isinstance(comp, RandSeqK):
        k = msg["values"].shape[1]
        idx = (np.asarray(msg["start"]).astype(np.int64)[:, None] + np.arange(k)[None, :]) % n
        return _entry_sum(msg["values"], idx, w, d)
    if isinstance(comp, (TopK, TopLEK, RandK)):
        return _entry_sum(msg["values"], msg["index"], w, d)
    if isinstance(comp, Natural):
        return _natural_sum(np.asarray(msg["code"]), w, d)
    if isinstance(comp, RankR):
        V = np.asarray(msg["eigvecs"])  # (P, d, r)
        coef = (w[:, None] * np.asarray(msg["eigvals"])).reshape(-1)
        Vs = V.transpose(1, 0, 2).reshape(d, -1)  # (d, P r)
        M = (Vs * coef[None, :]) @ Vs.T
        return 0.5 * (M + M.T)
    raise TypeError(f"no block path for {type(comp).__name__}")
