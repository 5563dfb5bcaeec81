"""FedProx (Li et al. 2020): local objective f_i(theta_i) + mu/2 ||theta_i - theta||^2, i.e. the
gradient hook g += mu (theta_i - theta); the server step is FedAvg's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .fedavg import FedAvg


@dataclass(frozen=True)
class FedProx(FedAvg):
    name: ClassVar[str] = "fedprox"
    label: ClassVar[str] = "FedProx"

    mu: float = 0.01

    def grad_hook(self, down, client):
        if not self.mu:
            return None
        anchor = down["params"]
        return lambda name, p, g: g.add_(p - anchor[name], alpha=self.mu)
