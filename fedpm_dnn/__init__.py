"""fedpm_dnn: FedPM with FOOF preconditioners for federated DNN training (PyTorch).

The building blocks for your own model and data: ``FOOF`` (the local step, a ``torch.optim.Optimizer``),
``mix`` (the server's preconditioned mixing of state dicts) and ``federated`` (the in-process simulator)."""

from .federated import FederatedRun, federated
from .mixing import mix
from .optim import FOOF

__all__ = ["FOOF", "FederatedRun", "federated", "mix"]
