"""Registry of the federated algorithms: name -> class (one line per method)."""
import dataclasses

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

REGISTRY = {cls.name: cls for cls in (
    FedAvg, PSGD, FedAvgM, FedProx, Scaffold, FedAdam, FedNL, FedNLLS, FedNLPP, FedNS, LocalNewton, FedPM, Newton,
    GradientDescent)}

# the eight methods of the paper's Test 1, in its legend order
PAPER_TEST1 = ("fedavg", "fedavgm", "scaffold", "fedadam", "fedns", "fednl", "localnewton", "fedpm")


def _cls(name: str):
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(sorted(REGISTRY))}") from None


def hyperparameters(name: str) -> tuple:
    """The names of method ``name``'s hyper-parameters (its dataclass fields; class constants excluded)."""
    return tuple(f.name for f in dataclasses.fields(_cls(name)))


def make_algorithm(name: str, **params) -> Algorithm:
    """The method ``name`` with hyper-parameters ``params``; a key the method does not have is an error
    (a misspelt hyper-parameter must not silently fall back to its default)."""
    unknown = sorted(set(params) - set(hyperparameters(name)))
    if unknown:
        raise ValueError(f"{name} has no hyper-parameter {', '.join(map(repr, unknown))}; it takes "
                         f"{', '.join(sorted(hyperparameters(name)))}")
    return _cls(name)(**params)


def applicable(name: str, shared: dict) -> dict:
    """The entries of ``shared`` -- settings a command line gives every method alike, such as the number
    of local steps -- that method ``name`` has; the others do not apply to it."""
    fields = set(hyperparameters(name)) - set(_cls(name).fixed)
    return {k: v for k, v in shared.items() if k in fields}


__all__ = ["Algorithm", "PAPER_TEST1", "REGISTRY", "RoundInfo", "State", "applicable", "hyperparameters", "make_algorithm"]
