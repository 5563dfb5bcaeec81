"""Registry of the federated algorithms: name -> class (one line per method)."""

from ..registry import Registry
from .base import Algorithm, RoundInfo, State
from .centralized import GradientDescent, Newton
from .fedadam import FedAdam
from .fedavg import PSGD, FedAvg
from .fedavgm import FedAvgM
from .fednl import FedNL, FedNLLS, FedNLPP
from .fedns import FedNS
from .fedpm import FedPM
from .fedprox import FedProx
from .localnewton import LocalNewton
from .scaffold import Scaffold

REGISTRY = Registry(
    (
        FedAvg,
        PSGD,
        FedAvgM,
        FedProx,
        Scaffold,
        FedAdam,
        FedNL,
        FedNLLS,
        FedNLPP,
        FedNS,
        LocalNewton,
        FedPM,
        Newton,
        GradientDescent,
    )
)

# the eight methods of the paper's Test 1, in its legend order
PAPER_TEST1 = ("fedavg", "fedavgm", "scaffold", "fedadam", "fedns", "fednl", "localnewton", "fedpm")


hyperparameters = REGISTRY.hyperparameters
make_algorithm = REGISTRY.make
applicable = REGISTRY.applicable


__all__ = [
    "Algorithm",
    "PAPER_TEST1",
    "REGISTRY",
    "RoundInfo",
    "State",
    "applicable",
    "hyperparameters",
    "make_algorithm",
]
