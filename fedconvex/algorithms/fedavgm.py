"""FedAvgM (Hsu et al. 2019): FedAvg with server momentum v <- beta v + Delta, theta <- theta - server_lr v."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..server_opt import Momentum
from .fedavg import FedAvg
from .grids import FIRST_ORDER_LR


@dataclass(frozen=True)
class FedAvgM(FedAvg):
    name: ClassVar[str] = "fedavgm"
    label: ClassVar[str] = "FedAvgM"
    # momentum grid from the paper's appendix ("tuned from {0.7, 0.9, 0.99}")
    search_space: ClassVar[dict] = {"lr": FIRST_ORDER_LR, "momentum": (0.7, 0.9, 0.99)}

    momentum: float = Momentum.beta
    server_lr: float = Momentum.lr

    def server_optimizer(self):
        return Momentum(self.server_lr, self.momentum)
