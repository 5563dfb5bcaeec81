"""The DNN front-end's transport for ``fedconvex.driver``: runs a round's participants on the task's
engine and delivers their replies as one stacked message.

Per-client work that must happen before the replies can be stacked lives here: fault injection for
tests (``tamper(round, client, reply) -> reply``) and the structural check.  Everything else -- NaN/Inf, PSD
matrices, the magnitude guard, divergence -- is the driver's screening, from the method's ``message_fields``.  The
history row gets the round's mean training loss (weighted by the participants' sample counts) and the clients'
compute seconds.

The structural check is one rule for every path that stacks DNN replies, in process and on Flower (the strategy
``fedpm_flower.strategy.FedPM`` and the CNN app's transport ``fedpm_flower.cnn.CnnTransport``): a reply is checked
against the server's own *template*, never against another reply.  A template says what a usable reply looks like,
entirely from what the server itself knows: field -> {entry name: (shape, dtype)} (``None`` for a codec's
payloads, which their decoding checks).  A reply must name exactly the template's fields and entries, each a real
floating-point tensor of the template's shape and dtype; one that does not is rejected, naming the client.  Taking
the first reply of a round as the reference instead would let one client -- sending float64 arrays, or the matrices
of one block only -- get every honest client rejected and the model set to its own values.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from fedconvex.driver import Delivery
from fedconvex.screening import dtype_problem
from fedconvex.screening import log as server_log

from ..algorithms.base import PARAM_DTYPES, stack_replies


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def reply_problem(reply, template: dict) -> str | None:
    """None if ``reply`` (field -> {name: tensor}) is what ``template`` (field -> {name: (shape, dtype)} or None)
    describes, else the first reason it is not."""
    if not isinstance(reply, dict):
        return f"reply is a {type(reply).__name__}, not a mapping"
    extra = sorted(map(str, set(reply) - set(template)))
    if extra:
        return f"unexpected entries {extra}"
    for field, spec in template.items():
        if field not in reply:
            return f"missing {field!r}"
        value = reply[field]
        if not isinstance(value, dict):
            return f"{field} is a {type(value).__name__}, not a mapping"
        if spec is None:
            continue
        if set(value) != set(spec):
            return f"{field} has entries {sorted(map(str, value))}, expected {sorted(map(str, spec))}"
        for name, (shape, dtype) in spec.items():
            a, where = value[name], f"{field}[{name}]"
            bad = dtype_problem(a)
            if bad:
                return f"{where} {bad}"
            if not torch.is_tensor(a):
                return f"{where} is a {type(a).__name__}, not a tensor"
            if tuple(a.shape) != tuple(shape):
                return f"{where} has shape {tuple(a.shape)}, expected {tuple(shape)}"
            if a.dtype != dtype:
                return f"{where} has dtype {_name(a.dtype)}, expected {_name(dtype)}"
    return None


def reply_template(alg, params: dict, blocks: dict) -> dict:
    """The template of a fedpm_dnn method's reply: its ``reply_shapes`` for the broadcast ``params`` and the
    model's FOOF ``blocks``, in the dtypes the method sends -- the parameters in ``param_dtype`` (float32: as
    trained, the model's dtype), FOOF matrices in ``precond_dtype``, every other entry in its parameter's dtype."""
    wire = PARAM_DTYPES.get(getattr(alg, "param_dtype", "float32"))
    precond = torch.float16 if getattr(alg, "precond_dtype", "float32") == "float16" else torch.float32
    out = {}
    for field, shapes in alg.reply_shapes(params, blocks).items():
        if shapes is None:
            out[field] = None
            continue
        spec = {}
        for name, shape in shapes.items():
            if field == "foof":
                dtype = precond
            elif field == "params" and wire is not None and params[name].is_floating_point():
                dtype = wire
            else:
                dtype = params[name].dtype
            spec[name] = (tuple(shape), dtype)
        out[field] = spec
    return out


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
        template = reply_template(alg, down["params"], task.blocks)  # the server's own, never another reply
        up, kept, rejected = check_and_stack(template, replies, sel, round_)
        loss = float(np.average(losses, weights=task.sizes[sel]))
        return Delivery(
            up=up,
            cstate=states,
            sel=np.asarray(sel)[kept],
            rejected=rejected,
            extra={"train_loss": loss, "client_seconds": seconds},
        )


def check_and_stack(template: dict, replies: list, clients, round_: int):
    """(stacked message of the replies ``template`` accepts or None, their positions, (client, reason) for the
    others -- logged)."""
    kept, rejected = [], []
    for k, (client, reply) in enumerate(zip(clients, replies, strict=True)):
        problem = reply_problem(reply, template)
        if problem is None:
            kept.append(k)
        else:
            rejected.append((int(client), problem))
            server_log.warning("round %d: client %d rejected: %s", round_, int(client), problem)
    return (stack_replies([replies[k] for k in kept]) if kept else None), kept, rejected
