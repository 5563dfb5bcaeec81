"""A registry of methods (name -> algorithm class), shared by fedconvex and fedpm_dnn: lookup with a clear
error, construction that refuses a hyper-parameter the method does not have, and the filter that passes a
command line's shared settings only to the methods that take them."""

from __future__ import annotations

import dataclasses


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
        return self.cls(name)(**params)  # types and ranges: fedconvex.hyperparams, when the method is made

    def foreign(self, names, given) -> list:
        """The keys of ``given`` (hyper-parameters a caller set explicitly) that none of the methods ``names``
        has: a setting that would apply to nothing, which a command line refuses rather than ignores."""
        taken = set().union(*(self.hyperparameters(n) for n in names))
        return [k for k in given if k not in taken]

    def applicable(self, name: str, shared: dict) -> dict:
        """The entries of ``shared`` -- settings given to every method alike, such as a command line's number
        of local steps -- that the method takes; fixed ones (PSGD's single step) do not apply."""
        fields = set(self.hyperparameters(name)) - set(getattr(self.cls(name), "fixed", {}))
        return {k: v for k, v in shared.items() if k in fields}
