"""Registry of the DNN methods (paper Test 2): name -> class, one line per method, in the paper's order.

Each method follows fedconvex's algorithm protocol (``fedpm_dnn.algorithms.base``); adding one is a
file here and a line below.
"""
import dataclasses

from .base import DnnAlgorithm
from .fedadam import FedAdam
from .fedavg import FedAvg
from .fedavgm import FedAvgM
from .fedpm import FedPM
from .fedprox import FedProx
from .localnewton import LocalNewton
from .scaffold import Scaffold

REGISTRY = {cls.name: cls for cls in (FedAvg, FedAvgM, FedProx, Scaffold, FedAdam, LocalNewton, FedPM)}
METHODS = tuple(REGISTRY)


def method_class(name: str):
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def hyperparameters_of(name: str) -> tuple:
    """The method's hyper-parameters (its dataclass fields; class constants such as ``label`` excluded)."""
    return tuple(f.name for f in dataclasses.fields(method_class(name)))


def make_method(name: str, **hp) -> DnnAlgorithm:
    """The method ``name`` with hyper-parameters ``hp``; a key the method does not have is an error
    (a misspelt or inapplicable hyper-parameter must not silently fall back to its default)."""
    unknown = sorted(set(hp) - set(hyperparameters_of(name)))
    if unknown:
        raise ValueError(f"{name} has no hyper-parameter {', '.join(map(repr, unknown))}; it takes "
                         f"{', '.join(sorted(hyperparameters_of(name)))}")
    return method_class(name)(**hp)


def applicable(name: str, shared: dict) -> dict:
    """The entries of ``shared`` -- settings given to every method alike (a test's common settings, a
    sweep's grid) -- that method ``name`` takes; the others do not apply to it."""
    fields = hyperparameters_of(name)
    return {k: v for k, v in shared.items() if k in fields}


__all__ = ["DnnAlgorithm", "METHODS", "REGISTRY", "applicable", "hyperparameters_of", "make_method", "method_class"]
