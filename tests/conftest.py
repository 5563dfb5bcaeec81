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


# pytest-xdist (the suite's default: `-n auto`, pyproject.toml) runs the tests of one group on one worker: a module's
# tests together (its module fixtures are built once), and the modules that use a session fixture which starts
# something expensive together (the shared secure deployment, the Flower check runs), so that each is built once.
SHARED_FIXTURES = ("deployment_runs", "flower_check_runs")
SHARED_GROUP = "flower-shared-runs"
SHARED_MODULES = {"test_cli_vocabulary.py", "test_flower.py", "test_flower_secure.py", "test_hostile_params.py"}


def xdist_group(nodeid: str) -> str:
    """The group of a test from its node id (all pytest-xdist's scheduler sees)."""
    path = nodeid.split("::", 1)[0]
    return SHARED_GROUP if os.path.basename(path) in SHARED_MODULES else path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Groups holding a slow test first, so that the longest ones start early rather than finish last on one
    worker; each group's tests stay in their order."""
    slow = {xdist_group(item.nodeid) for item in items if item.get_closest_marker("slow")}
    first = {}
    for n, item in enumerate(items):
        first.setdefault(xdist_group(item.nodeid), n)
    items.sort(key=lambda item: (xdist_group(item.nodeid) not in slow, first[xdist_group(item.nodeid)]))


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduler with our groups as scopes, in the collection's order (pytest-xdist's own
    `xdist_group` mark is not read on this pytest: it rewrites node ids, which pytest 9.2 no longer allows)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return xdist_group(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)
