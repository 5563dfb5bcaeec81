"""The budgeted, resumable sweep (validation/sweep.py, validation/executors.py) on the smoke profile and generated
CIFAR-10 files: a sweep killed at random points and resumed, a run stopped at its --deadline and resumed, and Ray's
executor, all give the histories of one uninterrupted local sweep."""

import contextlib
import csv
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from fake_cifar import cifar_pickle  # noqa: E402

from validation import dnn, experiments, sweep  # noqa: E402
from validation.executors import NOT_STARTED, Job, LocalExecutor, run_unit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = "smoke"
RUNS = experiments.plan(PROFILE)
# measurements, not results: they differ between two uninterrupted runs too
TIMING = {"client_seconds", "server_seconds", "peak_memory_mb", "wall_seconds"}


def computed(history_csv: str) -> str:
    """history.csv without its timing columns, as text: what must be byte-identical."""
    rows = list(csv.reader(io.StringIO(history_csv)))
    keep = [i for i, name in enumerate(rows[0]) if name not in TIMING]
    return "\n".join(",".join(r[i] for i in keep) for r in rows)


def histories(results) -> dict:
    root = os.path.join(results, PROFILE)
    out = {}
    for r in RUNS:
        with open(os.path.join(root, r.name, "history.csv")) as fh:
            out[r.name] = computed(fh.read())
    return out


def sweep_argv(data, results, root_flag="--out"):
    """The arguments of a sweep of the test profile (experiments: the runs' root is --out; figures: --results)."""
    return ["--profile", PROFILE, "--data-dir", str(data), root_flag, str(results)]


def in_process(fn, *args, **kw):
    """``fn`` here, leaving torch's thread count as it found it (the profile's runs set one thread)."""
    threads = torch.get_num_threads()
    try:
        return fn(*args, **kw)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    cifar_pickle(str(d / "cifar-10-batches-py"), n=60, balanced=True)
    return d


@pytest.fixture(scope="module")
def reference_run(data, tmp_path_factory):
    """One uninterrupted local sweep, its progress bar drawn (stderr a terminal): its results folder, histories
    and what it wrote on stderr.  The sweeps compared with it draw none: the bar changes no result."""
    from test_cli_vocabulary import FakeTerminal

    results, term = tmp_path_factory.mktemp("reference"), FakeTerminal()
    with contextlib.redirect_stderr(term):
        assert in_process(experiments.main, sweep_argv(data, results)) == 0
    return results, histories(results), term


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[:2]


def test_the_sweep_draws_one_bar_over_its_runs(reference_run):
    from test_cli_vocabulary import bar_lines

    lines = bar_lines(reference_run[2], f"{PROFILE} runs")
    n = len(RUNS)
    assert lines and f"{n}/{n}" in lines[-1], reference_run[2].getvalue()


def rounds_done(results) -> int:
    total = 0
    for r in RUNS:
        path = os.path.join(results, PROFILE, r.name, "history.csv")
        if os.path.isfile(path):
            with open(path) as fh:
                total += max(len(fh.read().splitlines()) - 1, 0)
    return total


def test_priority_fills_cifar10_alpha01_first_fedpm_and_fedavg_seed_by_seed():
    order = [r.name for r in sweep.priority(experiments.plan("paper"))]
    assert order[:6] == [f"main-cifar10-a0.1-{m}-s{s}" for s in range(3) for m in ("fedpm", "fedavg")]
    main = [f"main-cifar10-a0.1-{m}-s{s}" for m in experiments.DNN_METHODS for s in range(3)]
    assert sorted(order[:21]) == sorted(main)  # the whole column (7 methods x 3 seeds) before anything else
    assert order[6:11] == [f"main-cifar10-a0.1-{m}-s0" for m in experiments.DNN_METHODS if m not in ("fedpm", "fedavg")]
    columns = [next((c for c in sweep.COLUMNS if n.startswith(f"main-{c}-")), None) for n in order]
    seen = [c for i, c in enumerate(columns) if c and c not in columns[:i]]
    assert seen == ["cifar10-a0.1", "cifar10-a1.0", "cifar100-a0.1", "cifar100-a1.0"]
    last_main = max(i for i, c in enumerate(columns) if c)
    assert all(
        n.startswith(("epochs-", "sampling-", "foof-", "compression-", "superlinear-")) for n in order[last_main + 1 :]
    )
    assert order[-1].startswith(("superlinear-", "compression-w8a", "compression-a9a"))
    assert sorted(order) == sorted(r.name for r in experiments.plan("paper"))


def test_killed_sweep_resumes_to_the_uninterrupted_histories(data, reference, tmp_path):
    """SIGKILL of the sweep's process group at random points (each after a new round was written), then one
    call that finishes: every history byte for byte the uninterrupted sweep's (timing columns aside)."""
    _, ref = reference
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "validation.experiments"] + sweep_argv(data, results)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    rng = random.Random(26)
    saw_partial = False
    for _ in range(2):
        before = rounds_done(results)
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            while rounds_done(results) == before and proc.poll() is None:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.05))  # within the run: a round of this tiny run can take 0.1 s
        finally:
            with contextlib.suppress(ProcessLookupError):  # a call that finished first has no group left
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        states = sweep.statuses(RUNS, str(results / PROFILE))
        saw_partial |= any(
            s.state == sweep.PARTIAL and 0 < s.rounds_done < r.rounds
            for r, s in zip(RUNS, states.values(), strict=True)
        )
    listed = "\n".join(sweep.listing(RUNS, str(results / PROFILE), "cpu"))
    assert "partial (" in listed or "missing" in listed, listed  # the kills left work to do
    assert in_process(experiments.main, sweep_argv(data, results)) == 0
    assert histories(results) == ref
    assert saw_partial, "no kill landed inside a run: the test did not exercise a resume"
    final = "\n".join(sweep.listing(RUNS, str(results / PROFILE), "cpu"))
    assert final.count("done ") == len(RUNS) and "0 missing" in final, final


def test_deadline_stops_after_a_round_checkpointed_and_resume_completes(data, reference, tmp_path):
    _, ref = reference
    run = RUNS[0]
    out = tmp_path / run.name
    argv = list(run.argv) + ["--data-dir", str(data), "--out", str(out), "--quiet"]
    assert in_process(dnn.main, argv + ["--deadline", "1"]) == dnn.EXIT_PARTIAL  # 1 s after the epoch: passed
    st = sweep.status(run, str(out))
    assert (st.state, st.rounds_done) == (sweep.PARTIAL, 1)
    assert json.loads((out / "summary.json").read_text())["rounds_done"] == 1
    assert in_process(dnn.main, argv + ["--resume"]) == 0
    assert computed((out / "history.csv").read_text()) == ref[run.name]


def test_budget_starts_nothing_that_cannot_fit_and_keeps_the_priority_order(tmp_path):
    job = Job(str(tmp_path), "", end=time.time() + sweep.START_SECONDS / 2)
    units = sweep.units(RUNS)
    out = list(LocalExecutor().map(units, job, {}))
    assert [o for _, outs in out for _, o in outs] == [NOT_STARTED] * len(RUNS)
    assert not os.listdir(tmp_path)  # nothing written
    # an estimate that does not fit keeps the unit (and all after it) waiting, one that fits would start it
    later = Job(str(tmp_path), "", end=time.time() + 3600)
    assert run_unit(units[0], later, {units[0][0].name: 7200.0}) == [(units[0][0].name, NOT_STARTED)]


def test_figures_compute_a_missing_run_on_the_sweeps_bar_to_its_history(data, reference, tmp_path, monkeypatch):
    """`python -m figures --compute` computes what is missing through the sweep, with its bar; the run equals the
    one of the uninterrupted sweep.  (Drawing is tested in test_figures.py: here it is left out, it costs most of
    the time.)"""
    from test_cli_vocabulary import FakeTerminal, bar_lines

    from figures import __main__ as figures_main

    ref_results, ref = reference
    results = tmp_path / "results"
    shutil.copytree(ref_results, results)
    shutil.rmtree(results / PROFILE / RUNS[-1].name)
    monkeypatch.setattr(figures_main, "draw_into", lambda out, root, profile: [os.path.join(out, "t.md")])
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    argv = sweep_argv(data, results, "--results") + ["--out", str(tmp_path / "figs"), "--compute"]
    assert in_process(figures_main.main, argv) == 0
    monkeypatch.undo()
    lines = bar_lines(term, f"{PROFILE} runs")
    assert lines and "1/1" in lines[-1], term.getvalue()
    assert histories(results) == ref


def test_listing_says_done_partial_missing_and_stale(data, reference, tmp_path):
    ref_results, _ = reference
    root = tmp_path / PROFILE
    shutil.copytree(ref_results / PROFILE, root)
    done, partial, missing, stale = RUNS
    # partial: the history of one round less (the checkpoint stays)
    h = (root / partial.name / "history.csv").read_text().splitlines()
    (root / partial.name / "history.csv").write_text("\n".join(h[:-1]) + "\n")
    shutil.rmtree(root / missing.name)
    s = json.loads((root / stale.name / "summary.json").read_text())
    s["command"] = s["command"].replace("--seed 1", "--seed 1 --lr 0.3")
    (root / stale.name / "summary.json").write_text(json.dumps(s))
    states = sweep.statuses(RUNS, str(root))
    assert [states[r.name].state for r in RUNS] == [sweep.DONE, sweep.PARTIAL, sweep.MISSING, sweep.STALE]
    assert states[partial.name].rounds_done == partial.rounds - 1
    assert "lr is 0.3, the profile's " in states[stale.name].why
    here = sweep.this_machine("cpu")
    lines = sweep.listing(RUNS, str(root), "cpu")
    assert lines[-2] == "1 done, 1 partial, 1 missing, 1 stale of 4 runs"
    # time left: the partial run's round and the missing run's three, from the runs measured here
    assert f"estimated time left on this machine (cpu: {here}): " in lines[-1]
    assert lines[-1].endswith("from its own runs"), lines[-1]
    # nothing was measured on a GPU, and the smoke runs are not the paper's size: no estimate is made up
    assert "unknown for 3 runs (no run like them measured on cuda)" in sweep.listing(RUNS, str(root), "cuda")[-1]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("PYTHONPATH", ROOT)  # the workers import this tree's validation package
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # Ray's node start times out on an overloaded machine: nothing of ours ran
        ray.shutdown()
        pytest.skip(f"a local Ray did not start here: {str(exc).splitlines()[0]}")
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_executor_gives_the_local_histories(data, reference, tmp_path, local_ray):
    from validation.executors import RayExecutor

    _, ref = reference
    experiments.ensure(PROFILE, str(data), str(tmp_path), executor=RayExecutor(), log=lambda *a: None)
    assert histories(tmp_path) == ref


def ray_task_pids() -> list[int]:
    """Processes whose title says they run a sweep unit (Ray names a busy worker ray::<function>)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if fh.read().startswith(b"ray::run_unit"):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.mark.slow
def test_ray_worker_killed_mid_run_is_retried_to_the_local_histories(data, reference, tmp_path, local_ray):
    import threading

    from validation.executors import RayExecutor

    _, ref = reference
    killed = []

    def kill_one_worker_mid_run():
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            if rounds_done(tmp_path) >= 2 and ray_task_pids():
                pid = ray_task_pids()[0]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one_worker_mid_run, daemon=True)
    killer.start()
    experiments.ensure(PROFILE, str(data), str(tmp_path), executor=RayExecutor(max_retries=3), log=lambda *a: None)
    killer.join(timeout=1)
    assert killed, "no worker was running a unit to kill"
    assert histories(tmp_path) == ref


def test_tables_beside_the_paper_say_seeds_gaps_and_verdicts():
    """Ours equal to the paper's means give zero gaps and the paper's ordering (Kendall τ 1); FedAvg one paper σ
    higher with two seeds is +1.0σ and INCOMPLETE; a column without runs is all dashes."""
    from figures.tables import PAPER, versus_paper

    key = "cifar10-a0.1"
    ours = {m: [mu / 100] * 3 for m, (mu, sd) in PAPER[key].items()}
    exact = {"cifar10-a1.0": {m: [mu / 100] * 3 for m, (mu, sd) in PAPER["cifar10-a1.0"].items()}}
    mu, sd = PAPER[key]["fedavg"]
    ours["fedavg"] = [(mu + sd) / 100] * 2
    header, rows = versus_paper({key: ours, **exact}, experiments.DNN_METHODS)
    col = {r[1]: r[2:] for r in rows if r[0] == "CIFAR-10 α=0.1"}
    assert col["FedPM"] == ["68.6 ± 0.0", "3 of 3 seeds", "68.6 ± 2.0", "+0.0"]
    assert col["FedAvg"] == ["65.2 ± 0.0", "2 of 3 seeds (INCOMPLETE)", "63.1 ± 2.1", "+1.0"]
    assert (
        col["verdict"][0].startswith("best FedPM (paper FedPM)") and "largest gap +1.0σ (FedAvg)" in col["verdict"][0]
    )
    assert col["verdict"][1] == "1 cells incomplete"
    same = {r[1]: r[2:] for r in rows if r[0] == "CIFAR-10 α=1.0"}
    assert "Kendall τ 1.00 over 7 methods" in same["verdict"][0] and same["verdict"][1] == "complete"
    empty = {r[1]: r[2:] for r in rows if r[0] == "FEMNIST"}
    assert empty["FedPM"] == ["–", "0 of 3 seeds (INCOMPLETE)", "79.2 ± 1.7", "–"]
    assert empty["verdict"][0] == "no results"
    assert header[:2] == ["Column", "Method"] and len(rows) == 5 * 8


def test_fingerprint_resolves_defaults_and_preset_values():
    """A recorded command that spells out the default client count or a preset's own value computes the same run
    (done, not stale); another value does not."""
    from fedpm_dnn.presets import PRESETS

    base = ["--dataset", "cifar10", "--method", "fedpm", "--preset", "cifar10-a0.1", "--seed", "0"]
    lr = PRESETS["cifar10-a0.1"]["methods"]["fedpm"]["lr"]
    same = dnn.command_fingerprint(base + ["--clients", "10", "--lr", str(lr), "--out", "x", "--rounds", "7"])
    assert dnn.command_fingerprint(base) == same
    assert dnn.command_fingerprint(base + ["--lr", str(lr / 2)]) != same
    assert dnn.command_fingerprint(base + ["--clients", "9"]) != same
    assert dnn.command_fingerprint(base + ["--participants", "5"]) != same


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus-per-task", "1"], "--gpus-per-task applies to --executor ray"),
        (["--ray-address", "auto"], "--ray-address applies to --executor ray"),
        (["--budget-minutes", "0"], "--budget-minutes: must be a number > 0, got 0"),
        (["--executor", "dask"], "argument --executor: invalid choice: 'dask'"),
    ],
)
def test_sweep_flags_are_checked_in_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        experiments.main(["--profile", PROFILE, "--out", str(tmp_path)] + argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not os.listdir(tmp_path)


def test_a_budget_ending_mid_run_leaves_it_partial_and_the_next_call_finishes_it(
    data, reference, tmp_path, monkeypatch
):
    """The budget's end passes during the first run's first round: that run stops after it, checkpointed (exit 75
    inside, partial), nothing after it starts; a call without a budget then completes the sweep to the
    uninterrupted histories."""
    _, ref = reference
    monkeypatch.setattr(sweep, "START_SECONDS", 0.0)  # no start-up allowance: the first run starts at once
    # every round lasts longer than the budget (a round of this tiny run alone can take 0.1 s on a quiet machine)
    from fedconvex.driver import Driver

    one_round = Driver.round

    def slow_round(self, *a, **k):
        time.sleep(1.5)
        return one_round(self, *a, **k)

    monkeypatch.setattr(Driver, "round", slow_round)
    clock = sweep.Budget(None)
    clock.end = time.time() + 1.0
    messages = []
    in_process(experiments.ensure, PROFILE, str(data), str(tmp_path), log=messages.append, budget=clock)
    states = sweep.statuses(RUNS, str(tmp_path / PROFILE))
    first = RUNS[0]  # main-cifar10-a0.1-fedpm-s0: first in the priority order too
    assert sweep.priority(RUNS)[0] == first
    assert (states[first.name].state, states[first.name].rounds_done) == (sweep.PARTIAL, 1)
    assert all(states[r.name].state == sweep.MISSING for r in RUNS[1:])
    assert any(m.startswith(f"budget spent: {len(RUNS) - 1} runs not started") for m in messages), messages
    monkeypatch.setattr(Driver, "round", one_round)
    in_process(experiments.ensure, PROFILE, str(data), str(tmp_path), log=messages.append)
    assert histories(tmp_path) == ref


def _imports(path: str, package: str) -> set:
    """The modules a file imports, at its top or inside functions ('validation.sweep', 'validation.dnn', ...)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = package if node.level == 1 else (node.module or "")
            module = f"{package}.{node.module}" if node.level == 1 and node.module else base
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_the_sweeps_modules_import_one_another_without_a_circle():
    """validation/ and figures/ as a graph of imports (those inside functions too): no module reaches itself.  The
    sweep's planner (validation/sweep.py) owns the grouping and the method order; the executors import it, the
    experiments import both, nothing imports back."""
    graph = {}
    for package in ("validation", "figures"):
        for f in os.listdir(os.path.join(ROOT, package)):
            if f.endswith(".py"):
                graph[f"{package}.{f[:-3]}"] = _imports(os.path.join(ROOT, package, f), package)
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}

    def reaches(start, target, seen):
        return any(
            d == target or (d not in seen and not seen.add(d) and reaches(d, target, seen)) for d in graph[start]
        )

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert circles == [], circles
    assert "validation.experiments" not in graph["validation.sweep"] | graph["validation.executors"]
