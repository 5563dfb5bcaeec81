import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fedconvex.data import load_bundled, sequential_split  # noqa: E402
from fedconvex.problem import FederatedLogReg  # noqa: E402
from fedconvex.reference import initial_point, solve_optimum  # noqa: E402


@pytest.fixture(scope="session")
def a9a():
    return load_bundled("a9a")


@pytest.fixture(scope="session")
def a9a_paper(a9a):
    """The paper's a9a Test 1 set-up: 80 clients x 407 rows, lam = 1e-3, theta0 = theta* + N(0, 0.01 I)."""
    pb = FederatedLogReg(a9a.X, a9a.y, sequential_split(a9a.n, 80, 407), lam=1e-3)
    theta_star, f_star, _ = solve_optimum(pb)
    return pb, theta_star, f_star, initial_point(pb, theta_star, "paper", seed=0)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(scope="session")
def deployment_runs(tmp_path_factory):
    """Every run of the one shared secure deployment (tests/flower_deployment.py), done once for all modules."""
    pytest.importorskip("flwr")
    from flower_deployment import run_all

    return run_all(tmp_path_factory.mktemp("deployment"))


@pytest.fixture(scope="session")
def flower_check_runs(tmp_path_factory):
    """The documented `python -m validation.flower --problem logreg --dataset a9a --method M --mode simulation
    --check` for SCAFFOLD and FedNL, each with a terminal as its stderr: {method: (exit code, its --out folder,
    what it drew there)}.
    Shared by the check command's tests and the progress bar's: each simulation starts Ray (tens of seconds)."""
    pytest.importorskip("flwr")
    from test_cli_vocabulary import FakeTerminal

    from validation.flower import main

    runs = {}
    for method in ("scaffold", "fednl"):
        out = tmp_path_factory.mktemp("check") / method
        term = FakeTerminal()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("sys.stderr", term)
            argv = ["--problem", "logreg", "--dataset", "a9a", "--method", method, "--mode", "simulation", "--check"]
            code = main(argv + ["--out", str(out)])
        runs[method] = (code, out, term.getvalue())
    return runs


# Session fixtures that start something expensive (a secure deployment, Ray simulations): every module that uses
# one runs on the same pytest-xdist worker, so each is built once per suite, not once per worker.
SHARED_FIXTURES = ("deployment_runs", "flower_check_runs")


def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's `--dist loadgroup` (the suite's default, pyproject.toml): a module's tests stay
    together (its module fixtures are built once), and modules joined by a shared session fixture stay together."""
    parent = {}

    def find(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    for item in items:
        module = item.module.__name__
        for fixture in SHARED_FIXTURES:
            if fixture in item.fixturenames:
                parent[find(module)] = find(fixture)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(find(item.module.__name__)))
