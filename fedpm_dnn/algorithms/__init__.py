"""Registry of the DNN methods (paper Test 2): name -> class, one line per method, in the paper's order.

Each method follows fedconvex's algorithm protocol (``fedpm_dnn.algorithms.base``); adding one is a
file here and a line below.
"""

from fedconvex.registry import Registry

from .base import DnnAlgorithm
from .fedadam import FedAdam
from .fedavg import FedAvg
from .fedavgm import FedAvgM
from .fedpm import FedPM
from .fedprox import FedProx
from .localnewton import LocalNewton
from .scaffold import Scaffold

REGISTRY = Registry((FedAvg, FedAvgM, FedProx, Scaffold, FedAdam, LocalNewton, FedPM))
METHODS = tuple(REGISTRY)


method_class = REGISTRY.cls
hyperparameters_of = REGISTRY.hyperparameters
make_method = REGISTRY.make
applicable = REGISTRY.applicable


__all__ = ["DnnAlgorithm", "METHODS", "REGISTRY", "applicable", "hyperparameters_of", "make_method", "method_class"]
