"""LocalNewton (Gupta et al. 2021): K local Newton steps, simple mixing of the parameters.

Client: theta_i <- theta_i - lr P_i^{-1} grad f_i(theta_i), P_i = grad^2 f_i(theta_i) (paper eq. LocalNewton).
Server: theta <- mix_i(theta_i) (simple mixing).  FedPM differs only in the mixing and in
sending P_i (see fedpm.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..local import newton_steps
from ..mixing import simple_mix
from .base import Algorithm, RoundInfo, State, start_stack
from .grids import SECOND_ORDER_LR


@dataclass(frozen=True)
class LocalNewton(Algorithm):
    name: ClassVar[str] = "localnewton"
    label: ClassVar[str] = "LocalNewton"
    search_space: ClassVar[dict] = {"lr": SECOND_ORDER_LR}

    lr: float = 1.0
    local_steps: int = 1

    def client_update(self, problem, down, cstate, sel, rng):
        thetas, P = newton_steps(problem, start_stack(problem, down["theta"], len(sel)), sel, self.lr, self.local_steps)
        return self.message(thetas, P), cstate

    def message(self, thetas, P) -> dict:
        return {"theta": thetas}

    def mix(self, up, weights):
        return simple_mix(up["theta"], weights)

    def server_update(self, problem, state, up, info: RoundInfo) -> State:
        return State(
            theta=self.mix(up, info.weights), server=state.server, clients=state.clients, round=state.round + 1
        )
