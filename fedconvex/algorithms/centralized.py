"""Centralized references on the pooled objective f = sum_i w_i f_i (no communication).

Newton: theta <- theta - lr (grad^2 f)^{-1} grad f.   GD: theta <- theta - lr grad f.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Algorithm, RoundInfo, State
from .grids import FIRST_ORDER_LR, SECOND_ORDER_LR


@dataclass(frozen=True)
class Newton(Algorithm):
    name: ClassVar[str] = "newton"
    label: ClassVar[str] = "Newton (centralized)"
    search_space: ClassVar[dict] = {"lr": SECOND_ORDER_LR}

    lr: float = 1.0

    def broadcast(self, state):
        return {}

    def client_update(self, problem, down, cstate, sel, rng):
        return {}, cstate

    def step(self, problem, theta):
        H = problem.hessian(theta)
        return problem.xp.linalg.solve(H, problem.gradient(theta)[:, None])[:, 0]

    def server_update(self, problem, state, up, info: RoundInfo) -> State:
        return State(theta=state.theta - self.lr * self.step(problem, state.theta), round=state.round + 1)


@dataclass(frozen=True)
class GradientDescent(Newton):
    name: ClassVar[str] = "gd"
    label: ClassVar[str] = "GD (centralized)"
    search_space: ClassVar[dict] = {"lr": FIRST_ORDER_LR}

    lr: float = 1.0

    def step(self, problem, theta):
        return problem.gradient(theta)
