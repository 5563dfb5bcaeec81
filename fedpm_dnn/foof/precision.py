"""The arithmetic of FOOF's two large products: the per-step apply ``G X`` (``--foof-apply inverse``) and the
statistics Gram ``a^T a``.

``--foof-precision``:

* ``fp32``: plain float32 products (PyTorch's default: TF32 off), the reference.
* ``split-tf32``: each float32 operand split into a TF32-representable high part and its residual,
  ``x = hi + lo`` with ``hi = tf32(x)`` (10 explicit mantissa bits, round to nearest even) and ``lo = x - hi``
  (exact in float32, ``|lo| <= 2^-11 |x|``).  The apply is ``hi_a hi_b + (hi_a lo_b + lo_a hi_b)``: three TF32
  products with float32 accumulation; the dropped ``lo_a lo_b`` and the rounding of ``lo`` to TF32 add at most
  ``~6 * 2^-22 = 24 u`` (u = 2^-24) of ``|a||b|`` per term, independent of the length k of the sums, against the
  ``k u`` (worst case) or ``sqrt(k) u`` (typical) that a float32 product of length k already has.  The symmetric
  Gram needs two products: ``hi^T hi + (C + C^T)``, ``C = hi^T lo``.
* ``tf32``: one TF32 product (inputs rounded to 11 significant bits): error up to ``2^-10 |a||b|`` per term
  plus the float32 accumulation -- an opt-in approximation.
* ``bf16``: one bfloat16 product (8 significant bits, output rounded to bfloat16): error up to
  ``2^-7 |a||b| + 2^-8 |ab|`` -- an opt-in approximation.

On CUDA the TF32 products run on the tensor cores (``torch.backends.cuda.matmul.allow_tf32`` switched on for the
product only); elsewhere they are emulated by rounding the inputs (the same arithmetic, no speed), which is how the
CPU tests hold each mode to its bound.  In ``fp32`` every function here is the plain product the callers made
before, so default results do not change.

The kernels read the mode from ``use(mode)`` (a context variable), entered by the engines around a client's
round with the method's ``foof_precision``.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

MODES = ("fp32", "split-tf32", "tf32", "bf16")
APPROXIMATE = ("tf32", "bf16")  # opt-in: errors above float32's own
_mode: ContextVar[str] = ContextVar("foof_precision", default="fp32")


def check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"foof precision must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


@contextmanager
def use(mode: str):
    """FOOF's products inside the block in ``mode``."""
    token = _mode.set(check(mode))
    try:
        yield
    finally:
        _mode.reset(token)


def current() -> str:
    return _mode.get()


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to the nearest TF32 value (10 explicit mantissa bits, ties to even), as float32;
    non-finite entries unchanged."""
    bits = x.contiguous().view(torch.int32)
    rounded = ((bits + (0xFFF + ((bits >> 13) & 1))) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def split(x: torch.Tensor) -> tuple:
    """(hi, lo): hi = round_tf32(x), lo = x - hi (exact)."""
    hi = round_tf32(x)
    return hi, x - hi


@contextmanager
def _tensor_cores(on: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _emulated(t: torch.Tensor, emulate) -> bool:
    return t.device.type != "cuda" if emulate is None else emulate


def tf32_product(a: torch.Tensor, b: torch.Tensor, emulate=None) -> torch.Tensor:
    """One TF32 product with float32 accumulation: on CUDA's tensor cores, else with the inputs rounded."""
    if _emulated(a, emulate):
        return torch.matmul(round_tf32(a), round_tf32(b))
    with _tensor_cores(True):
        return torch.matmul(a, b)


def bf16_product(a: torch.Tensor, b: torch.Tensor, emulate=None) -> torch.Tensor:
    """One bfloat16 product (inputs and output rounded to bfloat16), returned in a's dtype."""
    if _emulated(a, emulate):
        return torch.matmul(a.bfloat16().to(a.dtype), b.bfloat16().to(a.dtype)).bfloat16().to(a.dtype)
    return torch.matmul(a.bfloat16(), b.bfloat16()).to(a.dtype)


def matmul(a: torch.Tensor, b: torch.Tensor, mode: str | None = None, emulate=None) -> torch.Tensor:
    """``a @ b`` in ``mode`` (default: the current one); float32 operands (others: the plain product)."""
    mode = current() if mode is None else check(mode)
    if mode == "fp32" or a.dtype != torch.float32:
        return torch.matmul(a, b)
    if mode == "tf32":
        return tf32_product(a, b, emulate)
    if mode == "bf16":
        return bf16_product(a, b, emulate)
    a_hi, a_lo = split(a)
    b_hi, b_lo = split(b)
    small = tf32_product(a_hi, b_lo, emulate) + tf32_product(a_lo, b_hi, emulate)
    return tf32_product(a_hi, b_hi, emulate) + small


def gram(a: torch.Tensor, mode: str | None = None, emulate=None, half: bool = False) -> torch.Tensor:
    """``a^T a`` over the rows of ``a`` (..., n, d) -> (..., d, d) in ``mode``; exactly symmetric in the split form
    (two products: hi^T hi + (C + C^T), C = hi^T lo).  ``half``: exactly symmetric in every mode, from only the
    lower triangle's block rows (``half_gram``) where that multiplies less (``half_pays``), else the full product
    averaged with its transpose."""
    mode = current() if mode is None else check(mode)
    if half:
        if half_pays(a.shape[-1], mode if a.dtype == torch.float32 else "fp32"):
            return half_gram(a, mode, emulate)
        S = gram(a, mode, emulate)
        return 0.5 * (S + S.mT)
    at = a.mT
    if mode == "fp32" or a.dtype != torch.float32:
        return torch.bmm(at, a) if a.dim() == 3 else at @ a
    if mode in APPROXIMATE:
        return matmul(at, a, mode, emulate)
    hi, lo = split(a)
    cross = tf32_product(hi.mT, lo, emulate)
    return tf32_product(hi.mT, hi, emulate) + (cross + cross.mT)


GRAM_BLOCK = 256  # the narrowest block row of ``half_gram``: narrower products run below a GEMM's pace


def triangle_blocks(d: int) -> list:
    """[(start, end)] of ``half_gram``'s block rows: d // GRAM_BLOCK (at least 1) rows of equal width."""
    t = max(1, d // GRAM_BLOCK)
    width = -(-d // t)
    return [(s, min(d, s + width)) for s in range(0, d, width)]


def half_gram(a: torch.Tensor, mode: str | None = None, emulate=None) -> torch.Tensor:
    """``a^T a`` (..., n, d) -> (..., d, d) from the lower triangle's block rows alone: block row [s, e) is the
    product of a's columns s:e with its columns 0:e, one product per block row in ``mode`` (three in
    ``split-tf32``: hi^T hi + (hi^T lo + lo^T hi), the terms of ``gram``'s two products), so with t block rows
    the products cost (t + 1) / (2 t) of the full one.  The diagonal blocks are averaged with their transposes
    and the blocks above are the transposes of those below: exactly symmetric.  Each entry is the same float
    sum of n products as the full product's (up to the summation order a product picks)."""
    mode = current() if mode is None else check(mode)
    d = a.shape[-1]
    S = a.new_empty(*a.shape[:-2], d, d)
    if mode == "split-tf32" and a.dtype == torch.float32:
        hi, lo = split(a)
    for s, e in triangle_blocks(d):
        if mode == "fp32" or a.dtype != torch.float32:
            row = torch.matmul(a[..., s:e].mT, a[..., :e])
        elif mode in APPROXIMATE:
            row = matmul(a[..., s:e].mT, a[..., :e], mode, emulate)
        else:
            small = tf32_product(hi[..., s:e].mT, lo[..., :e], emulate) + tf32_product(
                lo[..., s:e].mT, hi[..., :e], emulate
            )
            row = tf32_product(hi[..., s:e].mT, hi[..., :e], emulate) + small
        diag = row[..., s:e]
        S[..., s:e, s:e] = 0.5 * (diag + diag.mT)
        S[..., s:e, :s] = row[..., :s]
        S[..., :s, s:e] = row[..., :s].mT
    return S


def half_gram_cost(d: int) -> float:
    """``half_gram``'s products as a fraction of the full product's multiply-adds."""
    return sum((e - s) * e for s, e in triangle_blocks(d)) / (d * d) if d else 0.0


def half_pays(d: int, mode: str) -> bool:
    """Whether ``half_gram`` multiplies less than ``gram``'s full form for width d in ``mode``: in
    ``split-tf32`` its three products of one triangle against the full form's two (from 4 block rows on)."""
    return HALF_GRAM_PRODUCTS[mode] * half_gram_cost(d) < GRAM_PRODUCTS[mode]


def default_mode(device) -> str:
    """The mode of ``--foof-precision auto``: split-tf32 on CUDA (tensor cores at float32's accuracy), fp32
    elsewhere (no tensor cores: the split form would only cost three products)."""
    return "split-tf32" if torch.device(device).type == "cuda" else "fp32"


# --- cost model -------------------------------------------------------------------------------------------------
PRODUCTS = {"fp32": 1, "tf32": 1, "bf16": 1, "split-tf32": 3}  # products per apply
GRAM_PRODUCTS = {"fp32": 1, "tf32": 1, "bf16": 1, "split-tf32": 2}  # per Gram (symmetric: C + C^T)
HALF_GRAM_PRODUCTS = {"fp32": 1, "tf32": 1, "bf16": 1, "split-tf32": 3}  # per block row of half_gram
