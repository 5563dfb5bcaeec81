"""FedAdam (Reddi et al. 2021): FedAvg whose server step is Adam on the pseudo-gradient.

beta1 = 0.9, beta2 = 0.99, tau = 1e-3 fixed and server_lr in {0.05, 0.03, 0.01} (paper appendix).
``bias_correction`` (Adam's, on by default as in Test 1's runs) can be turned off, as in Reddi et al.'s
Algorithm 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..server_opt import Adam
from .fedavg import FedAvg
from .grids import FIRST_ORDER_LR


@dataclass(frozen=True)
class FedAdam(FedAvg):
    name: ClassVar[str] = "fedadam"
    label: ClassVar[str] = "FedAdam"
    search_space: ClassVar[dict] = {"lr": FIRST_ORDER_LR, "server_lr": (0.05, 0.03, 0.01)}

    # the constants are server_opt.Adam's (defined once there; the DNN FedAdam reads the same)
    server_lr: float = Adam.lr
    beta1: float = Adam.b1
    beta2: float = Adam.b2
    tau: float = Adam.tau
    bias_correction: bool = Adam.bias_correction

    def server_optimizer(self):
        return Adam(self.server_lr, self.beta1, self.beta2, self.tau, self.bias_correction)
