"""FOOF curvature blocks (Benzing 2022) for nn.Linear and nn.Conv2d (paper eqs. foof_local / foof_mixing).

For a block with weight W (d_out x d_in) and optional bias b, the parameters are written as
Theta = [W b]^T of shape (d_in + 1, d_out) (Conv2d: d_in = C_in kh kw, W reshaped), and the
FOOF matrix is the uncentred covariance of the layer input augmented with a constant 1,

    A = E[a a^T]   (Conv2d: over samples *and* spatial positions of the unfolded patches).

Local step: Theta <- Theta - lr (A + lam I)^{-1} G_Theta.  Server (FedPM): per block
Theta = precond_mix(A_stack, Theta_stack, w, damping=lam) -- the fedconvex kernel.
A registry maps layer types to their block adapter (KFAC-jax / BackPACK style).

This module is the preconditioner's core -- the blocks, their statistics, the damped factors and their apply --
and the package ``fedpm_dnn.foof`` itself, so ``fedpm_dnn.foof.compute_foof`` and the rest keep the paths they
had when it was a single module.  Beside it: ``batched`` (the statistics and factors of a stack of clients),
``precision`` (the arithmetic of the large products), ``cost`` (a FLOP and memory model), ``solve_graph`` (the step
directions as one CUDA graph) and ``optimizer`` (``FOOF``, a ``torch.optim.Optimizer``).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedconvex.hyperparams import FLOAT32_MAX
from fedconvex.screening import psd_problem

from . import precision


class LinearBlock:
    def __init__(self, module: nn.Linear):
        self.module = module
        # a frozen bias is no part of the block: Theta = W^T alone, its matrix without the constant 1
        self.has_bias = module.bias is not None and module.bias.requires_grad

    def patches(self, x):
        """(rows, d_in) inputs whose outer products make A."""
        return x.reshape(-1, x.shape[-1])

    def gram(self, x):
        """(sum_rows a a^T, sum_rows a, rows) of the block's input batch."""
        a = self.patches(x)
        return precision.gram(a, half=half_forms(a.device)), a.sum(0), a.shape[0]

    def weight_matrix(self, w):
        return w

    def restore_weight(self, W):
        return W


def numeric_padding(m: nn.Conv2d) -> tuple:
    """``m``'s padding as a pair of numbers: padding='valid' is (0, 0); padding='same' (stride 1) pads
    dilation (k - 1) in all per axis, half on each side when that is even.  An odd total pads one side more
    than the other, which the symmetric patches cannot express: a ValueError."""
    if not isinstance(m.padding, str):
        return tuple(m.padding)
    if m.padding == "valid":
        return (0, 0)
    totals = [d * (k - 1) for d, k in zip(m.dilation, m.kernel_size, strict=True)]
    if any(t % 2 for t in totals):
        raise ValueError("padding='same' with an even kernel span pads one side more than the other")
    return tuple(t // 2 for t in totals)


def conv_geometry(m: nn.Conv2d):
    """(kernel, stride, dilation, padding) of ``m`` as pairs; the errors for convs FOOF cannot block."""
    padding = numeric_padding(m)
    if m.groups != 1:
        raise ValueError(f"grouped convolution (groups={m.groups}): FOOF blocks take groups=1 only")
    if m.padding_mode != "zeros" and any(padding):
        # the patches are built with zero padding: a reflect/replicate/circular border would be read wrongly
        raise ValueError(f"FOOF blocks take zero padding only, got padding_mode={m.padding_mode!r}")
    return m.kernel_size, m.stride, m.dilation, padding


def conv_patches(m: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Every receptive field of the conv ``m`` in ``x`` (N, C, H, W) as rows: (N, L, C kh kw), in
    F.unfold's order (channel, kernel row, kernel column; positions row-major).

    Built from strided views (Tensor.unfold) and one copy.  F.unfold on CUDA launches one im2col
    kernel per image: profiled on an H200, a FOOF statistics pass over 5,000 images per client for
    10 clients spent 53 % of its GPU time in 50,000 such launches; this is one kernel."""
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = conv_geometry(m)
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    v = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)  # (N, C, oh, ow, span_h, span_w)
    v = v[..., ::dh, ::dw]  # (N, C, oh, ow, kh, kw)
    N, C, oh, ow = v.shape[:4]
    return v.permute(0, 2, 3, 1, 4, 5).reshape(N, oh * ow, C * kh * kw)


def half_forms(device) -> bool:
    """Whether the Grams on ``device`` multiply only what a symmetric result needs (``precision.half_gram``; the
    row form's own Grams of one row with itself): on CUDA.  The CPU keeps the full products it has always made
    (a measured syrk there was no faster, docs/decisions.md), and with them its results."""
    return torch.device(device).type == "cuda"


def conv_gram_form(m: nn.Conv2d, shape, device, mode: str) -> tuple:
    """(form, half) that ``conv_gram`` takes for images of ``shape`` on ``device`` in precision ``mode``: form
    'row' (``row_form_gram``) or 'patch' (``patch_gram``), half as ``half_forms``.  On a CPU the row form in fp32
    where the CPU's rule says it pays, else the patch form; on CUDA the row form in every mode where the CUDA rule
    says it pays, else the patch form, both with half products; elsewhere the patch form."""
    kind = torch.device(device).type
    if kind == "cpu":
        return ("row" if mode == "fp32" and row_form_pays(m, shape) else "patch"), False
    if kind == "cuda":
        return ("row" if row_form_pays(m, shape, "cuda") else "patch"), True
    return "patch", False


def conv_gram(m: nn.Conv2d, x: torch.Tensor):
    """Per stack k of images x (K, B, C, H, W): (sum of a a^T, sum of a) over every patch a of conv ``m``,
    (K, D, D) and (K, D), and the patches per image L; the sequential engine's blocks are the K = 1 case.

    Where ``conv_gram_form`` says, by Grams of input rows (``row_form_gram``: S and total in float64); else
    from the materialised patches (``patch_gram``: in x's dtype).  Both take the images in chunks of the same
    size; the row form's float products each sum at most half the terms of the patch form's (as many for one
    output row; see ``row_pairings``), so the float32 round-off bound is no larger, and measured smaller
    (tests/test_conv_gram.py)."""
    form, half = conv_gram_form(m, x.shape, x.device, precision.current())
    return row_form_gram(m, x, half) if form == "row" else patch_gram(m, x, half)


def _chunk(K: int, L: int, D: int) -> int:
    """Images per chunk: patches of about 2^25 entries (bounded memory)."""
    return max(1, int(2**25 // (K * L * D)))


def patch_gram(m: nn.Conv2d, x: torch.Tensor, half: bool = False):
    """conv_gram from the patches, in chunks of images (``_chunk``), one batched product each (``half``: the
    lower triangle's block rows, ``precision.half_gram``)."""
    K, B = x.shape[:2]
    D = m.weight[0].numel()
    L = conv_patches(m, x[0, :1]).shape[1]
    step = _chunk(K, L, D)
    S = torch.zeros(K, D, D, dtype=x.dtype, device=x.device)
    total = torch.zeros(K, D, dtype=x.dtype, device=x.device)
    for i in range(0, B, step):
        # reshape, not view: an unpadded 1x1 stride-1 conv's patches are a permuted view of x
        a = conv_patches(m, x[:, i : i + step].reshape(-1, *x.shape[2:])).reshape(K, -1, D)
        if precision.current() == "fp32" and not half:
            S.baddbmm_(a.transpose(1, 2), a)
        else:  # --foof-precision: the products on tensor cores (fedpm_dnn.foof.precision); or half of them
            S += precision.gram(a, half=half)
        total += a.sum(1)
    return S, total, L


def _out_size(size: int, k: int, stride: int, dilation: int, pad: int) -> int:
    """Output length of a convolution along one axis."""
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


@cache
def row_pairings(kh: int, dh: int, sh: int, oh: int) -> tuple:
    """Which input rows the row form multiplies, and how the products add up to the blocks of S.

    The block of kernel rows (i, i + e) of S is sum over output rows p < oh of G(h, h + e dh), h = i dh + p sh,
    where G(h, h') = sum over images and output columns of the Gram between the width patches of input rows
    h and h'.  Input rows are split by residue mod sh (class r: rows r + t sh at position t), so the rows h
    of block (i, i + e) are the window [s, s + oh) of positions of class r = i dh mod sh, s = i dh // sh, and
    their partners the same window shifted by ``shift`` in class r2.  The windows of one (e, r) cut the
    positions into segments of at most oh // 2 rows (float32 sums over at most half the terms of a patch-form
    product): one product per segment, each window the sum of its segments.
    Returns (e, r, r2, shift, segments, {i: indices of window i's segments}) per (e, r)."""
    out, span = [], max(1, oh // 2)
    for e in range(kh):
        for r in range(sh):
            starts = {i: i * dh // sh for i in range(kh - e) if i * dh % sh == r}
            if not starts:
                continue
            cuts = sorted(set(starts.values()) | {s + oh for s in starts.values()})
            segments = [
                (c, min(b, c + span))
                for a, b in zip(cuts, cuts[1:], strict=False)
                if any(s <= a < s + oh for s in starts.values())
                for c in range(a, b, span)
            ]
            windows = {i: [k for k, (a, _) in enumerate(segments) if s <= a < s + oh] for i, s in starts.items()}
            out.append((e, r, (r + e * dh) % sh, (r + e * dh) // sh, tuple(segments), windows))
    return tuple(out)


# The row form's extra costs in multiply-adds of the patch form, measured on this project's 2-core CPU at 1 and
# 2 threads (benchmarks/foof_conv_gram_rule.py): one float64 element update of its sums, and one
# more product (its call and its float64 sums' overhead).
ROW_FORM_FLOAT64_COST = 250
ROW_FORM_PRODUCT_COST = 1.5e6
# On CUDA, where each product and each window sum is a kernel launch: unmeasured estimates from an H100's
# published rates (~33 T float32 multiply-adds/s on the CUDA cores, ~3 TB/s): a launch ~5 us ~ 1.5e8
# multiply-adds, one float64 element update (24 bytes moved, ~8 ps) ~ 250 (benchmarks/foof_gram_forms.py
# times the forms on a device).
ROW_FORM_LAUNCH_COST_CUDA = 1.5e8
ROW_FORM_FLOAT64_COST_CUDA = 250


def row_form_pays(m: nn.Conv2d, shape, device="cpu") -> bool:
    """Whether the multiply-adds the row form saves on images of ``shape`` (K, B, C, H, W) pay for its float64
    work and its products, at the measured CPU costs above; for ``device`` CUDA, against the patch form's half
    products (``precision.half_gram``) with the row form's own Grams halved too, at the CUDA estimates."""
    if torch.device(device).type != "cuda":
        saved, float64_updates, products = row_form_costs(m, shape)
        return saved > ROW_FORM_FLOAT64_COST * float64_updates + ROW_FORM_PRODUCT_COST * products
    c = row_form_counts(m, shape)
    if c is None:
        return False
    saved = c["patch_half_ma"] - c["row_half_ma"]
    extra = ROW_FORM_FLOAT64_COST_CUDA * c["float64_updates"] + ROW_FORM_LAUNCH_COST_CUDA * c["launches"]
    return saved > extra


def row_form_costs(m: nn.Conv2d, shape) -> tuple:
    """(multiply-adds the row form saves, its float64 element updates (window sums and S), its products).

    Per image and output column the patch form multiplies (C kh kw)^2 per output row, the row form
    (C kw)^2 per input row of a segment."""
    c = row_form_counts(m, shape)
    if c is None:
        return 0, 0, 0
    return c["patch_ma"] - c["row_ma"], c["float64_updates"], c["products"]


def row_form_counts(m: nn.Conv2d, shape) -> dict | None:
    """The work of both forms of the conv Gram on images of ``shape`` (K, B, C, H, W), in multiply-adds (``_ma``:
    full products; ``_half_ma``: with ``precision.half_gram``'s products where a Gram is of one matrix with
    itself -- the patch form's, the row form's segments of a row with itself), the row form's float64 element
    updates, products and launches (products and window sums); ``row_other_ma`` the row form's products of a row
    with another row; None when the conv has no output."""
    K, B, C, H, W = shape
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = conv_geometry(m)
    oh, ow = _out_size(H, kh, sh, dh, ph), _out_size(W, kw, sw, dw, pw)
    if oh < 1 or ow < 1:
        return None
    E, D = C * kw, C * kh * kw
    pairings = row_pairings(kh, dh, sh, oh)
    chunks = -(-B // _chunk(K, oh * ow, D))
    rows = sum(b - a for *_, segments, _ in pairings for a, b in segments)
    own = sum(b - a for e, *_, segments, _ in pairings if e == 0 for a, b in segments)  # rows with themselves
    products = chunks * sum(len(segments) for *_, segments, _ in pairings)
    sums = chunks * sum(len(members) for *_, windows in pairings for members in windows.values())
    per_row = K * B * ow * E * E
    return {
        "patch_ma": per_row * oh * kh * kh,
        "row_ma": per_row * rows,
        "patch_half_ma": per_row * oh * kh * kh * precision.half_gram_cost(D),
        "row_half_ma": per_row * (rows - own + own * precision.half_gram_cost(E)),
        "row_other_ma": per_row * (rows - own),
        "float64_updates": K * (sums * E * E + D * D),
        "products": products,
        "launches": products + sums,
    }


def width_patches(m: nn.Conv2d, x: torch.Tensor) -> list:
    """For images x (K, B, C, H, W): per padded input row the (C kw)-vectors of its receptive fields along
    the width (F.unfold's (channel, kernel column) order), rows split by residue mod the row stride: for
    class r, (K, C kw, rows, B ow) -- the images and output columns last, so that consecutive rows are one
    matrix (the inner dimension of a product over several rows) and the copy runs along the width."""
    K, B, C = x.shape[:3]
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = conv_geometry(m)
    x = x.reshape(K * B, *x.shape[2:])
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    v = x.unfold(3, dw * (kw - 1) + 1, sw)[..., ::dw]  # (K B, C, rows, ow, kw)
    v = v.reshape(K, B, *v.shape[1:])
    return [v[:, :, :, r::sh].permute(0, 2, 5, 3, 1, 4).reshape(K, C * kw, -1, B * v.shape[4]) for r in range(sh)]


def row_form_gram(m: nn.Conv2d, x: torch.Tensor, half: bool = False):
    """conv_gram by Grams of input rows (``row_pairings``): the receptive fields of neighbouring output rows
    share kh - 1 input rows, so the patch form multiplies most row pairs kh times over; this multiplies each
    once.  float products (x's dtype, in the current ``precision`` mode) per segment, summed in float64 on x's
    device into the blocks of kernel rows (i, i + e) of S, the blocks below by symmetry; ``half``: a segment's
    Gram of rows with themselves (e = 0) from its lower triangle (``precision.half_gram``).  total = the
    patches' sum, from the images' float64 sum."""
    K, B, C, H, W = x.shape
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = conv_geometry(m)
    oh, ow = _out_size(H, kh, sh, dh, ph), _out_size(W, kw, sw, dw, pw)
    D = C * kh * kw
    step = _chunk(K, oh * ow, D)
    S = torch.zeros(K, C, kh, kw, C, kh, kw, dtype=torch.float64, device=x.device)
    for i in range(0, B, step):
        rows = width_patches(m, x[:, i : i + step])
        for e, r, r2, shift, segments, windows in row_pairings(kh, dh, sh, oh):
            parts = [
                _segment_gram(rows[r], rows[r2], a, b, shift, e == 0, half).view(K, C, kw, C, kw) for a, b in segments
            ]
            for top, members in windows.items():
                block = S[:, :, top, :, :, top + e, :]
                for k in members:
                    block.add_(parts[k])
    _mirror_kernel_rows(S)
    total = F.unfold(x.sum(1, dtype=torch.float64), (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))
    return S.view(K, D, D), total.sum(2), oh * ow


def _segment_gram(
    left: torch.Tensor, right: torch.Tensor, a: int, b: int, shift: int, own: bool = False, half: bool = False
) -> torch.Tensor:
    """Sum over positions t in [a, b) of the Gram between the width patches of rows left[t] and right[t + shift]
    ((K, C kw, rows, B ow) each): one product, its inner dimension the rows' images and output columns, in the
    current ``precision`` mode; ``own`` (right is left, shift 0): the Gram of one matrix, ``half`` as
    ``precision.gram``'s."""
    K, E = left.shape[:2]
    lhs = left[:, :, a:b].reshape(K, E, -1)
    if own:
        return precision.gram(lhs.mT, half=half)
    return precision.matmul(lhs, right[:, :, a + shift : b + shift].reshape(K, E, -1).mT)


def _mirror_kernel_rows(S: torch.Tensor) -> None:
    """S (K, C, kh, kw, C, kh, kw) with its blocks of kernel rows i <= i' filled: fill those below from
    them and average each diagonal block with its transpose -- exactly symmetric, as a sum of a a^T is."""
    kh = S.shape[2]
    for i in range(kh):
        diag = S[:, :, i, :, :, i, :]
        diag.copy_(diag + diag.permute(0, 3, 4, 1, 2)).mul_(0.5)
        for below in range(i + 1, kh):
            S[:, :, below, :, :, i, :].copy_(S[:, :, i, :, :, below, :].permute(0, 3, 4, 1, 2))


class Conv2dBlock(LinearBlock):
    def patches(self, x):
        return conv_patches(self.module, x).reshape(-1, self.module.weight[0].numel())  # every position of every sample

    def gram(self, x):
        S, total, L = conv_gram(self.module, x[None])
        return S[0], total[0], x.shape[0] * L

    def weight_matrix(self, w):
        return w.reshape(w.shape[0], -1)

    def restore_weight(self, W):
        return W.reshape(self.module.weight.shape)


DEFAULT_DAMPING = 1.0  # lambda of (A + lambda I): one default for the local steps and the mixing

REGISTRY = {nn.Linear: LinearBlock, nn.Conv2d: Conv2dBlock}  # every subclass of these takes its base's adapter


def adapter(m: nn.Module):
    """The block adapter class of ``m``'s layer type (its nearest registered base class), or None."""
    return next((REGISTRY[base] for base in type(m).__mro__ if base in REGISTRY), None)


def skip_reason(name: str, m: nn.Module, owners: dict) -> str | None:
    """Why the Linear / Conv2d (or subclass) ``m`` named ``name`` is no FOOF block, or None when it is one.
    ``owners``: module name -> module, to find the layer's parent."""
    parent = owners.get(name.rpartition(".")[0]) if name else None
    if isinstance(parent, nn.MultiheadAttention) and m is getattr(parent, "out_proj", None):
        # F.multi_head_attention_forward reads out_proj.weight itself: the layer is never called, no hook sees its input
        return "nn.MultiheadAttention applies its out_proj weight without calling the layer, so its input is never seen"
    if not m.weight.requires_grad:
        return "frozen (weight.requires_grad is False)"
    if isinstance(m, nn.Conv2d):
        try:
            conv_geometry(m)
        except ValueError as exc:
            return str(exc)
    return None


def survey(model: nn.Module) -> tuple[dict, dict]:
    """(blocks, skipped): name -> block adapter for every layer a FOOF block covers, in module order, and
    name -> (layer type, why not) for every nn.Linear / nn.Conv2d (or subclass) that is no block."""
    owners = dict(model.named_modules())
    blocks, skipped = {}, {}
    for name, m in owners.items():
        cls = adapter(m)
        if cls is None:
            continue
        why = skip_reason(name, m, owners)
        if why is None:
            blocks[name] = cls(m)
        else:
            skipped[name] = (type(m).__name__, why)
    return blocks, skipped


def coverable(m: nn.Module) -> bool:
    """Whether a FOOF block can take ``m`` on its own: a Linear or Conv2d (or a subclass) with a trainable weight
    whose geometry ``conv_geometry`` accepts (grouped or non-zero-padded convolutions stay plain parameters,
    trained and mixed without a matrix)."""
    return adapter(m) is not None and skip_reason("", m, {}) is None


def foof_blocks(model: nn.Module) -> dict:
    """name -> block adapter for every layer a FOOF block covers (``survey``), in module order."""
    return survey(model)[0]


def block_sizes(blocks: dict) -> dict:
    """block -> d, the side of its FOOF matrix (d_in, +1 with a bias)."""
    return {name: b.module.weight[0].numel() + (1 if b.has_bias else 0) for name, b in blocks.items()}


def param_name(block_name: str, attr: str) -> str:
    """The named_parameters() key of a block's weight or bias (a root module has no prefix)."""
    return f"{block_name}.{attr}" if block_name else attr


def get_theta(block, weight, bias):
    """Theta = [W b]^T of shape (d_in (+1), d_out)."""
    W = block.weight_matrix(weight)
    return torch.cat([W, bias[:, None]], 1).T if bias is not None else W.T


def split_theta(block, theta):
    """Inverse of get_theta: (weight, bias or None)."""
    if block.has_bias:
        return block.restore_weight(theta[:-1].T), theta[-1]
    return block.restore_weight(theta.T), None


class StatsAccumulator:
    """Sums of a a^T (augmented with 1 when the layer has a bias) over forward passes."""

    def __init__(self, blocks: dict):
        self.blocks = blocks
        self.sums = {}
        self.counts = {}
        self.model_input = None
        self.input_blocks = set()  # blocks fed the model's input directly: their A depends on data only

    def add(self, name, x):
        if x is self.model_input:
            self.input_blocks.add(name)
        block = self.blocks[name]
        x = x.detach()
        if x.dtype in (torch.float16, torch.bfloat16):  # mixed precision: the statistics are kept in float32
            x = x.float()
        x, mode = precision.for_statistics(x)
        # autocast would run the Gram products in half precision
        with torch.autocast(x.device.type, enabled=False), precision.use(mode):
            S, s, rows = block.gram(x)
        if block.has_bias:
            n = torch.tensor([[float(rows)]], dtype=S.dtype, device=S.device)
            S = torch.cat([torch.cat([S, s[:, None]], 1), torch.cat([s[None, :], n], 1)], 0)
        # float64 accumulation: a round sums millions of patch outer products
        self.sums[name] = self.sums.get(name, 0) + S.to(torch.float64)
        self.counts[name] = self.counts.get(name, 0) + rows

    def result(self) -> dict:
        """The matrices, kept in float64 (accumulated there) until they are factorised or sent."""
        out = {}
        for name, S in self.sums.items():
            if not self.counts[name]:
                raise ValueError(f"the batches held no rows for block {name!r} (an empty batch): no statistics to take")
            A = S / self.counts[name]
            out[name] = 0.5 * (A + A.T)
        return out


@contextmanager
def capture_inputs(blocks: dict, acc: StatsAccumulator):
    """Forward pre-hooks that feed every block's input to ``acc``."""
    handles = [
        b.module.register_forward_pre_hook(lambda mod, inp, name=name: acc.add(name, inp[0]))
        for name, b in blocks.items()
    ]
    try:
        yield acc
    finally:
        for h in handles:
            h.remove()


@contextmanager
def buffers_kept(model: nn.Module):
    """Restore every buffer of ``model`` on leaving: a statistics pass in train mode leaves BatchNorm's running
    mean, variance and batch count as they were."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


@torch.no_grad()
def compute_foof(model: nn.Module, blocks: dict, batches, static: dict | None = None) -> dict:
    """A = E[a a^T] per block over the given input batches (the client's local data), the model's buffers
    (BatchNorm's running statistics) left as they were.

    ``static`` caches the matrices of blocks that read the model input itself (the first
    layer): those depend on the data alone, so over the same data they are computed once.
    Pass the same dict every round for the same fixed data; it is filled on the first call."""
    use_cache = static is not None and len(static) > 0
    active = {k: b for k, b in blocks.items() if not (use_cache and k in static)}
    acc = StatsAccumulator(active)
    seen = 0
    with buffers_kept(model), capture_inputs(active, acc):
        for x in batches:
            acc.model_input = x
            model(x)
            seen += 1
    if not seen:
        raise ValueError("the FOOF statistics saw no batch: the data given for them is empty")
    unused = [k for k in active if k not in acc.sums]
    if unused:
        raise ValueError(
            f"layer(s) {', '.join(repr(k) for k in unused)} received no input in the forward pass, so they have "
            "no FOOF statistics (a layer the model does not call?): call it, or freeze its parameters "
            "(requires_grad=False) so that it is no block"
        )
    out = acc.result()
    if static is not None:
        if use_cache:
            out.update(static)
        else:
            static.update({k: out[k] for k in acc.input_blocks})
    return {k: out[k] for k in blocks}


# FOOF matrices from outside (a client's in ``mix``, ``FOOF.set_matrices``, a saved state) are checked as the
# server checks a reply's: symmetric PSD within float32's round-off
MATRIX_TOL = 64 * float(torch.finfo(torch.float32).eps)


def matrix_problem(M: torch.Tensor) -> str | None:
    """None if the float64 ``M`` can be a FOOF matrix (a second moment of float32 activations): finite, within
    float32's range, symmetric and positive semidefinite within ``MATRIX_TOL``; else why not."""
    if bool(torch.isfinite(M).all()) and M.numel() and float(M.abs().max()) > FLOAT32_MAX:
        return f"holds entries beyond float32's range ({FLOAT32_MAX:.3g}): no second moment of float32 activations"
    return psd_problem(M, tol=MATRIX_TOL)


def finite_float64(name: str, M):
    """M in float64; NaN/Inf there means the local training that produced it diverged."""
    M64 = M.to(torch.float64)
    if not bool(torch.isfinite(M64).all()):
        raise ArithmeticError(
            f"FOOF matrix of {name} contains NaN or Inf: local training diverged "
            "(lower the learning rate or clip the step)"
        )
    return M64


def factorize(A: dict, damping: float, dtype=None) -> dict:
    """Cholesky factors of A + damping I (computed once per matrix refresh, used every step).

    Factorised in float64, then cast to ``dtype`` (the parameters') for the per-step solves:
    triangular solves with an accurate factor are backward stable in float32.  A is positive
    semidefinite in exact arithmetic, but float32 Gram products of large activations can leave
    eigenvalues of -eps ||A||, below a damping as small as the paper's 1e-4; then A is replaced
    by its nearest PSD matrix (negative eigenvalues set to 0) before the damping is added."""
    out = {}
    for name, M in A.items():
        M64 = finite_float64(name, M)
        eye = torch.eye(M.shape[0], dtype=torch.float64, device=M.device)
        L, info = torch.linalg.cholesky_ex(M64 + damping * eye)
        out[name] = (L if int(info) == 0 else repaired_factor(name, M64, damping)).to(dtype or M.dtype)
    return out


def repaired_factor(name: str, M64: torch.Tensor, damping: float) -> torch.Tensor:
    """The float64 Cholesky factor of nearest-PSD(M64) + damping I, for a (d, d) M64 whose plain factorisation
    failed (``factorize``); an ArithmeticError naming the block if even that has none."""
    eye = torch.eye(M64.shape[0], dtype=torch.float64, device=M64.device)
    w, V = torch.linalg.eigh(M64)
    psd = (V * w.clamp(min=0)) @ V.T
    L, info = torch.linalg.cholesky_ex(0.5 * (psd + psd.T) + damping * eye)
    if int(info) != 0:
        raise ArithmeticError(
            f"FOOF matrix of {name} + damping {damping:g} is not positive definite; raise the damping"
        )
    return L


def damped_inverses(A: dict, damping: float, dtype=None) -> dict:
    """(A + damping I)^{-1} per block, from the float64 Cholesky factor of ``factorize`` (same repair, same
    errors), symmetrised, then cast to ``dtype``: formed once per matrix refresh and applied as one product
    per step, as K-FAC/FOOF libraries and the paper's cost table do."""
    out = {}
    for name, L in factorize(A, damping, torch.float64).items():
        inv = torch.cholesky_inverse(L)
        out[name] = (0.5 * (inv + inv.mT)).to(dtype or A[name].dtype)
    return out


def solve_rows(T, L, U=None):
    """T (A + lam I)^{-1} for row blocks T (..., d_out, d) and the Cholesky factor L of A + lam I
    (U = L^T, contiguous; formed here when not given).

    Two right-side triangular solves, Z U = T then D L = Z: the rows form keeps T in the layout the
    gradients already have (cholesky_solve wants (d, d_out) columns and copies them), and on CUDA it
    is one batched trsm per solve.  Measured on this project's CPU for SimpleCNN's fc1 block (401 x 401,
    120 rows, 10 clients, one thread): 8.3 ms against cholesky_solve's 19.6 ms, same float32 accuracy."""
    if U is None:
        U = L.mT.contiguous()
    Z = torch.linalg.solve_triangular(U, T, upper=True, left=False)
    return torch.linalg.solve_triangular(L, Z, upper=False, left=False)


def with_uppers(factors: dict) -> dict:
    """name -> (L, L^T contiguous): both factors of every block, formed once per refresh for solve_rows."""
    return {name: (L, L.mT.contiguous()) for name, L in factors.items()}


# How a local step applies (A + lam I)^{-1} to its gradient rows (--foof-apply; ``resolve_apply`` picks for 'auto').
APPLIES = ("solve", "inverse", "auto")


# --foof-apply auto on a CPU, per block of side d (its FOOF matrix) and output width ``rows``: 'inverse' when the
# block is at most INVERSE_MAX_SIDE_CPU wide and its factor serves at least INVERSE_STEPS_CPU * d / rows local steps.
# The inverse's once-per-refresh cost grows as d^3, its per-step saving over the two solves as rows d^2.  Measured on
# this project's 2-core CPU at one thread (benchmarks/foof_apply.py, docs/stacking.md): the break-even step count
# times rows / d was 0.3-12.3 for every block of SimpleCNN and ResNet18-GN up to 576 wide; from 1,152 wide the
# product saved nothing per step (both forms compute-bound) while the inverse cost 0.16-22 s a block.
INVERSE_STEPS_CPU = 16
INVERSE_MAX_SIDE_CPU = 1024


def resolve_apply(apply: str, device, blocks: dict, steps: int | None = None) -> dict:
    """name -> 'solve' or 'inverse' for every block: ``apply`` itself, or for 'auto' the rule for ``device`` with
    factors that serve ``steps`` local steps each.

    On CUDA 'auto' is 'inverse' for every block: a batched triangular solve is the costliest call to issue there
    (solve_graph's measurement) on a launch-bound step, the product one GEMM.  On a CPU it is the measured rule
    above (``steps`` None: as many as it takes)."""
    if apply != "auto":
        return dict.fromkeys(blocks, apply)
    if torch.device(device).type != "cpu":
        return dict.fromkeys(blocks, "inverse")
    out = {}
    for name, b in blocks.items():
        d, rows = b.module.weight[0].numel() + (1 if b.has_bias else 0), b.module.weight.shape[0]
        pays = d <= INVERSE_MAX_SIDE_CPU and (steps is None or steps * rows >= INVERSE_STEPS_CPU * d)
        out[name] = "inverse" if pays else "solve"
    return out


def damped_inverse(L64: torch.Tensor, dtype) -> torch.Tensor:
    """(A + lam I)^{-1} from its float64 Cholesky factor L (or a stack of them): ``cholesky_inverse``,
    symmetrised (it is symmetric only to round-off), then cast to ``dtype``."""
    X = torch.cholesky_inverse(L64)
    return (0.5 * (X + X.mT)).to(dtype)


def operators(L64: dict, dtype, apply) -> dict:
    """name -> what every local step multiplies by, from the blocks' float64 factors, formed once per refresh;
    ``apply`` 'solve' or 'inverse' for every block, or name -> one of them (``resolve_apply``):
    'solve' (L, L^T) in ``dtype`` for two triangular solves a step (``solve_rows``); 'inverse' ((A + lam I)^{-1},)
    in ``dtype`` for one product a step -- the form the paper's cost table counts (one inverse per block and
    round) and the K-FAC/FOOF libraries use, with its TF32 parts in ``split-tf32`` (``precision.split_operand``:
    (X, X_hi, X_lo)).  ``direction`` tells them apart by their length.  Call it inside ``precision.use``."""
    out = {}
    for name, L in L64.items():
        how = apply if isinstance(apply, str) else apply[name]
        if how == "inverse":  # in split-tf32 with the inverse's TF32 parts, split once here, not at every step
            X = damped_inverse(L, dtype)
            out[name] = (X, *precision.split_operand(X))
        elif how == "solve":
            out[name] = with_uppers({name: L.to(dtype)})[name]
        else:
            raise ValueError(f"foof apply must be solve or inverse here, got {how!r}")
    return out


def prepare(A: dict, damping: float, dtype, apply) -> dict:
    """``operators`` of the damped matrices A + damping I (``factorize`` in float64 first)."""
    return operators(factorize(A, damping, torch.float64), dtype, apply)


def direction(T, op: tuple):
    """T (A + lam I)^{-1} for row blocks T (..., d_out, d) and a block's ``operators`` entry: (X,) or, in
    split-tf32, (X, X_hi, X_lo) -- a product with the inverse; (L, L^T) -- two triangular solves."""
    if len(op) == 2:
        return solve_rows(T, *op)
    return precision.matmul_kept(T, op[0], op[1:])


@contextmanager
def one_cpu_thread(device):
    """torch on one CPU thread inside the block (nothing changes on a GPU or a one-thread process).

    The per-step solves are small (SimpleCNN's largest is 401 x 401 with 120 rows); at two OpenMP
    threads each call pays the team's hand-off instead of splitting useful work -- measured on this
    project's 2-core CPU: 0.24 ms a call against 0.11 ms at one thread, and far worse while another
    process keeps the second core busy.  Switching the count costs nothing measurable."""
    n = torch.get_num_threads()
    if torch.device(device).type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@torch.no_grad()
def precondition_grads(model: nn.Module, blocks: dict, factors: dict) -> None:
    """Replace each block's gradient G_Theta by (A + lam I)^{-1} G_Theta in place (``factors``: name -> an
    ``operators`` entry, e.g. (L, L^T) as ``with_uppers`` makes them); on a CPU on one thread (``one_cpu_thread``)."""
    device = next(iter(factors.values()))[0].device if factors else "cpu"
    with one_cpu_thread(device):
        apply_to_grads(blocks, lambda name, T: direction(T, factors[name]))


@torch.no_grad()
def apply_to_grads(blocks: dict, apply) -> None:
    """Replace each block's gradient G_Theta by ``apply(name, G_Theta^T)``^T (rows (d_out, d) in, same out)."""
    for name, block in blocks.items():
        m = block.module
        if m.weight.grad is None:
            continue
        D = apply(name, get_theta(block, m.weight.grad, m.bias.grad if block.has_bias else None).T)
        gw, gb = split_theta(block, D.T)
        m.weight.grad.copy_(gw)
        if gb is not None:
            m.bias.grad.copy_(gb)
