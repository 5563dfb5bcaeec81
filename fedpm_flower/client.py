"""``fedpm_fit``: a FedPM client's round for a Flower ClientApp, any PyTorch model and DataLoader.

    @app.train()
    def train(msg, context):
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        content = fedpm_fit(model, trainloader, msg.content["config"], context.state)
        return Message(content=content, reply_to=msg)

The round follows the paper's schedule: local steps with ``fedpm_dnn.FOOF`` preconditioned by the matrices the
client computed at the end of its previous round (kept in ``context.state``; at the received model in its first
round), then the matrices at the end of local training, which travel to the server (``fedpm_flower.strategy.FedPM``)
for the mixing and stay for the next round's steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from fedpm_dnn.engine.sequential import batch_length
from fedpm_dnn.foof import DEFAULT_DAMPING
from fedpm_dnn.foof.optimizer import FOOF

from .strategy import MATRICES_KEY

STATE_KEY = "fedpm.foof"  # the client's matrices between rounds, in Context.state


def _number(config, key: str, default, low: float, above: bool = False, what: str = "") -> float:
    """The train config's ``key`` (``default`` when absent): a finite real number >= ``low`` (> with ``above``)."""
    value = config.get(key, default) if hasattr(config, "get") else default
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < low or (above and value == low):
        raise ValueError(f"train config {key!r} must be a finite number {'>' if above else '>='} {low:g}{what}, "
                         f"got {value!r}")  # fmt: skip
    return float(value)


def _epochs(config) -> int:
    value = config.get("local-epochs", 1) if hasattr(config, "get") else 1
    whole = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not whole or value != int(value) or value < 1:
        raise ValueError(f"train config 'local-epochs' must be an integer >= 1, got {value!r}")
    return int(value)


def fedpm_fit(
    model: nn.Module,
    trainloader,
    config,
    state: RecordDict | None = None,
    loss_fn: Callable = F.cross_entropy,
) -> RecordDict:
    """Train ``model`` (holding the received global model) on ``trainloader`` for one FedPM round; returns the
    reply's content: ``"arrays"`` (the trained state dict), ``"foof"`` (FOOF matrices, float32) and ``"metrics"``
    (``train_loss``, ``num-examples``).

    config   the train ConfigRecord (or a dict): ``lr`` (required), ``damping`` (the strategy sends its own),
             ``local-epochs`` (1), ``clip`` (0: none), ``weight-decay`` (0); a value that is not a finite number in
             its range (an integer >= 1 for ``local-epochs``) is a ValueError naming it, before anything is trained
    state    ``context.state``: keeps the matrices between rounds (None: computed at the received model)"""
    if "lr" not in config:
        raise ValueError("train config has no 'lr' (pass train_config=ConfigRecord({'lr': ...}) to strategy.start)")
    lr = _number(config, "lr", None, 0.0, above=True)
    clip = _number(config, "clip", 0.0, 0.0, what=" (0: no clipping)")
    damping = _number(config, "damping", DEFAULT_DAMPING, 0.0)
    weight_decay = _number(config, "weight-decay", 0.0, 0.0)
    epochs = _epochs(config)  # every setting checked before anything is trained
    opt = FOOF(
        model, lr=lr, damping=damping, clip=clip if clip > 0 else None, weight_decay=weight_decay, stats_every=None
    )
    kept = state.get(STATE_KEY) if state is not None else None
    if kept is not None:
        opt.set_matrices(kept.to_torch_state_dict())
    else:  # first participation: the matrices at the received model
        opt.update_statistics(trainloader)
    device = next(model.parameters()).device
    model.train()
    total, seen = 0.0, 0
    for _ in range(epochs):
        for batch in trainloader:
            x, y = batch[0].to(device), batch[1].to(device)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * batch_length(y)
            seen += batch_length(y)
    matrices = opt.update_statistics(trainloader)  # end of the round: for the mixing and the next round's steps
    if state is not None:
        state[STATE_KEY] = ArrayRecord(matrices)
    return RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            MATRICES_KEY: ArrayRecord({k: v.to(torch.float32) for k, v in matrices.items()}),
            "metrics": MetricRecord({"train_loss": total / max(seen, 1), "num-examples": seen}),
        }
    )
