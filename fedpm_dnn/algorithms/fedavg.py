"""FedAvg (McMahan et al. 2017) on DNNs, written as FedOpt (Reddi et al. 2021).

Client: ``local_epochs`` epochs of minibatch SGD from the broadcast model (the engine's local training).
Server: Delta = theta - mix_i(theta_i) over the flattened parameters; theta <- ServerOpt(theta, Delta)
with a server optimizer of ``fedconvex.server_opt`` -- SGD(1) here; FedAvgM and FedAdam change only
``server_optimizer``, FedProx only the local gradient (``grad_hook``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedconvex.mixing import simple_mix
from fedconvex.server_opt import SGD

from .base import DnnAlgorithm, State, flatten, flatten_stack, mixing_weights, unflatten


@dataclass(frozen=True)
class FedAvg(DnnAlgorithm):
    name: ClassVar[str] = "fedavg"
    label: ClassVar[str] = "FedAvg"

    def server_optimizer(self):
        return SGD(1.0)

    def init_server(self, params: dict) -> dict:
        return {"opt": self.server_optimizer().init(flatten(params))}

    def server_update(self, task, state: State, up: dict, info) -> State:
        params = state.theta
        theta = flatten(params)
        mixed = simple_mix(flatten_stack(up["params"], params), mixing_weights(info, theta))
        t = state.round + 1
        theta, opt = self.server_optimizer().step(theta, theta - mixed, state.server["opt"], t)
        return State(
            theta=unflatten(theta, params), server={**state.server, "opt": opt}, clients=state.clients, round=t
        )
