"""Gram matrices a^T a of the FOOF statistics, on a one-thread CPU by BLAS's symmetric rank-k update (syrk).

A Gram is symmetric, so syrk computes one triangle: half the multiply-adds of the general product.  torch has
no syrk, so the rows go to SciPy's BLAS (ssyrk/dsyrk) as NumPy views of the same memory, and each product is
added in place into one triangle of the accumulator; ``mirror`` fills the other triangle once at the end.

Only where torch itself runs on one CPU thread (``torch.set_num_threads(1)``, as in parallel single-thread
runs), and then on one BLAS thread.  Measured on this project's 2-core CPU (results/cpu-bench-2026-11-26/session4/):
at one thread syrk takes about half the time of torch's product (SimpleCNN's fc1 rows, ResNet18-GN's patch
Grams); at two threads a one-thread syrk only matches torch's two-thread product, and a two-thread syrk left
SciPy's BLAS workers spinning after each call beside torch's own threads: sequential-engine FedPM rounds 3.1-3.4 s
against 2.5-2.8 s with torch's product.  On more cores torch's threads win outright.  Other devices keep torch's
general product (torch exposes no syrk)."""
from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache

import torch
from scipy.linalg import blas

_SYRK = {torch.float32: blas.ssyrk, torch.float64: blas.dsyrk}


def syrk_on_cpu(dtype) -> bool:
    """Whether CPU rows of ``dtype`` take syrk now: float32 or float64, torch on one thread."""
    return dtype in _SYRK and torch.get_num_threads() == 1


def uses_syrk(a: torch.Tensor) -> bool:
    """Whether ``add_gram`` runs syrk for rows like ``a`` (``syrk_on_cpu``, and not part of a graph)."""
    return a.device.type == "cpu" and not a.requires_grad and syrk_on_cpu(a.dtype)


@lru_cache(maxsize=1)
def _controller():
    from threadpoolctl import ThreadpoolController   # scikit-learn's dependency: always installed with ours
    return ThreadpoolController().select(user_api="blas")


@contextmanager
def one_blas_thread():
    """SciPy's BLAS on one thread for the calls inside (restored afterwards): no worker left spinning."""
    with _controller().limit(limits=1):
        yield


def add_gram(S: torch.Tensor, a: torch.Tensor) -> None:
    """S (D x D) += a^T a for rows a (n x D), S and a of one dtype.  With syrk (``uses_syrk``) only S's lower
    triangle is updated (its upper one is left as it was): call ``mirror`` once after the last addition; else
    all of S, and ``mirror`` leaves it unchanged up to the symmetrization of round-off."""
    if not uses_syrk(a) or not S.is_contiguous() or a.shape[0] == 0:
        S.addmm_(a.T, a)
        return
    rows = a.contiguous().numpy()
    # S in C order is S^T in Fortran order: syrk's upper triangle of that view is S's lower triangle
    out = _SYRK[a.dtype](1.0, rows.T, beta=1.0, c=S.numpy().T, trans=0, lower=0, overwrite_c=1)
    if out.ctypes.data != S.data_ptr():   # pragma: no cover - f2py copies only for a layout we never pass
        raise RuntimeError("syrk did not update the Gram in place")


def mirror(S: torch.Tensor) -> torch.Tensor:
    """S (..., D, D) with its strictly upper triangle replaced by the transpose of its strictly lower one."""
    return S.tril() + S.tril(-1).transpose(-1, -2)


def gram(a: torch.Tensor) -> torch.Tensor:
    """a^T a (D x D, symmetric, a's dtype) of rows a (n x D)."""
    if not uses_syrk(a):
        return a.T @ a
    S = torch.zeros(a.shape[1], a.shape[1], dtype=a.dtype)
    with one_blas_thread():
        add_gram(S, a)
    return mirror(S)


def stacked_grams(a: torch.Tensor) -> torch.Tensor:
    """Per client k, a[k]^T a[k]: (K, n, D) -> (K, D, D)."""
    if not uses_syrk(a):
        return torch.bmm(a.transpose(1, 2), a)
    S = torch.zeros(a.shape[0], a.shape[2], a.shape[2], dtype=a.dtype)
    with one_blas_thread():
        for k in range(a.shape[0]):
            add_gram(S[k], a[k])
    return mirror(S)
