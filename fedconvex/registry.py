"""A registry of methods (name -> algorithm class), shared by fedconvex and fedpm_dnn: lookup with a clear
error, construction that refuses a hyper-parameter the method does not have, and the filter that passes a
command line's shared settings only to the methods that take them."""

from __future__ import annotations

import dataclasses
import math
import numbers

from .backend import python_scalar


class Registry(dict):
    """name -> class, in registration order (the order figures and tables use)."""

    def __init__(self, classes):
        super().__init__((cls.name, cls) for cls in classes)

    def cls(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(self)}") from None

    def hyperparameters(self, name: str) -> tuple:
        """The names of the method's hyper-parameters (its dataclass fields; class constants excluded)."""
        return tuple(f.name for f in dataclasses.fields(self.cls(name)))

    def make(self, name: str, **params):
        """The method with hyper-parameters ``params``; a key the method does not have is an error (a
        misspelt hyper-parameter must not silently fall back to its default)."""
        unknown = sorted(set(params) - set(self.hyperparameters(name)))
        if unknown:
            raise ValueError(
                f"{name} has no hyper-parameter {', '.join(map(repr, unknown))}; it takes "
                f"{', '.join(sorted(self.hyperparameters(name)))}"
            )
        defaults = {f.name: f.default for f in dataclasses.fields(self.cls(name))}
        params = {key: check_value(name, key, value, defaults[key]) for key, value in params.items()}
        return self.cls(name)(**params)

    def applicable(self, name: str, shared: dict) -> dict:
        """The entries of ``shared`` -- settings given to every method alike, such as a command line's number
        of local steps -- that the method takes; fixed ones (PSGD's single step) do not apply."""
        fields = set(self.hyperparameters(name)) - set(getattr(self.cls(name), "fixed", {}))
        return {k: v for k, v in shared.items() if k in fields}


# hyper-parameters every method that has them reads the same way: a step size, a count of local steps
_POSITIVE = {"lr"}
_AT_LEAST_ONE = {"local_steps", "local_epochs", "batch_size"}


def check_value(method: str, key: str, value, default):
    """A hyper-parameter of the kind its default is (a finite number, an integer, a string), and in range where
    the meaning is the same in every method (``lr`` > 0; counts of steps >= 1): a value from outside (a JSON
    ``--params``, a caller) fails here with one line naming it, not later in the middle of a round.  Fields
    without a typed default (None) are the method's own business."""
    if isinstance(default, numbers.Number) and not isinstance(value, numbers.Number):
        value = python_scalar(value)  # np.array(0.5), torch.tensor(0.5): the number they hold
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{method}: {key} must be true or false, got {value!r}")
    elif isinstance(default, numbers.Integral):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{method}: {key} must be an integer, got {value!r}")
    elif isinstance(default, numbers.Real):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{method}: {key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{method}: {key} must be a finite number, got {value!r}")
    elif isinstance(default, str) and not isinstance(value, str):
        raise ValueError(f"{method}: {key} must be a string, got {value!r}")
    if key in _POSITIVE and isinstance(value, numbers.Real) and not value > 0:
        raise ValueError(f"{method}: {key} must be > 0, got {value!r}")
    if key in _AT_LEAST_ONE and isinstance(value, numbers.Integral) and value < 1:
        raise ValueError(f"{method}: {key} must be >= 1, got {value!r}")
    return value
