"""Server-side screening of client replies (shared by fedconvex, fedpm_dnn and the Flower apps).

A reply is rejected -- with a logged reason naming the client -- when an array has the wrong
shape, contains NaN/Inf, or a preconditioner is not symmetric positive semidefinite within a
tolerance.  The round then completes with the remaining clients (their weights renormalised);
with none left the caller skips the round and keeps the model.

PSD test: a Cholesky factorisation of M + tol * max(1, max|M|) I must succeed, i.e. no
eigenvalue below about -tol * max|M| -- the same cost as one factorisation, far cheaper than
an eigendecomposition.
"""
from __future__ import annotations

import logging

import numpy as np
from scipy.linalg.lapack import dpotrf

from .backend import is_torch, namespace

log = logging.getLogger("fedpm.server")

PSD_TOL = 1e-8  # relative tolerance for float64 matrices; lower precisions get 64 eps of their dtype


def default_tol(M) -> float:
    """Rounding a PSD matrix to float32 / float16 (how FOOF matrices travel) leaves eigenvalues of
    about -eps * max|M|, so the tolerance follows the matrix's precision."""
    name = str(M.dtype).split(".")[-1]
    eps = {"float16": 9.77e-4, "bfloat16": 7.8e-3, "float32": 1.19e-7}.get(name, 2.2e-16)
    return max(PSD_TOL, 64 * eps)


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
        ok_sym = sym <= tol * scale   # False for NaN
        ok = ok_sym and int(xp.linalg.cholesky_ex(M + (tol * scale + shift) * xp.eye(n, dtype=M.dtype, device=M.device))[1]) == 0
    elif xp is np:
        M = np.asarray(M, dtype=np.float64)
        scale = max(1.0, float(np.abs(np.diagonal(M)).max()))
        ok_sym = float(np.abs(M - M.T).max()) <= tol * scale
        ok = False
        if ok_sym:
            S = M.copy()
            S.flat[::n + 1] += tol * scale + shift
            ok = dpotrf(S, lower=1, clean=0, overwrite_a=1)[1] == 0
    else:
        scale = max(1.0, float(xp.max(xp.abs(xp.diagonal(M)))))
        ok_sym = float(xp.max(xp.abs(M - M.T))) <= tol * scale
        try:
            ok = ok_sym and bool(xp.all(xp.isfinite(xp.linalg.cholesky(M + (tol * scale + shift) * xp.eye(n, dtype=M.dtype)))))
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
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, a in items:
            name = key if sub is None else f"{key}[{sub}]"
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


def screen(replies: list, clients, shapes: dict, psd_keys=(), round_: int | None = None):
    """Indices of the usable replies, and (client, reason) for the rejected ones (logged)."""
    kept, rejected = [], []
    for k, (reply, client) in enumerate(zip(replies, clients)):
        problem = reply_problem(reply, shapes, psd_keys)
        if problem is None:
            kept.append(k)
        else:
            rejected.append((int(client), problem))
            log.warning("%sclient %s rejected: %s", f"round {round_}: " if round_ is not None else "", client, problem)
    if not kept and len(replies):
        log.warning("%sno usable client reply: round skipped, model unchanged",
                    f"round {round_}: " if round_ is not None else "")
    return kept, rejected
