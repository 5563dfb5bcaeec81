"""FedAvgM (Hsu et al. 2019): FedAvg with server momentum v <- beta v + Delta, theta <- theta - server_lr v."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedconvex.server_opt import Momentum

from .fedavg import FedAvg


@dataclass(frozen=True)
class FedAvgM(FedAvg):
    name: ClassVar[str] = "fedavgm"
    label: ClassVar[str] = "FedAvgM"

    momentum: float = Momentum.beta  # the appendix tunes it in {0.7, 0.9, 0.99}
    server_lr: float = Momentum.lr

    def server_optimizer(self):
        return Momentum(self.server_lr, self.momentum)
