"""FedAvg / PSGD (McMahan et al. 2017; Collins et al. 2022), written as FedOpt (Reddi et al. 2021).

Client: K local gradient steps theta_i <- theta_i - lr grad f_i(theta_i), from theta.
Server: Delta = theta - mix_i(theta_i); theta <- ServerOpt(theta, Delta).
With K = 1 and SGD(lr=1) this is PSGD: theta <- theta - lr * mean_i grad f_i(theta).

paper symbol -> field:  eta -> lr,  K -> local_steps.  Subclasses change only the server
optimizer (FedAvgM, FedAdam) or the local gradient (FedProx).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..local import gd_steps
from ..mixing import simple_mix
from ..server_opt import SGD
from .base import Algorithm, RoundInfo, State, start_stack
from .grids import FIRST_ORDER_LR


@dataclass(frozen=True)
class FedAvg(Algorithm):
    name: ClassVar[str] = "fedavg"
    label: ClassVar[str] = "FedAvg/PSGD"
    search_space: ClassVar[dict] = {"lr": FIRST_ORDER_LR}

    lr: float = 0.1
    local_steps: int = 1

    def server_optimizer(self):
        return SGD(1.0)

    def local_grad_hook(self, down, cstate):
        return None

    def init(self, problem, theta0) -> State:
        return State(theta=theta0, server=self.server_optimizer().init(theta0))

    def client_update(self, problem, down, cstate, sel, rng):
        thetas = start_stack(problem, down["theta"], len(sel))
        thetas = gd_steps(problem, thetas, sel, self.lr, self.local_steps, self.local_grad_hook(down, cstate))
        return {"theta": thetas}, cstate

    def server_update(self, problem, state, up, info: RoundInfo) -> State:
        delta = state.theta - simple_mix(up["theta"], info.weights)
        theta, opt = self.server_optimizer().step(state.theta, delta, state.server, state.round + 1)
        return State(theta=theta, server=opt, clients=state.clients, round=state.round + 1)


@dataclass(frozen=True)
class PSGD(FedAvg):
    """PSGD (paper eq. PSGD): FedAvg with exactly one local step, theta <- theta - lr mean_i grad f_i(theta)."""

    name: ClassVar[str] = "psgd"
    label: ClassVar[str] = "PSGD"
    fixed: ClassVar[dict] = {"local_steps": 1}

    local_steps: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.local_steps != 1:
            raise ValueError(
                f"psgd takes exactly one local step (got local_steps={self.local_steps}); use fedavg for more"
            )
