"""A FLOP and memory model of FedPM's FOOF parts at any size, so that their cost can be weighed without a device.

``block_shapes(model, image)`` reads each FOOF block's geometry from one forward pass; ``foof_cost(shapes, ...)``
is a pure function of those shapes and the run's size.  FLOPs count a multiply-add as 2.  Per block of side
``d`` (its matrix: inputs, + 1 for a bias), ``rows`` outputs and ``L`` rows of the Gram per image (1 for a Linear,
the output positions for a Conv2d):

* apply, per client and local step: ``2 rows d^2`` -- the product with the inverse (``G X``), or the two
  triangular solves (``rows d^2`` each); times 3 products in ``split-tf32`` (fedpm_dnn.foof.precision), 1 otherwise;
* Gram, per client and statistics image, ``gram_form`` 'full' (every product whole: the CPU's patch form):
  ``2 L d_in^2`` (``d_in`` = d without the bias column, added from the row sums), times 2 products in
  ``split-tf32``; 'half' (the CUDA path, ``foof.half_forms``): the lower triangle's block rows alone where
  ``precision.half_pays`` (``precision.half_gram_cost`` of the full product, times 3 in ``split-tf32``), else
  the full product; and for a conv
  where ``foof.row_form_pays`` on CUDA, the row form's products (``foof.row_form_counts``: a row with itself
  as a half Gram, a row with another as a general product, times 3 in ``split-tf32``);
* factorisation, per client and refresh: the float64 Cholesky ``d^3 / 3`` multiply-adds (``2 d^3 / 3`` FLOP) and,
  for the inverse apply, ``cholesky_inverse`` ``2 d^3 / 3`` more multiply-adds (``4 d^3 / 3`` FLOP);
* memory traffic, per client and local step (``apply_bytes_per_step``): what the apply's kernels read and write --
  the product ``4 (d^2 + 2 rows d)`` bytes in float32; in ``split-tf32`` the gradient rows' split (the inverse's
  parts are formed once per refresh, ``foof.operators``), three products reading both parts and two sums,
  ``4 (3 d^2 + 17 rows d)``; the two solves ``4 (2 d^2 + 4 rows d)``; and per client and statistics image
  (``gram_split_bytes_per_image``) the split of the patches in ``split-tf32``, ``4 * 5 L d_in``;
* memory: per client the matrix A in float64 (``8 d^2`` bytes: the client's state) and the step operators in
  the training dtype (``4 d^2`` per operator: the inverse one, the solves two, L and L^T); the statistics pass
  holds one block's patches at a time, in products of at most 2^25 float32 entries for the whole stack
  (``foof._chunk``): its peak is that of its widest block, whatever the number of clients.
"""

from __future__ import annotations

import torch

from .. import foof
from . import precision

FLOAT32, FLOAT64 = 4, 8
PATCH_ENTRIES = 2**25  # foof._chunk: the entries of one statistics product's patches


def block_shapes(model: torch.nn.Module, image: torch.Tensor) -> list:
    """[{name, d, d_in, rows, L, conv}] of every FOOF block of ``model`` for one ``image`` (C, H, W); ``conv``: a
    conv's input (C, H, W) and geometry (kernel, stride, dilation, padding), None for a Linear."""
    blocks = foof.foof_blocks(model)
    found, convs = {}, {}

    def hook(name):
        def record(mod, inp, out):
            found[name] = out[0, 0].numel() if isinstance(mod, torch.nn.Conv2d) else 1
            if isinstance(mod, torch.nn.Conv2d):
                geometry = [list(g) for g in foof.conv_geometry(mod)]
                convs[name] = {"input": list(inp[0].shape[1:]), "geometry": geometry}

        return record

    handles = [b.module.register_forward_hook(hook(n)) for n, b in blocks.items()]
    try:
        with torch.no_grad():
            model(image[None])
    finally:
        for h in handles:
            h.remove()
    out = []
    for name, b in blocks.items():
        d_in = b.module.weight[0].numel()
        out.append(
            {
                "name": name,
                "d": d_in + int(b.has_bias),
                "d_in": d_in,
                "rows": b.module.weight.shape[0],
                "L": found[name],
                "conv": convs.get(name),
            }
        )
    return out


def foof_cost(
    shapes: list,
    clients: int,
    per_client: int,
    epochs: int,
    batch: int,
    apply: str = "inverse",
    mode: str = "fp32",
    gram_form: str = "full",
    stats_chunk: int = 512,
    refreshes: int = 1,
) -> dict:
    """FLOPs and bytes of the FOOF parts of one round of ``clients`` clients, ``per_client`` images each,
    ``epochs`` local epochs of batches of ``batch`` (module doc); per block and in total."""
    precision.check(mode)
    if apply not in ("solve", "inverse"):
        raise ValueError(f"apply must be solve or inverse, got {apply!r}")
    if gram_form not in GRAM_FORMS:
        raise ValueError(f"gram_form must be one of {', '.join(GRAM_FORMS)}, got {gram_form!r}")
    steps = epochs * -(-per_client // batch)
    apply_products = precision.PRODUCTS[mode] if apply == "inverse" else 1  # the solves stay in float32
    blocks = []
    total = {"apply_flop": 0, "gram_flop": 0, "factorisation_flop": 0, "state_bytes": 0, "operator_bytes": 0}
    total.update(apply_bytes=0, gram_split_bytes=0)
    for s in shapes:
        d, d_in, rows, L = s["d"], s["d_in"], s["rows"], s["L"]
        gram_per_image, form = gram_flop_per_image(s, mode, gram_form, clients, min(stats_chunk, per_client))
        row = {
            "name": s["name"],
            "d": d,
            "apply_flop_per_step": 2 * rows * d * d * apply_products,
            "apply_bytes_per_step": apply_bytes(d, rows, apply, mode),
            "apply_kernels_per_step": APPLY_KERNELS[apply if apply == "solve" else mode],
            "gram_split_bytes_per_image": FLOAT32 * 5 * L * d_in if mode == "split-tf32" else 0,
            "gram_flop_per_image": gram_per_image,
            "gram_form": form,
            "factorisation_flop": (2 * d**3 // 3) * (2 if apply == "inverse" else 1),
            "state_bytes": FLOAT64 * d * d,
            "operator_bytes": FLOAT32 * d * d * (1 if apply == "inverse" else 2),
            # one statistics product's patches for the whole stack (foof._chunk: at most 2^25 entries)
            "stats_patch_bytes": FLOAT32 * min(clients * min(stats_chunk, per_client) * L * d_in, PATCH_ENTRIES),
        }
        row["apply_flop"] = clients * steps * row["apply_flop_per_step"]
        row["gram_flop"] = clients * per_client * row["gram_flop_per_image"]
        row["apply_bytes"] = clients * steps * row["apply_bytes_per_step"]
        row["gram_split_bytes"] = clients * per_client * row["gram_split_bytes_per_image"]
        row["factorisation_flop_round"] = clients * refreshes * row["factorisation_flop"]
        blocks.append(row)
        total["apply_flop"] += row["apply_flop"]
        total["apply_bytes"] += row["apply_bytes"]
        total["gram_split_bytes"] += row["gram_split_bytes"]
        total["gram_flop"] += row["gram_flop"]
        total["factorisation_flop"] += row["factorisation_flop_round"]
        total["state_bytes"] += clients * row["state_bytes"]
        total["operator_bytes"] += clients * row["operator_bytes"]
    total["stats_patch_bytes_peak"] = max((b["stats_patch_bytes"] for b in blocks), default=0)
    return {
        "steps_per_client": steps,
        "apply": apply,
        "precision": mode,
        "gram_form": gram_form,
        "total": total,
        "blocks": blocks,
    }


GRAM_FORMS = ("full", "half")
# kernels a step's apply launches per block: the product; split-tf32's two for the rows' split, three products and
# two sums; the two triangular solves
APPLY_KERNELS = {"fp32": 1, "tf32": 1, "bf16": 3, "split-tf32": 7, "solve": 2}


def apply_bytes(d: int, rows: int, apply: str, mode: str) -> int:
    """Bytes one client's apply of a block of side d to ``rows`` gradient rows reads and writes (module doc)."""
    if apply == "solve":
        return FLOAT32 * (2 * d * d + 4 * rows * d)
    if mode == "split-tf32":
        return FLOAT32 * (3 * d * d + 17 * rows * d)
    return FLOAT32 * (d * d + 2 * rows * d)


# What a CUDA device does per second, for --foof-precision auto's rule (``split_pays``): float32 FLOPs on the CUDA
# cores, TF32 FLOPs on the tensor cores (dense), memory bytes, and the seconds a kernel launch costs.  The vendors'
# figures for the SXM parts, derated to what large GEMMs and copies reach; estimates until validation/gpu_checks.sh
# measures the two forms (benchmarks/foof_apply.py).  A device not named here is taken as an H100.
DEVICE_RATES = {
    "H200": {"fp32": 50e12, "tf32": 350e12, "bytes": 4.0e12, "launch": 4e-6},
    "H100": {"fp32": 50e12, "tf32": 350e12, "bytes": 2.8e12, "launch": 4e-6},
    "A100": {"fp32": 17e12, "tf32": 120e12, "bytes": 1.6e12, "launch": 4e-6},
}


def device_rates(name: str) -> dict:
    return next((r for key, r in DEVICE_RATES.items() if key in name), DEVICE_RATES["H100"])


def apply_seconds(shapes: list, mode: str, clients: int, rates: dict) -> float:
    """Modelled seconds of one local step's inverse apply for ``clients`` clients: per block the longer of its
    FLOPs at the mode's rate and its bytes at the memory's, plus its kernels' launches."""
    rate = rates["tf32"] if mode == "split-tf32" else rates["fp32"]
    total = 0.0
    for s in shapes:
        d, rows = s["d"], s["rows"]
        flop = clients * 2 * rows * d * d * precision.PRODUCTS[mode]
        moved = clients * apply_bytes(d, rows, "inverse", mode)
        total += max(flop / rate, moved / rates["bytes"]) + APPLY_KERNELS[mode] * rates["launch"]
    return total


def split_pays(shapes: list, clients: int = 10, device_name: str = "") -> bool:
    """Whether ``split-tf32``'s apply is modelled faster than plain float32's for these blocks (``apply_seconds``)."""
    rates = device_rates(device_name)
    return apply_seconds(shapes, "split-tf32", clients, rates) < apply_seconds(shapes, "fp32", clients, rates)


def gram_flop_per_image(shape: dict, mode: str, gram_form: str, clients: int, stats_chunk: int) -> tuple:
    """(FLOPs, form) of one block's statistics Gram per client and image (module doc); form 'patch' (a Linear's
    rows count as its patches) or 'row'."""
    d_in, L = shape["d_in"], shape["L"]
    full = 2 * L * d_in * d_in
    if gram_form == "full":
        return full * precision.GRAM_PRODUCTS[mode], "patch"
    general_products = precision.PRODUCTS[mode]
    patch = full * _half_gram_products(d_in, mode)
    conv = shape.get("conv")
    if conv is None:
        return round(patch), "patch"
    m = torch.nn.Conv2d(
        conv["input"][0], 1, conv["geometry"][0], conv["geometry"][1], conv["geometry"][3], conv["geometry"][2]
    )
    image_shape = (clients, stats_chunk, *conv["input"])
    if not foof.row_form_pays(m, image_shape, "cuda"):
        return round(patch), "patch"
    per_image = foof.row_form_counts(m, (1, 1, *conv["input"]))
    E = conv["input"][0] * conv["geometry"][0][1]
    own_rows = (per_image["row_ma"] - per_image["row_other_ma"]) / (E * E)  # rows x columns with themselves
    own = 2 * own_rows * E * E * _half_gram_products(E, mode)
    return round(own + 2 * per_image["row_other_ma"] * general_products), "row"


def _half_gram_products(d: int, mode: str) -> float:
    """``precision.gram(half=True)``'s products in full products of width d: ``half_gram``'s where it pays."""
    full = precision.GRAM_PRODUCTS[mode]
    if not precision.half_pays(d, mode):
        return full
    return precision.HALF_GRAM_PRODUCTS[mode] * precision.half_gram_cost(d)


def paper_cost(model_name: str, apply: str = "inverse", mode: str = "fp32", **size) -> dict:
    """``foof_cost`` of ``model_name`` ('cnn': CIFAR-10 SimpleCNN, 'resnet18gn': CIFAR-100 ResNet18-GN) at the
    paper's size (10 clients x 5,000 images x 5 epochs, batch 64) unless ``size`` says otherwise."""
    from ..models import make_model

    classes = 10 if model_name == "cnn" else 100
    shapes = block_shapes(make_model(model_name, classes, 3, 32), torch.zeros(3, 32, 32))
    kw = {"clients": 10, "per_client": 5000, "epochs": 5, "batch": 64, **size}
    return foof_cost(shapes, apply=apply, mode=mode, **kw)


def auto_mode(device, model: str | None = None, clients: int = 10) -> str:
    """The mode of ``--foof-precision auto``: ``precision.default_mode`` (fp32 off CUDA), and on CUDA split-tf32
    only where ``split_pays`` models its apply faster than fp32's for the blocks of ``model`` ('cnn',
    'resnet18gn', at CIFAR's 32 x 32 images) and ``clients`` clients on this device -- the split costs memory
    traffic and launches that a small block's product does not repay -- else fp32."""
    mode = precision.default_mode(device)
    dev = torch.device(device)
    if mode != "split-tf32" or model is None or dev.type != "cuda":
        return mode
    from ..models import make_model

    shapes = block_shapes(make_model(model, 10, 3, 32), torch.zeros(3, 32, 32))
    name = torch.cuda.get_device_name(dev) if torch.cuda.is_available() else ""
    return "split-tf32" if split_pays(shapes, clients, name) else "fp32"
