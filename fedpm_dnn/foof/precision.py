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
before, so default results do not change.  On a device (not emulated) the first split-tf32 apply and the first
Gram of a process are checked against float64 on the same operands (``checked``); one outside the elementwise
bound that tensor cores can meet gives one warning and plain float32 products there from then on, recorded.

The kernels read the mode from ``use(mode)`` (a context variable), entered by the engines around a client's
round with the method's ``foof_precision``.

The rest of a round's arithmetic follows the same setting (``backend_flags``), so that no product runs in TF32
unsaid: inside ``use(mode)`` cuBLAS's TF32 is off (``torch.backends.cuda.matmul.allow_tf32``: the split and TF32
products switch it on for themselves) and cuDNN's convolutions run in TF32 (``torch.backends.cudnn.allow_tf32``,
PyTorch's default) in every mode but ``fp32``, where they are plain float32 -- "fp32" means float32 throughout.
Every run's summary.json records these flags with the device's name (``record``).  On a CPU the flags change
nothing.
"""

from __future__ import annotations

import warnings
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


_conv: ContextVar = ContextVar("conv_tf32", default=None)  # ``convolutions``' setting; None: from the mode


@contextmanager
def convolutions(tf32: bool):
    """cuDNN's convolutions in TF32 (True) or float32 (False) inside the block, whatever the rounds' mode: a
    comparison of methods (benchmarks) gives FedAvg, which has no ``--foof-precision``, FedPM's convolutions."""
    token = _conv.set(bool(tf32))
    try:
        yield
    finally:
        _conv.reset(token)


def backend_flags(mode: str) -> dict:
    """The TF32 flags of cuDNN and cuBLAS a round in ``mode`` runs with (module doc; ``convolutions`` overrides
    cuDNN's)."""
    conv = _conv.get()
    return {"cudnn_allow_tf32": check(mode) != "fp32" if conv is None else conv, "cuda_matmul_allow_tf32": False}


@contextmanager
def use(mode: str):
    """FOOF's products inside the block in ``mode``, and cuDNN's and cuBLAS's TF32 flags set from it (restored
    on leaving)."""
    token = _mode.set(check(mode))
    flags = backend_flags(mode)
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
    torch.backends.cuda.matmul.allow_tf32 = flags["cuda_matmul_allow_tf32"]
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old
        _mode.reset(token)


def record(mode: str, device) -> dict:
    """What a run's training arithmetic was, for its summary.json: the device's name, the FOOF precision and the
    TF32 flags of cuDNN's convolutions and cuBLAS's other products in its rounds."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" and torch.cuda.is_available() else "CPU"
    return {"device_name": name, "foof_precision": check(mode), **backend_flags(mode)}


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
    return checked("apply", a, b, tf32_product(a_hi, b_hi, emulate) + small, emulate)


def split_operand(b: torch.Tensor, mode: str | None = None) -> tuple:
    """What a fixed right operand ``b`` is kept as beside itself for ``matmul_kept``: its (hi, lo) parts in
    ``split-tf32`` with float32 ``b`` (formed once, where ``matmul`` would split it at every product), else ()."""
    mode = current() if mode is None else check(mode)
    return split(b) if mode == "split-tf32" and b.dtype == torch.float32 else ()


def matmul_kept(a: torch.Tensor, b: torch.Tensor, parts: tuple, emulate=None) -> torch.Tensor:
    """``matmul(a, b)`` with ``b``'s split parts ``parts`` (``split_operand``) given: the same value, bit for bit,
    with only ``a`` split."""
    if not parts or current() != "split-tf32" or a.dtype != torch.float32:
        return matmul(a, b, emulate=emulate)
    b_hi, b_lo = parts
    a_hi, a_lo = split(a)
    small = tf32_product(a_hi, b_lo, emulate) + tf32_product(a_lo, b_hi, emulate)
    return checked("apply", a, b, tf32_product(a_hi, b_hi, emulate) + small, emulate)


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
        # one product computes (i, j) and (j, i) in different orders, and the rounding of the opt-in modes makes
        # them differ: the statistics must be exactly symmetric (the server's screening refuses them otherwise)
        S = matmul(at, a, mode, emulate)
        return 0.5 * (S + S.mT)
    hi, lo = split(a)
    cross = tf32_product(hi.mT, lo, emulate)
    return checked("gram", at, a, tf32_product(hi.mT, hi, emulate) + (cross + cross.mT), emulate)


# --- the first tensor-core products of a process, checked ---------------------------------------------------------
CHECK_SLACK = 32  # units of u = 2^-24 the split form may add to a float32 product's k u (module doc: ~24 u)
_verdicts: dict = {}  # (device, 'apply' | 'gram') -> None (trusted) or why the split form was given up there


def elementwise_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What a product of a and b in split-tf32 may be off by, entry by entry, on any hardware that rounds as IEEE
    allows (tensor cores included): ``(k + CHECK_SLACK) u (|a| |b|)``, k the length of the sums -- float32's own
    worst case plus the split's dropped terms."""
    k = a.shape[-1]
    return (k + CHECK_SLACK) * 2.0**-24 * torch.matmul(a.abs().double(), b.abs().double())


def bound_ratio(a: torch.Tensor, b: torch.Tensor, result: torch.Tensor) -> float:
    """The largest ratio of ``result``'s error (against float64) to ``elementwise_bound``: <= 1 within it."""
    exact = torch.matmul(a.double(), b.double())
    bound = elementwise_bound(a, b)
    err = (result.double() - exact).abs()
    ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), err * float("inf"))
    worst = float(ratio.nan_to_num(nan=float("inf")).max()) if ratio.numel() else 0.0
    return worst


def checked(kind: str, a: torch.Tensor, b: torch.Tensor, result: torch.Tensor, emulate=None) -> torch.Tensor:
    """``result`` of a split-tf32 product of a and b, the first time one of its ``kind`` runs on a device (not in
    emulation, which is exact by construction) checked against float64 on the same operands within
    ``elementwise_bound``; where it is not, one warning, the plain float32 product instead from then on for that
    device and kind, and the reason in ``fallbacks()`` (each run's summary records it)."""
    if _emulated(a, emulate):
        return result
    key = (str(a.device), kind)
    if key not in _verdicts:
        ratio = bound_ratio(a, b, result)
        _verdicts[key] = None if ratio <= 1.0 else f"{ratio:.3g} times its bound on its first operands"
        if _verdicts[key]:
            warnings.warn(
                f"split-tf32 {kind} on {a.device}: {_verdicts[key]}; running float32 products there instead",
                RuntimeWarning,
                stacklevel=3,
            )
    if _verdicts[key] is None:
        return result
    plain = torch.matmul(a, b)
    return 0.5 * (plain + plain.mT) if kind == "gram" else plain  # a Gram stays exactly symmetric


def fallbacks() -> dict:
    """'<device> <kind>' -> why this process runs that kind of product in float32 in place of split-tf32."""
    return {f"{dev} {kind}": why for (dev, kind), why in _verdicts.items() if why}


def for_statistics(x: torch.Tensor, mode: str | None = None) -> tuple:
    """(the inputs FOOF's statistics are built from, the mode of their products).  In the approximate modes a
    Gram of rounded products is not positive semidefinite: bf16 rounds each entry of its output, and either mode
    sums the bias row from inputs its product rounded -- the server then rejects every such reply.  So the inputs
    are rounded here, once (to TF32 or bfloat16 values), and their products run in TF32: exact for them (at most
    11 significant bits, each product exact in float32) with float32 accumulation.  The statistics are then the
    Gram of the rounded activations, the bias row their sums: positive semidefinite to float32's round-off, as in
    fp32.  fp32, split-tf32 and non-float32 inputs are returned as they are."""
    mode = current() if mode is None else check(mode)
    if mode not in APPROXIMATE or x.dtype != torch.float32:
        return x, mode
    return (round_tf32(x) if mode == "tf32" else x.bfloat16().float()), "tf32"


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
    if mode == "split-tf32" and a.dtype == torch.float32:
        return checked("gram", a.mT, a, S, emulate)
    return S


def half_gram_cost(d: int) -> float:
    """``half_gram``'s products as a fraction of the full product's multiply-adds."""
    return sum((e - s) * e for s, e in triangle_blocks(d)) / (d * d) if d else 0.0


def half_pays(d: int, mode: str) -> bool:
    """Whether ``half_gram`` multiplies less than ``gram``'s full form for width d in ``mode``: in
    ``split-tf32`` its three products of one triangle against the full form's two (from 4 block rows on)."""
    return HALF_GRAM_PRODUCTS[mode] * half_gram_cost(d) < GRAM_PRODUCTS[mode]


def default_mode(device) -> str:
    """The mode of ``--foof-precision auto`` before the model is known: split-tf32 on CUDA (tensor cores at
    float32's accuracy), fp32 elsewhere (no tensor cores: the split form would only cost three products).
    ``fedpm_dnn.foof.cost.auto_mode`` narrows it to where the split pays for the run's model."""
    return "split-tf32" if torch.device(device).type == "cuda" else "fp32"


# --- cost model -------------------------------------------------------------------------------------------------
PRODUCTS = {"fp32": 1, "tf32": 1, "bf16": 1, "split-tf32": 3}  # products per apply
GRAM_PRODUCTS = {"fp32": 1, "tf32": 1, "bf16": 1, "split-tf32": 2}  # per Gram (symmetric: C + C^T)
HALF_GRAM_PRODUCTS = {"fp32": 1, "tf32": 1, "bf16": 1, "split-tf32": 3}  # per block row of half_gram
