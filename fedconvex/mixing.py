"""Server-side mixing kernels shared by fedconvex and fedpm_dnn.

``precond_mix`` is FedPM's *preconditioned mixing* (paper eq. fedpm_multi and eq.
foof_mixing)::

    theta = (sum_i w_i (P_i + lam I))^{-1}  sum_i w_i (P_i + lam I) X_i

with w_i = 1/N by default.  The same damping lam must be used here as in the clients'
local steps, otherwise identical clients would not reproduce their own model.  The
symmetric system is solved by Cholesky (LU, then a minimum-norm solve, only for a
sum without a Cholesky factor), for theta - X_0 on dense stacks.

Both kernels are backend-agnostic: they run unchanged on NumPy, CuPy and torch arrays
(the namespace is inferred from the inputs) and accept matrix right-hand sides X_i of
shape (d, k), which is how a DNN layer block [W b]^T is mixed.
"""

from __future__ import annotations

import numpy as np

from .backend import asarray_like, eye_like, is_torch, namespace, python_scalar
from .hyperparams import NONNEGATIVE, checked_number
from .screening import dtype_problem

_INF = float("inf")


def _weights(xp, weights, n, like):
    """Normalised (n,) weights in ``like``'s library (and dtype: ``like`` is real floating point)."""
    if weights is None:
        return asarray_like(xp, [1.0 / n] * n, like)
    if not hasattr(weights, "dtype"):  # a list: read by NumPy, whose object and string dtypes the check refuses
        try:
            weights = np.asarray(weights)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"weights must be real numbers, got {_shown(weights)}") from None
    if dtype_problem(weights, "fiu"):
        raise ValueError(f"weights must be real numbers, got {_shown(weights)}")
    w = asarray_like(xp, weights, like)
    if w.shape != (n,):
        raise ValueError(f"weights must have shape ({n},), got {tuple(w.shape)}")
    total = xp.sum(w)
    t = float(total)
    if not 0 < t < _INF:  # NaN or Inf here would make every mixed parameter NaN
        raise ValueError(f"weights must sum to a finite positive number, got {t}")
    low = float(xp.min(w))
    if not low >= 0:  # a negative weight extrapolates away from a client instead of averaging
        raise ValueError(f"weights must be >= 0, got {low}")
    return w / total


def _shown(value) -> str:
    """``value`` for a message: one line, cut short."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def _real(name: str, a) -> None:
    bad = dtype_problem(a)
    if bad:
        raise ValueError(f"{name} {bad}")


def _as_matrix_rhs(X, d):
    """(N, d) -> (N, d, 1); (N, d, k) unchanged.  Returns the array and whether it was a vector."""
    if X.ndim == 2:
        if X.shape[1] != d:
            raise ValueError(f"X has shape {tuple(X.shape)}, expected (N, {d}) or (N, {d}, k)")
        return X[:, :, None], True
    if X.ndim == 3 and X.shape[1] == d:
        return X, False
    raise ValueError(f"X has shape {tuple(X.shape)}, expected (N, {d}) or (N, {d}, k)")


def precond_mix(P, X, weights=None, damping: float = 0.0):
    """Preconditioned mixing of client parameters.

    Parameters
    ----------
    P : (N, d, d) stack of symmetric positive (semi)definite client preconditioners, or a
        structured stack (e.g. ``fedconvex.blocks.ActiveBlocks``) that provides
        ``weighted_sum(w) -> (d, d)`` and ``weighted_apply_sum(w, X) -> (d, k)``.
    X : (N, d) client parameter vectors, or (N, d, k) client parameter blocks.
    weights : optional (N,) non-negative mixing weights; normalised to sum to one.
        Default uniform (the paper's 1/N).
    damping : lam >= 0 added to every P_i (and therefore to their mean) before mixing.

    Returns the mixed parameters with the shape of one client's X (``(d,)`` or ``(d, k)``).
    """
    structured = hasattr(P, "weighted_sum")
    # attribute and length checks only: this runs once per block per round, on any backend
    if not structured and not hasattr(P, "ndim"):
        raise TypeError(f"P must be an (N, d, d) array stack or a structured stack, got {type(P).__name__}")
    if not hasattr(X, "ndim"):
        raise TypeError(f"X must be an (N, d) or (N, d, k) array, got {type(X).__name__}")
    xp = namespace(X) if structured else namespace(P, X)
    if not structured and (P.ndim != 3 or P.shape[1] != P.shape[2]):
        raise ValueError(f"P must have shape (N, d, d), got {tuple(P.shape)}")
    n, d = (len(P), P.d) if structured else (P.shape[0], P.shape[1])
    Xm, was_vector = _as_matrix_rhs(X, d)
    if X.shape[0] != n:
        raise ValueError(f"P has {n} clients but X has {X.shape[0]}")
    if n < 1:
        raise ValueError("precond_mix needs at least one client (P and X hold 0)")
    damping = checked_number("damping", python_scalar(damping), NONNEGATIVE)
    if not structured:
        _real("P", P)  # a complex or integer stack would be mixed in the wrong arithmetic
    _real("X", X)
    if not structured and is_torch(xp) and P.dtype != X.dtype:  # torch's products refuse the mix with a RuntimeError
        raise ValueError(f"P has dtype {P.dtype} and X {X.dtype}: give them one dtype")
    # written with array-API functions (xp.sum, xp.matmul, ...) so any conforming library works
    w = _weights(xp, weights, n, X)
    if structured:
        Pbar = P.weighted_sum(w)
    else:  # sum_i w_i P_i in one pass over the stack (torch names the contraction count dims, the array API axes)
        Pbar = xp.tensordot(w, P, dims=1) if is_torch(xp) else xp.tensordot(w, P, axes=1)
    if damping:
        Pbar = _add_to_diagonal(xp, Pbar, damping)
    Pbar = 0.5 * (Pbar + Pbar.T)  # symmetrise: round-off in the sum must not leak into the solve
    if not bool(xp.all(xp.isfinite(Pbar))) or not bool(xp.all(xp.isfinite(Xm))):  # (d, d) and (N, d, k): cheap
        raise ValueError("precond_mix: the preconditioners or parameters contain NaN or Inf")
    factor = cholesky_factor(xp, Pbar)
    if factor is not None and not structured:
        # theta = X_0 + Pbar^{-1} sum_{i>0} w_i (P_i + lam I) (X_i - X_0), the same mix since sum_i w_i = 1: one
        # (d, d) x (d, k) product fewer than sum_i w_i (P_i + lam I) X_i (half of them with two clients, all of
        # them with one), and identical clients give back X_0 exactly
        out = Xm[0] + 0  # a new array, not a view of the input
        if n > 1:
            wD = w[1:, None, None] * (Xm[1:] - Xm[0])  # (N - 1, d, k); P[1:] is a view: no (N, d, d) copy
            out = out + cholesky_solve(xp, factor, _damped_sum(xp, P[1:], wD, damping))
        return out[:, 0] if was_vector else out
    # sum_i w_i (P_i + lam I) X_i = sum_i P_i (w_i X_i) + lam * sum_i w_i X_i: damping added once
    wX = w[:, None, None] * Xm
    if structured:
        rhs = P.weighted_apply_sum(w, Xm)
        rhs = rhs + damping * xp.sum(wX, axis=0) if damping else rhs
    else:
        rhs = _damped_sum(xp, P, wX, damping)
    if factor is not None:
        out = cholesky_solve(xp, factor, rhs)
    else:  # semidefinite (undamped PSD stacks are legal input), or no Cholesky factorisation in this library
        out = _symmetric_solve(xp, Pbar, rhs)
    return out[:, 0] if was_vector else out


def _damped_sum(xp, P, wX, damping: float):
    """sum_i (P_i + damping I) wX_i for an (M, d, d) stack P and weighted (M, d, k) blocks wX."""
    out = xp.sum(xp.matmul(P, wX), axis=0)
    return out + damping * xp.sum(wX, axis=0) if damping else out


def _add_to_diagonal(xp, A, value: float):
    """A + value I; in place on a (d, d) A this module owns, where the library allows it (NumPy, CuPy, torch)."""
    if is_torch(xp):
        A.diagonal().add_(value)
        return A
    if xp.__name__ in ("numpy", "cupy"):
        A[xp.arange(A.shape[0]), xp.arange(A.shape[0])] += value
        return A
    return A + value * eye_like(xp, A.shape[0], A)


def cholesky_factor(xp, A):
    """The Cholesky factor of a symmetric (d, d) A (only its lower triangle is read), in the form
    ``cholesky_solve`` takes, or None when A has none (semidefinite, indefinite) or the library offers no
    triangular solve (array-API libraries other than NumPy, CuPy and torch).  Half an LU's flops, and the
    project's rule for symmetric positive definite systems."""
    if xp is np:
        from scipy.linalg import get_lapack_funcs

        potrf = get_lapack_funcs("potrf", (A,))
        # A is symmetric, so its transpose is the same matrix in LAPACK's column-major order: no copy
        U, info = potrf(A.T, lower=0, clean=0, overwrite_a=0)
        return U if info == 0 else None
    if is_torch(xp):
        L, info = xp.linalg.cholesky_ex(A)
        return L if int(info) == 0 else None
    if xp.__name__ == "cupy":
        try:
            L = xp.linalg.cholesky(A)
        except np.linalg.LinAlgError:  # what CuPy raises
            return None
        # CuPy may report a failed factorisation as NaN, not an error
        return L if bool(xp.all(xp.isfinite(L))) else None
    return None


def cholesky_solve(xp, factor, B):
    """A^{-1} B from ``cholesky_factor(xp, A)``."""
    if xp is np:
        from scipy.linalg import get_lapack_funcs

        potrs = get_lapack_funcs("potrs", (factor, B))
        return potrs(factor, B, lower=0)[0]
    if is_torch(xp):
        return xp.cholesky_solve(B, factor)
    from cupyx.scipy.linalg import solve_triangular

    return solve_triangular(factor, solve_triangular(factor, B, lower=True), lower=True, trans="T")


def _symmetric_solve(xp, A, B):
    """A^{-1} B for a symmetric A without a Cholesky factor: the general LU solve (the kernel's only solve before
    the Cholesky path, so such stacks mix as they always did); for an exactly singular A, where LU has no answer, the
    minimum-norm solution from A's eigendecomposition, eigenvalues below d * eps * max|eigenvalue| taken as zero."""
    errors = tuple({np.linalg.LinAlgError, getattr(xp.linalg, "LinAlgError", np.linalg.LinAlgError)})
    try:
        # explicit (d, k) right-hand side: NumPy 2 changed solve's vector broadcasting rule
        out = xp.linalg.solve(A, B)
        if bool(xp.all(xp.isfinite(out))):  # CuPy may report a zero pivot as Inf/NaN, not an error
            return out
    except errors:
        pass
    vals, vecs = xp.linalg.eigh(A)
    top = float(xp.max(xp.abs(vals)))
    keep = xp.abs(vals) > A.shape[0] * _eps(A) * top
    inv = xp.where(keep, 1.0 / xp.where(keep, vals, xp.ones_like(vals)), xp.zeros_like(vals))
    return xp.matmul(vecs, inv[:, None] * xp.matmul(vecs.T, B))


def _eps(A) -> float:
    return float(np.finfo(str(A.dtype).split(".")[-1]).eps)


def simple_mix(X, weights=None):
    """Weighted average of client parameters (FedAvg / LocalNewton mixing).  Integer entries (a count such as
    BatchNorm's num_batches_tracked) are averaged in float64 and rounded back to their dtype."""
    if not hasattr(X, "ndim"):
        raise TypeError(f"X must be an (N, ...) array stack, got {type(X).__name__}")
    if X.ndim < 1:
        raise ValueError("X must be an (N, ...) array stack, got a 0-d array")
    if X.shape[0] < 1:
        raise ValueError("simple_mix needs at least one client (X holds 0)")
    xp = namespace(X)
    if dtype_problem(X, "iu") is None:
        mixed = simple_mix(X.double() if is_torch(xp) else X.astype(xp.float64), weights)
        return xp.round(mixed).to(X.dtype) if is_torch(xp) else xp.round(mixed).astype(X.dtype)
    if dtype_problem(X, "f"):  # bool: there is no average of flags; complex: no model of ours is
        raise ValueError(f"simple_mix: X has dtype {str(X.dtype).replace('torch.', '')}, expected numbers")
    if not bool(xp.all(xp.isfinite(X))):  # one NaN would become the mixed entry, silently
        raise ValueError("simple_mix: X contains NaN or Inf")
    w = _weights(xp, weights, X.shape[0], X)
    return xp.sum(xp.reshape(w, (-1,) + (1,) * (X.ndim - 1)) * X, axis=0)
