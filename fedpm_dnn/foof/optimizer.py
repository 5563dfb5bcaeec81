"""``FOOF``: FOOF-preconditioned SGD as a ``torch.optim.Optimizer`` for any model (the local step of FedPM /
LocalNewton-FOOF, and a centralised optimizer of its own).

Every ``nn.Linear`` and ``nn.Conv2d`` layer (subclasses included) whose weight the optimizer trains is a FOOF block
(``fedpm_dnn.foof``): its gradient, written as G_Theta of shape (d_in (+1 for a trained bias), d_out), is replaced
by (A + lam I)^{-1} G_Theta, where A = E[a a^T] is the second moment of the layer's input (augmented with a
constant 1 when the block has a bias).  Every other parameter (LayerNorm, BatchNorm, embeddings, ...) takes a plain
SGD step.  ``blocks()`` lists what is preconditioned and why the rest is not.

Order within a step, per parameter group: weight decay added to the gradient (coupled, as ``torch.optim.SGD``),
clip (``clip_stage``: 'gradient' the raw gradient, 'update' the preconditioned one; over all parameters
together), momentum (buf <- momentum buf + direction, as ``torch.optim.SGD`` with dampening 0), step of size lr.

Where A comes from (the damped inverses are formed from float64 Cholesky factors and applied as one product per
block and step):
  ``stats_every="auto"``          the default: forward hooks take A from the training batches every
                                  ``DEFAULT_STATS_EVERY`` steps, inverses every ``DEFAULT_INVERSE_EVERY`` (the
                                  cadence benchmarks/foof_centralised.py measured best at equal time), so that
                                  ``zero_grad(); loss.backward(); step()`` works from the first step -- until
                                  matrices are given explicitly (``update_statistics`` or ``set_matrices``): from
                                  then on only those, as with ``stats_every=None``.
  ``stats_every=None``            A only from ``update_statistics(batches)`` (over the given data, at the current
                                  parameters) or ``set_matrices`` -- the paper's refresh once a round, what FedPM's
                                  clients do.
  ``stats_every=N``               forward hooks take A from the training batches themselves, on every N-th step's
                                  forward pass(es) (grad enabled, model in train mode), folded into a running
                                  average ``stats_decay``; the inverses are formed again every ``inverse_every``
                                  steps (default N); ``update_statistics`` replaces the running average.

paper symbol -> argument: eta -> lr, lam -> damping; A_i -> ``matrices()``.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from fedconvex.hyperparams import FLOAT32_MAX, Range, checked_number

from .. import foof

DEFAULT_STATS_DECAY = 0.95  # running average of hooked statistics: A <- decay A + (1 - decay) A_batch
# stats_every="auto": the cadence benchmarks/foof_centralised.py recommends for centralised training (hooks every 5
# steps, inverses every 20: ahead of SGD and Adam at equal CPU time there, docs/use-in-your-code.md)
DEFAULT_STATS_EVERY, DEFAULT_INVERSE_EVERY = 5, 20
UNSEEN = "no forward pass reached it, so it has no statistics"  # why a block found unreachable steps plainly


def batch_inputs(batch, device=None):
    """The model input of a batch: the batch itself, or the first element of an (inputs, targets, ...)
    tuple or list, moved to ``device``."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return x.to(device) if device is not None and torch.is_tensor(x) else x


@dataclass(frozen=True)
class Layer:
    """One row of ``FOOF.blocks()``: a module holding parameters, and whether FOOF preconditions it."""

    name: str  # the module's name in the model ('' for the root)
    kind: str  # its class name
    preconditioned: bool
    side: int | None  # d of its (d, d) matrix when preconditioned
    why: str  # what is done with its parameters


def _number(name: str, value, low: float, *, low_ok: bool = True, high: float | None = None) -> float:
    """``value`` as a float32-representable finite float in [low, high) (low excluded unless ``low_ok``); a
    ValueError/TypeError naming it (``fedconvex.hyperparams.checked_number``, the rule of every entry point)."""
    allowed = Range(low, math.inf if high is None else high, low_open=not low_ok, high_open=high is not None)
    return checked_number(name, value, allowed, limit=FLOAT32_MAX)


def _every(name: str, value) -> int | None:
    if value is None or (name == "stats_every" and value == "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        also = ", 'auto'" if name == "stats_every" else ""
        raise ValueError(f"{name} must be a positive integer{also} or None, got {value!r}")
    return value


GROUP_NUMBERS = (("lr", 0.0, False, None), ("momentum", 0.0, True, 1.0), ("weight_decay", 0.0, True, None))


class FOOF(torch.optim.Optimizer):
    """FOOF-preconditioned SGD (see the module docstring).

    params         the model itself (all its trainable parameters; its layers give the blocks), or an iterable of
                   parameters or of param-group dicts, as any ``torch.optim`` optimizer takes, together with
                   ``model=``: the blocks are the model's layers whose weight is among these parameters
    lr             step size eta (a group may set its own)
    damping        lam of (A + lam I), > 0 unless every matrix is positive definite; use the same in ``mix``
    momentum       heavy-ball momentum of the preconditioned step (0: none; a group may set its own)
    weight_decay   coupled L2, added to the gradient before preconditioning (a group may set its own)
    clip           max norm of the step direction over all parameters (None: no clipping)
    clip_stage     'update' (after the preconditioner, the default) or 'gradient' (before it)
    model          the network, when ``params`` are parameters or groups
    stats_every    'auto' (hooks every 5 steps, inverses every 20, until matrices are given explicitly), None
                   (statistics only from ``update_statistics``/``set_matrices``: FedPM's once-a-round mode), or N:
                   hooks take them from the training batches of every N-th step
    inverse_every  with hooked statistics: form the damped inverses every this many steps (default: 20 with
                   'auto', else stats_every)
    stats_decay    with ``stats_every``: running-average weight of the old statistics (0: the latest batch only)
    """

    def __init__(
        self,
        params,
        lr: float,
        damping: float = foof.DEFAULT_DAMPING,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        clip: float | None = None,
        clip_stage: str = "update",
        *,
        model: nn.Module | None = None,
        stats_every: int | str | None = "auto",
        inverse_every: int | None = None,
        stats_decay: float = DEFAULT_STATS_DECAY,
    ):
        if isinstance(params, nn.Module):
            if model is not None and model is not params:
                raise ValueError(
                    "FOOF was given a model twice: pass FOOF(model, ...) or FOOF(params, ..., model=model)"
                )
            model, params = params, [p for p in params.parameters() if p.requires_grad]
        elif model is None:
            raise TypeError(
                "FOOF finds its blocks among the model's layers: pass FOOF(model, lr) or "
                "FOOF(model.parameters(), lr, model=model) (parameters or param groups)"
            )
        elif not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        lr = _number("lr", lr, 0.0, low_ok=False)
        self.damping = _number("damping", damping, 0.0)
        momentum = _number("momentum", momentum, 0.0, high=1.0)
        weight_decay = _number("weight_decay", weight_decay, 0.0)
        if clip is not None:
            clip = _number("clip", clip, 0.0, low_ok=False)
        if clip_stage not in ("update", "gradient"):
            raise ValueError(f"clip_stage must be 'update' or 'gradient', got {clip_stage!r}")
        self.stats_every = _every("stats_every", stats_every)
        self.inverse_every = _every("inverse_every", inverse_every)
        self._auto = self.stats_every == "auto"  # hooked at the default cadence until matrices are given
        if self._auto:
            self.stats_every = DEFAULT_STATS_EVERY
            self.inverse_every = self.inverse_every or DEFAULT_INVERSE_EVERY
        if self.inverse_every is not None and self.stats_every is None:
            raise ValueError("inverse_every needs stats_every (statistics taken from the training batches)")
        self.stats_decay = _number("stats_decay", stats_decay, 0.0, high=1.0)
        self._matrices: dict | None = None  # the statistics (running average with hooks)
        self._inverted: dict | None = None  # the matrices the inverses in use were formed from
        self._inverses: dict | None = None
        # torch.optim's __init__ adds each group through add_param_group (checked there)
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self.clip, self.clip_stage = clip, clip_stage
        self._find_blocks()
        self._steps = 0
        self._handles: list = []
        self._batch = None  # a StatsAccumulator while hooks collect this step's statistics
        self._hook()

    def _hook(self) -> None:
        """(Re)attach the statistics hooks to the blocks (``stats_every``)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.stats_every is None:
            return
        for name, b in self._blocks.items():
            self._handles.append(
                b.module.register_forward_pre_hook(lambda m, inp, name=name: self._hooked(name, inp[0]))
            )

    # ---- which layers are blocks ---------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """A group of the model's parameters (``torch.optim``'s), its lr, momentum and weight decay checked as the
        defaults are; a Linear/Conv2d weight among them becomes a FOOF block, whose statistics the next
        ``update_statistics`` takes (``step`` refuses to run without them)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"a param group must be a dict, got {type(param_group).__name__}")
        params = param_group.get("params")
        if torch.is_tensor(params) or (isinstance(params, Iterable) and not isinstance(params, (set, str, dict))):
            params = [params] if torch.is_tensor(params) else list(params)  # a generator is read once, here
            param_group = {**param_group, "params": params}
        if isinstance(params, list):
            owned = {id(p) for p in self.model.parameters()}
            foreign = [p for p in params if torch.is_tensor(p) and id(p) not in owned]
            if foreign:
                raise ValueError(
                    f"{len(foreign)} of the {len(params)} parameters given are not parameters of the model FOOF "
                    "was given (model=): FOOF preconditions the model's own layers; pass that model's parameters"
                )
        for key, low, low_ok, high in GROUP_NUMBERS:
            if key in param_group:
                _number(f"a param group's {key}", param_group[key], low, low_ok=low_ok, high=high)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key, low, low_ok, high in GROUP_NUMBERS:  # the defaults filled in are checked already
            group[key] = _number(f"a param group's {key}", group[key], low, low_ok=low_ok, high=high)
        if hasattr(self, "_blocks"):  # added after construction: its layers become blocks too
            self._find_blocks()
            self._hook()

    def _find_blocks(self) -> None:
        given = {id(p) for g in self.param_groups for p in g["params"]}
        unseen = {k for k, (_, why) in getattr(self, "_skipped", {}).items() if why == UNSEEN}
        old = getattr(self, "_blocks", {})
        blocks, skipped = foof.survey(self.model)
        self._blocks, self._skipped = {}, dict(skipped)
        for name, b in blocks.items():
            if name in unseen:  # found unreachable before: it stays plain
                self._skipped[name] = (type(b.module).__name__, UNSEEN)
                continue
            if id(b.module.weight) not in given:
                self._skipped[name] = (type(b.module).__name__, "its weight is not among the optimizer's parameters")
                continue
            b.has_bias = b.has_bias and id(b.module.bias) in given  # a bias trained elsewhere is no part of the block
            self._blocks[name] = b
            if name not in old or old[name].has_bias != b.has_bias:  # new, or its matrix changed size: none yet
                for held in (self._matrices, self._inverted, self._inverses):
                    if held is not None:
                        held.pop(name, None)
        by_kind: dict = {}
        for name, (kind, why) in self._skipped.items():
            if not why.startswith(("frozen", "its weight is not")):
                by_kind.setdefault(kind, []).append(f"{name or '(root)'}: {why}")
        for kind, rows in by_kind.items():
            warnings.warn(f"FOOF leaves {kind} layer(s) without preconditioning (plain SGD): " + "; ".join(rows),
                          stacklevel=3)  # fmt: skip

    def _side(self, b) -> int:
        return b.module.weight[0].numel() + int(b.has_bias)

    def blocks(self) -> list:
        """One ``Layer`` per module holding parameters, in module order: preconditioned (a FOOF block, with the
        side of its matrix) or not, and why."""
        out = []
        for name, m in self.model.named_modules():
            if name in self._blocks:
                b = self._blocks[name]
                out.append(Layer(name, type(m).__name__, True, self._side(b), "FOOF block: (A + damping I)^-1 step"))
            elif name in self._skipped:
                out.append(Layer(name, *self._skipped[name][:1], False, None, self._skipped[name][1]))
            elif any(True for _ in m.parameters(recurse=False)):
                out.append(Layer(name, type(m).__name__, False, None, "plain SGD step: FOOF blocks are Linear/Conv2d"))
        return out

    # ---- statistics and inverses ---------------------------------------------------------------------------------

    @torch.no_grad()
    def update_statistics(self, batches: Iterable) -> dict:
        """A = E[a a^T] of every block over ``batches`` (a DataLoader, or any iterable of input tensors or
        (inputs, targets) pairs), at the model's current parameters, in float64, its buffers (BatchNorm's running
        statistics) left untouched; then the damped inverses for the next steps.  The model runs in the mode it
        is in (put it in eval mode first to keep dropout out of the statistics).  Returns ``matrices()``."""
        device = next(iter(self.model.parameters())).device
        acc = foof.StatsAccumulator(self._blocks)
        seen = 0
        with foof.buffers_kept(self.model), foof.capture_inputs(self._blocks, acc):
            for b in batches:
                self.model(batch_inputs(b, device))
                seen += 1
        if not seen:
            raise ValueError("update_statistics saw no batch: pass the data to take the statistics over")
        self._drop_unseen(set(acc.sums))
        self._use(self._checked(acc.result()))  # built here: symmetric and PSD by construction
        return self.matrices()

    def _drop_unseen(self, seen: set) -> None:
        """Blocks no forward pass reached (a layer the model does not call) become plain parameters, once."""
        unseen = [name for name in self._blocks if name not in seen]
        for name in unseen:
            self._skipped[name] = (type(self._blocks.pop(name).module).__name__, UNSEEN)
        if unseen:
            warnings.warn(f"FOOF: layer(s) {', '.join(map(repr, unseen))} received no input in the forward pass: "
                          "plain SGD steps for them", stacklevel=3)  # fmt: skip
            self._hook()

    def set_matrices(self, matrices: dict) -> None:
        """Use these FOOF matrices (block name -> (d, d), as ``matrices()`` returns) from now on: a client's
        matrices kept from its previous round, for instance.  Each must be finite, symmetric and positive
        semidefinite (within float32's round-off): a ValueError naming the block otherwise.  With
        ``stats_every='auto'`` the hooks stop here: from now on A comes only from these calls (the once-a-round
        mode)."""
        self._use(self._checked(matrices, values=True))

    def _use(self, matrices: dict) -> None:
        if self._auto:  # matrices given explicitly (update_statistics, set_matrices): the once-a-round mode
            self._explicit()
        self._inverted = matrices
        self._matrices = dict(self._inverted)
        self._invert()

    def _explicit(self) -> None:
        """Leave 'auto' for the explicit mode (``stats_every=None``): no hooks, no running average."""
        self._auto, self.stats_every, self.inverse_every, self._batch = False, None, None, None
        self._hook()

    def _checked(self, matrices, partial: bool = False, values: bool = False, only=None) -> dict:
        """``matrices`` in float64 on the model's device, checked against the blocks (with ``partial``: those of
        some blocks only, as hooks that have not yet seen every block hold); ``values``: also finite, symmetric
        and positive semidefinite, as matrices from outside must be."""
        if not isinstance(matrices, dict):
            raise TypeError(
                f"FOOF matrices must be a dict of block name -> (d, d) tensor, got {type(matrices).__name__}"
            )
        sides = {
            name: self._side(b)
            for name, b in self._blocks.items()
            if (not partial or name in matrices) and (only is None or name in only)
        }
        if set(matrices) != set(sides):
            raise ValueError(f"FOOF matrices name blocks {sorted(matrices)}, the model has {sorted(sides)}")
        for name, d in sides.items():
            M = matrices[name]
            if not torch.is_tensor(M) or tuple(M.shape) != (d, d):
                shape = tuple(M.shape) if torch.is_tensor(M) else type(M).__name__
                raise ValueError(f"FOOF matrix {name!r} has shape {shape}, expected {(d, d)}")
            if values and (M.is_complex() or not (M.is_floating_point() or M.dtype == torch.int64)):
                raise ValueError(f"FOOF matrix {name!r} must hold real numbers, got dtype {M.dtype}")
        device = next(iter(self.model.parameters())).device
        out = {k: matrices[k].detach().to(device=device, dtype=torch.float64) for k in sides}
        for name, M in out.items() if values else ():
            problem = foof.matrix_problem(M)
            if problem:
                raise ValueError(f"FOOF matrix {name!r} {problem}: it must be a second moment E[a a^T]")
        return out

    def _invert(self) -> None:
        """The damped inverses of ``_inverted``, each in its block's dtype."""
        self._inverses = {
            name: foof.damped_inverses({name: A}, self.damping, self._blocks[name].module.weight.dtype)[name]
            for name, A in self._inverted.items()
        }

    def matrices(self) -> dict:
        """The FOOF matrices in use (block name -> (d, d) float64): what a FedPM client sends for mixing."""
        if self._matrices is None:
            raise RuntimeError("FOOF has no matrices yet: call update_statistics(batches) first")
        return dict(self._matrices)

    def _collecting(self) -> bool:
        return self.stats_every is not None and self._steps % self.stats_every == 0 and torch.is_grad_enabled()

    def _hooked(self, name: str, x) -> None:
        if not (self._collecting() and self._blocks[name].module.training):
            return
        if self._batch is None:
            self._batch = foof.StatsAccumulator(self._blocks)
        with torch.no_grad():
            self._batch.add(name, x)

    def _fold_batch(self) -> None:
        """Fold the statistics the hooks took on this step's forward passes into the running average."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        fresh = batch.result()
        if self._matrices is None:
            self._matrices = {}
        for name, A in fresh.items():
            old = self._matrices.get(name)
            self._matrices[name] = A if old is None else self.stats_decay * old + (1.0 - self.stats_decay) * A
        self._drop_unseen(set(self._matrices))  # a block the first hooked pass did not reach is never called

    # ---- the step ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One preconditioned step from the parameters' ``.grad``; ``closure`` (optional) re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stats_every is not None:
            self._fold_batch()
            every = self.inverse_every or self.stats_every
            if self._matrices and (self._inverses is None or self._steps % every == 0):
                self._inverted = dict(self._matrices)
                self._invert()
        missing = [] if self._inverses is None or self.stats_every else sorted(set(self._blocks) - set(self._inverses))
        if missing:
            raise RuntimeError(
                f"FOOF has no matrices for block(s) {', '.join(map(repr, missing))} (added by add_param_group): call "
                "update_statistics(batches) again before step()"
            )
        if self._inverses is None:
            raise RuntimeError(
                "FOOF has no matrices yet: call update_statistics(batches) before step(), or take the statistics "
                "from the training batches (FOOF(..., stats_every='auto' or N), the model in train mode, the "
                "forward pass with gradients enabled before step())"
            )
        self._steps += 1
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for group in self.param_groups:
            if group["weight_decay"]:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.add_(p, alpha=group["weight_decay"])
        if self.clip is not None and self.clip_stage == "gradient":
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        # rows (d_out, d) times the symmetric inverse: G_Theta^T (A + lam I)^{-1}; a block without statistics yet
        # (hooks that have not seen it) steps plainly
        ready = {k: b for k, b in self._blocks.items() if k in self._inverses}
        foof.apply_to_grads(ready, lambda name, T: T @ self._inverses[name].to(T.dtype))
        if self.clip is not None and self.clip_stage == "update":
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if group["momentum"]:
                    buf = self.state[p].get("momentum_buffer")
                    if buf is None:
                        buf = self.state[p]["momentum_buffer"] = d.detach().clone()
                    else:
                        buf.mul_(group["momentum"]).add_(d)
                    d = buf
                p.add_(d, alpha=-group["lr"])
        return loss

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``torch.optim`` state (momentum buffers, param groups) plus the FOOF matrices, the matrices the
        inverses in use were formed from, and the step count: ``load_state_dict`` resumes identically."""
        out = super().state_dict()
        out["foof"] = {
            "damping": self.damping,
            "steps": self._steps,
            "hooked": self.stats_every is not None,  # an 'auto' optimizer given matrices resumes explicit
            "blocks": sorted(self._blocks),
            "matrices": None if self._matrices is None else {k: v.clone() for k, v in self._matrices.items()},
            "inverted": None if self._inverted is None else {k: v.clone() for k, v in self._inverted.items()},
        }
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("foof"), dict):
            raise ValueError("not a FOOF optimizer state: it has no 'foof' entry (write it with FOOF.state_dict())")
        # a copy: torch.optim keeps the given tensors, which would tie this optimizer's momentum to the saved one's
        state_dict = copy.deepcopy(state_dict)
        saved = state_dict.pop("foof")
        for key in ("damping", "steps", "blocks", "matrices", "inverted"):
            if key not in saved:
                raise ValueError(f"the saved FOOF state has no {key!r} entry (write it with FOOF.state_dict())")
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"the saved optimizer state has no {key!r} entry (write it with FOOF.state_dict())")
        blocks = saved["blocks"]
        if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
            raise ValueError(f"the saved FOOF state's 'blocks' must be a list of block names, got {blocks!r}")
        if not set(blocks) <= set(self._blocks) or (self._blocks and not blocks):
            raise ValueError(f"the saved FOOF state names blocks {blocks}, this one {sorted(self._blocks)}")
        damping = _number("the saved FOOF state's damping", saved["damping"], 0.0)
        steps = checked_number("the saved FOOF state's steps", saved["steps"], Range(0), integer=True)
        for group in state_dict["param_groups"] if isinstance(state_dict["param_groups"], list) else ():
            for key, low, low_ok, high in GROUP_NUMBERS:
                if isinstance(group, dict) and key in group:
                    _number(f"the saved param group's {key}", group[key], low, low_ok=low_ok, high=high)
        partial = self.stats_every is not None
        inverted, matrices = (
            None if saved[k] is None else self._checked(saved[k], partial=partial, values=True, only=set(blocks))
            for k in ("inverted", "matrices")
        )
        super().load_state_dict(state_dict)  # its own checks (the groups' sizes) before anything here changes
        for name in set(self._blocks) - set(blocks):  # found unreachable by the saved optimizer: plain, as there
            self._skipped[name] = (type(self._blocks.pop(name).module).__name__, UNSEEN)
        self._hook()
        if self._auto and saved.get("hooked") is not True:  # no key: saved before 'auto', whose default was explicit
            self._explicit()
        self.damping, self._steps = damping, steps
        self._matrices = self._inverted = self._inverses = None
        if inverted is not None:
            self._inverted = inverted
            self._invert()
        self._matrices = matrices

    def remove_hooks(self) -> None:
        """Detach the statistics hooks from the model (``stats_every``); the optimizer then takes no new ones."""
        for h in self._handles:
            h.remove()
        self._handles = []
