"""``federated``: the in-process simulator for any PyTorch model, any per-client data and any loss, through the
one round driver (``fedconvex.driver``) and the DNN front-end (``fedpm_dnn.simulation``): every method of the
registry (``fedpm_dnn.algorithms``), the driver's screening, history rows, checkpoints and resume.

Clients are ``torch.utils.data.DataLoader``s (or any iterable of (inputs, targets) batches; ``client.LoaderData``)
or the image clients of ``validation.dnn`` (``client.ClientData``), which train exactly as there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import checkpoint as _ck
from .algorithms import DnnAlgorithm, make_method
from .client import ClientData, LoaderData, _load
from .simulation import drive, make_driver
from .task import DnnTask


@dataclass
class FederatedRun:
    model: nn.Module  # the final global model
    history: list  # one dict per round (round 1 first): evaluate's metrics, train_loss, bytes, seconds, rejected


def _structure(model: nn.Module) -> str:
    """A digest of the model's parameter names, shapes and dtypes (what a checkpoint must fit)."""
    text = ";".join(f"{k}:{tuple(p.shape)}:{p.dtype}" for k, p in model.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    if isinstance(method, DnnAlgorithm):
        if hyperparameters:
            raise ValueError(f"pass hyper-parameters {sorted(hyperparameters)} in the method object, not beside it")
        alg = method
    else:
        alg = make_method(method, **hyperparameters)
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if not client_loaders:
        raise ValueError("federated needs at least one client")
    clients = [c if isinstance(c, ClientData) else LoaderData(c, device) for c in client_loaders]
    images = all(isinstance(c, ClientData) for c in clients)
    if engine != "sequential" and (not images or loss_fn is not F.cross_entropy):
        raise ValueError("engine 'vectorized' trains ClientData clients with cross-entropy only; use 'sequential'")
    torch.manual_seed(seed)
    model = model_fn().to(device)
    task = DnnTask(model, clients, device, seed, engine, loss_fn=loss_fn)

    def metrics(state) -> dict:
        if evaluate is None:
            return {}
        _load(model, state.theta)
        model.eval()
        try:
            with torch.no_grad():
                return dict(evaluate(model))
        finally:
            model.train()

    driver = make_driver(alg, task, metrics, participants, max_ratio)
    state = alg.init(task, task.initial_params())
    fp = _fingerprint(alg, model, clients, participants, seed, engine) if checkpoint else None
    state, history = drive(task, driver, state, rounds, seed, fp, checkpoint, resume, on_round)
    _load(model, state.theta)
    return FederatedRun(model=model, history=history)
