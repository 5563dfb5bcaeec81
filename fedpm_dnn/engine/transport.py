"""The DNN front-end's transport for ``fedconvex.driver``: runs a round's participants on the task's
engine and delivers their replies as one stacked message.

Per-client work that must happen before the replies can be stacked lives here: fault injection for
tests (``tamper(round, client, reply) -> reply``) and the structural check (a reply with a missing
entry, a wrong shape or dtype cannot be stacked; it is rejected, naming the client).  Everything
else -- NaN/Inf, PSD matrices, the magnitude guard, divergence -- is the driver's screening, from the
method's ``message_fields``.  The history row gets the round's mean training loss (weighted by the
participants' sample counts) and the clients' compute seconds.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from fedconvex.driver import Delivery
from fedconvex.screening import dtype_problem
from fedconvex.screening import log as server_log

from ..algorithms.base import stack_replies


def structure_problem(reply, shapes: dict, like: dict | None) -> str | None:
    """None if ``reply`` can be stacked with replies shaped as ``shapes`` (field -> {name: shape}, or None
    for codec payloads, which decoding checks) and dtyped as ``like`` (a reply already accepted)."""
    if not isinstance(reply, dict):
        return f"reply is a {type(reply).__name__}, not a mapping"
    for key, shape in shapes.items():
        if key not in reply:
            return f"missing {key!r}"
        value = reply[key]
        if not isinstance(value, dict):
            return f"{key} is a {type(value).__name__}, not a mapping"
        if shape is None:
            continue
        if set(value) != set(shape):
            return f"{key} has entries {sorted(map(str, value))}, expected {sorted(map(str, shape))}"
        for sub, a in value.items():
            name = f"{key}[{sub}]"
            bad = dtype_problem(a)
            if bad:
                return f"{name} {bad}"
            if tuple(a.shape) != tuple(shape[sub]):
                return f"{name} has shape {tuple(a.shape)}, expected {tuple(shape[sub])}"
            if like is not None and a.dtype != like[key][sub].dtype:
                return (
                    f"{name} has dtype {str(a.dtype).replace('torch.', '')}, expected "
                    f"{str(like[key][sub].dtype).replace('torch.', '')}"
                )
    extra = sorted(set(reply) - set(shapes))
    return f"unexpected entries {extra}" if extra else None


def _synchronize(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


class DnnTransport:
    def __init__(self, task, tamper=None):
        self.task, self.tamper = task, tamper

    def __call__(self, alg, down, cstate, sel, rng, round_):
        task = self.task
        task.round = round_
        start = time.perf_counter()
        replies, states, losses = alg.client_replies(task, down, cstate, sel)
        _synchronize(task.device)
        seconds = time.perf_counter() - start
        if self.tamper is not None:
            replies = [self.tamper(round_, int(i), r) for i, r in zip(sel, replies, strict=False)]
        up, kept, rejected = check_and_stack(alg, alg.reply_shapes(down["params"], task.blocks), replies, sel, round_)
        loss = float(np.average(losses, weights=task.sizes[sel]))
        return Delivery(
            up=up,
            cstate=states,
            sel=np.asarray(sel)[kept],
            rejected=rejected,
            extra={"train_loss": loss, "client_seconds": seconds},
        )


def check_and_stack(alg, shapes: dict, replies: list, clients, round_: int):
    """(stacked message of the replies that can be stacked or None, their positions, (client, reason) for
    the others -- logged)."""
    kept, rejected, like = [], [], None
    for k, (client, reply) in enumerate(zip(clients, replies, strict=False)):
        problem = structure_problem(reply, shapes, like)
        if problem is None:
            kept.append(k)
            like = like or reply
        else:
            rejected.append((int(client), problem))
            server_log.warning("round %d: client %d rejected: %s", round_, int(client), problem)
    return (stack_replies([replies[k] for k in kept]) if kept else None), kept, rejected
