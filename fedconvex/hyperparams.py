"""Every hyper-parameter of every method (fedconvex's and fedpm_dnn's) checked in one place, when the method is
made (``Algorithm.__post_init__``: ``make_algorithm``, ``make_method``, a direct call, ``with_params``).

The type comes from the field's annotation (``float``, ``int``, ``str``, ``bool``, ``... | None``); the range from
``RANGES``, one entry per field name whose meaning is the same in every method that has it (a class can narrow
one in its ``ranges``).  A value from outside (a JSON ``--params``, a caller) fails here with one line naming the
method and the argument, not later in the middle of a round.  A bool is not a number, and only ``int`` / ``float``
(or a 0-d array holding one) count as numbers: a ``Fraction`` or a ``Decimal`` would reach the arrays as objects.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import NamedTuple

from .backend import python_scalar


class Range(NamedTuple):
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, v) -> bool:
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low:g}, {self.high:g}{right}"


POSITIVE = Range(0.0, low_open=True)
NONNEGATIVE = Range(0.0)
AT_LEAST_ONE = Range(1)
FRACTION = Range(0.0, 1.0, high_open=True)  # momentum-like coefficients: 1 would never forget

RANGES = {
    # step sizes and scales
    "lr": POSITIVE,
    "server_lr": POSITIVE,
    "global_lr": POSITIVE,
    "alpha": POSITIVE,  # FedNL's Hessian-learning rate
    "tau": POSITIVE,  # Adam's denominator floor
    "clip": POSITIVE,
    # coefficients
    "momentum": FRACTION,
    "beta1": FRACTION,
    "beta2": FRACTION,
    "mu": NONNEGATIVE,  # FedProx's proximal weight (FedNL narrows its projection floor to > 0)
    "weight_decay": NONNEGATIVE,
    "damping": NONNEGATIVE,
    "c": Range(0.0, 1.0, low_open=True, high_open=True),  # FedNL-LS's Armijo constant
    "gamma": Range(0.0, 0.5, low_open=True),  # FedNL-LS's backtracking factor
    # counts
    "local_steps": AT_LEAST_ONE,
    "local_epochs": AT_LEAST_ONE,
    "batch_size": AT_LEAST_ONE,
    "k": AT_LEAST_ONE,
    "rank": AT_LEAST_ONE,
    "sketch_size": AT_LEAST_ONE,
    "max_backtracks": AT_LEAST_ONE,  # 0 trials would never move the model
    "foof_samples": AT_LEAST_ONE,
    "refresh_every": AT_LEAST_ONE,
}


@functools.cache
def _specs(cls) -> tuple:
    """(field name, allowed kinds, optional, range) per hyper-parameter of ``cls``."""
    ranges = {**RANGES, **getattr(cls, "ranges", {})}
    out = []
    for f in dataclasses.fields(cls):
        kinds = {part.strip() for part in str(f.type).split("|")}
        optional = "None" in kinds
        kinds.discard("None")
        out.append((f.name, frozenset(kinds), optional, ranges.get(f.name)))
    return tuple(out)


FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: a DNN's numbers become float32 scalars in its updates
FLOAT32_TINY = 2.0**-149  # the smallest positive float32 (subnormal): anything smaller rounds to 0 there


def number_problem(value, allowed: Range | None = None, *, integer: bool = False, limit: float = math.inf):
    """None if ``value`` is a number of its kind in ``allowed``, else why not (words to follow the argument's
    name).  A bool is no number; ``integer``: an ``int``; otherwise an ``int`` or ``float``, finite and of
    magnitude at most ``limit`` (the largest value the arrays it reaches can hold: ``FLOAT32_MAX`` in the DNN).
    The one rule for numbers of every entry point: hyper-parameters, ``FOOF``'s arguments and saved state, the
    learning-rate schedule."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be an integer" if integer else "must be a number"
    if integer and not isinstance(value, int):
        return "must be an integer"
    if not integer and isinstance(value, int) and abs(value) > sys.float_info.max:  # no float holds it
        return "must be a finite number" + ("" if allowed is None else f" {allowed}")
    if not integer and not math.isfinite(value):
        return "must be a finite number" + ("" if allowed is None else f" {allowed}")
    if not integer and abs(value) > limit:
        return f"must be at most {limit:g} in magnitude (larger is no float32 number)"
    if not integer and limit == FLOAT32_MAX and 0 < abs(value) < FLOAT32_TINY:
        return f"must be 0 or at least {FLOAT32_TINY:.3g} in magnitude (smaller rounds to 0 in float32)"
    if allowed is not None and value not in allowed:
        return f"must be {'an integer' if integer else 'a finite number'} {allowed}"
    return None


def checked_number(name: str, value, allowed: Range | None = None, *, integer: bool = False, limit=math.inf):
    """``value`` (as ``float``, or ``int`` with ``integer``) when ``number_problem`` finds nothing, else a
    TypeError (not a number at all) or ValueError naming ``name``."""
    problem = number_problem(value, allowed, integer=integer, limit=limit)
    if problem:
        wrong_kind = isinstance(value, bool) or not isinstance(value, (int, float))
        raise (TypeError if wrong_kind else ValueError)(f"{name} {problem}, got {value!r}")
    return int(value) if integer else float(value) + 0.0


def _kind_problem(value, kinds, limit=math.inf) -> str | None:
    if "bool" in kinds:
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(value, bool):  # True is an int to Python, not a count or a step size to us
        return "must be an integer" if "int" in kinds else "must be a number" if "float" in kinds else None
    if "int" in kinds:
        return None if isinstance(value, int) else "must be an integer"
    if "float" in kinds:
        return number_problem(value, limit=limit)
    if "str" in kinds:
        return None if isinstance(value, str) else "must be a string"
    return None  # a field of another kind is its method's own business


def check_hyperparameters(alg) -> None:
    """Raise ValueError naming the method and the argument unless every field of ``alg`` (a frozen dataclass)
    has its annotated type and lies in its range; 0-d arrays are replaced by the Python number they hold."""
    method = getattr(alg, "name", "") or type(alg).__name__
    for key, kinds, optional, allowed in _specs(type(alg)):
        value = getattr(alg, key)
        if value is None and optional:
            continue
        plain = python_scalar(value)
        if plain is not value:
            object.__setattr__(alg, key, plain)  # frozen: the one place a field is normalised
            value = plain
        problem = _kind_problem(value, kinds, getattr(alg, "float_limit", math.inf))
        if problem is None and allowed is not None and value not in allowed:
            problem = f"must be {allowed}"
        if problem:
            raise ValueError(f"{method}: {key} {problem}, got {value!r}")
