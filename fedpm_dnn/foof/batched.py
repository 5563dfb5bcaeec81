"""FOOF statistics and factorisations for a stack of clients at once (the vectorized engine).

The matrices are those of ``foof.compute_foof`` -- A = E[a a^T] over the client's plain
(un-augmented) data, augmented with a constant 1 for blocks with a bias -- computed for K
clients in batched matrix products: float32 products per chunk of 512 samples (the chunk of the
sequential path), accumulated in float64.  Clients hold different numbers of samples: the
samples are padded to the largest client and the padded rows' block inputs are zeroed, so they
add nothing to the sums; each client's count is its own.
"""

from __future__ import annotations

import torch

from .. import foof
from . import precision


def input_blocks(model, blocks: dict, sample: torch.Tensor) -> set:
    """Names of the blocks that read the model's input itself (their A depends on the data only)."""
    found = set()
    handles = [
        b.module.register_forward_pre_hook(lambda mod, inp, name=name: found.add(name) if inp[0] is sample else None)
        for name, b in blocks.items()
    ]
    try:
        with torch.no_grad():
            model(sample)
    finally:
        for h in handles:
            h.remove()
    return found


def stacked_gram(block, x: torch.Tensor):
    """Per-client (sum a a^T, sum a, rows per sample) of a block's input x: (K, B, ...) -> (K, D, D), (K, D), int."""
    K, B = x.shape[:2]
    if isinstance(block, foof.Conv2dBlock):
        return foof.conv_gram(block.module, x)
    a = x.reshape(K, -1, x.shape[-1])
    per = a.shape[1] // B
    return precision.gram(a, half=foof.half_forms(a.device)), a.sum(1), per


class StackedCapture:
    """Forward pre-hooks that collect the block inputs of a vmapped forward (returned as its outputs)."""

    def __init__(self, blocks: dict):
        self.blocks = blocks
        self.active = None
        self.store = {}
        self.handles = []

    def __enter__(self):
        def hook(mod, inp, name):
            if self.active is not None and name in self.active:
                self.store[name] = inp[0]

        self.handles = [
            b.module.register_forward_pre_hook(lambda mod, inp, name=name: hook(mod, inp, name))
            for name, b in self.blocks.items()
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


@torch.no_grad()
def stacked_foof(
    forward_capture,
    capture: StackedCapture,
    blocks: dict,
    params: dict,
    images,
    counts,
    skip: set = frozenset(),
    stats_batch: int = 512,
) -> dict:
    """A per block for K clients (float64, (K, D, D)), blocks in ``skip`` left out.

    ``images(s, e)`` returns the clients' normalised plain inputs of padded rows s:e, shape (K, e-s, C, H, W);
    ``counts`` (K,) the number of real rows of each client.  ``forward_capture(params, x)`` is the vmapped
    forward that returns the captured block inputs."""
    active = [k for k in blocks if k not in skip]
    if not active:
        return {}
    capture.active = set(active)
    K = counts.shape[0]
    dev = counts.device
    sums, rows = {}, {}
    n_max = int(counts.max())
    for s in range(0, n_max, stats_batch):
        e = min(n_max, s + stats_batch)
        x = images(s, e)
        valid = torch.arange(s, e, device=dev)[None, :] < counts[:, None]  # (K, b)
        inputs = forward_capture(params, x)
        for name in active:
            a = inputs[name]
            a = a * valid.view(K, e - s, *([1] * (a.dim() - 2))).to(a.dtype)
            block = blocks[name]
            a, mode = precision.for_statistics(a)
            with precision.use(mode):
                S, sv, per = stacked_gram(block, a)
            if block.has_bias:
                nrow = (valid.sum(1) * per).to(S.dtype)
                S = torch.cat(
                    [torch.cat([S, sv[:, :, None]], 2), torch.cat([sv[:, None, :], nrow[:, None, None]], 2)], 1
                )
            sums[name] = sums.get(name, 0) + S.to(torch.float64)
            rows[name] = per
    capture.active = None
    out = {}
    for name in active:
        A = sums[name] / (counts.to(torch.float64) * rows[name])[:, None, None]
        out[name] = 0.5 * (A + A.transpose(1, 2))
    return out


def factorize_stacked(A: dict, damping: float, dtype) -> dict:
    """Batched Cholesky factors of A + damping I (float64, cast to ``dtype``); a matrix whose
    factorisation fails goes straight to ``foof.repaired_factor`` (nearest-PSD repair or the same error)."""
    out = {}
    for name, M in A.items():
        M64 = foof.finite_float64(name, M)
        eye = torch.eye(M.shape[-1], dtype=torch.float64, device=M.device)
        L, info = torch.linalg.cholesky_ex(M64 + damping * eye)
        bad = torch.nonzero(info).flatten().tolist()
        for i in bad:
            L[i] = foof.repaired_factor(name, M64[i], damping)
        out[name] = L.to(dtype)
    return out
