"""``cost(model, example, ...)``: what FedPM costs on a model before it runs -- each FOOF block's matrix, the bytes
a client uploads per round against FedAvg's, FOOF's extra work per local step against SGD's, and which
``--precond-codec`` (``precond_codec=``) brings the upload down, by how much.

Bytes are those the simulator counts for a reply (``bytes_up``: the arrays' raw buffers): FedAvg sends the model's
floating-point state (its parameters and float buffers, float32); FedPM sends the same plus, per FOOF block, its
(d, d) matrix in float32 -- or the codec's payload (``fedconvex.codecs``: ``sym`` the upper triangle; ``fp16``
that in half precision; ``lowrank:R`` the top-R eigenpairs and the residual's diagonal; ``delta:C`` the first
upload in full, then the compressed change C(A - A_hat) of a matrix both sides track).

FLOPs count a multiply-add as 2 and only the FOOF blocks' products (the Linear and Conv2d layers: the bulk of a
CNN's or an MLP's work; bias adds, activations, pooling and normalisation are left out).  A plain SGD step is
forward + backward = 3 forward products per sample (the usual count: the backward multiplies for the inputs'
and the weights' gradients).  FOOF adds per step the product with each block's damped inverse (2 rows d^2), and
per round a statistics pass (a forward pass and a Gram product per block, 2 L d_in^2 per sample, over the
client's samples) and the inverses (float64 Cholesky and inverse, 4 d^3 / 3), spread here over the round's steps
(``fedpm_dnn.foof.cost`` has the model of every term).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from fedconvex.codecs import parse

from . import cost as foof_cost

# codecs to weigh where the matrices outweigh the model: lossless first, then lossy by bytes
CANDIDATES = ("sym", "fp16", "lowrank:32", "lowrank:8", "delta:rankr:8", "delta:topk:0.01")
NOTES = {
    "sym": "lossless",
    "fp16": "half precision",
    "lowrank": "lossy: top-R eigenpairs + diagonal",
    "delta": "after the first round; A_hat tracked on both sides",
}


@dataclass(frozen=True)
class Cost:
    """What ``cost`` found; ``str(cost)`` is the report, ``cost.line()`` its one-line summary."""

    blocks: list  # per FOOF block: name, kind, d, rows, params (with the bias), matrix_bytes, forward_flop
    fedavg_bytes: int  # a client's upload a round with FedAvg: the model's float state
    fedpm_bytes: int  # with FedPM and ``codec``
    codec: str
    sgd_flop_per_step: int  # a local SGD step on the blocks: 3 forward products per sample
    foof_flop_per_step: int  # FOOF's extra per step: the inverses' products + the round's statistics and inverses
    steps_per_round: int
    codecs: list = field(default_factory=list)  # [(spec, fedpm bytes, note)] where the matrices outweigh the model

    @property
    def upload_ratio(self) -> float:
        return self.fedpm_bytes / self.fedavg_bytes

    @property
    def work_ratio(self) -> float:
        return (self.sgd_flop_per_step + self.foof_flop_per_step) / self.sgd_flop_per_step

    def line(self) -> str:
        widest = max(self.blocks, key=lambda b: b["d"], default=None)
        text = (
            f"FedPM cost: upload {_mb(self.fedpm_bytes)} a client a round, {self.upload_ratio:.1f}x FedAvg's "
            f"{_mb(self.fedavg_bytes)} (codec {self.codec}); a local step {self.work_ratio:.2f}x SGD's work"
        )
        if widest is not None:
            text += f"; widest FOOF block {widest['name']!r}: {widest['d']} x {widest['d']}"
        if self.codecs:
            spec, b, _ = min(self.codecs, key=lambda c: c[1])
            text += f"; --precond-codec {spec}: {_mb(b)} ({b / self.fedavg_bytes:.1f}x FedAvg)"
        return text

    def __str__(self) -> str:
        rows = [
            f"{'block':<16} {'kind':<7} {'matrix':>11} {'params':>9} {'matrix MB':>9} {'vs params':>9} "
            f"{'fwd MFLOP/sample':>16}",
            *(
                f"{b['name'] or '(root)':<16} {b['kind']:<7} {b['d']:>5} x {b['d']:<5} {b['params']:>9,} "
                f"{b['matrix_bytes'] / 1e6:>9.3f} {b['matrix_bytes'] / (4 * b['params']):>8.1f}x "
                f"{b['forward_flop'] / 1e6:>16.3f}"
                for b in self.blocks
            ),
            "",
            f"upload a client a round: FedAvg {_mb(self.fedavg_bytes)}, FedPM {_mb(self.fedpm_bytes)} "
            f"({self.upload_ratio:.2f}x; codec {self.codec})",
            f"work a local step: SGD {self.sgd_flop_per_step / 1e6:,.1f} MFLOP, "
            f"FOOF +{self.foof_flop_per_step / 1e6:,.1f} MFLOP ({self.work_ratio:.2f}x; {self.steps_per_round} steps "
            "a round)",
        ]
        if self.codecs:
            rows.append("the matrices outweigh the model; --precond-codec (precond_codec=) brings the upload to:")
            rows += [f"  {s:<16} {_mb(b):>10}  {b / self.fedavg_bytes:5.2f}x FedAvg  ({n})" for s, b, n in self.codecs]
        return "\n".join(rows)


def _mb(n: int) -> str:
    """Bytes in MB, kB under a megabyte, plain bytes under a kilobyte."""
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n} B"


def float_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's floating-point state (parameters and float buffers) as float32: FedAvg's upload."""
    return sum(4 * t.numel() for t in model.state_dict().values() if t.is_floating_point())


def matrix_bytes(d: int, codec: str = "none", first: bool = False, precond_dtype: str = "float32") -> int:
    """Bytes of one (d, d) FOOF matrix on the wire: whole in ``precond_dtype`` (codec 'none') or the codec's
    payload (``first``: a delta codec's first upload, the full upper triangle)."""
    c = parse(codec)
    return (2 if precond_dtype == "float16" else 4) * d * d if c is None else c.payload_bytes(d, 4, first)


def cost(
    model: torch.nn.Module,
    example: torch.Tensor,
    *,
    batch: int = 64,
    samples: int = 5000,
    epochs: int = 1,
    codec: str = "none",
    stats_samples: int | None = None,
    precond_dtype: str = "float32",
    refreshes: int = 1,
) -> Cost:
    """FedPM's cost on ``model`` for one client's round of ``samples`` samples, ``epochs`` local epochs of batches
    of ``batch``, ``refreshes`` statistics passes a round (1: FedPM's once-a-round refresh) over ``stats_samples``
    of them (None: all, as FedPM's default), the matrices sent in ``precond_dtype`` or with ``codec`` (module
    doc).  ``example``: one input, without the batch dimension (``torch.zeros(3, 32, 32)`` for CIFAR images): the
    conv layers' output sizes come from a forward pass of it, on a copy of the model (the model, its buffers and
    the random generators are left as they were)."""
    stats_samples = samples if stats_samples is None else stats_samples
    checked = (("batch", batch), ("samples", samples), ("epochs", epochs), ("stats_samples", stats_samples),
               ("refreshes", refreshes))  # fmt: skip
    for name, v in checked:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    parse(codec)  # a ValueError naming the choices
    if precond_dtype not in ("float32", "float16"):
        raise ValueError(f"precond_dtype must be float32 or float16, got {precond_dtype!r}")
    if not torch.is_tensor(example):
        raise TypeError(f"example must be one input tensor (without the batch dimension), got {type(example).__name__}")
    probe = copy.deepcopy(model).cpu()
    with torch.random.fork_rng(devices=[]):
        shapes = foof_cost.block_shapes(probe, example.detach().cpu())
    steps = foof_cost.foof_cost(shapes, clients=1, per_client=samples, epochs=epochs, batch=batch)["steps_per_client"]
    stats = foof_cost.foof_cost(shapes, clients=1, per_client=stats_samples, epochs=epochs, batch=batch)
    kinds = {name: type(m).__name__ for name, m in probe.named_modules()}
    blocks, forward = [], 0
    for s in shapes:
        flop = 2 * s["L"] * s["d_in"] * s["rows"]
        forward += flop
        blocks.append(
            {
                "name": s["name"],
                "kind": kinds[s["name"]],
                "d": s["d"],
                "rows": s["rows"],
                "params": s["rows"] * s["d"],
                "matrix_bytes": matrix_bytes(s["d"], codec, precond_dtype=precond_dtype),
                "forward_flop": flop,
            }
        )
    total = stats["total"]
    # per round: the inverses' products every step; a statistics pass (forward + Grams) over stats_samples; the
    # inverses formed once
    apply = steps * sum(2 * s["rows"] * s["d"] ** 2 for s in shapes)
    round_extra = apply + refreshes * (total["gram_flop"] + stats_samples * forward + total["factorisation_flop"])
    fedavg = float_state_bytes(probe)

    def fedpm(spec):
        return fedavg + sum(matrix_bytes(b["d"], spec, precond_dtype=precond_dtype) for b in blocks)

    heavy = fedpm(codec) - fedavg > fedavg  # the matrices outweigh the model itself
    codecs = [(c, fedpm(c), NOTES[c.split(":")[0]]) for c in CANDIDATES if c != codec] if heavy else []
    return Cost(
        blocks=blocks,
        fedavg_bytes=fedavg,
        fedpm_bytes=fedpm(codec),
        codec=codec,
        sgd_flop_per_step=3 * batch * forward,
        foof_flop_per_step=round(round_extra / steps),
        steps_per_round=steps,
        codecs=sorted(codecs, key=lambda c: c[1]),
    )


def method_line(alg, model: torch.nn.Module, clients: list, batch: int | None = None) -> str | None:
    """``cost(...).line()`` for a FedPM method object (``fedpm_dnn.algorithms.FedPM``) on ``model`` and its
    clients (``fedpm_dnn.engine.sequential``'s ``ClientData`` or loader clients; the example input is a client's
    first sample, the samples their mean count); None for other methods or where no sample can be read without
    drawing from the data."""
    if getattr(alg, "name", None) != "fedpm" or not clients:
        return None
    first = clients[0]
    if hasattr(first, "x"):  # ClientData: uint8 images
        example, batch = first.x[0].float(), batch or alg.batch_size
    else:
        loader = getattr(first, "loader", first)
        try:
            example = loader.dataset[0][0]
        except (AttributeError, TypeError, IndexError, KeyError):
            return None
        batch = batch or getattr(loader, "batch_size", None) or alg.batch_size
    if not torch.is_tensor(example):
        return None
    samples = max(1, round(sum(len(c) for c in clients) / len(clients)))
    stats = min(samples, alg.foof_samples) if alg.foof_samples else None
    codec, dtype = alg.precond_codec, alg.precond_dtype
    steps = alg.local_epochs * -(-samples // batch)
    refreshes = 1 + (steps - 1) // alg.refresh_every if alg.refresh_every else 1  # after s, 2s, ...; at the end
    try:
        return cost(model, example, batch=batch, samples=samples, epochs=alg.local_epochs, codec=codec,
                    stats_samples=stats, precond_dtype=dtype, refreshes=refreshes).line()  # fmt: skip
    except Exception as exc:  # noqa: BLE001 -- a report must not stop the run it describes; the run will say
        return f"FedPM cost: not estimated ({type(exc).__name__}: {exc})".splitlines()[0]
