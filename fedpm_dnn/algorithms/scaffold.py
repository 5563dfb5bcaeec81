"""SCAFFOLD (Karimireddy et al. 2020), option II control variates, global step 1, on DNNs.

Client i (control c_i, server control c): local steps with g += c - c_i;
c_i+ = c_i - c + (theta - theta_i) / (steps lr); sends theta_i and Delta c_i = c_i+ - c_i.
Server: theta <- theta + mix(theta_i - theta); c <- c + (|S|/N) mean(Delta c_i).  Controls start at zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedconvex.mixing import simple_mix

from .base import DnnAlgorithm, State, mixing_weights


@dataclass(frozen=True)
class Scaffold(DnnAlgorithm):
    name: ClassVar[str] = "scaffold"
    label: ClassVar[str] = "SCAFFOLD"
    message_fields: ClassVar[dict] = {"params": "model", "dcontrol": "data"}
    client_tensors: ClassVar[tuple] = ("control",)
    server_tracked_state: ClassVar[tuple] = ("control",)  # the server's control is the mean of the clients'

    def init_server(self, params):
        return {"control": {k: torch.zeros_like(v) for k, v in params.items()}}

    def broadcast(self, state):
        return {"params": state.theta, "control": state.server["control"]}

    def prepare_client(self, cs, down):
        if "control" not in cs:
            cs["control"] = {k: torch.zeros_like(v) for k, v in down["params"].items()}
        return cs

    def grad_hook(self, down, client):
        c, ci = down["control"], client["control"]
        return lambda name, p, g: g.add_(c[name] - ci[name])

    def finish_reply(self, cs, local, steps, down, end_foof):
        params, c, ci = down["params"], down["control"], cs["control"]
        new_c = {k: ci[k] - c[k] + (params[k] - local[k]) / (steps * self.lr) for k in local}
        cs["control"] = new_c
        return {"params": local, "dcontrol": {k: new_c[k] - ci[k] for k in local}}

    def reply_shapes(self, params, blocks):
        shapes = super().reply_shapes(params, blocks)
        return {**shapes, "dcontrol": dict(shapes["params"])}

    def server_update(self, task, state: State, up, info) -> State:
        params = state.theta
        w = mixing_weights(info, next(iter(params.values())))
        theta = {k: p + simple_mix(up["params"][k] - p, w) for k, p in params.items()}
        frac = len(info.sel) / info.n_clients
        control = {k: c + frac * up["dcontrol"][k].mean(0) for k, c in state.server["control"].items()}
        return State(
            theta=theta, server={**state.server, "control": control}, clients=state.clients, round=state.round + 1
        )
