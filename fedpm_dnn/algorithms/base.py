"""The DNN methods on fedconvex's algorithm protocol (``fedconvex.algorithms.base``).

A DNN method is a frozen dataclass of hyper-parameters: the shared local-training settings below
(every default defined here, once) plus its own fields.  ``State.theta`` is the model's parameters
(name -> tensor), ``State.server`` the method's server state, ``State.clients`` one dict per client
(FOOF matrices, SCAFFOLD's control, codec estimates).  The local training itself runs on the task's
engine (``fedpm_dnn.engine.training_task``: sequential or vectorized); a method only says how it differs:

  grad_hook      a correction added to every parameter's gradient (FedProx, SCAFFOLD)
  prepare_client  per-client state a first participation needs (SCAFFOLD's zero control)
  finish_reply   the reply of a client that trained to ``local`` (SCAFFOLD's control update,
                 FedPM's matrices); the engines call ``client_reply``, which casts its 'params' to the
                 wire dtype ``param_dtype`` (the server's ``receive`` upcasts them to the model's dtype
                 before screening and mixing; the byte count sees them as sent)
  server_update  the server step over the stacked replies

paper symbol / table column -> field: learning rate -> lr, grad. clip -> clip (None = no clipping),
weight decay -> weight_decay, local epochs -> local_epochs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from fedconvex.algorithms.base import Algorithm, RoundInfo, State  # noqa: F401
from fedconvex.hyperparams import FLOAT32_MAX

# --param-dtype: the wire dtype of a reply's model parameters (None: sent as trained)
PARAM_DTYPES = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DnnAlgorithm(Algorithm):
    """Shared local-training settings of every DNN method (paper Test 2 and appendix)."""

    message_fields: ClassVar[dict] = {"params": "model"}
    uses_foof: ClassVar[bool] = False  # the engines compute FOOF matrices for these methods
    client_tensors: ClassVar[tuple] = ()  # per-client tensor dicts that ``grad_hook`` reads (stacked by the engine)

    # every number of a DNN method meets float32 tensors (its updates, its clip, its decay): beyond float32's
    # range it would overflow there (fedconvex.hyperparams.number_problem)
    float_limit: ClassVar[float] = FLOAT32_MAX

    lr: float = 0.1
    clip: float | None = None
    # Where the clip acts.  'update' (default): on the preconditioned step eta (A+lam I)^{-1} G, over all
    # blocks together -- the only reading under which the appendix's choice of damping 1e-4 with clip 1.0
    # for LocalNewton is stable ((A+lam I)^{-1} amplifies near-dead ReLU inputs by up to 1/lam).
    # 'gradient': on the raw gradient before preconditioning.  Identical for first-order methods.
    clip_stage: str = "update"
    weight_decay: float = 1e-4
    # 'coupled' (default) adds wd * theta to the gradient before preconditioning and clipping, as
    # torch.optim.SGD(weight_decay=...) does; 'decoupled' shrinks theta by lr * wd after the step.
    weight_decay_mode: str = "coupled"
    local_epochs: int = 5
    batch_size: int = 64
    # The last batch of an epoch when the client's sample count is not a multiple of batch_size: 'keep' steps on
    # it (the loss is its mean, so a 1-image remainder takes a full-rate step on one image), 'drop' takes only
    # full batches, as the code bases the paper cites do (DataLoader(drop_last=True)); the epoch's shuffle
    # decides which samples wait for the next epoch.  A client smaller than one batch trains on all it has.
    last_batch: str = "keep"
    weighting: str = "uniform"  # mixing weights: uniform 1/N (paper) or 'samples'
    # dtype the reply's model parameters travel in (float16 / bfloat16 halve their bytes); float32 sends
    # them as trained.  The server upcasts them to the model's dtype before screening and mixing.
    param_dtype: str = "float32"

    def __post_init__(self):
        super().__post_init__()  # types and ranges (fedconvex.hyperparams); the choices below
        choices = {
            "weighting": ("uniform", "samples"),
            "clip_stage": ("gradient", "update"),
            "weight_decay_mode": ("coupled", "decoupled"),
            "param_dtype": tuple(PARAM_DTYPES),
            "last_batch": ("keep", "drop"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be {' or '.join(allowed)}, got {getattr(self, name)!r}")

    # --- protocol ------------------------------------------------------------------------------------------
    def init(self, task, theta0) -> State:
        params = {k: v.detach().clone() for k, v in theta0.items()}
        return State(theta=params, server=self.init_server(params), clients=[{} for _ in range(task.n_clients)])

    def init_server(self, params: dict) -> dict:
        return {}

    def broadcast(self, state: State) -> dict:
        return {"params": state.theta}

    def client_replies(self, task, down: dict, cstate: list, sel):
        """Per participant: (replies, new client states, mean training losses); the inputs are not changed."""
        states = [self.prepare_client(_copy_state(cs), down) for cs in cstate]
        out = task.train(self, down, states, sel)
        return [r for r, _ in out], states, [loss for _, loss in out]

    def client_update(self, task, down: dict, cstate: list, sel, rng):
        replies, states, _ = self.client_replies(task, down, cstate, sel)
        return stack_replies(replies), states

    # --- hooks ---------------------------------------------------------------------------------------------
    def prepare_client(self, cs: dict, down: dict) -> dict:
        return cs

    def grad_hook(self, down: dict, client: dict):
        """None, or ``hook(name, p, g)`` adding this method's correction to ``g`` in place (``p`` and ``g``
        are one client's parameter and gradient, or the engine's stacks of them)."""
        return None

    def finish_reply(self, cs: dict, local: dict, steps: int, down: dict, end_foof) -> dict:
        return {"params": local}

    def client_reply(self, cs: dict, local: dict, steps: int, down: dict, end_foof) -> dict:
        """The reply as sent: ``finish_reply``'s, its 'params' cast to ``param_dtype`` (the client's own
        state and the rest of the reply are computed from the exact parameters)."""
        reply = self.finish_reply(cs, local, steps, down, end_foof)
        dtype = PARAM_DTYPES[self.param_dtype]
        if dtype is not None and isinstance(reply, dict) and isinstance(reply.get("params"), dict):
            reply = {
                **reply,
                "params": {
                    k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                    for k, v in reply["params"].items()
                },
            }
        return reply

    def receive(self, task, state: State, up: dict, info):
        """Server side, before screening: the replies' parameters upcast to the model's dtype (no-op for
        ``param_dtype`` float32, where they arrive in it)."""
        params = up.get("params")
        if PARAM_DTYPES[self.param_dtype] is None or not isinstance(params, dict):
            return up, state
        theta = state.theta
        out = {
            k: v.to(theta[k].dtype) if k in theta and torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in params.items()
        }
        return {**up, "params": out}, state

    def reply_shapes(self, params: dict, blocks: dict) -> dict:
        """What a usable reply looks like (checked before the replies are stacked)."""
        return {"params": {k: tuple(v.shape) for k, v in params.items()}}

    def client_weights(self, sizes: np.ndarray, sel) -> np.ndarray:
        """Un-normalised mixing weights of the clients ``sel``."""
        return sizes[sel] if self.weighting == "samples" else np.ones(len(sel))


def _copy_state(cs: dict) -> dict:
    """A client state the engines may update without touching the caller's (two levels: the engines
    replace tensors and fill per-block dicts, they never write into a tensor)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in cs.items()}


def mixing_weights(info: RoundInfo, like: torch.Tensor) -> torch.Tensor:
    """The round's normalised weights as float32 on the parameters' device."""
    return torch.as_tensor(np.asarray(info.weights), dtype=torch.float32, device=like.device)


def stack_replies(replies: list) -> dict:
    """One stacked message from per-client replies: field -> {name: (K, ...)}; a field whose entries are
    themselves dicts (a codec's payloads) stays a per-client list, decoded by the method's ``receive``."""
    up = {}
    for field, value in replies[0].items():
        if all(torch.is_tensor(v) for v in value.values()):
            up[field] = {name: torch.stack([r[field][name] for r in replies]) for name in value}
        else:
            up[field] = {name: [r[field][name] for r in replies] for name in value}
    return up


def flatten(params: dict) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params.values()])


def flatten_stack(stack: dict, names) -> torch.Tensor:
    """(K, D): each client's parameters flattened in ``names`` order."""
    return torch.cat([stack[n].reshape(stack[n].shape[0], -1) for n in names], 1)


def unflatten(vec: torch.Tensor, like: dict) -> dict:
    out, k = {}, 0
    for name, p in like.items():
        out[name] = vec[k : k + p.numel()].view_as(p).clone()
        k += p.numel()
    return out
