"""FedProx (Li et al. 2020): local objective f_i(theta_i) + mu/2 ||theta_i - theta||^2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .fedavg import FedAvg
from .grids import FIRST_ORDER_LR


@dataclass(frozen=True)
class FedProx(FedAvg):
    name: ClassVar[str] = "fedprox"
    label: ClassVar[str] = "FedProx"
    search_space: ClassVar[dict] = {"lr": FIRST_ORDER_LR, "mu": (0.01, 0.001, 0.0001)}

    mu: float = 0.01

    def local_grad_hook(self, down, cstate):
        anchor = down["theta"]
        return lambda g, thetas: g + self.mu * (thetas - anchor[None, :])
