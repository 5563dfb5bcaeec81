"""Replies checked against the server's own template, never against another reply.

A template says what a usable reply looks like, entirely from what the server itself knows: field ->
{entry name: (shape, dtype)} (``None`` for a codec's payloads, which their decoding checks).  A reply must name
exactly the template's fields and entries, each a real floating-point tensor of the template's shape and dtype.
Taking the first reply of a round as the reference instead would let one node -- sending float64 arrays, or the
matrices of one block only -- get every honest node rejected and the model set to its own values.

Every Flower path that stacks DNN replies uses ``reply_problem``: the strategy ``fedpm_flower.strategy.FedPM``
(template: the arrays it sent, and the FOOF blocks of that model) and the CNN app's transport
(``fedpm_flower.cnn.CnnTransport``: the broadcast, the method's reply shapes and its wire dtypes).  Content
(NaN/Inf, PSD matrices, the magnitude guard) is the round driver's screening, after the replies are stacked.
A reply's sample count is checked by ``num_examples_problem``.
"""

from __future__ import annotations

import math

import torch

from fedconvex.screening import dtype_problem
from fedconvex.screening import log as server_log
from fedpm_dnn.algorithms.base import PARAM_DTYPES, stack_replies

# the largest sample count a reply may claim: an integer float64 holds exactly, and thousands of them still sum
# to a finite number (an unbounded claim would make the normalised weights inf / inf)
MAX_EXAMPLES = float(2**53)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def entries_of(arrays: dict, dtype=None) -> dict:
    """name -> (shape, dtype) of ``arrays`` (tensors), with ``dtype`` in place of theirs when given."""
    return {k: (tuple(v.shape), dtype or v.dtype) for k, v in arrays.items()}


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


def num_examples_problem(value, positive: bool) -> str | None:
    """None if ``value`` is a usable sample count: a finite number in 0..2**53 (above 0 when it weights the
    mixing, ``positive``), else why not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {value!r}, not a number"
    if not math.isfinite(value) or not 0 <= value <= MAX_EXAMPLES:
        return f"is {value!r}, not a finite number in 0..2**53"
    if positive and value == 0:
        return "is 0: the reply would have no weight"
    return None


def dnn_template(alg, params: dict, blocks: dict) -> dict:
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
