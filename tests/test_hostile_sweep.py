"""Hostile cases of the sweep (python -m validation.experiments, its executors, --list) and of python -m figures:
waits that must be bounded, exit statuses that must tell the truth, files read back that must be distrusted,
shipped runs copied whole or not at all, and drawing that must not turn into computing.

Most cases replace the runner (validation.dnn.main) and the plan by small fakes: what is checked is the sweep's
handling of their outcomes, not training."""

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from validation import dnn, executors, experiments, sweep
from validation.executors import BUSY, STOPPED, Job, RayExecutor, run_unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "python -m validation.experiments"


def one_line(main, argv, capsys, prog=PROG) -> str:
    """Run a command in-process; it must end with exit 2 and one line naming the cause; that line."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


def fake_runs(*names):
    return [experiments.Run(n, "dnn", ("--seed", str(i)), 1) for i, n in enumerate(names)]


@pytest.fixture
def fake_sweep(monkeypatch):
    """A plan of the given runs, data present, and validation.dnn.main replaced by ``runner(name) -> exit code``
    (a run that exits 0 or 75 writes a finished or partial result as the real runner would)."""

    def install(runs, runner):
        monkeypatch.setattr(experiments, "plan", lambda profile: runs)
        monkeypatch.setattr(experiments, "data_available", lambda ds, d: True)
        monkeypatch.setattr(experiments, "_cuda", lambda: False)
        calls = []

        def fake_main(argv):
            out = argv[argv.index("--out") + 1]
            name = os.path.basename(out)
            calls.append(name)
            code = runner(name)
            if code in (0, dnn.EXIT_PARTIAL):
                os.makedirs(out, exist_ok=True)
                with open(os.path.join(out, "summary.json"), "w") as fh:
                    json.dump({"rounds_done": 1}, fh)
                with open(os.path.join(out, "history.csv"), "w") as fh:
                    fh.write("round,test_acc,wall_seconds\n" + ("1,0.5,1.0\n" if code == 0 else ""))
            if code:
                raise SystemExit(code)
            return 0

        monkeypatch.setattr(dnn, "main", fake_main)
        return calls

    return install


def args(tmp_path, *more):
    return ["--profile", "smoke", "--out", str(tmp_path / "results"), "--quiet", *more]


# --- exit status tells the truth -------------------------------------------------------------------------------


def test_a_sweep_with_a_failed_run_exits_1_and_names_it(tmp_path, fake_sweep, capsys):
    fake_sweep(fake_runs("bad", "good"), lambda name: 2 if name == "bad" else 0)
    assert experiments.main(args(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "partial result: 1 of 2 runs done; 1 failed (bad)" in err, err


def test_a_sweep_whose_budget_leaves_runs_unstarted_exits_75_and_says_the_same_command_continues(
    tmp_path, fake_sweep, capsys, monkeypatch
):
    calls = fake_sweep(fake_runs("first", "second"), lambda name: 0)
    monkeypatch.setattr(sweep, "START_SECONDS", 10_000.0)  # no run fits a 1-minute budget
    assert experiments.main(args(tmp_path, "--budget-minutes", "1")) == experiments.EXIT_PARTIAL
    err = capsys.readouterr().err
    assert calls == [] and "2 unfinished (the same command continues them)" in err, err


def test_a_complete_sweep_exits_0_and_says_nothing_more(tmp_path, fake_sweep, capsys):
    fake_sweep(fake_runs("a", "b"), lambda name: 0)
    assert experiments.main(args(tmp_path)) == 0
    assert "partial result" not in capsys.readouterr().err


class Ref:
    def __init__(self, value):
        self.value = value


class FakeRay(types.ModuleType):
    """The few calls RayExecutor makes, run synchronously in this process (a task runs when it is submitted); no
    GPU unless given; ``schedulable`` False: no task ever starts (ray.wait returns nothing within its timeout)."""

    def __init__(self, resources=None, schedulable=True):
        super().__init__("ray")
        self.resources = resources or {"CPU": 2.0}
        self.schedulable, self.cancelled, self.options_seen = schedulable, [], []
        self.exceptions = types.SimpleNamespace(RayError=RuntimeError)

    def is_initialized(self):
        return True

    def cluster_resources(self):
        return dict(self.resources)

    def remote(self, fn):
        ray = self

        class Task:
            def options(self, **kw):
                ray.options_seen.append(kw)
                return self

            def remote(self, *a):
                return Ref(fn(*a) if ray.schedulable else None)

        return Task()

    def wait(self, refs, num_returns=1, timeout=None):
        if not self.schedulable:
            assert timeout is not None, "an unbounded wait on a task that never starts"
            return [], refs
        return refs[:1], refs[1:]

    def get(self, ref):
        return ref.value

    def cancel(self, ref, force=False):
        self.cancelled.append(ref)

    def shutdown(self):
        pass


def test_a_ray_sweep_with_a_failed_run_exits_1(tmp_path, fake_sweep, capsys, monkeypatch):
    fake_sweep(fake_runs("bad", "good"), lambda name: 2 if name == "bad" else 0)
    monkeypatch.setitem(sys.modules, "ray", FakeRay())
    assert experiments.main(args(tmp_path, "--executor", "ray")) == 1
    assert "1 failed (bad)" in capsys.readouterr().err


# --- every wait is bounded -------------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_address_nobody_serves_is_one_line_within_the_connect_bound(tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    cmd = [sys.executable, "-m", "validation.experiments", *args(tmp_path)]
    cmd += ["--executor", "ray", "--ray-address", address, "--budget-minutes", "1"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    began = time.time()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{PROG}: error: --executor ray: no Ray cluster at {address}: no connection within")
    assert time.time() - began < 120  # python and ray's import, then at most CONNECT_SECONDS


def test_more_gpus_per_task_than_the_cluster_has_is_refused_in_one_line(tmp_path, fake_sweep, capsys, monkeypatch):
    calls = fake_sweep(fake_runs("a"), lambda name: 0)
    monkeypatch.setitem(sys.modules, "ray", FakeRay({"CPU": 4.0}))
    line = one_line(experiments.main, args(tmp_path, "--executor", "ray", "--gpus-per-task", "1"), capsys)
    assert "--gpus-per-task 1: the Ray cluster has 0 GPUs, so no run could ever start" in line
    assert calls == []


def test_ray_tasks_never_scheduled_are_stopped_after_the_budget_and_its_grace(tmp_path, monkeypatch):
    ray = FakeRay({"CPU": 1.0}, schedulable=False)
    monkeypatch.setitem(sys.modules, "ray", ray)
    units = [(r,) for r in fake_runs("a", "b")]
    job = Job(str(tmp_path), "", end=time.time() - executors.STOP_GRACE_SECONDS)
    out = list(RayExecutor().map(units, job, {}))
    assert [o for _, outs in out for _, o in outs] == [STOPPED, STOPPED] and len(ray.cancelled) == 2
    assert ray.options_seen[0]["num_gpus"] == 0  # no GPU in the cluster: the default asks for none


def test_ray_init_leaves_the_commands_signal_handlers_in_place(monkeypatch):
    """ray.init installs its own SIGTERM handler (sys.exit, then its core worker's native stack dump): after
    connecting, the command's handlers are back, so SIGTERM stays one line (common.run_command)."""

    def ours(signum, frame):
        raise KeyboardInterrupt

    class Initialising(FakeRay):
        def init(self, **kw):
            signal.signal(signal.SIGTERM, lambda s, f: sys.exit(s))
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(signal.SIGTERM, ours)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        executors._connect(Initialising(), None, 1.0)
        assert signal.getsignal(signal.SIGTERM) is ours
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@pytest.mark.slow
def test_sigterm_to_a_ray_sweep_is_one_line_and_exit_143(tmp_path):
    """A real local Ray: SIGTERM once the driver is connected gives the command's one line, not Ray's native
    stack dump."""
    pytest.importorskip("ray")
    from fake_cifar import cifar_pickle

    data = tmp_path / "data"
    cifar_pickle(str(data / "cifar-10-batches-py"), n=60, balanced=True)
    cmd = [sys.executable, "-m", "validation.experiments", *args(tmp_path, "--data-dir", str(data))]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd + ["--executor", "ray"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not (tmp_path / "results" / "smoke").exists():
            time.sleep(0.2)
        while time.time() < deadline and proc.poll() is None and not os.listdir(tmp_path / "results" / "smoke"):
            time.sleep(0.2)  # a worker has taken up a run: the driver is connected
        if proc.poll() is not None:
            err = proc.stderr.read()
            if "no Ray cluster at this machine" in err:
                pytest.skip(f"a local Ray did not start here: {err.strip()}")
            pytest.fail(err)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    # one line, no native stack dump; under a local Ray the driver reports the signal as an interrupt (130), not
    # always as SIGTERM (143)
    assert proc.returncode in (130, 143), err
    assert "SIGTERM received" not in err and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("python -m validation.experiments: error: ")]
    assert len(lines) == 1 and ("terminated (SIGTERM)" in lines[0] or "interrupted" in lines[0]), err
    assert err.strip().splitlines()[-1] == lines[0], err  # the command's line is the last word


# --- a run another sweep computes ------------------------------------------------------------------------------


@contextlib.contextmanager
def held_by_another_process(folder):
    """``folder`` held by another process as a running sweep's runner holds it (validation.outputs.exclusive)."""
    code = (
        "import sys; from validation.outputs import exclusive\n"
        "with exclusive(sys.argv[1]):\n    print('held', flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)],
        env={**os.environ, "PYTHONPATH": ROOT},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_run_another_sweep_is_computing_is_left_to_it_not_called_failed(tmp_path, fake_sweep, capsys):
    calls = fake_sweep(fake_runs("theirs", "mine"), lambda name: 0)
    root = tmp_path / "results" / "smoke"
    root.mkdir(parents=True)
    with held_by_another_process(root / "theirs") as pid:
        assert experiments.main(args(tmp_path)) == experiments.EXIT_PARTIAL
    out = capsys.readouterr()
    assert calls == ["mine"]
    assert f"run theirs is {BUSY} (pid {pid}): left to it" in out.out, out.out
    assert "failed" not in out.out + out.err and "1 unfinished" in out.err, out.err
    assert sorted(os.listdir(root)) == ["mine"]  # no lock file of ours left beside the runs


def test_run_unit_leaves_a_held_folder_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(dnn, "main", lambda argv: pytest.fail("the held run was started"))
    (run,) = fake_runs("theirs")
    with held_by_another_process(tmp_path / "theirs") as pid:
        assert run_unit((run,), Job(str(tmp_path), ""), {}) == [("theirs", f"{BUSY} (pid {pid})")]


# --- files read back are untrusted -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [12345, ["python"], None, 'python -m validation.dnn --lr "0.1', "python -m validation.dnn \\"]
)
def test_a_summary_whose_command_is_not_a_command_line_is_stale_not_a_crash(tmp_path, command, capsys):
    run = next(r for r in experiments.plan("smoke"))
    folder = tmp_path / "results" / "smoke" / run.name
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"command": command, "best_test_acc": 0.3}))
    st = sweep.status(run, str(folder))
    assert (st.state, st.why) == (sweep.STALE, "its recorded command does not parse")
    capsys.readouterr()
    assert experiments.main(args(tmp_path, "--list")) == 0
    (row,) = [ln for ln in capsys.readouterr().out.splitlines() if run.name in ln]
    assert row.startswith("stale: its recorded command does not parse")


def test_a_history_without_usable_timing_gives_no_estimate_rather_than_a_crash(tmp_path):
    run = experiments.Run("r", "dnn", ("--seed", "0"), 3)
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"device": ["cpu"]}))
    (folder / "history.csv").write_text("round,test_acc,wall_seconds\n1,0.5,0\n")
    st = sweep.status(run, str(folder))
    assert (st.state, st.rounds_done, st.round_seconds, st.device) == (sweep.MISSING, 1, None, None)
    # a negative time is no measurement but a damaged history (fedconvex.results): nothing of it is counted
    (folder / "history.csv").write_text("round,test_acc,wall_seconds\n1,0.5,-4\n")
    st = sweep.status(run, str(folder))
    assert (st.state, st.rounds_done) == (sweep.MISSING, 0) and "wall_seconds is -4.0, below 0" in st.why


# --- shipped runs: read in place by --list, copied whole by a sweep --------------------------------------------


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A reference/ with two finished smoke runs (copies of one summary), in place of the repository's."""
    ref = tmp_path / "reference"
    names = [r.name for r in experiments.plan("smoke")][:2]
    for n in names:
        (ref / "smoke" / n).mkdir(parents=True)
        (ref / "smoke" / n / "summary.json").write_text(json.dumps({"best_test_acc": 0.3}))
        rows = "".join(f"{k},0.3,{k}.0\n" for k in (1, 2, 3))  # the smoke profile's 3 rounds
        (ref / "smoke" / n / "history.csv").write_text("round,test_acc,wall_seconds\n" + rows)
    monkeypatch.setattr(experiments, "REFERENCE", str(ref))
    return names


def test_list_reads_the_shipped_runs_in_place_and_writes_nothing(tmp_path, shipped, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "copytree", lambda *a, **k: pytest.fail("--list copied"))
    assert experiments.main(args(tmp_path, "--list")) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "results").exists()
    for n in shipped:
        (row,) = [ln for ln in out.splitlines() if ln.endswith(n) or f"{n} " in ln]
        assert row.startswith("done")  # history.csv and summary.json of a smoke run with no command: done


@pytest.mark.parametrize("kind", ["file", "dangling link"])
def test_a_profile_folder_that_is_a_file_or_a_dangling_link_is_one_line(tmp_path, kind, capsys):
    results = tmp_path / "results"
    results.mkdir()
    if kind == "file":
        (results / "smoke").write_text("not a folder\n")
    else:
        (results / "smoke").symlink_to(tmp_path / "nowhere")
    for extra in (["--list"], []):
        line = one_line(experiments.main, args(tmp_path, *extra), capsys)
        what = "a symbolic link to nothing" if kind == "dangling link" else "not a folder"
        assert f"{results / 'smoke'} is {what}" in line
    assert not (tmp_path / "nowhere").exists()


def test_a_full_disk_while_copying_a_shipped_run_leaves_no_half_copy(tmp_path, shipped, capsys, monkeypatch):
    real_copyfile = shutil.copyfile
    copied = []

    def copyfile(src, dst, **kw):
        if copied:  # the second file of the first run: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        copied.append(src)
        return real_copyfile(src, dst, **kw)

    monkeypatch.setattr(shutil, "copyfile", copyfile)
    monkeypatch.setattr(experiments, "plan", lambda profile: [])
    line = one_line(experiments.main, args(tmp_path), capsys)
    assert "cannot copy the runs shipped in reference/smoke into" in line and "No space left on device" in line
    assert os.listdir(tmp_path / "results" / "smoke") == []  # no half-copied run, no temporary copy


def test_two_calls_copying_the_shipped_runs_at_once_both_succeed_with_one_copy(tmp_path, shipped, monkeypatch):
    """The other call copies a run between this call's look and its copy: this call's copy is dropped."""
    real_copytree = shutil.copytree
    raced = []

    def copytree(src, dst, **kw):
        if not raced:
            raced.append(src)
            experiments.seed_from_reference("smoke", str(tmp_path / "results"))  # the other call, all at once
        return real_copytree(src, dst, **kw)

    monkeypatch.setattr(shutil, "copytree", copytree)
    experiments.seed_from_reference("smoke", str(tmp_path / "results"))
    root = tmp_path / "results" / "smoke"
    assert sorted(os.listdir(root)) == sorted(shipped)
    for n in shipped:
        assert sorted(os.listdir(root / n)) == ["history.csv", "summary.json"]


# --- flags ----------------------------------------------------------------------------------------------------


def test_max_retries_without_the_ray_executor_is_refused_like_its_siblings(tmp_path, capsys):
    line = one_line(experiments.main, args(tmp_path, "--max-retries", "5"), capsys)
    assert line.endswith("--max-retries applies to --executor ray")
    assert not (tmp_path / "results").exists()


# --- figures draw; they compute only when asked -----------------------------------------------------------------


def test_figures_draw_without_computing_even_with_fedpm_data_set(tmp_path, monkeypatch, capsys):
    from figures import __main__ as figures_main

    monkeypatch.setenv("FEDPM_DATA", str(tmp_path / "data"))
    monkeypatch.setattr(figures_main, "ensure_from_args", lambda *a, **k: pytest.fail("drawing computed"))
    monkeypatch.setattr(figures_main, "draw_into", lambda out, root, profile: [os.path.join(out, "t.md")])
    argv = ["--profile", "smoke", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "figs")]
    assert figures_main.main(argv) == 0
    err = capsys.readouterr().err
    n = len(experiments.plan("smoke"))
    assert f"{n} of the smoke profile's {n} runs are not done" in err
    assert "make figures PROFILE=smoke COMPUTE=1" in err and "--compute" in err


def test_figures_compute_flags_without_compute_are_refused(tmp_path, capsys):
    from figures import __main__ as figures_main

    for extra in (["--data-dir", "D"], ["--budget-minutes", "3"], ["--executor", "ray"]):
        line = one_line(figures_main.main, ["--results", str(tmp_path)] + extra, capsys, figures_main.PROG)
        assert line.endswith(f"{extra[0]} applies to --compute (drawing reads only --results)")


def test_figures_writing_nothing_say_why_when_no_runs_are_shipped(tmp_path, monkeypatch, capsys):
    from figures import __main__ as figures_main

    monkeypatch.setattr(experiments, "REFERENCE", str(tmp_path / "no-reference"))  # a copy installed with pip
    monkeypatch.setattr(figures_main, "draw_into", lambda out, root, profile: [])
    argv = ["--profile", "smoke", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "figs")]
    assert figures_main.main(argv) == 1
    err = capsys.readouterr().err
    assert f"wrote 0 files under {tmp_path / 'figs'}" in err and "ships none in reference/smoke" in err
    assert "COMPUTE=1" in err


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_figures_passes_no_data_and_computes_only_with_compute_1():
    env = {**os.environ, "FEDPM_DATA": "/data"}
    plain = subprocess.run(["make", "-n", "figures"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert plain.returncode == 0 and "--compute" not in plain.stdout and "--data-dir" not in plain.stdout
    asked = subprocess.run(["make", "-n", "figures", "COMPUTE=1", "DATA=D"], cwd=ROOT, capture_output=True, text=True)
    assert "--compute" in asked.stdout and "--data-dir D" in asked.stdout
    refused = subprocess.run(["make", "-n", "figures", "BUDGET=3"], cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode != 0 and "apply to COMPUTE=1" in refused.stderr
