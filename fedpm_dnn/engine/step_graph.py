"""The vectorized engine's full local step as one function of static buffers, replayed as a CUDA graph.

On a GPU the engine's SimpleCNN step is launch-bound: gathering the batch, cropping, flipping and
standardising it, the forward and backward of the stacked model, the method's gradient hook, clipping, the FOOF
directions and the update are each a few small kernels, and the host takes longer to issue them than the device
to run them.  ``FullStep`` is that step for the common case -- every client of the chunk still training -- written
as a function of tensors that stay in place for the whole round: the stacked parameters (updated in place), the
round's schedule as (T, K, B) tensors with the step index ``t`` a device tensor that the step itself advances, the
FOOF operators (a refresh writes new ones into the same tensors), the method's per-client tensors and the loss sum.
It takes no argument, returns nothing, never reads a value back to the host and has no branch on data, so that
``Runner`` can capture it once per chunk and round (``torch.cuda.graph``, after warm-up steps on a side stream) and
replay it for every later full step: one launch a step.

The step is the engine's eager loop (``vectorized.VectorizedEngine._chunk``) operation for operation, so that the
two give the same parameters (the CPU tests hold them equal bit for bit, eagerly); the graph replays the kernels of
that eager function.  Steps where a client has finished (unequal client sizes) stay in the eager loop.  Where the
capture fails, the engine warns once and runs the same function eagerly.  ``--step-graph`` (``resolve``): 'auto'
uses the static step on CUDA and the loop on a CPU; 'on' uses it on any device (on a CPU eagerly: the tests'
form); 'off' the loop.  ``solve_graph.ENV`` = 0 switches every capture off (the static step then runs eagerly).

Costs of the graph: one capture per chunk and round (``torch.cuda.graph`` synchronises the device, collects
garbage and empties the allocator's cache as it starts), and the step's intermediate tensors held in the graph's
own memory pool until the chunk's steps end (``Runner.release``, before the end-of-round statistics pass).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

from .. import foof
from ..data.augment import crop_flip
from ..foof import solve_graph

MODES = ("auto", "on", "off")
WARMUP = 2  # eager steps on a side stream before the capture (cuBLAS/cuDNN workspaces, the autograd engine)
_warned = []


def check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"step graph must be {' or '.join(MODES)}, got {mode!r}")
    return mode


def resolve(mode: str, device) -> bool:
    """Whether full steps run as ``FullStep``: 'auto' on CUDA, 'on' anywhere, 'off' never."""
    if check(mode) == "auto":
        return torch.device(device).type == "cuda"
    return mode == "on"


def capturable(device) -> bool:
    """Whether ``Runner`` captures the step: on CUDA, unless the graphs are switched off (``solve_graph.ENV``)."""
    return torch.device(device).type == "cuda" and os.environ.get(solve_graph.ENV, "1") != "0"


class FullStep:
    """``self()``: one local step of every client of the chunk at schedule index ``self.t``, in place.

    ``P`` name -> (K, ...) stacked parameters, updated in place; ``ints`` (3, T, K, B) the rows of ``x``/``y`` to
    train on, the crop offsets oy and ox; ``bools`` (2, T, K, B) the batch mask and the flips; ``counts`` (T, K) the
    batch sizes in the parameters' dtype; ``ms`` (K, 2, C) each client's mean and std; ``hook`` the method's
    gradient correction on the stacks (None: none); ``factors`` the FOOF operators (None: a first-order method);
    ``loss_sum`` (K,) float64, to which each step adds its summed losses."""

    def __init__(self, cfg, forward, names, P, x_all, y_all, ms, ints, bools, counts, hook, factors, blocks, loss_sum):
        self.cfg, self.forward, self.names, self.P = cfg, forward, names, P
        self.x_all, self.y_all, self.ints, self.bools, self.counts = x_all, y_all, ints, bools, counts
        self.hook, self.factors, self.blocks, self.loss_sum = hook, factors, blocks, loss_sum
        self.K, self.B = ints.shape[2], ints.shape[3]
        shape = (self.K, 1, -1, 1, 1)
        self.mean, self.std = ms[:, 0].view(shape), ms[:, 1].view(shape)
        self.device = loss_sum.device
        self.t = torch.zeros(1, dtype=torch.long, device=self.device)  # the schedule index, advanced by the step

    def __call__(self) -> None:
        cfg, names, K, B = self.cfg, self.names, self.K, self.B
        C, H, W = self.x_all.shape[1:]
        ints = self.ints.index_select(1, self.t)  # (3, 1, K, B): one gather for the step's integer draws
        bools = self.bools.index_select(1, self.t)
        g, oy, ox = ints[0, 0].reshape(-1), ints[1, 0].reshape(-1), ints[2, 0].reshape(-1)
        m_t, flip = bools[0, 0], bools[1, 0].reshape(-1)
        c_t = self.counts.index_select(0, self.t)[0]
        x = self.x_all.index_select(0, g).float().div_(255.0)
        x = crop_flip(x, oy, ox, flip).view(K, B, C, H, W)
        x = (x - self.mean) / self.std
        y = self.y_all.index_select(0, g)
        Pk = {n: self.P[n].detach().requires_grad_(True) for n in names}
        out = self.forward(Pk, x)
        ce = F.cross_entropy(out.reshape(K * B, -1), y, reduction="none").view(K, B)
        loss = (ce * m_t).sum(1) / c_t
        grads = torch.autograd.grad(loss.sum(), [Pk[n] for n in names])
        with torch.no_grad():
            G = dict(zip(names, [gr.detach() for gr in grads], strict=True))
            for n in names:
                if self.hook is not None:
                    self.hook(n, Pk[n], G[n])
                if cfg.weight_decay and cfg.weight_decay_mode == "coupled":
                    G[n].add_(Pk[n], alpha=cfg.weight_decay)
            if cfg.clip is not None and cfg.clip_stage == "gradient":
                clip_(list(G.values()), cfg.clip)
            if self.factors is not None:
                self._precondition(G)
            if cfg.clip is not None and cfg.clip_stage == "update":
                clip_(list(G.values()), cfg.clip)
            decay = cfg.lr * cfg.weight_decay if cfg.weight_decay_mode == "decoupled" else 0.0
            for n in names:
                new = Pk[n].detach().add_(G[n], alpha=-cfg.lr)  # a view of P[n]: the update lands in place
                if decay:
                    new.mul_(1.0 - decay)
            self.loss_sum.add_((loss.detach() * c_t).to(torch.float64))
            self.t.add_(1)

    def _precondition(self, G: dict) -> None:
        """G's block entries replaced by their FOOF directions (views of the products, as the eager loop has them)."""
        K, dirs = self.K, {}
        with foof.one_cpu_thread(self.device):
            for bname, block in self.blocks.items():
                wn = foof.param_name(bname, "weight")
                gw = G[wn].reshape(K, G[wn].shape[1], -1)
                rhs = torch.cat([gw, G[foof.param_name(bname, "bias")][:, :, None]], 2) if block.has_bias else gw
                dirs[bname] = foof.direction(rhs, self.factors[bname])
        for bname, block in self.blocks.items():
            wn, D = foof.param_name(bname, "weight"), dirs[bname]
            G[wn] = (D[:, :, :-1] if block.has_bias else D).reshape(G[wn].shape)
            if block.has_bias:
                G[foof.param_name(bname, "bias")] = D[:, :, -1]


def clip_(grads: list, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ per client: grads are (K, ...) stacks."""
    K = grads[0].shape[0]
    norms = torch.stack([torch.linalg.vector_norm(g.reshape(K, -1), dim=1) for g in grads], 1)
    total = torch.linalg.vector_norm(norms, dim=1)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.view(K, *([1] * (g.dim() - 1))))


class Runner:
    """Runs a ``FullStep`` once per call: eagerly, or with ``capture`` on CUDA the first ``WARMUP`` calls eagerly
    on a side stream, then one capture, then a replay per call.  A failed capture warns and leaves the calls eager,
    for the rest of the process (no later round tries again).  ``replays`` counts the replays (the benchmarks and
    tests read it)."""

    def __init__(self, step: FullStep, capture: bool):
        self.step, self.capture, self.calls, self.replays = step, capture and not _warned, 0, 0
        self.graph = None

    def __call__(self) -> None:
        self.calls += 1
        if not self.capture:
            self.step()
        elif self.graph is not None:
            self.graph.replay()
            self.replays += 1
        elif self.calls <= WARMUP:
            dev = self.step.device
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream(dev).wait_stream(side)
        else:
            self.graph = self._capture()
            if self.graph is None:
                self.capture = False
                self.step()
            else:
                self.graph.replay()
                self.replays += 1

    def _capture(self):
        """The step captured as a CUDA graph (capture runs nothing: the call's step is the first replay), or None
        with one warning per process."""
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step()
        except Exception as exc:  # capture is an optimisation: any failure means the eager step
            if not _warned:
                _warned.append(exc)
                warnings.warn(
                    f"CUDA graph capture of the local step failed ({type(exc).__name__}: {exc}); running it eagerly "
                    f"(--step-graph off skips the attempt)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        return graph

    def release(self) -> None:
        """Drop the graph (its memory pool goes back to the allocator before the round's statistics pass)."""
        self.graph = None
