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
that eager function.  Unequal clients' steps are graphed too: a client whose steps have ended takes masked steps
(no loss, no update, no decay) until the longest client's end, so that every step of the chunk is the one static
function (``graphed_share`` in the engine's record: 1 on CUDA wherever the capture holds).  Where the
capture fails, or its first replay disagrees with the eager step, the runner warns (once per process) and runs the
same function eagerly for that chunk and round; the engine records what each round used.  ``--step-graph``
(``resolve``): 'auto' uses the static step on CUDA and the loop on a CPU; 'on' uses it on any device (on a CPU
eagerly: the tests' form); 'off' the loop.  ``solve_graph.ENV`` = 0 switches every capture off (the static step
then runs eagerly).

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
        self.x_all, self.y_all, self.ints, self.bools = x_all, y_all, ints, bools
        # a client whose steps have ended (unequal clients: counts 0) takes masked steps that leave it as it is:
        # its batch counted as 1 image (no 0 / 0), its update and decay multiplied by 0 (``active``)
        finished = counts == 0
        self.active = None if not bool(finished.any()) else (~finished).to(counts.dtype)
        self.counts = counts if self.active is None else counts.clamp_min(1)
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
            a_t = None if self.active is None else self.active.index_select(0, self.t)[0]
            if a_t is not None:  # finished clients: no update, no decay (x 1.0 leaves the others' bits as they are)
                for n in names:
                    G[n] = G[n] * a_t.view(K, *([1] * (G[n].dim() - 1)))
            for n in names:
                new = Pk[n].detach().add_(G[n], alpha=-cfg.lr)  # a view of P[n]: the update lands in place
                if decay and a_t is None:
                    new.mul_(1.0 - decay)
                elif decay:
                    keep = torch.where(a_t > 0, a_t.new_tensor(1.0 - decay), a_t.new_tensor(1.0))
                    new.mul_(keep.view(K, *([1] * (new.dim() - 1))))
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


def _cuda_graph(step, device):
    """``step`` captured as a CUDA graph on a stream context of its own (``solve_graph.capture_graph``)."""
    return solve_graph.capture_graph(step, device)[0]


CHECK_RTOL = 1e-2  # the first replay's parameters within 1 % of the eager step's own change (cuDNN's atomics)
_said = set()  # the fallback warnings given in this process (each said once; no run is changed by another's)


def _say(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


class Runner:
    """Runs a ``FullStep`` once per call: eagerly, or with ``capture`` the first ``WARMUP`` calls eagerly on a side
    stream, then one capture, then a replay per call.

    The first replay checks itself: the step is run eagerly from the same state, the state put back, the graph
    replayed, and the two results compared (parameters within ``CHECK_RTOL`` of the eager step's change, loss and
    step index alike); where they differ, or the capture fails, the eager result stands, the runner stays eager and
    says why once per process, and ``used``/``fallback`` record it.  A failed capture leaves the stream and the
    step's state as they were before it.  Nothing carries over to another runner: each round and chunk tries again.
    ``graph_factory(step, device)`` makes the graph (tests inject failures); ``replays`` counts the replays."""

    def __init__(self, step: FullStep, capture: bool, graph_factory=None):
        self.step, self.capture, self.calls, self.replays = step, capture, 0, 0
        self.graph, self.fallback = None, None
        self._factory = graph_factory or _cuda_graph

    @property
    def used(self) -> str:
        """'graph' (replays ran), 'eager' (no capture asked) or 'eager: <why the graph was given up>'."""
        if self.fallback:
            return f"eager: {self.fallback}"
        return "graph" if self.replays else "eager"

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
            self._first_replay()

    def _state(self) -> list:
        st = self.step
        return [*st.P.values(), st.t, st.loss_sum]

    def _first_replay(self) -> None:
        before = [t.clone() for t in self._state()]
        try:
            graph = self._factory(self.step, self.step.device)
        except Exception as exc:  # capture is an optimisation: any failure means the eager step
            self._restore(before)  # a capture runs nothing, but a failing one may have run part of the step
            self._give_up(f"CUDA graph capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
            self.step()
            return
        self.step()  # the eager step from the same state: the reference of the first replay
        eager = [t.clone() for t in self._state()]
        self._restore(before)
        graph.replay()
        worst = self._disagreement(before, eager)
        if worst > CHECK_RTOL:
            self._restore(eager)
            self._give_up(f"the first graphed step differs from the eager one ({worst:.2e} of its change)")
            return
        self.graph = graph
        self.replays += 1

    def _restore(self, saved: list) -> None:
        with torch.no_grad():
            for t, v in zip(self._state(), saved, strict=True):
                t.copy_(v)

    def _disagreement(self, before: list, eager: list) -> float:
        """The largest difference of the replayed state from the eager one, relative to the eager step's change."""
        worst = 0.0
        for got, want, old in zip(self._state(), eager, before, strict=True):
            change = float((want.double() - old.double()).norm())
            diff = float((got.double() - want.double()).norm())
            if diff and not change:
                return float("inf")
            worst = max(worst, diff / change if change else 0.0)
        return worst if worst == worst else float("inf")  # NaN: disagreement

    def _give_up(self, why: str) -> None:
        self.capture, self.graph, self.fallback = False, None, why
        _say(f"{why}; running the local step eagerly for this round (--step-graph off skips the attempt)")

    def release(self) -> None:
        """Drop the graph (its memory pool goes back to the allocator before the round's statistics pass)."""
        self.graph = None
