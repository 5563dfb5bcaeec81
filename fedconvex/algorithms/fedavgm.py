"""FedAvgM (Hsu et al. 2019): FedAvg with server momentum v <- beta v + Delta, theta <- theta - server_lr v.

``momentum_form="ema"`` (v <- beta v + (1 - beta) Delta) and ``bias_correction`` are the other forms of
``fedconvex.server_opt.Momentum``; the defaults (heavy-ball, no correction) are the ones Test 1 was run with.
"""

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
    momentum_form: str = Momentum.form
    bias_correction: bool = Momentum.bias_correction

    def __post_init__(self):
        self.server_optimizer()  # an unknown momentum_form fails here, at construction

    def server_optimizer(self):
        return Momentum(self.server_lr, self.momentum, self.momentum_form, self.bias_correction)
