"""Hostile flags, hyper-parameters, mixing inputs and client shapes: each case failed before its fix.

A bad value is refused where it enters (the method's constructor, the command line, the library call) with one
line naming the argument; a legal but unusual input (a client without features) gives the same result on every
path.  The command-line cases follow ``test_hostile_inputs``: exit code 2, one stderr line, nothing written."""

import math
from fractions import Fraction

import numpy as np
import pytest

from fedconvex.algorithms import make_algorithm


# ------------------------------------------------------------------ hyper-parameters, one checker for all
@pytest.mark.parametrize(
    "method,params,message",
    [
        ("fedadam", {"server_lr": -0.1}, "fedadam: server_lr must be > 0, got -0.1"),
        ("fedavgm", {"server_lr": 0.0}, "fedavgm: server_lr must be > 0, got 0.0"),
        ("fedavgm", {"momentum": 1.0}, "fedavgm: momentum must be in [0, 1), got 1.0"),
        ("fedavgm", {"momentum": -0.1}, "fedavgm: momentum must be in [0, 1), got -0.1"),
        ("fedadam", {"beta2": 1.5}, "fedadam: beta2 must be in [0, 1), got 1.5"),
        ("fedprox", {"mu": math.nan}, "fedprox: mu must be a finite number, got nan"),
        ("fedprox", {"mu": -1.0}, "fedprox: mu must be >= 0, got -1.0"),
        ("fednl", {"mu": 0.0}, "fednl: mu must be > 0, got 0.0"),
        ("fednl-ls", {"max_backtracks": -1}, "fednl-ls: max_backtracks must be >= 1, got -1"),
        ("fednl-ls", {"c": 1.0}, "fednl-ls: c must be in (0, 1), got 1.0"),
        ("fednl", {"compressor": "topk", "k": "5"}, "fednl: k must be an integer, got '5'"),
        ("fednl", {"compressor": "topk", "k": 5.0}, "fednl: k must be an integer, got 5.0"),
        ("fednl", {"compressor": "topk", "k": True}, "fednl: k must be an integer, got True"),
        ("fednl", {"compressor": "rankr", "rank": 0}, "fednl: rank must be >= 1, got 0"),
        ("fedns", {"sketch_size": 0}, "fedns: sketch_size must be >= 1, got 0"),
        ("fedpm", {"lr": Fraction(1, 2)}, "fedpm: lr must be a number, got Fraction(1, 2)"),
        ("fedpm", {"lr": True}, "fedpm: lr must be a number, got True"),
        ("scaffold", {"global_lr": -1.0}, "scaffold: global_lr must be > 0, got -1.0"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_make_algorithm_checks_every_hyper_parameter(method, params, message):
    with pytest.raises(ValueError) as exc:
        make_algorithm(method, **params)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    "method,params,message",
    [
        ("fedpm", {"refresh_every": 0}, "fedpm: refresh_every must be >= 1, got 0"),
        ("localnewton", {"foof_samples": 0}, "localnewton: foof_samples must be >= 1, got 0"),
        ("fedavgm", {"momentum": 1.0}, "fedavgm: momentum must be in [0, 1), got 1.0"),
        ("fedadam", {"server_lr": -1.0}, "fedadam: server_lr must be > 0, got -1.0"),
        ("fedavg", {"clip": 0.0}, "fedavg: clip must be > 0, got 0.0"),
        ("fedavg", {"weight_decay": -1e-4}, "fedavg: weight_decay must be >= 0, got -0.0001"),
        ("fedpm", {"damping": math.inf}, "fedpm: damping must be a finite number, got inf"),
        ("fedavg", {"batch_size": 64.0}, "fedavg: batch_size must be an integer, got 64.0"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_make_method_checks_every_hyper_parameter(method, params, message):
    from fedpm_dnn.algorithms import make_method

    with pytest.raises(ValueError) as exc:
        make_method(method, **params)
    assert str(exc.value) == message


def test_the_check_holds_for_direct_construction_and_with_params():
    """Not only make_algorithm: the class itself and ``with_params`` (dataclasses.replace) check too."""
    from fedconvex.algorithms import FedAvgM, FedNL

    with pytest.raises(ValueError, match="fedavgm: server_lr must be > 0"):
        FedAvgM(server_lr=-1.0)
    with pytest.raises(ValueError, match="fednl: k must be an integer"):
        FedNL(compressor="topk", k="3")
    with pytest.raises(ValueError, match="fedavgm: momentum must be in"):
        FedAvgM().with_params(momentum=2.0)


def test_zero_d_arrays_are_the_numbers_they_hold_and_every_default_passes():
    from fedconvex.algorithms import REGISTRY
    from fedpm_dnn.algorithms import REGISTRY as DNN

    alg = make_algorithm("fednl", compressor="topk", k=np.int64(3), lr=np.float64(0.5))
    assert type(alg.k) is int and type(alg.lr) is float and (alg.k, alg.lr) == (3, 0.5)
    for registry in (REGISTRY, DNN):
        for name in registry:
            registry.make(name)  # every registered default lies in its range
