"""Federated L2-regularised logistic regression (paper Test 1; docs/architecture.md).

    f_c(theta) = 1/M_c sum_j log(1 + exp(-y_cj x_cj^T theta)) + lam/2 ||theta||^2
    f(theta)   = sum_c p_c f_c(theta),   p_c = 1/N (paper) or M_c / sum M (option)

Oracles take a *stack* of parameters, one row per selected client (``thetas`` of shape
(P, d) and ``sel`` the client ids), because after local steps every client sits at a
different point.  Values, gradients and Hessian-vector products are vectorised over all
clients at once through a block-sparse design matrix (one compiled sparse product, no
Python loop), which is what pays on sparse data such as w8a (3.9% dense).  Hessians are built
per client on its active features (see ``blocks.ActiveBlocks``).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import scipy.sparse as sp

from .backend import is_torch, python_scalar, to_numpy
from .blocks import ActiveBlocks, Layout
from .data.libsvm import DataError

# lambda of f_i's L2 term: the FedNL setting the paper's Test 1 follows.  Every front-end's default
# (the CLIs, Flower's run config, the benchmarks) is this constant.
DEFAULT_LAM = 1e-3


def _xp_asarray(xp, a, dtype=None):
    if is_torch(xp):
        return xp.as_tensor(np.ascontiguousarray(a), dtype=dtype or (xp.float64 if a.dtype.kind == "f" else xp.int64))
    return xp.asarray(a, dtype=dtype)


def _sparse_module(xp):
    if xp is np:
        return sp
    import cupyx.scipy.sparse as csp  # the CuPy backend; same API as scipy.sparse

    return csp


def _unique_bounded(keys, bound):
    """np.unique(keys, return_inverse=True) for integer keys in [0, bound): a mark array instead of a
    sort (linear time; the Hessian plan's keys run to millions)."""
    mark = np.zeros(bound, dtype=bool)
    mark[keys] = True
    uniq = np.flatnonzero(mark)
    # 32-bit ranks where they fit: the plan's inverse runs to millions of entries, and fresh memory is not free
    rank = np.cumsum(mark, dtype=np.int32 if bound < 2**31 else np.int64) - 1
    return uniq, rank[keys]


def _matvec_into(Q, x):
    """[Q x, 0]: the sparse product written straight into a buffer one longer (no appended copy).  SciPy's
    compiled kernel is what ``Q @ x`` runs (it adds into a zeroed output in the same order); where that
    private entry point is missing, ``Q @ x`` and a copy."""
    try:
        from scipy.sparse._sparsetools import csr_matvec
    except ImportError:  # pragma: no cover - another SciPy layout
        return np.append(Q @ x, 0.0)
    out = np.zeros(Q.shape[0] + 1)
    csr_matvec(Q.shape[0], Q.shape[1], Q.indptr, Q.indices, Q.data, np.ascontiguousarray(x, dtype=np.float64), out)
    return out


class _Rows:
    """The data of a set of clients as a block design matrix.

    Row j of client slot k has its features at columns k*d + f, so for a stack V (P, d)
    ``XB @ V.ravel()`` gives every row's x_j^T v_{client(j)} and ``XB^T @ r`` every client's
    sum_j r_j x_j in one compiled sparse product, without a loop over clients.
    """

    def __init__(self, xp, d, nnz_row, nnz_col, nnz_val, nnz_slot, y, row_w, row_slot, n_slots):
        self.n_rows, self.n_slots = len(y), n_slots
        host = sp.csr_matrix((nnz_val, (nnz_row, nnz_slot.astype(np.int64) * d + nnz_col)), shape=(len(y), n_slots * d))
        sm = _sparse_module(xp)
        self.XB = sm.csr_matrix(host)
        self.XBT = sm.csr_matrix(host.T.tocsr())
        self.y = _xp_asarray(xp, y)
        self.row_w = _xp_asarray(xp, row_w)
        self.row_slot = _xp_asarray(xp, row_slot)


def _check_lam(lam):
    """lam as a Python number (a 0-d array's value), or one clear error."""
    lam = python_scalar(lam)
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real):
        raise TypeError(f"lam must be a real number, got {lam!r}")
    if not (lam >= 0 and math.isfinite(lam)):
        raise ValueError(f"lam must be a finite number >= 0, got {lam}")
    return lam


# a bound on |x_ip x_iq| summed over the rows (n max|x|^2) that leaves float64 room for the products after it
_MAX_GRAM = 1e300


def _check_lam_resolves(lam: float, X) -> None:
    """A positive lam is there to regularise: one below float64's resolution next to the data Hessian's scale
    (its largest diagonal entry is at most max_j mean_i x_ij^2 / 4) adds nothing to H + lam I, and a singular
    H stays singular.  lam = 0 (no regularisation) is what it says."""
    if lam == 0 or not X.nnz:
        return
    scale = 0.25 * float(np.asarray(X.multiply(X).sum(axis=0)).max()) / X.shape[0]
    floor = np.finfo(np.float64).eps * scale
    if lam < floor:
        raise ValueError(
            f"lam {lam:g} is below float64's resolution next to the Hessian's scale {scale:.3g}: it regularises "
            f"nothing; use lam >= {floor:.1e} (or 0 for none)"
        )


def _real_dtype(a, name: str) -> None:
    """DataError for complex entries (a cast to float64 drops the imaginary part with only a warning), TypeError
    for any other kind that is not a number; booleans and integers are real numbers and are cast exactly."""
    kind = getattr(getattr(a, "dtype", None), "kind", None)
    if kind == "c":
        raise DataError(f"{name} is complex ({a.dtype}); pass its real part ({name}.real) if that is what you mean")
    if kind is not None and kind not in "biuf":
        raise TypeError(f"{name} must be real numbers, got {type(a).__name__} of {a.dtype}")


def _canonical_csr(X):
    """X as CSR float64 in SciPy's canonical form: duplicate entries summed (what they mean: ``toarray`` sums
    them), column indices sorted, no stored zeros.  The problem's index plans assume one stored entry per place,
    and the finiteness check below sees every entry as the matrix holds it (inf + -inf duplicates are NaN)."""
    X = sp.csr_matrix(X, dtype=np.float64, copy=True)
    X.sum_duplicates()
    X.eliminate_zeros()
    return X


def _checked_data(X, y):
    """X as canonical CSR float64 and y as float64 labels, or one clear error: X 2-D, real, finite, with a
    column; y 1-D, real, one label a row, every label -1 or +1 (the loss is log(1 + exp(-y x^T theta));
    ``parse_libsvm`` maps a file's two labels to these)."""
    try:
        if not sp.issparse(X):
            X = np.asarray(X)
            _real_dtype(X, "X")
            X = X.astype(np.float64)
            if X.ndim != 2:
                raise DataError(f"X must be 2-D (rows x features), got shape {X.shape}")
        else:
            _real_dtype(X, "X")
        X = _canonical_csr(X)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise TypeError(
            f"X must be a 2-D numeric array or SciPy sparse matrix, got {type(X).__name__}"
            f"{' of ' + str(X.dtype) if hasattr(X, 'dtype') else ''}"
        ) from None
    if X.shape[1] < 1:
        raise DataError(f"X has no columns (shape {X.shape}); a problem needs at least one feature")
    if not np.isfinite(X.data).all():
        row = int(np.searchsorted(X.indptr, np.flatnonzero(~np.isfinite(X.data))[0], side="right") - 1)
        raise DataError(f"X holds NaN or Inf (row {row}); remove or impute those entries")
    if X.nnz and float(np.abs(X.data).max()) > math.sqrt(_MAX_GRAM / X.shape[0]):
        big = int(np.argmax(np.abs(X.data)))
        row = int(np.searchsorted(X.indptr, big, side="right") - 1)
        raise DataError(
            f"X holds a value of {X.data[big]:.3g} (row {row}): sums of squares over its {X.shape[0]} rows "
            "overflow float64 in the gradients and Hessians; rescale the features"
        )
    try:
        y = np.asarray(y)
        _real_dtype(y, "y")
        y = y.astype(np.float64)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise TypeError(
            f"y must be numeric labels -1 and +1, got {type(y).__name__}"
            f"{' of ' + str(y.dtype) if hasattr(y, 'dtype') else ''}"
        ) from None
    if y.ndim != 1:
        raise DataError(f"y must be a 1-D array of labels, got shape {y.shape}")
    if len(y) != X.shape[0]:
        raise DataError(f"y has {len(y)} labels but X has {X.shape[0]} rows")
    bad = (y != 1.0) & (y != -1.0)
    if bad.any():
        if not np.isfinite(y).all():
            raise DataError(f"y holds NaN or Inf (row {int(np.flatnonzero(~np.isfinite(y))[0])})")
        got = ", ".join(f"{v:g}" for v in np.unique(y[bad])[:3])
        raise DataError(
            f"y must hold labels -1 and +1 (the loss is log(1 + exp(-y x^T theta))), got {got} "
            f"(row {int(np.flatnonzero(bad)[0])}); for 0/1 labels pass 2 * y - 1, for others "
            "np.where(y == positive, 1.0, -1.0)"
        )
    return X, y


def _checked_parts(parts, n_rows: int) -> list:
    """The clients' row indices as int64 arrays, or one clear error: a non-empty sequence of non-empty 1-D
    integer arrays, every index in 0..n_rows-1 (no wrap-around of negative indices, no truncated floats).  A row may
    stand twice in one client (a resampled client: the same problem as that row copied) or in several clients."""
    if isinstance(parts, (str, bytes)) or not hasattr(parts, "__iter__"):
        raise TypeError(f"parts must be a sequence of row-index arrays (one per client), got {type(parts).__name__}")
    parts = list(parts)
    if not parts:
        raise DataError("a federated problem needs at least one client")
    out = []
    for c, p in enumerate(parts):
        try:
            a = np.asarray(p)
        except (TypeError, ValueError):
            raise TypeError(f"client {c}'s rows are not an array of row indices") from None
        if a.ndim != 1:
            raise DataError(
                f"client {c}'s rows must be a 1-D array of row indices, got "
                + ("a scalar" if a.ndim == 0 else f"shape {a.shape}")
            )
        if a.size == 0:
            raise DataError(f"every client needs at least one sample (client {c} has none)")
        if a.dtype.kind not in "iu":
            raise TypeError(f"client {c}'s row indices must be integers, got {a.dtype}")
        # checked in the given dtype, before the cast (a huge unsigned index must not wrap to a negative one)
        lo, hi = a.min(), a.max()
        if lo < 0 or hi >= n_rows:
            raise DataError(
                f"client {c} has row index {lo if lo < 0 else hi}; row indices must be in "
                f"0..{n_rows - 1} (X has {n_rows} rows)"
            )
        out.append(a.astype(np.int64, copy=False))
    return out


class FederatedLogReg:
    def __init__(
        self, X, y, parts, lam: float = DEFAULT_LAM, weighting: str = "uniform", xp=np, hessian_plan: bool = True
    ):
        lam = _check_lam(lam)
        if weighting not in ("uniform", "samples"):
            raise ValueError(f"weighting must be 'uniform' or 'samples', got {weighting!r}")
        X, y = _checked_data(X, y)
        _check_lam_resolves(lam, X)
        parts = _checked_parts(parts, X.shape[0])
        self.xp, self.lam, self.weighting = xp, float(lam), weighting
        self.d = X.shape[1]
        self.n_clients = len(parts)
        order = np.concatenate(parts)
        self.X = X[order]
        self.X.sort_indices()
        self.y_host = y[order]
        self.counts = np.array([len(p) for p in parts], dtype=np.int64)
        self.row_offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.nnz_offsets = self.X.indptr[self.row_offsets]
        w = self.counts / self.counts.sum() if weighting == "samples" else np.full(self.n_clients, 1.0 / self.n_clients)
        self.client_weights_host = w
        self.client_weights = _xp_asarray(xp, w)
        self._nnz_row = np.repeat(np.arange(self.X.shape[0]), np.diff(self.X.indptr))
        self._row_client = np.repeat(np.arange(self.n_clients), self.counts)
        self._full = self._build_rows(np.arange(self.n_clients))
        # per-client active features and reduced dense designs for the Hessian blocks
        self.active_host, self.reduced, self.reduced_T_csr = [], [], []
        for c in range(self.n_clients):
            Xc = self.X[self.row_offsets[c] : self.row_offsets[c + 1]]
            act = np.unique(Xc.indices).astype(np.int64)
            dense = np.ascontiguousarray(Xc[:, act].toarray())
            self.active_host.append(act)
            self.reduced.append(dense if xp is np else _xp_asarray(xp, dense))
            self.reduced_T_csr.append(sp.csr_matrix(dense.T) if xp is np else None)
        self.active = tuple(a if xp is np else _xp_asarray(xp, a) for a in self.active_host)
        self.block_flat = tuple((a[:, None] * self.d + a[None, :]).reshape(-1) for a in self.active)
        # hessian_plan=False: the caller installs it later (validation.common builds it in a thread while
        # the optimum is solved; nothing but ``hessians`` uses it, and they are right without it, only slower)
        self._plan = self.build_hessian_plan() if hessian_plan else None

    def build_hessian_plan(self):
        """The one-product Hessian plan (NumPy; else None), returned, not installed: ``set_hessian_plan``."""
        return self._hessian_plan() if self.xp is np else None

    def set_hessian_plan(self, plan) -> None:
        self._plan = plan

    # Above this many (row, feature pair) products the one-product plan would cost more memory than
    # it saves time (dense rows); the per-client loop is used instead.
    PLAN_MAX_PAIRS = 12_000_000

    def _hessian_plan(self):
        """All client Hessians as one sparse product (NumPy).

        The loss Hessian of client c is sum_j s_j x_j x_j^T over its rows; entry (p, q) of its
        active block is sum_j s_j x_jp x_jq.  Q (upper-triangle entries x rows) holds the
        constant products x_jp x_jq, so ``Q @ s`` gives every client's upper triangle at once
        (w8a: ~78 products a row, no Python loop), mirrored into the packed layout.
        """
        X, d = self.X, self.d
        rownnz = np.diff(X.indptr).astype(np.int64)  # int32 would overflow k (k + 1) / 2 past 46,340
        pairs = int((rownnz * (rownnz + 1) // 2).sum())
        if pairs > self.PLAN_MAX_PAIRS:
            return None
        sizes = np.array([len(a) for a in self.active_host], dtype=np.int64)
        layout = Layout(sizes, self.block_flat, d, persistent=True)
        nnz_client = self._row_client[self._nnz_row]
        keys = nnz_client * d + X.indices.astype(np.int64)
        uniq, inv = _unique_bounded(keys, self.n_clients * d)
        local = inv - np.searchsorted(uniq, np.arange(self.n_clients) * d)[nnz_client]  # index in active set
        # every row's products laid out in row order (rows with the same count k are formed together, then
        # scattered to their rows' places): the COO -> CSR conversion below is a stable counting sort, so each
        # row of Q comes out with its X rows ascending -- the canonical order, which it would otherwise sort
        # into (w8a: 6.9 M entries, ~0.5 s of the plan) -- and Q @ s sums them in that same order.  Positions,
        # their ranks and the row numbers are 32-bit where they fit (the int32 indices Q gets anyway): a
        # quarter of the plan's fresh memory, which costs system time to map in (w8a: ~200 MB)
        npairs = rownnz * (rownnz + 1) // 2
        start = np.concatenate([[0], np.cumsum(npairs)])
        small = max(layout.total, X.shape[0]) < 2**31
        pos = np.empty(int(start[-1]), dtype=np.int32 if small else np.int64)
        vals = np.empty(int(start[-1]))
        for k in np.unique(rownnz):
            if k == 0:
                continue
            rows = np.flatnonzero(rownnz == k)
            at = X.indptr[rows][:, None] + np.arange(k)[None, :]  # (r, k) positions in X.data
            iu, ju = np.triu_indices(k)
            li, lk, v = local[at], local[at], X.data[at]
            c = self._row_client[rows][:, None]
            dest = (start[rows][:, None] + np.arange(len(iu))[None, :]).ravel()
            pos[dest] = (layout.offsets[c] + li[:, iu] * sizes[c] + lk[:, ju]).ravel()
            vals[dest] = (v[:, iu] * v[:, ju]).ravel()
        upos, pid = _unique_bounded(pos, layout.total)
        rows = np.repeat(np.arange(X.shape[0], dtype=np.int32 if small else np.int64), npairs)
        Q = sp.csr_matrix((vals, (pid, rows)), shape=(len(upos), X.shape[0]))
        del pos, pid, rows, vals
        c = np.searchsorted(layout.offsets, upos, side="right") - 1
        r = upos - layout.offsets[c]
        lpos = layout.offsets[c] + (r % sizes[c]) * sizes[c] + r // sizes[c]  # mirrored position
        # packed = [u, 0][gather]: each packed entry reads its upper-triangle value (or the 0 slot)
        gather = np.full(layout.total, len(upos), dtype=np.intp)
        gather[upos] = np.arange(len(upos))
        gather[lpos] = np.arange(len(upos))
        return {"Q": Q, "gather": gather, "layout": layout}

    # ----------------------------------------------------------------- helpers
    @property
    def n_samples(self) -> int:
        return int(self.counts.sum())

    def _build_rows(self, sel) -> _Rows:
        sel = np.asarray(sel, dtype=np.int64)
        row_idx = np.concatenate([np.arange(self.row_offsets[c], self.row_offsets[c + 1]) for c in sel])
        nnz_idx = np.concatenate([np.arange(self.nnz_offsets[c], self.nnz_offsets[c + 1]) for c in sel])
        local_row = np.empty(self.X.shape[0], dtype=np.int64)
        local_row[row_idx] = np.arange(len(row_idx))
        row_client = self._row_client[row_idx]
        slot_of_client = np.full(self.n_clients, -1, dtype=np.int64)
        slot_of_client[sel] = np.arange(len(sel))
        nnz_row = self._nnz_row[nnz_idx]
        return _Rows(
            self.xp,
            self.d,
            local_row[nnz_row],
            self.X.indices[nnz_idx].astype(np.int64),
            self.X.data[nnz_idx],
            slot_of_client[self._row_client[nnz_row]],
            self.y_host[row_idx],
            1.0 / self.counts[row_client],
            slot_of_client[row_client],
            len(sel),
        )

    def _rows(self, sel) -> _Rows:
        if sel is None or (len(sel) == self.n_clients and np.array_equal(np.asarray(sel), np.arange(self.n_clients))):
            return self._full
        return self._build_rows(sel)

    def _check(self, thetas, rows):
        if tuple(thetas.shape) != (rows.n_slots, self.d):
            raise ValueError(f"thetas must have shape ({rows.n_slots}, {self.d}), got {tuple(thetas.shape)}")

    def _xv(self, V, rows):
        """Per-row x_j^T v_{client(j)} for a stack V (P, d)."""
        return rows.XB @ V.reshape(-1)

    def _xtr(self, r, rows):
        """Per-client sum_j r_j x_j as a (P, d) stack."""
        return (rows.XBT @ r).reshape(rows.n_slots, self.d)

    def _segment_sum(self, v, rows):
        return self.xp.bincount(rows.row_slot, weights=v, minlength=rows.n_slots)

    # ---------------------------------------------------------- client oracles
    def _margins_and_values(self, thetas, rows):
        """The margins y x^T theta of every row and f_c(theta_c) of every selected client."""
        self._check(thetas, rows)
        m = rows.y * self._xv(thetas, rows)
        loss = self._segment_sum(rows.row_w * self.xp.logaddexp(m * 0, -m), rows)
        return m, loss + 0.5 * self.lam * (thetas * thetas).sum(1)

    def values_and_gradients(self, thetas, sel=None):
        """(f_c(theta_c) for each selected client, their gradients (P, d))."""
        xp, rows = self.xp, self._rows(sel)
        m, vals = self._margins_and_values(thetas, rows)
        sig_neg = 0.5 * (1 - xp.tanh(0.5 * m))  # sigma(-m), stable for any m
        grads = self._xtr(-rows.row_w * rows.y * sig_neg, rows) + self.lam * thetas
        return vals, grads

    def values(self, thetas, sel=None):
        """f_c(theta_c) for each selected client, without the gradients' product (FedNL-LS evaluates f at
        every backtracking trial)."""
        return self._margins_and_values(thetas, self._rows(sel))[1]

    def gradients(self, thetas, sel=None):
        return self.values_and_gradients(thetas, sel)[1]

    def _curvature(self, thetas, rows):
        """Per-row weights w_j sigma(m)(1 - sigma(m)) of the loss Hessian."""
        t = self.xp.tanh(0.5 * rows.y * self._xv(thetas, rows))
        return rows.row_w * 0.25 * (1 - t * t)

    def hvps(self, thetas, V, sel=None):
        """Hessian-vector products: (P, d) stack of grad^2 f_c(theta_c) v_c."""
        rows = self._rows(sel)
        self._check(thetas, rows)
        self._check(V, rows)
        s = self._curvature(thetas, rows)
        return self._xtr(s * self._xv(V, rows), rows) + self.lam * V

    def hessians(self, thetas, sel=None) -> ActiveBlocks:
        """Exact client Hessians grad^2 f_c(theta_c), stored on each client's active features."""
        xp, rows = self.xp, self._rows(sel)
        self._check(thetas, rows)
        s = self._curvature(thetas, rows)
        sel = np.arange(self.n_clients) if sel is None else np.asarray(sel)
        if self._plan is not None:
            return self._planned_hessians(s, sel, rows)
        starts = np.concatenate([[0], np.cumsum(self.counts[sel])])
        blocks = []
        for k, c in enumerate(sel):
            scaled = self.reduced[c] * s[starts[k] : starts[k + 1], None]
            if xp is np:
                # sparse X^T times dense (D X): nnz x a flops instead of M x a^2 (w8a: 35 vs 54 ms)
                B = self.reduced_T_csr[c] @ scaled
            else:
                B = self.reduced[c].T @ scaled
            blocks.append(0.5 * (B + B.T))  # symmetric to the last bit, whatever the summation order
        return ActiveBlocks(
            tuple(blocks), tuple(self.active[c] for c in sel), self.d, self.lam, tuple(self.block_flat[c] for c in sel)
        )

    def _planned_packed(self, s, sel, rows, minus=None):
        """The packed Hessian blocks of ``sel`` (minus ``minus``, packed alike, if given), their layout and
        the product Q s they were gathered from."""
        plan = self._plan
        full = rows is self._full
        if not full:  # rows of the other clients get weight 0; their blocks are dropped below
            s_all = np.zeros(self.X.shape[0])
            s_all[np.concatenate([np.arange(self.row_offsets[c], self.row_offsets[c + 1]) for c in sel])] = s
            s = s_all
        u = _matvec_into(plan["Q"], s)  # Q s and, last, the 0 the off-block positions read
        packed = u[plan["gather"]]  # the same number on both sides of the diagonal: exactly symmetric
        layout = plan["layout"]
        if not full:
            layout = layout.take(sel)
            packed = np.concatenate([packed[plan["layout"].offsets[c] : plan["layout"].offsets[c + 1]] for c in sel])
        if minus is not None:
            np.subtract(packed, minus, out=packed)  # the numbers of packed - minus, in the gathered array
        return packed, layout, u

    def hessian_differences(self, thetas, sel, packed):
        """grad^2 f_c(theta_c) - (E_c B_c E_c^T + lam I) as a stack on the active blocks (shift 0: the lam I
        parts cancel), for blocks B_c given ``packed`` in the layout ``hessians(thetas, sel)`` has; its packed
        numbers are those of ``hessians(thetas, sel).packed - packed``, the Hessians gathered straight into the
        result (one fresh d-block-sized array instead of two).  None where ``hessians`` has no plan."""
        if self._plan is None:
            return None
        rows = self._rows(sel)
        self._check(thetas, rows)
        s = self._curvature(thetas, rows)
        sel = np.arange(self.n_clients) if sel is None else np.asarray(sel)
        diff, layout, _ = self._planned_packed(s, sel, rows, minus=packed)
        return ActiveBlocks(
            layout.views(diff),
            tuple(self.active[c] for c in sel),
            self.d,
            0.0,
            tuple(self.block_flat[c] for c in sel),
            diff,
            layout,
        )

    def _planned_hessians(self, s, sel, rows):
        packed, layout, u = self._planned_packed(s, sel, rows)
        packed.flags.writeable = False  # the certificate below describes these numbers; keep them
        cert = {"symmetric": True, "finite": bool(np.isfinite(u).all())}
        return ActiveBlocks(
            layout.views(packed),
            tuple(self.active[c] for c in sel),
            self.d,
            self.lam,
            tuple(self.block_flat[c] for c in sel),
            packed,
            layout,
            cert,
        )

    def blocks_like_hessians(self, blocks, sel) -> ActiveBlocks:
        """Client blocks on their active features (e.g. decoded from a lossless codec) in the very
        layout ``hessians`` gives ``sel``, so that sums over them round exactly as sums over the
        Hessians do (the packed fast path sums in another order than the per-block loop)."""
        sel = np.asarray(sel)
        flat = tuple(self.block_flat[c] for c in sel)
        active = tuple(self.active[c] for c in sel)
        if self._plan is None:
            return ActiveBlocks(tuple(blocks), active, self.d, self.lam, flat)
        layout = self._plan["layout"]
        if self._rows(sel) is not self._full:
            layout = layout.take(sel)
        if [tuple(b.shape) for b in blocks] != [(int(n), int(n)) for n in layout.sizes]:
            raise ValueError("blocks do not match the clients' active features")
        packed = (
            np.concatenate([np.asarray(b, dtype=np.float64).reshape(-1) for b in blocks])
            if len(blocks)
            else np.zeros(0)
        )
        packed.flags.writeable = False
        return ActiveBlocks(layout.views(packed), active, self.d, self.lam, flat, packed, layout)

    def sketched_roots(self, thetas, sketches, sel=None, scale: float = 1.0):
        """Per client (S_c A_c)^T = A_c^T S_c^T (a_c x k), given S_c^T (M_c x k) (dense, SciPy sparse,
        or a CountSketch or SRHT sketch given by its random choices: fedns.CountSketch / fedns.SRHTSketch); ``None``
        means S_c = I.  ``scale`` multiplies every sketch (e.g. 1/sqrt(k)).

        On NumPy the product goes through the sparse client design with the row weights and the scale
        folded into its non-zeros (nnz x k flops, no scaled copy of the M_c x k sketch), except for SRHT,
        whose fast transform runs on the dense reduced design (fedns.SRHTSketch.rows_product; its (S_c A_c)^T
        comes column-major)."""
        rows = self._rows(sel)
        root = self._curvature(thetas, rows) ** 0.5
        sel = np.arange(self.n_clients) if sel is None else np.asarray(sel)
        starts = np.concatenate([[0], np.cumsum(self.counts[sel])])
        out = []
        for k, (c, St) in enumerate(zip(sel, sketches, strict=False)):
            r = root[starts[k] : starts[k + 1], None]
            if St is None:
                # row-major like the sketched products (the server's Gram takes R^T as it is, see fedns._gram)
                out.append(np.ascontiguousarray((self.reduced[c] * r).T) if self.xp is np else (self.reduced[c] * r).T)
            elif self.xp is np:
                w = r[:, 0] * scale if scale != 1.0 else r[:, 0]
                if hasattr(St, "rows_product"):
                    # SRHT (fedns.SRHTSketch): the Hadamard transform's Kronecker structure on the dense reduced
                    # design, in BLAS, beats the sparse product with its k dense +-1 columns
                    out.append(St.rows_product(self.reduced[c], w))
                    continue
                RT = self.reduced_T_csr[c]
                data = RT.data * w[RT.indices]
                if hasattr(St, "bucket"):
                    # CountSketch (fedns.CountSketch): entry (i, b) is the sum, in row order, of the signed
                    # weighted non-zeros of feature i in the rows hashed to bucket b -- the sums SciPy's sparse
                    # product with S^T forms in the same order (its products v * (+-1) are exact), so the same
                    # numbers; bincount adds its weights in input order, starting from 0 like SciPy's sums
                    # (a client without features has no entries: bincount of nothing is an integer array, and the
                    # reply must still be real numbers)
                    rowi = np.repeat(np.arange(RT.shape[0], dtype=np.int64), np.diff(RT.indptr))
                    key = rowi * St.k + np.asarray(St.bucket, dtype=np.int64)[RT.indices]
                    sums = np.bincount(key, weights=data * St.sign[RT.indices], minlength=RT.shape[0] * St.k)
                    out.append(sums.astype(np.float64, copy=False).reshape(RT.shape[0], St.k))
                    continue
                scaled = sp.csr_matrix((data, RT.indices, RT.indptr), shape=RT.shape)
                prod = scaled @ St
                out.append(prod.toarray() if sp.issparse(prod) else prod)
            elif scale != 1.0:
                out.append((self.reduced[c] * (r * scale)).T @ St)
            else:
                out.append((self.reduced[c] * r).T @ St)
        return tuple(out)

    # --------------------------------------------------------- global oracles
    def _xtsx(self, s):
        """X^T diag(s) X as a dense array: the very numbers of ``(X.T @ X.multiply(s[:, None]).tocsr()).toarray()``.

        That is SciPy's sparse-sparse product of X^T (CSC) with the row-scaled X converted to CSC; its symbolic
        pass (the size of the result) depends on X's pattern only and cost 40 % of the product (w8a: 12.6 of
        30 ms), 20 times while the optimum is solved on Test 1's serial start-up path.  Here the pattern, its
        CSC form and that size are kept, and each call scales the CSC values (x_jk s_j, the same products as
        the row-scaled X) and calls the same numeric kernel on the same arrays.  Falls back to the expression
        where SciPy's private kernel is missing."""
        plan = getattr(self, "_xtsx_plan", None)
        if plan is None:
            try:
                plan = self._xtsx_pattern()
            except (ImportError, AttributeError, TypeError):  # pragma: no cover - another SciPy layout
                plan = False
            self._xtsx_plan = plan
        if plan is not False:
            Xc, XT, nnz, (ci, cj, ti, tj), idx = plan["Xc"], plan["XT"], plan["nnz"], plan["args"], plan["idx"]
            if nnz == 0:
                return np.zeros((self.d, self.d))
            indptr, indices, data = np.empty(self.d + 1, dtype=idx), np.empty(nnz, dtype=idx), np.empty(nnz)
            try:
                plan["matmat"](self.d, self.d, ci, cj, Xc.data * s[Xc.indices], ti, tj, XT.data, indptr, indices, data)
                return sp.csc_matrix((data, indices, indptr), shape=(self.d, self.d)).toarray()
            except TypeError:  # pragma: no cover - a SciPy whose private kernel takes other arguments
                self._xtsx_plan = False
        return (self.X.T @ self.X.multiply(s[:, None]).tocsr()).toarray()

    def _xtsx_pattern(self):
        """What ``_xtsx`` keeps: X^T, X's CSC pattern, the product's size and SciPy's index arrays for it."""
        from scipy.sparse._sparsetools import csr_matmat, csr_matmat_maxnnz

        XT = self.X.T  # CSC view of X's CSR arrays
        Xc = self.X.tocsc()  # the row-scaled X's CSC pattern (rows ascending)
        Xc.sort_indices()
        arrays = (Xc.indptr, Xc.indices, XT.indptr, XT.indices)
        idx = XT._get_index_dtype(arrays)
        args = tuple(np.asarray(a, dtype=idx) for a in arrays)
        nnz = int(csr_matmat_maxnnz(self.d, self.d, *args))
        idx2 = XT._get_index_dtype(arrays, maxval=nnz)
        return {
            "Xc": Xc,
            "XT": XT,
            "nnz": nnz,
            "args": tuple(np.asarray(a, dtype=idx2) for a in arrays),
            "idx": idx2,
            "matmat": csr_matmat,
        }

    def _stack(self, theta):
        xp = self.xp
        return xp.broadcast_to(theta[None, :], (self.n_clients, self.d)) * 1.0

    def value_and_gradient(self, theta):
        """f(theta) and grad f(theta) from one pass over the data."""
        vals, grads = self.values_and_gradients(self._stack(theta))
        return float((self.client_weights * vals).sum()), (self.client_weights[:, None] * grads).sum(0)

    def value(self, theta) -> float:
        return float((self.client_weights * self.values(self._stack(theta))).sum())

    def gradient(self, theta):
        return self.value_and_gradient(theta)[1]

    def hessian(self, theta):
        """Dense global Hessian sum_c p_c grad^2 f_c(theta)."""
        if self.xp is np:
            # one sparse X^T D X over all rows (D_jj = p_c w_j s_j) instead of N client blocks
            rows = self._full
            s = self._curvature(self._stack(theta), rows) * self.client_weights_host[self._row_client]
            H = self._xtsx(s)
            H[np.diag_indices(self.d)] += self.lam * self.client_weights_host.sum()
        else:
            H = self.hessians(self._stack(theta)).weighted_sum(self.client_weights)
        return 0.5 * (H + H.T)

    def to_backend(self, a):
        return _xp_asarray(self.xp, np.asarray(a, dtype=np.float64))

    def to_host(self, a):
        return to_numpy(a)

    def describe(self) -> dict:
        return {
            "n": self.n_samples,
            "d": self.d,
            "clients": self.n_clients,
            "lam": self.lam,
            "weighting": self.weighting,
            "min_client_size": int(self.counts.min()),
            "max_client_size": int(self.counts.max()),
            "mean_active_features": float(np.mean([len(a) for a in self.active_host])),
        }
