"""Array backends: infer the namespace from the inputs (SciPy's array-API style).

Kernels in this package are written against a tiny common subset of NumPy, CuPy and
torch (``matmul``, ``sum``, ``linalg.solve``, ``eye``...).  NumPy >= 2 and CuPy expose the
array-API ``__array_namespace__``; torch tensors do not, so they are special-cased.
"""

from __future__ import annotations

import importlib
import types

import numpy as np

BACKENDS = ("numpy", "cupy")


class BackendError(RuntimeError):
    """The requested array backend cannot be used on this machine."""


def namespace(*arrays) -> types.ModuleType:
    """The array module (numpy, cupy or torch) that owns ``arrays``; mixing is an error."""
    found = None
    for a in arrays:
        if a is None:
            continue
        if type(a).__module__.startswith("torch"):
            import torch

            mod = torch
        elif type(a).__module__.startswith("cupy"):
            # by module, not by __array_namespace__: a CuPy ndarray need not carry it, and taking one
            # for a NumPy array sends device arrays into host code (seen on an H100 with CuPy 14.2)
            mod = importlib.import_module("cupy")
        elif hasattr(a, "__array_namespace__") and not isinstance(a, np.ndarray):
            mod = a.__array_namespace__()
        else:
            mod = np
        if found is not None and mod is not found:
            raise TypeError(f"arrays from different libraries: {found.__name__} and {mod.__name__}")
        found = mod
    return found if found is not None else np


def is_torch(xp) -> bool:
    return getattr(xp, "__name__", "") == "torch"


def _device_kw(xp, like):
    # NumPy < 2 and CuPy take no device argument; torch and array-API libraries do
    if is_torch(xp) or xp.__name__ not in ("numpy", "cupy"):
        return {"device": like.device}
    return {}


def eye_like(xp, n: int, like):
    """Identity of size n with the dtype and device of ``like``."""
    return xp.eye(n, dtype=like.dtype, **_device_kw(xp, like))


def asarray_like(xp, values, like):
    """``values`` as an array of ``like``'s library, dtype and device."""
    if is_torch(xp):
        return xp.as_tensor(values, dtype=like.dtype, device=like.device)
    if xp.__name__ not in ("numpy", "cupy"):
        values = xp.asarray(values) if not isinstance(values, (list, tuple)) else values
    return xp.asarray(values, dtype=like.dtype, **_device_kw(xp, like))


def get_backend(name: str) -> types.ModuleType:
    """Return the array module for ``--backend NAME`` or raise a one-line reason why not."""
    if name == "numpy":
        return np
    if name != "cupy":
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    try:
        cp = importlib.import_module("cupy")
    except ImportError as exc:
        from fedconvex.extras import install_hint

        raise BackendError(f"backend 'cupy': {install_hint('CuPy', 'gpu')} ({exc})") from None
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA driver missing or broken
        raise BackendError(f"backend 'cupy': CuPy is installed but CUDA is unusable ({exc})") from None
    if n == 0:
        raise BackendError("backend 'cupy': CuPy is installed but no GPU is visible")
    return cp


def to_numpy(a) -> np.ndarray:
    """Host copy of any backend array (for metrics, files and plots)."""
    if isinstance(a, np.ndarray):
        return a
    if type(a).__module__.startswith("torch"):
        return a.detach().cpu().numpy()
    if hasattr(a, "get"):  # cupy
        return a.get()
    return np.asarray(a)


def nbytes(a) -> int:
    """Bytes an array occupies on the wire (its raw buffer)."""
    if type(a).__module__.startswith("torch"):
        return a.numel() * a.element_size()
    return int(a.nbytes)


def python_scalar(value):
    """A 0-d array of any library (NumPy, torch, CuPy: ``np.array(1e-3)``, ``torch.tensor(0.5)``) as the Python
    number it holds, so that hyper-parameters given that way pass the checks of plain numbers; anything else is
    returned as it is."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return value
