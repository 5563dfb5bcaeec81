"""Server-side screening of client replies (shared by fedconvex, fedpm_dnn and the Flower apps).

A reply is rejected -- with a logged reason naming the client -- when an array is not a real
floating-point array, has the wrong shape, contains NaN/Inf, or a preconditioner is not symmetric
positive semidefinite within a tolerance; when its client id is not an integer in range, is
claimed twice in the round, or is not the sender's; and, with the optional magnitude guard
(``max_ratio`` R), when its preconditioner trace or parameter norm exceeds R times the round's
(lower) median -- a valid but enormous preconditioner would otherwise let one client set the model.  The round then
completes with the remaining clients (their weights renormalised);
with none left the caller skips the round and keeps the model.

PSD test: a Cholesky factorisation of M + tol * max(1, max|M|) I must succeed, i.e. no
eigenvalue below about -tol * max|M| -- the same cost as one factorisation, far cheaper than
an eigendecomposition.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from scipy.linalg.lapack import dpotrf

from .backend import is_torch, namespace, to_numpy

log = logging.getLogger("fedpm.server")

PSD_TOL = 1e-8  # relative tolerance for float64 matrices; lower precisions get 64 eps of their dtype


def default_tol(M) -> float:
    """Rounding a PSD matrix to float32 / float16 (how FOOF matrices travel) leaves eigenvalues of
    about -eps * max|M|, so the tolerance follows the matrix's precision."""
    name = str(M.dtype).split(".")[-1]
    eps = {"float16": 9.77e-4, "bfloat16": 7.8e-3, "float32": 1.19e-7}.get(name, 2.2e-16)
    return max(PSD_TOL, 64 * eps)


def dtype_problem(a, kinds="f") -> str | None:
    """None if ``a`` is a numpy/torch/cupy array whose dtype kind is in ``kinds`` ('f' real floating
    point, 'iu' integer), else the reason."""
    dtype = getattr(a, "dtype", None)
    if dtype is None or not hasattr(a, "shape"):
        return f"is a {type(a).__name__}, not an array"
    if "torch" in type(a).__module__:
        kind = (
            "c"
            if a.is_complex()
            else "f"
            if a.is_floating_point()
            else "b"
            if dtype.__repr__().endswith("bool")
            else "i"
        )
    else:
        try:
            kind = np.dtype(dtype).kind
        except TypeError:  # another array-API library's dtype object
            kind = _array_api_kind(namespace(a), dtype)
    if kind not in kinds:
        expected = "a real floating-point" if kinds == "f" else "an integer"
        return f"has dtype {str(dtype).replace('torch.', '')}, expected {expected} array"
    return None


def _array_api_kind(xp, dtype) -> str:
    names = (("bool", "b"), ("signed integer", "i"), ("unsigned integer", "u"), ("real floating", "f"))
    return next((k for name, k in names if xp.isdtype(dtype, name)), "c")


def index_problem(a, what: str, bound: int | None, distinct: bool = False) -> str | None:
    """None if ``a`` (any backend) holds integer indices in 0..bound-1 (bound None: >= 0), distinct ones when
    ``distinct`` (a client's active features: a repeated one would count its block entries twice), else the
    reason, starting with ``what``.  The one check of indices for the wire (fedpm_flower.wire) and in-process."""
    bad = dtype_problem(a, "iu")
    if bad:
        return f"{what} {bad}"
    a = to_numpy(a)
    if a.ndim != 1 and distinct:
        return f"{what} is not a 1-d array"
    if a.size and (int(a.min()) < 0 or (bound is not None and int(a.max()) >= bound)):
        return f"{what} outside 0..{bound - 1}" if bound is not None else f"{what} has negative entries"
    if distinct and a.size > 1 and not bool((np.diff(a) > 0).all()) and len(np.unique(a)) != len(a):
        return f"{what} has repeated entries"  # (increasing indices, the usual case, are distinct at a glance)
    return None


def _finite(xp, a) -> bool:
    return bool(xp.all(xp.isfinite(a)))


def _max_abs(xp, a) -> float:
    n = a.numel() if is_torch(xp) else a.size
    return float(xp.max(xp.abs(a))) if n else 0.0


def psd_problem(M, tol: float | None = None, shift: float = 0.0) -> str | None:
    """None if M (+ ``shift`` I, for a stack stored as block + shift) is symmetric PSD within ``tol``
    (relative), else the reason.

    Fast path: one symmetry pass and one Cholesky of M + tol*scale*I (NaN/Inf make either
    fail); the specific reason is worked out only for a matrix that fails."""
    xp = namespace(M)
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        return f"is not a square matrix (shape {tuple(M.shape)})"
    n = M.shape[0]
    if n == 0:
        return None
    tol = default_tol(M) if tol is None else tol
    if is_torch(xp):
        M = M.to(xp.float64)
        scale = max(1.0, float(xp.abs(xp.diagonal(M)).max()))
        sym = float(xp.abs(M - M.T).max())
        ok_sym = sym <= tol * scale  # False for NaN
        ok = (
            ok_sym
            and int(xp.linalg.cholesky_ex(M + (tol * scale + shift) * xp.eye(n, dtype=M.dtype, device=M.device))[1])
            == 0
        )
    elif xp is np:
        M = np.asarray(M, dtype=np.float64)
        scale = max(1.0, float(np.abs(np.diagonal(M)).max()))
        ok_sym = float(np.abs(M - M.T).max()) <= tol * scale
        ok = False
        if ok_sym:
            S = M.copy()
            S.flat[:: n + 1] += tol * scale + shift
            ok = dpotrf(S, lower=1, clean=0, overwrite_a=1)[1] == 0
    else:
        scale = max(1.0, float(xp.max(xp.abs(xp.diagonal(M)))))
        ok_sym = float(xp.max(xp.abs(M - M.T))) <= tol * scale
        try:
            ok = ok_sym and bool(
                xp.all(xp.isfinite(xp.linalg.cholesky(M + (tol * scale + shift) * xp.eye(n, dtype=M.dtype))))
            )
        except Exception:
            ok = False
    if ok:
        return None
    if not _finite(xp, M):
        return "contains NaN or Inf"
    return "is not symmetric" if not ok_sym else "is not positive semidefinite"


def reply_problem(reply: dict, shapes: dict, psd_keys=()) -> str | None:
    """None if the reply is usable, else one line saying what is wrong with it.

    ``shapes`` maps every expected key to its shape (None: any shape); keys in ``psd_keys``
    hold a matrix, or a dict / tuple of matrices, that must be symmetric PSD."""
    for key, shape in shapes.items():
        if key not in reply:
            return f"missing {key!r}"
        value = reply[key]
        if isinstance(value, dict) and isinstance(shape, dict) and set(value) != set(shape):
            return f"{key} has entries {sorted(map(str, value))}, expected {sorted(map(str, shape))}"
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, a in items:
            name = key if sub is None else f"{key}[{sub}]"
            bad_dtype = dtype_problem(a)
            if bad_dtype:
                return f"{name} {bad_dtype}"
            expected = shape.get(sub) if isinstance(shape, dict) else shape
            if expected is not None and tuple(a.shape) != tuple(expected):
                return f"{name} has shape {tuple(a.shape)}, expected {tuple(expected)}"
            if not _finite(namespace(a), a):
                return f"{name} contains NaN or Inf"
            if key in psd_keys:
                problem = psd_problem(a)
                if problem:
                    return f"preconditioner {name} {problem}"
    return None


def lower_median(values) -> float:
    v = sorted(values)
    return v[(len(v) - 1) // 2]


def max_ratio_problem(max_ratio) -> str | None:
    """None if ``max_ratio`` is a usable magnitude guard R (None or 0: off; a finite R >= 1), else why not:
    below 1 even the median reply exceeds R x the median, so every round would reject almost everyone."""
    if max_ratio is None or (not isinstance(max_ratio, bool) and max_ratio == 0):
        return None
    if isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float)) or not math.isfinite(max_ratio):
        return "must be a finite number >= 1 (or 0 = off)"
    if max_ratio < 1:
        return "must be >= 1 (or 0 = off): below 1 even the median reply is rejected"
    return None


def magnitude_outliers(values, max_ratio: float) -> list:
    """Positions whose value exceeds ``max_ratio`` x the lower median of ``values`` (the lower
    median, so that with two replies the smaller one is the reference)."""
    if max_ratio is None or len(values) < 2:
        return []
    ref = lower_median(values)
    return [k for k, v in enumerate(values) if v > max_ratio * ref]


def magnitude_rejections(checks, max_ratio: float | None) -> dict:
    """{position: reason} over ``checks`` = [(what, one value per reply), ...]: the replies whose value
    exceeds ``max_ratio`` x the round's lower median; the first check that flags a reply names it.
    The one magnitude guard of the convex loop, the DNN simulator and the Flower servers."""
    out = {}
    if not max_ratio:
        return out
    for what, vals in checks:
        for pos in magnitude_outliers(vals, max_ratio):
            out.setdefault(
                pos, f"{what} {vals[pos]:.3g} exceeds {max_ratio:g} x the round's median {lower_median(vals):.3g}"
            )
    return out


def _norm(a) -> float:
    xp = namespace(a)
    return float(xp.sqrt(xp.sum(a.to(xp.float64) ** 2 if is_torch(xp) else xp.asarray(a, dtype=xp.float64) ** 2)))


def _trace(a) -> float:
    xp = namespace(a)
    return float(xp.sum(xp.diagonal(a.to(xp.float64) if is_torch(xp) else xp.asarray(a, dtype=xp.float64))))


def magnitudes(reply: dict, psd_keys=()) -> tuple:
    """(sum of the preconditioner traces, norm of everything else) of a usable reply."""
    trace, sq = 0.0, 0.0
    for key, value in reply.items():
        for a in value.values() if isinstance(value, dict) else [value]:
            if key in psd_keys:
                trace += _trace(a)
            else:
                sq += _norm(a) ** 2
    return trace, sq**0.5


def id_problems(clients, n_clients: int | None = None, senders=None) -> list:
    """Per reply, None or why its client id cannot be trusted (not an integer, out of range,
    claimed twice, or not the sender's)."""
    ids = list(clients)
    out = []
    for k, c in enumerate(ids):
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, np.integer)):
            out.append(f"client id {c!r} is not an integer")
        elif n_clients is not None and not 0 <= int(c) < n_clients:
            out.append(f"client id {int(c)} is outside 0..{n_clients - 1}")
        elif (
            sum(
                1
                for d in ids
                if not isinstance(d, (bool, np.bool_)) and isinstance(d, (int, np.integer)) and int(d) == int(c)
            )
            > 1
        ):
            out.append(f"client id {int(c)} is claimed by more than one reply")
        elif senders is not None and senders[k] != c:
            out.append(f"claims client id {int(c)} but was sent by {senders[k]!r}")
        else:
            out.append(None)
    return out


def screen(
    replies: list,
    clients,
    shapes: dict,
    psd_keys=(),
    round_: int | None = None,
    *,
    n_clients: int | None = None,
    senders=None,
    max_ratio: float | None = None,
):
    """Indices of the usable replies, and (client, reason) for the rejected ones (logged).

    ``n_clients``: ids must lie in 0..n_clients-1; ``senders``: the id each reply must carry
    (the transport's sender); ``max_ratio``: the magnitude guard (None = off)."""
    kept, rejected = [], []
    where = f"round {round_}: " if round_ is not None else ""

    def reject(k, client, problem):
        rejected.append((int(client) if isinstance(client, (int, np.integer)) else client, problem))
        log.warning("%sclient %s rejected: %s", where, client, problem)

    clients = list(clients)
    for k, (reply, client, bad_id) in enumerate(
        zip(replies, clients, id_problems(clients, n_clients, senders), strict=False)
    ):
        problem = bad_id or (
            reply_problem(reply, shapes, psd_keys)
            if isinstance(reply, dict)
            else f"reply is a {type(reply).__name__}, not a mapping"
        )
        if problem is None:
            kept.append(k)
        else:
            reject(k, client, problem)
    if max_ratio is not None and len(kept) > 1:
        mags = [magnitudes(replies[k], psd_keys) for k in kept]
        out = magnitude_rejections(
            (("preconditioner trace", [m[0] for m in mags]), ("parameter norm", [m[1] for m in mags])), max_ratio
        )
        for pos, reason in out.items():
            reject(kept[pos], clients[kept[pos]], reason)
        kept = [k for pos, k in enumerate(kept) if pos not in out]
    if not kept and len(replies):
        log.warning("%sno usable client reply: round skipped, model unchanged", where)
    return kept, rejected
