"""FedAvgM (Hsu et al. 2019): FedAvg with server momentum, ``fedconvex.server_opt.Momentum``.

heavy-ball: v <- beta v + Delta; ema: v <- beta v + (1 - beta) Delta; then theta <- theta - server_lr v
(v / (1 - beta^t) with ``bias_correction``).  The default, ema with bias correction, is the form under which
the appendix's tuned momenta are sensible choices of its grid {0.7, 0.9, 0.99} (measured: docs/presets.md).
"""

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
    # ema with bias correction, not fedconvex's heavy-ball: under it the appendix's tuned momenta (0.99 with 1 local
    # epoch, 0.9 / 0.7 elsewhere) are sensible choices of the grid {0.7, 0.9, 0.99}; heavy-ball's 1/(1 - beta)
    # step makes 0.99 the worst and blows the loss up (measured on CIFAR-10: docs/presets.md)
    momentum_form: str = "ema"
    bias_correction: bool = True

    def __post_init__(self):
        super().__post_init__()
        self.server_optimizer()  # an unknown momentum_form fails here, at construction

    def server_optimizer(self):
        return Momentum(self.server_lr, self.momentum, self.momentum_form, self.bias_correction)
