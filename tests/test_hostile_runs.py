"""Hostile cases of validation.dnn's single and stacked runs: their output folders, locks, clean-up, deadline,
warnings, resume and re-runs (docs/dnn.md, docs/robustness.md).  Tiny generated data: each run takes a second."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from argv_fuzz import snapshot  # noqa: E402  (every entry under a folder, links as links, with its files' bytes)
from fake_cifar import cifar_pickle  # noqa: E402

from fedpm_dnn.engine import checkpoint as ck  # noqa: E402
from validation import dnn, outputs, sweep  # noqa: E402

PROG = "python -m validation.dnn"
BASE = ["--dataset", "cifar10", "--method", "fedpm", "--clients", "2", "--local-epochs", "1"]
BASE += ["--batch-size", "16", "--foof-samples", "64", "--quiet", "--threads", "1"]
FEDPM = "main-cifar10-a0.1-fedpm-s"  # a stacked run's folder, as validation.experiments names it


@pytest.fixture(scope="module")
def one_thread():
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture(scope="module")
def data(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("data")
    cifar_pickle(str(root / "cifar-10-batches-py"), n=24)
    return str(root)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data):
    """A finished one-round run (its folder, to be copied)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert dnn.main(BASE + ["--data-dir", data, "--rounds", "1", "--out", str(out)]) == 0
    return out


def args(data, *extra):
    return BASE + ["--data-dir", data] + [str(a) for a in extra]


def call(argv, capsys):
    """(exit status, stdout, stderr) of validation.dnn in this process."""
    capsys.readouterr()
    try:
        rc = dnn.main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out, err


def one_line(argv, capsys) -> str:
    """The refusal: exit 2 and one line naming the cause."""
    rc, _, err = call(argv, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), err
    return lines[0]


def history_rounds(folder) -> int:
    return json.load(open(os.path.join(folder, "summary.json")))["rounds_done"]


# ------------------------------------------------------------------ 2. a lock file is never a link's target
@pytest.mark.parametrize("stacked", [False, True], ids=["single", "stack"])
def test_a_symlink_in_the_place_of_the_lock_is_refused_and_its_target_untouched(tmp_path, data, capsys, stacked):
    target = tmp_path / "precious.txt"
    target.write_text("my thesis\n")
    out = tmp_path / "out"
    if stacked:  # the lock of a stacked run lies beside its folder, inside --out
        out.mkdir()
        os.symlink(target, out / f".{FEDPM}0.fedpm-lock")
        argv = args(data, "--seeds", "0,1", "--rounds", "1", "--out", out)
    else:
        os.symlink(target, tmp_path / ".out.fedpm-lock")
        argv = args(data, "--rounds", "1", "--out", out)
    before = snapshot(tmp_path)
    line = one_line(argv, capsys)
    assert "is a symbolic link, never followed" in line, line
    assert target.read_text() == "my thesis\n" and snapshot(tmp_path) == before


def test_every_locking_writer_refuses_a_linked_or_hard_linked_lock(tmp_path):
    """The one lock (validation.outputs.exclusive) of every writing command: ResultDir (Flower, figures, the
    prepared partitions), superlinear's and dnn's --out."""
    target = tmp_path / "precious.txt"
    target.write_text("keep\n")
    os.symlink(target, tmp_path / ".a.fedpm-lock")
    os.link(target, tmp_path / ".b.fedpm-lock")
    with pytest.raises(outputs.OutputError, match="is a symbolic link, never followed"):
        with outputs.ResultDir(str(tmp_path / "a")):
            pass
    with pytest.raises(outputs.OutputError, match="has other hard links"):
        with outputs.exclusive(str(tmp_path / "b")):
            pass
    outputs.clean_stale(str(tmp_path))  # nor does the clean-up touch them
    assert target.read_text() == "keep\n" and os.path.islink(tmp_path / ".a.fedpm-lock")
    assert sorted(os.listdir(tmp_path)) == [".a.fedpm-lock", ".b.fedpm-lock", "precious.txt"]


# ------------------------------------------------------------------ 3. clean-up removes only what it proves its own
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_clean_up_removes_only_temporary_folders_it_can_prove_a_dead_run_made(tmp_path, data, finished, capsys):
    dead = _dead_pid()
    user = {}
    for name in (f".old-{dead}-mine", f".partial-{dead}-mine", f".old-{os.getppid()}-x", ".partial-1-notes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine\n")
        user[name] = "mine\n"
    left = tmp_path / f".partial-{dead}-left"  # what a killed run of this tool leaves: its marker names it
    left.mkdir()
    (left / outputs.TEMP_MARKER).write_text(json.dumps({"pid": dead, "start": None}))
    moved = tmp_path / f".old-{dead}-moved"  # killed between moving a previous result aside and the new one in
    shutil.copytree(finished, moved / "previous")
    (moved / outputs.TEMP_MARKER).write_text(json.dumps({"pid": dead, "start": None, "target": "res"}))
    assert dnn.main(args(data, "--rounds", "1", "--out", tmp_path / "new")) == 0
    for name, text in user.items():
        assert (tmp_path / name / "notes.txt").read_text() == text, name
    assert not left.exists() and not moved.exists()
    assert snapshot(tmp_path / "res") == snapshot(finished)  # put back where it stood


def test_a_marker_naming_a_living_process_or_another_pid_proves_nothing(tmp_path):
    alive = tmp_path / f".partial-{os.getpid()}-x"
    alive.mkdir()
    (alive / outputs.TEMP_MARKER).write_text(json.dumps({"pid": os.getpid(), "start": outputs.start_time(os.getpid())}))
    dead = _dead_pid()
    other = tmp_path / f".partial-{dead}-y"  # a marker copied from elsewhere: its pid is not the name's
    other.mkdir()
    (other / outputs.TEMP_MARKER).write_text(json.dumps({"pid": dead + 1, "start": None}))
    linked = tmp_path / f".old-{dead}-z"  # a link of that name: never followed, never removed
    os.symlink(alive, linked)
    outputs.clean_stale(str(tmp_path))
    assert alive.exists() and other.exists() and os.path.islink(linked)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--run-names", ".old-1-a,b", "--seeds", "0,1"], "--run-names: .old-1-a: a name this tool reserves"),
        (["--run-names", ".x.fedpm-lock,b", "--seeds", "0,1"], "a name this tool reserves"),
        (["--out", "{T}/.partial-7-z"], "--out {T}/.partial-7-z: .partial-7-z: a name this tool reserves"),
        (["--seeds", "0,1", "--out", "{T}/.old-7-z"], "a name this tool reserves"),
        (["--out", "{T}/" + "n" * 250], "at most 243 (its lock file must fit)"),
    ],
    ids=["run-name-old", "run-name-lock", "out-partial", "stack-out-old", "out-too-long"],
)
def test_names_the_tool_reserves_are_refused(tmp_path, data, capsys, argv, fragment):
    argv = [a.replace("{T}", str(tmp_path)) for a in argv]
    before = snapshot(tmp_path)
    line = one_line(args(data, "--rounds", "1", *argv), capsys)
    assert fragment.replace("{T}", str(tmp_path)) in line, line
    assert snapshot(tmp_path) == before


NAME_PARTS = st.sampled_from([".partial-", ".old-", ".fedpm-lock", ".fedpm-result", ".fedpm-temp", "-", ".", "a"])
NAMES = st.one_of(
    st.lists(st.one_of(NAME_PARTS, st.integers(0, 99999).map(str)), min_size=1, max_size=6).map("".join),
    st.text(alphabet="ab.-_0123456789", min_size=1, max_size=300),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=NAMES)
def test_a_name_is_refused_or_safe_from_the_clean_up_and_its_lock_never_follows_a_link(tmp_path_factory, name):
    """Whatever the name: --out is refused in one line (a reserved or overlong name), or it is one the clean-up
    never removes, and a link in its lock's place is refused with its target untouched."""
    root = tmp_path_factory.mktemp("names")
    path = os.path.join(root, name)
    try:
        outputs.check_out(path)
    except outputs.OutputError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("--out ")
        return
    if name in (".", ".."):
        return
    os.mkdir(path)
    with open(os.path.join(path, "notes.txt"), "w") as fh:
        fh.write("mine")
    target = os.path.join(root, "target")
    with open(target, "w") as fh:
        fh.write("keep")
    os.symlink(target, outputs._lock_path(path))
    outputs.clean_stale(str(root))
    assert open(os.path.join(path, "notes.txt")).read() == "mine"
    with pytest.raises(outputs.OutputError, match="never followed"):
        with outputs.exclusive(path):
            pass
    assert open(target).read() == "keep"


# ------------------------------------------------------------------ 5. a stack keeps --deadline
def test_a_stack_stops_at_its_deadline_checkpointed_with_exit_75(tmp_path, data, capsys):
    rc, out, _ = call(args(data, "--seeds", "0,1", "--rounds", "2", "--deadline", "1", "--out", tmp_path), capsys)
    assert rc == dnn.EXIT_PARTIAL and "stopped at --deadline" in out, out
    for s in "01":
        assert history_rounds(tmp_path / f"{FEDPM}{s}") == 1
    rc, _, _ = call(args(data, "--seeds", "0,1", "--rounds", "2", "--resume", "--out", tmp_path), capsys)
    assert rc == 0 and all(history_rounds(tmp_path / f"{FEDPM}{s}") == 2 for s in "01")


# ------------------------------------------------------------------ 16. a stack is never nested in a run's folder
def test_a_stack_into_a_single_runs_folder_is_refused(tmp_path, data, finished, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = snapshot(tmp_path)
    line = one_line(args(data, "--seeds", "0,1", "--rounds", "2", "--resume", "--out", run), capsys)
    assert f"--out {run}: is the result folder of {PROG}; a stack's --out is the parent" in line, line
    assert snapshot(tmp_path) == before


def test_a_stack_into_a_symlink_is_refused(tmp_path, data, capsys):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    line = one_line(args(data, "--seeds", "0,1", "--rounds", "1", "--out", tmp_path / "link"), capsys)
    assert "is a symbolic link; give the real folder" in line and not os.listdir(tmp_path / "real")


# ------------------------------------------------------------------ 24. FEMNIST has no Dirichlet split
@pytest.mark.parametrize(
    "flag", [["--alpha", "0.5"], ["--split", "dirichlet"], ["--split", "relaysum"], ["--split-seed", "3"]]
)
def test_femnist_refuses_the_dirichlet_splits_flags(tmp_path, capsys, flag):
    argv = ["--dataset", "femnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "o"), *flag]
    line = one_line(argv, capsys)
    assert f"{flag[0]} does not apply to --dataset femnist" in line, line
    assert os.listdir(tmp_path) == []


def test_femnist_takes_split_seed_for_its_test_subset():
    a = dnn.parse_args(["--dataset", "femnist", "--split-seed", "3", "--test-subset", "62", "--out", "x"])
    assert a.split_seed == 3


# ------------------------------------------------------------------ 25. nothing left when a stack fails early
def test_a_stack_failing_before_its_first_round_leaves_no_parent(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "stack"
    line = one_line(BASE + ["--data-dir", str(tmp_path / "nodata"), "--seeds", "0,1", "--out", str(out)], capsys)
    assert "nodata" in line and os.listdir(tmp_path) == []


def test_a_single_run_failing_before_its_first_round_leaves_no_parent(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "run"
    one_line(BASE + ["--data-dir", str(tmp_path / "nodata"), "--out", str(out)], capsys)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ 27. a stack warns as a single run does
def test_a_stack_warns_of_flags_overriding_its_preset_as_a_single_run_does(tmp_path, data, capsys):
    preset = ["--preset", "cifar10-a0.1", "--rounds", "1"]
    _, _, single = call(args(data, *preset, "--out", tmp_path / "one"), capsys)
    rc, _, stacked = call(args(data, *preset, "--seeds", "0,1", "--out", tmp_path / "stack"), capsys)
    warning = [ln for ln in single.splitlines() if "warning" in ln]
    assert rc == 0 and len(warning) == 1 and "override preset cifar10-a0.1's" in warning[0]
    assert [ln for ln in stacked.splitlines() if "warning" in ln] == warning


# ------------------------------------------------------------------ 28. a stack's resume advice can be followed
def test_a_stacked_run_checkpointed_by_the_sequential_engine_is_told_to_resume_alone(tmp_path, data, capsys):
    s0 = tmp_path / f"{FEDPM}0"
    assert dnn.main(args(data, "--seed", "0", "--rounds", "1", "--engine", "sequential", "--out", s0)) == 0
    rc, _, err = call(args(data, "--seeds", "0,1", "--rounds", "2", "--resume", "--out", tmp_path), capsys)
    assert rc == 1, err
    line = next(ln for ln in err.splitlines() if f"{FEDPM}0" in ln)
    assert "resume this run alone, with --engine sequential --out" in line and "(resume with" not in line, line
    assert history_rounds(tmp_path / f"{FEDPM}1") == 2 and history_rounds(s0) == 1


# ------------------------------------------------------------------ 30. settings compared resolved
def test_flags_spelling_out_defaults_are_no_difference_to_the_sweep():
    argv = ["--dataset", "cifar10", "--preset", "cifar10-a0.1", "--alpha", "0.1", "--method", "fedpm"]
    argv += ["--seed", "2", "--rounds", "4", "--train-subset", "3000"]
    spelled = ["--foof-apply", "solve", "--split-seed", "2", "--clients", "10", "--local-epochs", "5"]
    assert dnn.command_fingerprint(argv + spelled) == dnn.command_fingerprint(argv)
    assert dnn.command_fingerprint(argv + ["--split-seed", "3"]) != dnn.command_fingerprint(argv)


def test_a_finished_run_recorded_with_spelled_out_defaults_is_done_for_the_sweep(tmp_path, data, finished):
    from validation.experiments import Run

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    summary = json.load(open(run / "summary.json"))
    summary["command"] += " --foof-apply solve --split-seed 0"
    (run / "summary.json").write_text(json.dumps(summary))
    want = Run("r", "dnn", tuple(BASE + ["--rounds", "1"]), 1)
    assert sweep.status(want, str(run)).state == sweep.DONE


def test_resume_with_the_presets_own_values_spelled_out_continues(tmp_path, data, capsys):
    out = tmp_path / "run"
    plain = [a for a in args(data) if a not in ("--clients", "2")]  # the default 10 clients
    assert dnn.main(plain + ["--rounds", "1", "--out", str(out)]) == 0
    spelled = ["--clients", "10", "--split-seed", "0", "--foof-apply", "solve", "--seed", "0"]
    rc, _, err = call(plain + spelled + ["--rounds", "2", "--resume", "--out", str(out)], capsys)
    assert rc == 0 and history_rounds(out) == 2, err
    line = one_line(
        plain + ["--clients", "10", "--train-subset", "50", "--rounds", "3", "--resume", "--out", str(out)], capsys
    )
    assert "(--train-subset: checkpoint has None, this run 50)" in line, line


def test_a_checkpoint_recording_flags_as_given_still_resumes(tmp_path, data, finished, capsys):
    """Checkpoints written before the settings were compared resolved recorded each flag as given."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    old = {f"run.{k}": None for k in dnn.HYPERPARAMETER_FLAGS}
    saved["fingerprint"] = {**saved["fingerprint"], **old, "run.clients": 2, "run.local_epochs": 1}
    saved["fingerprint"].update({"run.foof_samples": "64", "run.participants": None, "run.split_seed": 0})
    torch.save(saved, run / "checkpoint.pt")
    rc, _, err = call(args(data, "--rounds", "2", "--resume", "--out", run), capsys)
    assert rc == 0 and history_rounds(run) == 2, err
    assert ck.first_difference(saved["fingerprint"], {**saved["fingerprint"], "run.split_seed": 5}) == (
        "--split-seed: checkpoint has None, this run 5"
    )


# ------------------------------------------------------------------ default --out, re-runs, --overwrite
README_QUICK = ["--dataset", "cifar10", "--model", "cnn", "--method", "fedpm", "--preset", "cifar10-a0.1"]
README_QUICK += ["--alpha", "0.1", "--rounds", "4", "--seed", "0", "--train-subset", "3000", "--test-subset", "2000"]
README_GPU = ["--dataset", "cifar10", "--model", "cnn", "--method", "fedpm", "--preset", "cifar10-a0.1"]
README_GPU += ["--alpha", "0.1", "--clients", "10", "--rounds", "100", "--seed", "0", "--device", "cuda"]


def test_default_folders_name_what_differs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quick, gpu = (dnn.parse_args(a).out for a in (README_QUICK, README_GPU))
    assert quick != gpu
    assert quick == os.path.join("results", "dnn-cifar10-a0.1-fedpm-s0-r4-train3000-test2000")
    assert gpu == os.path.join("results", "dnn-cifar10-a0.1-fedpm-s0-r100")  # --clients 10: the preset's own
    others = [["--lr", "0.3"], ["--alpha", "1.0"], ["--seed", "1"], ["--model", "resnet18gn"], ["--clients", "5"]]
    names = {dnn.parse_args(README_QUICK + o).out for o in others} | {quick}
    assert len(names) == len(others) + 1
    stack = dnn.parse_args(README_QUICK[:-6] + ["--seeds", "0,1"]).out
    assert stack == os.path.join("results", "dnn-stack-cifar10-a0.1-fedpm-r4")


def test_rerunning_a_finished_run_says_so_and_exits_0_and_overwrite_recomputes(tmp_path, data, finished, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = snapshot(run)
    rc, out, err = call(args(data, "--rounds", "1", "--out", run), capsys)
    assert rc == 0 and f"{run} already holds this run (1 round, best test accuracy" in out, err
    assert snapshot(run) == before
    line = one_line(args(data, "--rounds", "2", "--out", run), capsys)
    assert "holds 1 of the 2 rounds of this run; pass --resume to continue it, or --overwrite" in line
    line = one_line(args(data, "--rounds", "1", "--alpha", "0.5", "--out", run), capsys)
    assert "holds another run (--alpha: checkpoint has 0.1, this run 0.5); choose another --out, or --over" in line
    assert snapshot(run) == before
    rc, _, _ = call(args(data, "--rounds", "1", "--alpha", "0.5", "--out", run, "--overwrite"), capsys)
    assert rc == 0 and json.load(open(run / "summary.json"))["alpha"] == 0.5
    assert "--resume and --overwrite" in one_line(args(data, "--out", run, "--overwrite", "--resume"), capsys)


def test_a_stack_rerun_computes_only_its_unfinished_runs(tmp_path, data, capsys):
    s0 = tmp_path / f"{FEDPM}0"
    assert dnn.main(args(data, "--rounds", "1", "--engine", "vectorized", "--out", s0)) == 0
    before = snapshot(s0)
    rc, out, err = call(args(data, "--seeds", "0,1", "--rounds", "1", "--out", tmp_path), capsys)
    assert rc == 0 and f"{FEDPM}0 already holds this run" in out and "1 of 1 runs done" in out, err
    assert snapshot(s0) == before
    assert history_rounds(tmp_path / f"{FEDPM}1") == 1
