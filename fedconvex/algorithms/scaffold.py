"""SCAFFOLD (Karimireddy et al. 2020), option II control variates, global step 1.

Client i (control c_i, server control c): K steps theta_i <- theta_i - lr (grad f_i(theta_i) - c_i + c);
c_i+ = c_i - c + (theta - theta_i) / (K lr); sends Delta theta_i and Delta c_i = c_i+ - c_i.
Server: theta <- theta + global_lr mix(Delta theta_i); c <- c + (|S|/N) mean(Delta c_i).
Controls start at zero.  With K = 1 and full participation this is gradient descent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..local import gd_steps
from ..mixing import simple_mix
from .base import Algorithm, RoundInfo, State, start_stack
from .grids import FIRST_ORDER_LR


@dataclass(frozen=True)
class Scaffold(Algorithm):
    name: ClassVar[str] = "scaffold"
    label: ClassVar[str] = "SCAFFOLD"
    search_space: ClassVar[dict] = {"lr": FIRST_ORDER_LR}
    message_fields: ClassVar[dict] = {"dtheta": "update", "dc": "data"}
    server_tracked_state: ClassVar[tuple] = ("c",)  # the server's c is the mean of the c_i

    lr: float = 0.1
    local_steps: int = 1
    global_lr: float = 1.0  # fixed to 1.0 in the paper

    def init(self, problem, theta0) -> State:
        zeros = problem.xp.zeros((problem.n_clients, problem.d), dtype=theta0.dtype)
        return State(theta=theta0, server={"c": theta0 * 0}, clients={"c": zeros})

    def broadcast(self, state):
        return {"theta": state.theta, "c": state.server["c"]}

    def client_update(self, problem, down, cstate, sel, rng):
        theta, c = down["theta"], down["c"]
        ci = cstate["c"]
        thetas = gd_steps(
            problem,
            start_stack(problem, theta, len(sel)),
            sel,
            self.lr,
            self.local_steps,
            lambda g, _: g - ci + c[None, :],
        )
        ci_new = ci - c[None, :] + (theta[None, :] - thetas) / (self.local_steps * self.lr)
        return {"dtheta": thetas - theta[None, :], "dc": ci_new - ci}, {"c": ci_new}

    def server_update(self, problem, state, up, info: RoundInfo) -> State:
        theta = state.theta + self.global_lr * simple_mix(up["dtheta"], info.weights)
        frac = len(info.sel) / info.n_clients
        c = state.server["c"] + frac * up["dc"].mean(0)
        return State(theta=theta, server={"c": c}, clients=state.clients, round=state.round + 1)
