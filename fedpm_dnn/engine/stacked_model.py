"""A model run on a stack of K clients' parameters at once: the grouped formulation of the vectorized engine.

The model's own ``forward`` runs once on the clients' batches laid end to end, (K B, ...); only the
layers with parameters are swapped for stacked versions that read each client's slice of the
stacked parameters (K, ...):

  Linear     one batched matrix product (baddbmm) over the client axis;
  Conv2d     a grouped convolution with K groups on a GPU, one convolution per client on the CPU
             (measured on 2 cores, SimpleCNN's conv2 with 10 clients x 64 images, forward and the
             gradients of weight, bias and input: 21.8 ms per client loop against 37.9 ms grouped at one
             thread, 15.3 against 21.2 at two; an earlier rule kept the grouped form for the wider layers
             from timing the weight gradient alone) -- a fixed rule, so that a run repeats itself bit
             for bit;
  GroupNorm  normalisation without affine, then each client's scale and shift.

Layers without parameters (ReLU, pooling, flatten, residual additions) act per sample and need no
change.  Models with other parametrised layers go through ``torch.func.vmap`` instead
(``vectorized.VectorizedEngine`` decides).

Training on the CPU uses ``StackedModel.per_client`` instead: the model run once per client on its own
batch with its own parameters, inside the one autograd graph.  There the stacked batch (K B images) only
adds work: ReLU, pooling and their gradients on a 10 x 64-image stack ran 3-4 times slower per image than on
64-image batches that stay in cache, and the per-client convolutions' outputs had to be concatenated --
measured on 2 cores, a SimpleCNN step of 10 clients x 64 images at one thread: 77.5-81.3 ms client by client
against 91.4-95.3 ms stacked and 81.8-84.1 ms for ten steps of the sequential engine; at two threads 47.4-60.7,
54.0-59.0 and 53.7-58.4 ms, within the noise (``python benchmarks/vectorized_step_forms.py`` at 9097157;
docs/decisions.md).  The FOOF statistics pass keeps the stacked form: it runs without gradients, in chunks of
512 images, and its hooks read each layer's stacked input.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

SUPPORTED = (nn.Linear, nn.Conv2d, nn.GroupNorm)


def _linear(m, W, b, K, x):
    xv = x.reshape(K, -1, x.shape[-1])
    out = torch.baddbmm(b[:, None, :], xv, W.transpose(1, 2)) if b is not None else torch.bmm(xv, W.transpose(1, 2))
    return out.reshape(*x.shape[:-1], W.shape[1])


def _conv_loop(m, W, b, K, x):
    xv = x.view(K, -1, *x.shape[1:])
    return torch.cat(
        [
            F.conv2d(xv[k], W[k], None if b is None else b[k], m.stride, m.padding, m.dilation, m.groups)
            for k in range(K)
        ]
    )


def _conv_grouped(m, W, b, K, x):
    B = x.shape[0] // K
    xx = x.view(K, B, *x.shape[1:]).transpose(0, 1).reshape(B, K * x.shape[1], *x.shape[2:])
    out = F.conv2d(
        xx,
        W.reshape(-1, *W.shape[2:]),
        None if b is None else b.reshape(-1),
        m.stride,
        m.padding,
        m.dilation,
        K * m.groups,
    )
    return out.view(B, K, -1, *out.shape[2:]).transpose(0, 1).reshape(K * B, -1, *out.shape[2:])


def _group_norm(m, W, b, K, x):
    out = F.group_norm(x, m.num_groups, None, None, m.eps)
    if W is None:
        return out
    shape = (K, 1, -1) + (1,) * (x.dim() - 2)
    out = out.view(K, -1, *x.shape[1:]) * W.view(shape)
    if b is not None:
        out = out + b.view(shape)
    return out.view(x.shape)


def supported(model) -> bool:
    for m in model.modules():
        if list(m.parameters(recurse=False)) and type(m) not in SUPPORTED:
            return False
        if isinstance(m, nn.Conv2d) and m.padding_mode != "zeros":
            return False
    return True


class StackedModel:
    """``self(P, x)``: the model's outputs (K, B, ...) for stacked parameters P[name] (K, ...) and inputs x (K, B,
    ...)."""

    def __init__(self, model):
        self.model = model
        self.mods = {name: m for name, m in model.named_modules() if list(m.parameters(recurse=False))}
        self.conv_mode = {}  # layer name -> _conv_loop or _conv_grouped, overriding the fixed rule

    def _conv(self, name, m, W, b, K, x):
        # a fixed rule, not a timing: the two forms round differently, and a run must repeat itself exactly
        # (resume identity).  Per-client convolutions on the CPU, the grouped form on a GPU (module doc);
        # ``conv_mode`` (layer name -> form) overrides it, as the tests do to check the forms agree.
        fn = self.conv_mode.get(name) or (_conv_grouped if x.is_cuda else _conv_loop)
        return fn(m, W, b, K, x)

    @contextmanager
    def _forwards(self, P: dict, make):
        """For the block, every parametrised layer's forward is ``make(name, m, W, b)`` (W, b: the layer's entries
        of P, None where it has none); the layers' own forwards come back after it."""
        try:
            for name, m in self.mods.items():
                m.forward = make(
                    name, m, P.get(f"{name}.weight" if name else "weight"), P.get(f"{name}.bias" if name else "bias")
                )
            yield
        finally:
            for m in self.mods.values():
                m.__dict__.pop("forward", None)

    def bind(self, P: dict, K: int):
        """The layers reading the stacked parameters P[name] (K, ...) on the clients' batches laid end to end."""

        def make(name, m, W, b):
            if isinstance(m, nn.Conv2d):
                return partial(self._conv, name, m, W, b, K)
            return partial(_linear if isinstance(m, nn.Linear) else _group_norm, m, W, b, K)

        return self._forwards(P, make)

    def bind_client(self, P: dict):
        """The layers reading one client's parameters P[name] (unstacked) on its own batch."""

        def make(name, m, W, b):
            if isinstance(m, nn.Conv2d):
                return partial(
                    F.conv2d, weight=W, bias=b, stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups
                )
            if isinstance(m, nn.Linear):
                return partial(F.linear, weight=W, bias=b)
            return partial(F.group_norm, num_groups=m.num_groups, weight=W, bias=b, eps=m.eps)

        return self._forwards(P, make)

    def per_client(self, P: dict, x: torch.Tensor) -> torch.Tensor:
        """``self(P, x)`` computed client by client (module doc: the CPU's training form).  The parameters are
        sliced by ``unbind``, whose backward stacks each parameter's K gradients once."""
        parts = {n: v.unbind(0) for n, v in P.items()}
        outs = []
        for k in range(x.shape[0]):
            with self.bind_client({n: v[k] for n, v in parts.items()}):
                outs.append(self.model(x[k]))
        return torch.stack(outs)

    def __call__(self, P: dict, x: torch.Tensor) -> torch.Tensor:
        K, B = x.shape[:2]
        with self.bind(P, K):
            out = self.model(x.reshape(K * B, *x.shape[2:]))
        return out.view(K, B, *out.shape[1:])
