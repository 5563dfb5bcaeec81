import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from federations import LOCK_VARIABLE  # noqa: E402

from fedconvex.data import load_bundled, sequential_split  # noqa: E402
from fedconvex.problem import FederatedLogReg  # noqa: E402
from fedconvex.reference import initial_point, solve_optimum  # noqa: E402

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def pytest_configure(config):
    """Set before any worker starts (the workers inherit the environment): the lock file of tests/federations.py,
    and, under pytest-xdist, each worker's share of the cores for its numerical libraries: left at their default,
    every worker's OpenMP and BLAS pools start a thread per core, and N workers' pools oversubscribe N cores (their
    waiting threads spin: numerical test modules took 1.7x as long on 2 cores).  A value the user set is kept."""
    if hasattr(config, "workerinput"):
        return
    if LOCK_VARIABLE not in os.environ:
        lock = os.path.join(tempfile.gettempdir(), f"fedpm-test-federations-{os.getpid()}.lock")
        os.environ[LOCK_VARIABLE] = lock
        config.add_cleanup(lambda: os.path.exists(lock) and os.remove(lock))
    workers = getattr(config.option, "numprocesses", None)
    if not isinstance(workers, int) or workers < 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for name in THREAD_VARIABLES:
        os.environ.setdefault(name, str(max(1, cores // workers)))


@pytest.fixture(scope="session")
def a9a():
    return load_bundled("a9a")


@pytest.fixture(scope="session")
def a9a_paper(a9a):
    """The paper's a9a Test 1 set-up: 80 clients x 407 rows, lam = 1e-3, theta0 = theta* + N(0, 0.01 I)."""
    pb = FederatedLogReg(a9a.X, a9a.y, sequential_split(a9a.n, 80, 407), lam=1e-3)
    theta_star, f_star, _ = solve_optimum(pb)
    return pb, theta_star, f_star, initial_point(pb, theta_star, "paper", seed=0)


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory):
    """A CIFAR-10 folder of 40 class-balanced generated images (tests/fake_cifar.py), shared by the command tests."""
    from fake_cifar import cifar_pickle

    root = tmp_path_factory.mktemp("cifar")
    cifar_pickle(str(root / "cifar-10-batches-py"), n=40, balanced=True)
    return str(root)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(scope="session")
def deployment_runs(request, tmp_path_factory):
    """Every run of the one shared secure deployment (tests/flower_deployment.py), done once for all modules:
    under pytest-xdist by the process that the first worker started beside the tests (``shared_deployment``),
    else here."""
    pytest.importorskip("flwr")
    import flower_deployment

    if not hasattr(request.config, "workerinput"):
        return flower_deployment.run_all(tmp_path_factory.mktemp("deployment"))
    folder = deployment_folder(tmp_path_factory)
    deadline = time.time() + 600
    while not os.path.exists(os.path.join(folder, "pid")):  # the first worker starts it at its first test
        assert time.time() < deadline, "the shared deployment was never started"
        time.sleep(1.0)
    with open(os.path.join(folder, "pid")) as fh:
        pid = int(fh.read())
    from fedpm_flower.deploy import _zombie  # gone or a zombie: it will write nothing more

    return flower_deployment.wait_for(folder, lambda: not _zombie(pid))


def deployment_folder(tmp_path_factory) -> str:
    """The shared deployment's folder: in the session's temporary folder, which every worker of it shares."""
    return str(tmp_path_factory.getbasetemp().parent / "shared-deployment")


@pytest.fixture(scope="session", autouse=True)
def shared_deployment(request, tmp_path_factory):
    """On the first pytest-xdist worker, when a selected test needs the shared deployment: its runs start at
    this worker's first test, in a process of their own beside the tests.  They spend most of their minutes
    waiting on Flower's polls and process starts; done inside a test, they would hold a worker, and so a core,
    for all of it.  At the end this worker waits for them (another worker may still read their findings)."""
    workerinput = getattr(request.config, "workerinput", None)
    if workerinput is None or workerinput.get("workerid") != "gw0":
        yield
        return
    import importlib.util

    wanted = any("deployment_runs" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if not wanted or importlib.util.find_spec("flwr") is None:
        yield
        return
    folder = deployment_folder(tmp_path_factory)
    os.makedirs(folder, exist_ok=True)
    script = os.path.join(os.path.dirname(__file__), "flower_deployment.py")
    with open(os.path.join(folder, "log.txt"), "w") as log:
        # in this worker's process group: Ctrl-C reaches it, and its federation stops with it
        proc = subprocess.Popen([sys.executable, script, folder], stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join(folder, "pid.tmp"), "w") as fh:
        fh.write(str(proc.pid))
    os.replace(os.path.join(folder, "pid.tmp"), os.path.join(folder, "pid"))
    try:
        yield
    finally:
        stopping = request.session.shouldstop or request.session.shouldfail
        try:
            proc.wait(timeout=1 if stopping else 1800)
        except subprocess.TimeoutExpired:
            proc.terminate()  # its SIGTERM handler stops the federation
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def flower_check_runs(tmp_path_factory):
    """README's `python -m validation.flower --problem logreg --dataset a9a --method fedpm --clients 3 --rounds 2
    --mode simulation --check`, run as from a user's shell, its stderr a terminal (tests/terminal.py): {"fedpm": (exit
    code, its --out folder, what reached the terminal, its stdout)}.  Shared by the check command's test, the progress
    bar's and the one that keeps Flower's and Ray's output out of the terminal: each simulation starts Ray (tens of
    seconds of CPU); every method's Flower simulation is compared with its in-process run in tests/test_flower.py
    (``simulated``)."""
    pytest.importorskip("flwr")
    from terminal import run_on_a_terminal

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    work = tmp_path_factory.mktemp("check")
    out = work / "fedpm"
    argv = ["--problem", "logreg", "--dataset", "a9a", "--method", "fedpm", "--clients", "3", "--rounds", "2"]
    # --out relative to the shell's folder, as a user types it: the command prints it back as given
    cmd = [sys.executable, "-m", "validation.flower", *argv, "--mode", "simulation", "--check", "--out", out.name]
    env = {**os.environ, "PYTHONPATH": root}
    code, stdout, drawn = run_on_a_terminal(cmd, env, str(work))
    return {"fedpm": (code, out, drawn, stdout)}


# pytest-xdist (the suite's default: `-n auto`, pyproject.toml) runs the tests of one group on one worker: a module's
# tests together (its module fixtures are built once), and the modules that use a session fixture which starts
# something expensive together (the Flower check runs), so that it is built once.  Two groups go last: the tests
# that read the shared deployment's findings (it runs in a process of its own from the suite's start, for about ten
# minutes: reached earlier, a worker would sit waiting for it), and the twenty-SuperNode test, which runs alone
# among Flower's federations (tests/federations.py) and so after the shared deployment.
SHARED_FIXTURES = ("flower_check_runs",)
SHARED_GROUP = "flower-shared-runs"
SHARED_MODULES = {"test_cli_vocabulary.py", "test_flower.py"}
DEPLOYMENT_GROUP = "flower-deployment-findings"
# (module, test) of every test that reads ``deployment_runs``: the scheduler sees node ids only, not fixtures
# (pytest_collection_modifyitems checks this list against the fixtures)
DEPLOYMENT_READERS = {
    ("test_flower.py", "test_deployment_gives_the_in_process_model_and_stops_everything"),
    ("test_flower.py", "test_a_deployments_bar_counts_every_round_while_the_federation_runs"),
    ("test_flower.py", "test_a_supernode_dropping_out_is_tolerated"),
    ("test_flower.py", "test_cnn_deployment_gives_the_in_process_model"),
    ("test_hostile_params.py", "test_the_deployment_timeout_bounds_a_round_and_a_killed_supernode_is_dropped"),
    ("test_flower_secure.py", "test_secure_run_equals_in_process_and_keeps_intruders_out"),
    ("test_flower_secure.py", "test_the_superlink_keeps_its_state_in_memory"),
    ("test_flower_secure.py", "test_hostile_supernodes_are_each_rejected_with_their_reason"),
    ("test_flower_secure.py", "test_a_supernode_killed_mid_round_is_dropped_and_reported"),
}
LAST_GROUPS = ("test_flower_many_nodes.py", DEPLOYMENT_GROUP)  # in this order, after every other group


def _module_and_test(nodeid: str) -> tuple:
    path, _, rest = nodeid.partition("::")
    return os.path.basename(path), rest.split("[", 1)[0]


def xdist_group(nodeid: str) -> str:
    """The group of a test from its node id (all pytest-xdist's scheduler sees)."""
    module, test = _module_and_test(nodeid)
    if (module, test) in DEPLOYMENT_READERS:
        return DEPLOYMENT_GROUP
    return SHARED_GROUP if module in SHARED_MODULES else nodeid.split("::", 1)[0]


def _last(group: str) -> int:
    """0 for most groups; 1, 2, ... for LAST_GROUPS in their order."""
    name = os.path.basename(group)
    return LAST_GROUPS.index(name) + 1 if name in LAST_GROUPS else 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Groups holding a slow test first, so that the longest ones start early rather than finish last on one
    worker; LAST_GROUPS at the end; each group's tests stay in their order."""
    reads = [item for item in items if "deployment_runs" in getattr(item, "fixturenames", ())]
    readers = {_module_and_test(item.nodeid) for item in reads}
    if readers - DEPLOYMENT_READERS:
        raise pytest.UsageError(f"tests/conftest.py: add {sorted(readers - DEPLOYMENT_READERS)} to DEPLOYMENT_READERS")
    group = {item.nodeid: xdist_group(item.nodeid) for item in items}
    slow = {group[item.nodeid] for item in items if item.get_closest_marker("slow")}
    first = {}
    for n, item in enumerate(items):
        first.setdefault(group[item.nodeid], n)
    items.sort(key=lambda item: (_last(group[item.nodeid]), group[item.nodeid] not in slow, first[group[item.nodeid]]))


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduler with our groups as scopes, in the collection's order (pytest-xdist's own
    `xdist_group` mark is not read on this pytest: it rewrites node ids, which pytest 9.2 no longer allows)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return xdist_group(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)
