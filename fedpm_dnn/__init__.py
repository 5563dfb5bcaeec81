"""fedpm_dnn: FedPM with FOOF preconditioners for federated DNN training (PyTorch).

The building blocks for your own model and data: ``FOOF`` (the local step, a ``torch.optim.Optimizer``),
``mix`` (the server's preconditioned mixing of state dicts) and ``federated`` (the in-process simulator)."""

import importlib
import sys
import types

from . import _deprecated_paths

__all__ = ["FOOF", "FederatedRun", "cost", "federated", "mix"]

# imported on first use (PEP 562): the package's light modules (the method names, the presets) stay importable
# without torch, so a command's --help does not wait for it
_LAZY = {
    "FOOF": ".foof.optimizer",
    "FederatedRun": ".federated",
    "cost": ".foof.run_cost",
    "federated": ".federated",
    "mix": ".mixing",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


class _Package(types.ModuleType):
    """Importing the submodule fedpm_dnn.federated binds the package's ``federated`` to that module; the name is
    the function (the submodule stays in sys.modules), as it was when the exports were imported eagerly."""

    def __setattr__(self, name, value):
        if name in _LAZY and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
_deprecated_paths.install()  # fedpm_dnn.client and the other module paths of before the subpackages, with a warning
