"""Registry of the federated algorithms: name -> class (one line per method)."""
from .base import Algorithm, RoundInfo, State
from .centralized import GradientDescent, Newton
from .fedadam import FedAdam
from .fedavg import FedAvg
from .fedavgm import FedAvgM
from .fednl import FedNL, FedNLLS, FedNLPP
from .fedns import FedNS
from .fedpm import FedPM
from .fedprox import FedProx
from .localnewton import LocalNewton
from .scaffold import Scaffold

REGISTRY = {cls.name: cls for cls in (
    FedAvg, FedAvgM, FedProx, Scaffold, FedAdam, FedNL, FedNLLS, FedNLPP, FedNS, LocalNewton, FedPM, Newton, GradientDescent)}
REGISTRY["psgd"] = FedAvg  # FedAvg with one local step is PSGD (paper eq. PSGD)

# the eight methods of the paper's Test 1, in its legend order
PAPER_TEST1 = ("fedavg", "fedavgm", "scaffold", "fedadam", "fedns", "fednl", "localnewton", "fedpm")


def make_algorithm(name: str, **params) -> Algorithm:
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(sorted(REGISTRY))}") from None
    fields = cls.__dataclass_fields__
    return cls(**{k: v for k, v in params.items() if k in fields})


__all__ = ["Algorithm", "PAPER_TEST1", "REGISTRY", "RoundInfo", "State", "make_algorithm"]
