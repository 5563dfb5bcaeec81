"""The problem's non-NumPy code path (what --backend cupy runs), exercised on CPU.

No GPU is needed: a stand-in module that forwards to NumPy (and ``cupyx.scipy.sparse`` to
SciPy) is passed as the backend, so every ``xp is np`` fast path is skipped and the generic
branches run.  Results must equal the NumPy backend's.
"""

import sys
import types

import numpy as np
import pytest
import scipy.sparse
from naive import random_data

from fedconvex.algorithms import make_algorithm
from fedconvex.problem import FederatedLogReg
from fedconvex.reference import solve_optimum
from fedconvex.run import run


class _Forward(types.ModuleType):
    def __getattr__(self, name):
        return getattr(np, name)


@pytest.fixture
def generic_xp(monkeypatch):
    cupyx = types.ModuleType("cupyx")
    cupyx.scipy = types.ModuleType("cupyx.scipy")
    cupyx.scipy.sparse = scipy.sparse
    for name, mod in (("cupyx", cupyx), ("cupyx.scipy", cupyx.scipy), ("cupyx.scipy.sparse", scipy.sparse)):
        monkeypatch.setitem(sys.modules, name, mod)
    return _Forward("generic_numpy")


@pytest.mark.parametrize(
    "name,kw",
    [
        ("fedpm", {}),
        ("localnewton", dict(local_steps=2)),
        ("fednl", {}),
        ("fedns", dict(sketch_size=4)),
        ("scaffold", dict(lr=0.5)),
        ("fednl", dict(compressor="natural", alpha=8 / 9)),
        ("fednl", dict(compressor="toplek", k=6)),
        ("fednl", dict(compressor="randseqk", k=6, alpha=6 / 21)),
        ("fednl", dict(compressor="rankr", rank=1)),
        ("fednl-ls", {}),
        ("fednl-pp", {}),
        ("fedns", dict(sketch="srht", sketch_size=2)),
        ("fedns", dict(sketch="countsketch", sketch_size=2)),
    ],
)
def test_generic_backend_matches_numpy(generic_xp, rng, name, kw):
    X, y, parts = random_data(rng, 5, 6)
    fast = FederatedLogReg(X, y, parts, lam=1e-2)
    generic = FederatedLogReg(X, y, parts, lam=1e-2, xp=generic_xp)
    ts_fast, fs_fast, _ = solve_optimum(fast)
    ts_gen, fs_gen, _ = solve_optimum(generic)
    np.testing.assert_allclose(ts_gen, ts_fast, rtol=1e-10)
    theta0 = ts_fast + 0.3
    a = run(fast, make_algorithm(name, **kw), theta0, 3, participants=4, seed=2)[0].theta
    b = run(generic, make_algorithm(name, **kw), theta0, 3, participants=4, seed=2)[0].theta
    np.testing.assert_allclose(b, a, rtol=1e-10)


def test_namespace_recognises_a_cupy_array_by_its_module(monkeypatch):
    """A device array is a CuPy array whether or not its type carries ``__array_namespace__``."""
    from fedconvex.backend import namespace

    fake_cupy = types.ModuleType("cupy")
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    DeviceArray = type("ndarray", (), {"__module__": "cupy._core.core"})  # no __array_namespace__
    assert namespace(DeviceArray()) is fake_cupy
    with pytest.raises(TypeError, match="different libraries"):
        namespace(DeviceArray(), np.zeros(2))
