"""``federated``: the in-process simulator for any PyTorch model, any per-client data and any loss, through the
one round driver (``fedconvex.driver``) and the DNN front-end (``fedpm_dnn.engine.simulation``): every method of the
registry (``fedpm_dnn.algorithms``), the driver's screening, history rows, checkpoints and resume.

Clients are ``torch.utils.data.DataLoader``s (or any re-iterable of (inputs, targets) batches;
``engine.sequential.LoaderData``) or the image clients of ``validation.dnn`` (``engine.sequential.ClientData``),
which train exactly as there.

Buffers (BatchNorm's running mean, variance and batch count) are handled as ``fedpm_dnn.mix`` handles them: every
participant starts its round from the global model's buffers; after the round the global buffers are the mean of
the participants' (with the method's client weights; integers rounded, dtype kept), leaving out a participant
whose buffers are not finite.  They are checkpointed with the model and resumed identically.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .algorithms import DnnAlgorithm, make_method
from .engine import checkpoint as _ck
from .engine.sequential import ClientData, LoaderData, _load
from .engine.simulation import HISTORY_COLUMNS, drive, make_driver
from .engine.training_task import ENGINES, DnnTask
from .foof.run_cost import method_line

# history columns the driver writes: an evaluate() metric of one of these names would overwrite it or be lost
RESERVED_METRICS = frozenset(HISTORY_COLUMNS) - {"test_acc"} | {"seconds"}


@dataclass
class FederatedRun:
    model: nn.Module  # the final global model
    history: list  # one dict per round (round 1 first): evaluate's metrics, train_loss, bytes, seconds, rejected


def _structure(model: nn.Module) -> str:
    """A digest of the model's parameter (and buffer) names, shapes and dtypes (what a checkpoint must fit)."""
    text = ";".join(f"{k}:{tuple(p.shape)}:{p.dtype}" for k, p in model.named_parameters())
    buffers = ";".join(f"{k}:{tuple(b.shape)}:{b.dtype}" for k, b in model.named_buffers())
    if buffers:  # a model without buffers keeps the digest it had before buffers were checkpointed
        text += "|buffers:" + buffers
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class BufferedTask(DnnTask):
    """A ``DnnTask`` whose model's buffers are the global model's: loaded before every participant's round,
    averaged over the participants after it (see the module docstring), and checkpointed (``state``/``restore``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.buffers = {k: b.detach().clone() for k, b in self.model.named_buffers()}

    def _load_buffers(self) -> None:
        with torch.no_grad():
            for k, b in self.model.named_buffers():
                b.copy_(self.buffers[k])

    def train(self, alg, down: dict, states: list, sel) -> list:
        out, kept, weights = [], [], []
        weight_of = dict(zip([int(i) for i in sel], alg.client_weights(self.sizes, np.asarray(sel)), strict=True))
        for i, cs in zip(sel, states, strict=True):
            self._load_buffers()
            out += super().train(alg, down, [cs], [i])
            local = {k: b.detach().clone() for k, b in self.model.named_buffers()}
            if all(bool(torch.isfinite(v).all()) for v in local.values() if v.is_floating_point()):
                kept.append(local)
                weights.append(float(weight_of[int(i)]))
        if kept and sum(weights) > 0:
            w = torch.as_tensor(np.asarray(weights) / sum(weights), dtype=torch.float64)
            for k, v in self.buffers.items():
                stack = torch.stack([c[k] for c in kept])
                self.buffers[k] = (
                    torch.einsum("k,k...->...", w.to(v.dtype), stack)
                    if v.is_floating_point()
                    else torch.einsum("k,k...->...", w, stack.double()).round().to(v.dtype)
                )
        self._load_buffers()
        return out

    def state(self) -> dict:
        return {k: v.clone() for k, v in self.buffers.items()}

    def restore(self, saved: dict) -> None:
        if set(saved) != set(self.buffers):
            raise ValueError("the checkpoint's model buffers do not fit this model; remove it")
        self.buffers = {k: saved[k].to(self.buffers[k].device, self.buffers[k].dtype) for k in self.buffers}
        self._load_buffers()


def _check_client(i: int, c):
    """A client as federated takes it, or a TypeError naming client ``i``."""
    if isinstance(c, ClientData):
        return c
    if isinstance(c, Iterator):  # a generator: its batches would be gone after the first pass
        raise TypeError(
            f"client {i} is a one-shot iterator ({type(c).__name__}): federated reads a client's data every round; "
            "pass a DataLoader or a list of (inputs, targets) batches"
        )
    try:
        iter(c)
    except TypeError:
        raise TypeError(
            f"client {i} is a {type(c).__name__}: pass a DataLoader or a list of (inputs, targets) batches"
        ) from None
    return c


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_device(device) -> str:
    """``device`` as a string naming a torch device this machine has, or a TypeError/ValueError naming it."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    try:
        torch.empty(0, device=device)  # parses the name and reaches the device: cheap, and the real test
    except (RuntimeError, AssertionError, ValueError) as exc:  # torch's words differ by device kind and build
        why = " ".join(str(exc).split())[:120]
        raise ValueError(f"device {str(device)!r} is not usable here: {why}") from None
    return str(device)


def _check_arguments(client_loaders, rounds, participants, seed, engine, checkpoint, resume, evaluate, loss_fn):
    """The arguments ``federated`` checks before building anything; a TypeError/ValueError naming the cause."""
    if not _integer(rounds) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if not isinstance(client_loaders, (list, tuple)):
        raise TypeError(f"client_loaders must be a list of clients, got {type(client_loaders).__name__}")
    if not client_loaders:
        raise ValueError("federated needs at least one client")
    n = len(client_loaders)
    if participants is not None and (not _integer(participants) or not 1 <= participants <= n):
        raise ValueError(f"participants must be an integer from 1 to the {n} clients, or None, got {participants!r}")
    if not _integer(seed) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer from 0 to 2**63 - 1, got {seed!r}")
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    if not isinstance(resume, bool):
        raise TypeError(f"resume must be True or False, got {resume!r}")
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a file path, got {type(checkpoint).__name__}")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs checkpoint=PATH, the file to continue from")
    if resume and not os.path.isfile(checkpoint):
        raise ValueError(
            f"resume=True: there is no checkpoint file {os.fspath(checkpoint)!r} (resume=False starts a run)"
        )
    if evaluate is not None and not callable(evaluate):
        raise TypeError(f"evaluate must be a function of the model, got {type(evaluate).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function of (outputs, targets), got {type(loss_fn).__name__}")


def _library_words(text: str) -> str:
    """A message of the shared round driver or checkpoint code, which the command line also prints, with its flag
    advice in this function's keyword names ("drop --resume" -> "pass resume=False", "--local-epochs" ->
    "local_epochs")."""
    text = text.replace("drop --resume", "pass resume=False").replace("choose another --out", "choose another file")
    return re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_"), text)


def _checked_metrics(got) -> dict:
    """evaluate()'s return value as a history row's metric columns."""
    if not isinstance(got, dict):
        raise TypeError(f"evaluate must return a dict of metric name -> number, got {type(got).__name__}")
    clash = sorted(k for k in got if k in RESERVED_METRICS)
    if clash:
        raise ValueError(f"evaluate returned metric(s) {clash}: these names are the history's own columns; rename them")
    for k in got:
        if not isinstance(k, str):
            raise TypeError(f"evaluate's metric names must be strings, got {k!r}")
    return dict(got)


def _fingerprint(alg, model, clients, participants, seed, engine) -> dict:
    fp = {
        "model": _structure(model),
        "seed": int(seed),
        "n_clients": len(clients),
        "participants": None if participants is None else int(participants),
        "client_sizes": [len(c) for c in clients],
        "engine": engine,
        "config.name": alg.name,
        **{f"config.{k}": v for k, v in asdict(alg).items()},
    }
    if all(isinstance(c, ClientData) for c in clients):  # tensors at hand: the data themselves must match
        fp["data_hash"] = _ck.data_hash(clients)
    return fp


def federated(
    model_fn: Callable[[], nn.Module],
    client_loaders: list,
    *,
    method: str | DnnAlgorithm = "fedpm",
    rounds: int,
    loss_fn: Callable = F.cross_entropy,
    evaluate: Callable[[nn.Module], dict] | None = None,
    participants: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    engine: str = "sequential",
    checkpoint: str | None = None,
    resume: bool = False,
    on_round: Callable | None = None,
    max_ratio: float | None = None,
    **hyperparameters,
) -> FederatedRun:
    """Train ``model_fn()`` federatedly on ``client_loaders`` for ``rounds`` rounds.

    model_fn         builds the model (called once, after ``torch.manual_seed(seed)``)
    client_loaders   one DataLoader (batches of (inputs, targets)) or ``ClientData`` per client
    method           a registry name ('fedpm', 'localnewton', 'fedavg', ...) with its ``hyperparameters``
                     (lr, damping, local_epochs, clip, ...; unknown ones are rejected), or a method object
    loss_fn          ``loss_fn(model(inputs), targets)``, averaged over the batch
    evaluate         ``evaluate(model) -> {metric: value}`` on the global model after every round (eval mode,
                     no gradients); its metrics are the first columns of the history
    participants     clients sampled per round (None: all)
    checkpoint       file written after every round; ``resume=True`` continues from it to the identical result
    on_round         ``on_round(row, history)`` after every round (progress)
    max_ratio        the server's magnitude guard (``fedconvex.screening``; None: off)

    Returns ``FederatedRun(model, history)``.  Raises ``fedconvex.driver.Diverged`` when training diverges."""
    _check_arguments(client_loaders, rounds, participants, seed, engine, checkpoint, resume, evaluate, loss_fn)
    device = _check_device(device)
    if isinstance(method, DnnAlgorithm):
        if hyperparameters:
            raise ValueError(f"pass hyper-parameters {sorted(hyperparameters)} in the method object, not beside it")
        alg = method
    else:
        alg = make_method(method, **hyperparameters)
    clients = [_check_client(i, c) for i, c in enumerate(client_loaders)]
    clients = [c if isinstance(c, ClientData) else LoaderData(c, device) for c in clients]
    images = all(isinstance(c, ClientData) for c in clients)
    if engine != "sequential" and (not images or loss_fn is not F.cross_entropy):
        raise ValueError("engine 'vectorized' trains ClientData clients with cross-entropy only; use 'sequential'")
    torch.manual_seed(seed)
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
    model = model.to(device)
    has_buffers = any(True for _ in model.buffers())
    if has_buffers and engine != "sequential":
        raise ValueError("engine 'vectorized' takes models without buffers (BatchNorm...); use 'sequential'")
    task = (BufferedTask if has_buffers else DnnTask)(model, clients, device, seed, engine, loss_fn=loss_fn)

    def metrics(state) -> dict:
        if evaluate is None:
            return {}
        _load(model, state.theta)
        model.eval()
        try:
            with torch.no_grad():
                return _checked_metrics(evaluate(model))
        finally:
            model.train()

    line = method_line(alg, model, clients)  # what FedPM costs here, before the first round
    if line:
        print(line, file=sys.stderr)
    driver = make_driver(alg, task, metrics, participants, max_ratio)
    state = alg.init(task, task.initial_params())
    fp = _fingerprint(alg, model, clients, participants, seed, engine) if checkpoint else None
    extra = task if has_buffers else None
    try:
        state, history = drive(task, driver, state, rounds, seed, fp, checkpoint, resume, on_round, extra=extra)
    except (ValueError, _ck.CheckpointError) as exc:
        if "--" not in str(exc):
            raise
        raise type(exc)(_library_words(str(exc))) from None
    _load(model, state.theta)
    return FederatedRun(model=model, history=history)
