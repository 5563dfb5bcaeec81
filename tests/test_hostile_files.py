"""Hostile files, outputs, caches, disks and resumes.  Each case ends with one line naming its cause (exit 2, no
traceback) and leaves everything as it was, or does exactly what was asked: no FIFO or device is read, nothing of
someone else's is replaced, two runs never share an output folder, a cache answers for the data it was made from
(or is rebuilt), a full disk is named, and a resume never cuts a run short."""

# ruff: noqa: F811  (the fixtures of test_hostile_inputs, imported, are the tests' arguments)

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fake_cifar import cifar_images  # noqa: E402
from test_hostile_inputs import (  # noqa: E402, F401  (fixtures: base, one_thread, work)
    DNN,
    PROGS,
    ROOT,
    S,
    base,
    one_thread,
    snapshot,
    work,
)

from fedconvex.files import DamagedFile, NotARegularFile, read_regular  # noqa: E402
from fedpm_dnn.data import DatasetError  # noqa: E402
from fedpm_dnn.data import cifar as cifar_mod  # noqa: E402
from fedpm_dnn.data.femnist import load_femnist  # noqa: E402
from fedpm_flower.deploy import _zombie  # noqa: E402
from figures import __main__ as figures_main  # noqa: E402
from validation import dnn, experiments, flower, outputs, report, superlinear  # noqa: E402


def one_line(module, argv, capsys):
    """Run a command in-process; it must end with exit 2 and one line naming the cause; that line."""
    capsys.readouterr()
    try:
        rc = module.main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"{PROGS[module]}: error: "), lines[0]
    return lines[0]


@contextlib.contextmanager
def at_most(seconds):
    """A read that blocks (a FIFO never opened for writing) fails the case instead of hanging the suite."""

    def fire(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def dnn_args(w, *extra):
    return [a.replace("{W}", str(w)) for a in DNN] + list(extra)


# ------------------------------------------------------------------ 1. inputs are regular files
def _leaf(root):
    for split in ("train", "test"):
        os.makedirs(root / split)
        user = {"x": [[0.5] * 784] * 2, "y": [1, 2]}
        (root / split / "a.json").write_text(json.dumps({"users": ["u"], "num_samples": [2], "user_data": {"u": user}}))


def _fifo(path):
    os.mkfifo(path)


def _dev_zero(path):
    os.symlink("/dev/zero", path)


def _loop(path):
    os.symlink(os.path.basename(path), path)  # a link to itself


@pytest.mark.parametrize("make", [_fifo, _dev_zero, _loop], ids=["fifo", "dev-zero", "link-loop"])
@pytest.mark.parametrize("where", ["jpeg-folder", "leaf-json", "pickle-batch"])
def test_a_fifo_device_or_link_loop_named_as_data_is_refused_at_once(tmp_path, make, where):
    if where == "jpeg-folder":
        cifar_images(str(tmp_path / "d"), n_train=2, n_test=1)
        bad = tmp_path / "d" / "train" / "cat" / "9.jpg"
        load = lambda: cifar_mod.load_cifar_jpeg(str(tmp_path / "d"), str(tmp_path / "d"), str(tmp_path / "c"))  # noqa: E731
    elif where == "leaf-json":
        _leaf(tmp_path / "d")
        bad = tmp_path / "d" / "train" / "b.json"
        load = lambda: load_femnist(str(tmp_path / "d"))  # noqa: E731
    else:
        from fake_cifar import cifar_pickle

        cifar_pickle(str(tmp_path / "d"), n=10)
        bad = tmp_path / "d" / "data_batch_3"
        os.remove(bad)
        load = lambda: cifar_mod.load_cifar_pickle(str(tmp_path / "d"))  # noqa: E731
    make(str(bad))
    with at_most(20), pytest.raises(DatasetError) as exc:
        load()
    assert str(exc.value).startswith(str(bad)) and ("not a regular file" in str(exc.value) or "loop" in str(exc.value))


@pytest.mark.parametrize("name", ["train.npz", "meta.json"])
def test_a_fifo_in_a_prepared_flower_folder_is_refused_at_once(tmp_path, name):
    from fedpm_flower import prepared

    prepared.write(str(tmp_path), "train.npz", np.zeros((2, 3, 4, 4)), [0, 1], {"classes": 2})
    os.remove(tmp_path / name)
    os.mkfifo(tmp_path / name)
    with at_most(20), pytest.raises(ValueError, match=f"{tmp_path / name}: is a FIFO, not a regular file"):
        prepared.load(str(tmp_path), "train.npz")


def test_a_fifo_in_the_data_folder_is_one_line_from_the_command(tmp_path, capsys, one_thread):
    cifar_images(str(tmp_path / "d"), n_train=2, n_test=1)
    os.mkfifo(tmp_path / "d" / "test" / "dog" / "x.jpg")
    args = ["--data-dir", str(tmp_path / "d"), "--cache-dir", str(tmp_path / "c"), "--rounds", "1", "--clients", "2"]
    with at_most(60):
        line = one_line(dnn, args + ["--out", str(tmp_path / "out"), "--quiet"], capsys)
    assert "x.jpg: is a FIFO, not a regular file" in line and not (tmp_path / "out").exists()


def test_read_regular_reads_a_link_to_a_file_and_bounds_what_it_reads(tmp_path):
    (tmp_path / "f").write_bytes(b"12345")
    os.symlink(tmp_path / "f", tmp_path / "link")  # data folders of links are common: followed to the file
    assert read_regular(str(tmp_path / "link"), limit=5) == b"12345"
    with pytest.raises(NotARegularFile, match="5 bytes, more than the 4"):
        read_regular(str(tmp_path / "f"), limit=4)


# ------------------------------------------------------------------ 2. an output is ours alone
@pytest.mark.parametrize(
    "module,files,argv",
    [
        (superlinear, ("summary.json", "history.csv"), S),
        (dnn, ("summary.json", "history.csv"), dnn_args("{W}", "--rounds", "1")),
        (dnn, ("checkpoint.pt",), dnn_args("{W}", "--rounds", "1", "--resume")),
        (flower, ("result.json",), []),
    ],
    ids=["superlinear", "dnn", "dnn-resume", "flower"],
)
def test_someone_elses_result_files_are_never_replaced(work, capsys, module, files, argv):
    """Files named as ours but without the marker are someone else's: refused, named, left as they are."""
    theirs = work / "theirs"
    theirs.mkdir()
    for f in files:
        (theirs / f).write_text("mine\n")
    before = snapshot(work)
    line = one_line(module, [a.replace("{W}", str(work)) for a in argv] + ["--out", str(theirs)], capsys)
    assert f"--out {theirs}: is not a previous result of this tool: it holds {sorted(files)[0]}" in line
    assert snapshot(work) == before


def test_the_convex_experiment_never_replaces_a_dnn_run(work, capsys):
    before = snapshot(work)
    line = one_line(superlinear, S + ["--out", str(work / "run")], capsys)
    assert f"--out {work / 'run'}: holds a result of python -m validation.dnn" in line
    assert snapshot(work) == before


@pytest.mark.parametrize("module", [superlinear, figures_main])
def test_a_file_put_into_a_result_of_ours_is_never_deleted(work, capsys, module):
    out = work / "ours"
    out.mkdir()
    outputs.mark(str(out), PROGS[module])
    (out / "summary.json" if module is superlinear else out / "table3_accuracy.md").write_text("ours\n")
    (out / "notes.txt").write_text("my notes\n")
    argv = S if module is superlinear else ["--no-compute", "--results", str(work / "none")]
    before = snapshot(work)
    line = one_line(module, argv + ["--out", str(out)], capsys)
    assert f"--out {out}: holds notes.txt, which {PROGS[module]} does not write" in line
    assert snapshot(work) == before


def test_a_result_of_an_earlier_version_is_replaced_only_by_files_of_the_same_command(tmp_path):
    """A marker without a command (written before markers named one): its folder is ours, but only a command that
    writes every file in it may replace it (a DNN checkpoint is never dropped by the convex experiment)."""
    old = tmp_path / "old"
    old.mkdir()
    (old / outputs.MARKER).write_text("written by the FedPM toolkit; this folder may be replaced by a later run\n")
    for f in ("history.csv", "summary.json", "checkpoint.pt"):
        (old / f).write_text("x")
    outputs.check_out(str(old), kind=dnn.OUTPUT)
    with pytest.raises(outputs.OutputError, match="holds checkpoint.pt, which python -m validation.superlinear"):
        outputs.check_out(str(old), kind=superlinear.OUTPUT)


# ------------------------------------------------------------------ 3. two runs never share an output folder
HOLD = (
    "import sys; from validation.outputs import exclusive\n"
    "with exclusive(sys.argv[1]):\n print('held', flush=True)\n sys.stdin.read()\n"
)


def _holder(out):
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_into_a_folder_being_written_is_refused(base, tmp_path, capsys):
    out = tmp_path / "run"
    p = _holder(out)
    try:
        line = one_line(dnn, dnn_args(base, "--rounds", "1", "--out", str(out)), capsys)
        assert f"--out {out}: another run (pid {p.pid}) is writing into it" in line
        line = one_line(superlinear, S + ["--out", str(out)], capsys)  # refused before it computes anything
        assert f"--out {out}: another run (pid {p.pid}) is writing into it" in line
        with pytest.raises(outputs.OutputError, match=f"another run \\(pid {p.pid}\\)"):
            with outputs.ResultDir(str(out)):
                pass
        assert not out.exists()
    finally:
        p.communicate("")
    assert dnn.main(dnn_args(base, "--rounds", "1", "--out", str(out))) == 0  # its turn now
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no lock file left


@pytest.mark.slow
def test_two_dnn_runs_into_one_out_the_second_is_refused(base, tmp_path, capsys):
    """The real thing: a run in progress (a separate process) and a second one started into its --out."""
    out = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-m", "validation.dnn", *dnn_args(base, "--rounds", "100", "--out", str(out))],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not (out / outputs.MARKER).exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        line = one_line(dnn, dnn_args(base, "--rounds", "1", "--out", str(out)), capsys)
        assert "another run (pid" in line or "checkpoint.pt exists" in line
        line = one_line(dnn, dnn_args(base, "--rounds", "1", "--resume", "--out", str(out)), capsys)
        assert f"--out {out}: another run (pid {p.pid}) is writing into it" in line or "does not exist" in line
    finally:
        p.terminate()
        err = p.communicate(timeout=120)[1]
    assert p.returncode == 143 and "Traceback" not in err, err
    assert set(os.listdir(tmp_path)) <= {"run"}  # no lock file left


def test_the_lock_of_a_killed_run_is_taken_and_removed(base, tmp_path):
    out = tmp_path / "run"
    p = _holder(out)
    p.kill()
    p.wait()
    lock = tmp_path / ".run.fedpm-lock"
    assert lock.exists()  # what a kill -9 leaves
    with outputs.ResultDir(str(out)) as tmp:
        open(os.path.join(tmp, "summary.json"), "w").write("{}")
    assert sorted(os.listdir(tmp_path)) == ["run"]
    p = _holder(out)  # killed again; a dnn run into another folder beside it removes what it left
    p.kill()
    p.wait()
    assert dnn.main(dnn_args(base, "--rounds", "1", "--out", str(tmp_path / "other"))) == 0
    assert sorted(os.listdir(tmp_path)) == ["other", "run"]


# a run holding the lock forks a child (here one that sleeps; in a real run a subprocess between fork and exec) and
# is killed with -9: the child holds the lock's descriptor after its run has ended
FORKS = (
    "import os, sys, time; from validation.outputs import exclusive\n"
    "with exclusive(sys.argv[1]):\n"
    " child = os.fork()\n"
    " if child == 0:\n  time.sleep(float(sys.argv[2])); os._exit(0)\n"
    " print(child, flush=True)\n sys.stdin.read()\n"
)


def _killed_with_a_child(out, child_seconds):
    """(the killed run's pid, its child's pid): the run killed with -9 while its child, holding the lock, sleeps."""
    p = subprocess.Popen(
        [sys.executable, "-c", FORKS, str(out), str(child_seconds)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(p.stdout.readline())
    p.kill()
    p.wait()
    return p.pid, child


def test_a_lock_held_by_a_killed_runs_child_is_waited_for_then_taken(tmp_path):
    out = tmp_path / "run"
    _, child = _killed_with_a_child(out, 1.0)
    start = time.monotonic()
    with outputs.ResultDir(str(out)) as tmp:  # taken once the child has ended, not refused
        assert time.monotonic() - start > 0.2
        assert _zombie(child)  # gone, or ended and not yet reaped by whoever adopted it
        open(os.path.join(tmp, "summary.json"), "w").write("{}")
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_lock_a_killed_runs_child_keeps_is_refused_naming_the_ended_run(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run, child = _killed_with_a_child(out, 60.0)
    monkeypatch.setattr(outputs, "ORPHAN_WAIT", 0.3)
    try:
        with pytest.raises(outputs.OutputError) as exc:
            with outputs.ResultDir(str(out)):
                pass
        assert str(exc.value) == (
            f"--out {out}: its run (pid {run}) has ended, but a process it started still holds its lock; wait for "
            "that process to end or choose another --out"
        )
        assert not out.exists()
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not _zombie(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    with outputs.ResultDir(str(out)):
        pass
    assert sorted(os.listdir(tmp_path)) == ["run"]


# ------------------------------------------------------------------ 4, 15. the decoded-CIFAR cache
def _load(src, cache):
    return cifar_mod.load_cifar_jpeg(str(src), str(src), str(cache))


def test_deleting_a_class_is_seen_through_the_cache(tmp_path):
    cifar_images(str(tmp_path / "d"), n_train=3, n_test=2)
    assert _load(tmp_path / "d", tmp_path / "c").classes == ("cat", "dog", "frog", "ship")
    stamp = os.stat(tmp_path / "d").st_mtime_ns
    for split in ("train", "test"):
        shutil.rmtree(tmp_path / "d" / split / "ship")
    os.utime(tmp_path / "d", ns=(stamp, stamp))
    data = _load(tmp_path / "d", tmp_path / "c")
    assert data.classes == ("cat", "dog", "frog") and len(data.y_train) == 9 and len(data.y_test) == 6


def test_a_rewritten_zip_of_the_same_size_and_time_is_decoded_again(tmp_path):
    def zipped(seed):
        cifar_images(str(tmp_path / f"s{seed}"), n_train=2, n_test=1, seed=seed)
        with zipfile.ZipFile(tmp_path / "data.zip", "w", zipfile.ZIP_STORED) as z:
            for d, _, fs in sorted(os.walk(tmp_path / f"s{seed}")):
                for f in sorted(fs):
                    z.write(os.path.join(d, f), os.path.relpath(os.path.join(d, f), tmp_path / f"s{seed}"))
        os.utime(tmp_path / "data.zip", ns=(10**18, 10**18))

    zipped(0)
    first = _load(tmp_path / "data.zip", tmp_path / "c")
    size = os.path.getsize(tmp_path / "data.zip")
    zipped(1)
    assert os.path.getsize(tmp_path / "data.zip") == size
    again = _load(tmp_path / "data.zip", tmp_path / "c")
    fresh = _load(tmp_path / "data.zip", tmp_path / "fresh-cache")
    assert not np.array_equal(first.x_train, again.x_train) and np.array_equal(again.x_train, fresh.x_train)


def test_resume_after_every_image_was_replaced_is_refused(tmp_path, capsys, one_thread):
    cifar_images(str(tmp_path / "d"), n_train=12, n_test=4)
    args = ["--data-dir", str(tmp_path / "d"), "--cache-dir", str(tmp_path / "c"), "--clients", "2", "--quiet"]
    args += ["--local-epochs", "1", "--foof-samples", "64", "--out", str(tmp_path / "run")]
    assert dnn.main(args + ["--rounds", "1"]) == 0
    stamps = {d: os.stat(d).st_mtime_ns for d, _, _ in os.walk(tmp_path / "d")}
    cifar_images(str(tmp_path / "d"), n_train=12, n_test=4, seed=7)  # every image rewritten in place, same sizes
    for d, t in stamps.items():
        os.utime(d, ns=(t, t))
    before = snapshot(tmp_path / "run")
    line = one_line(dnn, args + ["--rounds", "2", "--resume"], capsys)
    assert "written by a different configuration (the data (partition, subsets or files) differ)" in line
    assert snapshot(tmp_path / "run") == before


def _damage(cache, how):
    if how == "garbage":
        cache.write_bytes(b"not a zip at all")
    elif how == "truncated":
        cache.write_bytes(cache.read_bytes()[:300])
    elif how == "missing-entry":
        with np.load(cache) as z:
            kept = {k: z[k] for k in z.files if k != "y_test"}
        np.savez(cache, **kept)
    elif how == "objects":
        with np.load(cache) as z:
            kept = {k: z[k] for k in z.files}
        np.savez(cache, **{**kept, "classes": np.array([{"a": 1}], dtype=object)})
    elif how == "wrong-shape":
        with np.load(cache) as z:
            kept = {k: z[k] for k in z.files}
        np.savez(cache, **{**kept, "x_train": kept["x_train"][:, :1]})


@pytest.mark.parametrize("how", ["garbage", "truncated", "missing-entry", "objects", "wrong-shape"])
def test_a_damaged_decoded_cache_is_rebuilt(tmp_path, how):
    cifar_images(str(tmp_path / "d"), n_train=2, n_test=1)
    first = _load(tmp_path / "d", tmp_path / "c")
    (cache,) = (tmp_path / "c").iterdir()
    _damage(cache, how)
    again = _load(tmp_path / "d", tmp_path / "c")
    assert np.array_equal(first.x_train, again.x_train) and np.array_equal(first.y_test, again.y_test)
    assert first.classes == again.classes and os.listdir(tmp_path / "c") == [cache.name]
    third = _load(tmp_path / "d", tmp_path / "c")  # the rewritten cache serves
    assert np.array_equal(first.x_test, third.x_test)


def test_a_folder_in_the_place_of_the_cache_is_one_clear_error(tmp_path):
    cifar_images(str(tmp_path / "d"), n_train=2, n_test=1)
    _load(tmp_path / "d", tmp_path / "c")
    (cache,) = (tmp_path / "c").iterdir()
    cache.unlink()
    cache.mkdir()
    with pytest.raises(DatasetError, match=f"decoded-image cache: {cache}: is not a regular file"):
        _load(tmp_path / "d", tmp_path / "c")


def test_a_huge_zip_member_is_refused_before_it_is_inflated(tmp_path):
    cifar_images(str(tmp_path / "s"), n_train=1, n_test=1)
    with zipfile.ZipFile(tmp_path / "data.zip", "w", zipfile.ZIP_DEFLATED) as z:
        for d, _, fs in os.walk(tmp_path / "s"):
            for f in fs:
                z.write(os.path.join(d, f), os.path.relpath(os.path.join(d, f), tmp_path / "s"))
        z.writestr("train/cat/bomb.jpg", b"\0" * (64 * 2**20))  # 64 MiB of zeros: 64 kB in the zip
    with pytest.raises(DatasetError, match="train/cat/bomb.jpg: 67108864 bytes, more than an image"):
        _load(tmp_path / "data.zip", tmp_path / "c")


def test_an_undecodable_image_names_the_file_and_why(tmp_path):
    cifar_images(str(tmp_path / "d"), n_train=1, n_test=1)
    (tmp_path / "d" / "train" / "cat" / "0.png").write_bytes(b"")
    with pytest.raises(DatasetError, match=r"train/cat/0.png: cannot decode image \(UnidentifiedImageError: .+\)"):
        _load(tmp_path / "d", tmp_path / "c")


# ------------------------------------------------------------------ 13. damaged results
def _results(base, root, damage=None):
    """A one-run results tree for the figures (a copy of the DNN run), its summary or history damaged."""
    run = root / "quick" / "main-cifar10-a0.1-fedpm-s0"
    shutil.copytree(base / "run", run)
    if damage == "summary-not-json":
        (run / "summary.json").write_text('{"best_test_acc": 0.3,')
    elif damage == "summary-text-accuracy":
        s = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**s, "best_test_acc": "high"}))
    elif damage == "summary-no-accuracy":
        s = json.loads((run / "summary.json").read_text())
        del s["best_test_acc"]
        (run / "summary.json").write_text(json.dumps(s))
    elif damage == "summary-list":
        (run / "summary.json").write_text("[1, 2]")
    elif damage == "history-short-row":
        (run / "history.csv").write_text((run / "history.csv").read_text() + "2,0.5\n")
    elif damage == "history-binary":
        (run / "history.csv").write_bytes(bytes(range(256)))
    elif damage == "history-text-cell":
        lines = (run / "history.csv").read_text().splitlines()
        head, row = lines[0].split(","), lines[1].split(",")
        row[head.index("test_acc")] = "high"
        (run / "history.csv").write_text("\n".join([lines[0], ",".join(row)]) + "\n")
    return run


DAMAGES = [
    "summary-not-json",
    "summary-text-accuracy",
    "summary-no-accuracy",
    "summary-list",
    "history-short-row",
    "history-binary",
    "history-text-cell",
]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_result_is_named_by_its_reader(base, tmp_path, damage):
    from figures import results

    run = _results(base, tmp_path / "results", damage)
    name = "summary.json" if damage.startswith("summary") else "history.csv"
    with pytest.raises(DamagedFile) as exc:
        summary = results.read_summary(run)
        history = results.read_history(run)
        summary["best_test_acc"], history["test_acc"]  # what the figures read first
    assert str(run / name) in str(exc.value) and ("damaged" in str(exc.value) or "not a history" in str(exc.value))


def test_figures_name_a_damaged_result_and_a_rerun_after_the_repair_works(base, tmp_path, capsys):
    run = _results(base, tmp_path / "results", "history-text-cell")
    out = tmp_path / "figs"
    args = ["--no-compute", "--results", str(tmp_path / "results"), "--out", str(out)]
    line = one_line(figures_main, args, capsys)
    assert f"{run / 'history.csv'}: damaged (line 2: test_acc is 'high', not a finite number)" in line
    shutil.copy(base / "run" / "history.csv", run / "history.csv")  # repaired: the folder it began is taken again
    assert figures_main.main(args) == 0 and (out / "table3_accuracy.md").exists()


def test_experiments_list_names_a_damaged_summary_and_keeps_it(base, tmp_path, capsys):
    """--list names the damaged file and its cause; the sweep never overwrites it (validation/sweep.py: stale)."""
    run = _results(base, tmp_path / "results", "summary-not-json")
    capsys.readouterr()
    assert experiments.main(["--list", "--out", str(tmp_path / "results")]) == 0
    out = capsys.readouterr()
    (row,) = [ln for ln in out.out.splitlines() if run.name in ln]
    assert row.startswith("stale: summary.json does not parse") and "move it away to recompute" in row
    assert not out.err and (run / "summary.json").read_text() == '{"best_test_acc": 0.3,'


def test_experiments_list_names_a_fifo_in_place_of_a_summary_at_once(base, tmp_path, capsys):
    """A FIFO named summary.json: a plain open would wait forever for a writer."""
    run = _results(base, tmp_path / "results")
    os.remove(run / "summary.json")
    os.mkfifo(run / "summary.json")
    capsys.readouterr()
    with at_most(20):
        assert experiments.main(["--list", "--out", str(tmp_path / "results")]) == 0
    (row,) = [ln for ln in capsys.readouterr().out.splitlines() if run.name in ln]
    assert row.startswith("stale: summary.json does not parse") and "is a FIFO, not a regular file" in row


def _hidden_enospc(*a, **k):
    """What matplotlib's PDF writer raises on a full disk: its own AttributeError, the OSError behind it."""
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise AttributeError("'Stream' object has no attribute 'pos'") from None


@pytest.mark.parametrize(
    "failure",
    [_hidden_enospc, lambda *a, **k: (_ for _ in ()).throw(PermissionError(errno.EROFS, "Read-only file system"))],
    ids=["full-disk", "read-only"],
)
def test_figures_on_a_full_disk_or_a_read_only_folder_is_one_line(base, tmp_path, capsys, monkeypatch, failure):
    from figures import draw

    _results(base, tmp_path / "results")
    monkeypatch.setattr(draw.plt.Figure, "savefig", failure)
    out = tmp_path / "figs"
    line = one_line(figures_main, ["--no-compute", "--results", str(tmp_path / "results"), "--out", str(out)], capsys)
    assert line.endswith(f"--out {out}: cannot be written (No space left on device)") or "Read-only" in line


# ------------------------------------------------------------------ 14. a full disk
def test_a_full_disk_in_the_convex_experiment_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report, "plot_convergence", _hidden_enospc)
    out = tmp_path / "out"
    line = one_line(superlinear, S + ["--methods", "fedavg", "--lr", "1", "--out", str(out)], capsys)
    assert line.endswith(f"--out {out}: cannot be written (No space left on device)")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("full_at", [1, 2])
def test_a_full_disk_in_dnn_names_the_file_and_keeps_the_rounds_done(base, tmp_path, capsys, monkeypatch, full_at):
    """torch's zip writer reports a full disk as 'unexpected pos': the line must say it is the disk."""
    from fedpm_dnn.engine import checkpoint as ck

    real, calls = ck.torch.save, []

    def save(obj, fh):
        calls.append(1)
        if len(calls) < full_at:
            return real(obj, fh)
        fh.write(b"PK half a zip")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 16576 vs 16528")

    monkeypatch.setattr(ck.torch, "save", save)
    out = tmp_path / "run"
    line = one_line(dnn, dnn_args(base, "--rounds", "3", "--out", str(out)), capsys)
    assert f"{out / 'checkpoint.pt'}: cannot be written (No space left on device)" in line
    if full_at == 1:
        assert line.endswith("nothing was written") and os.listdir(tmp_path) == []
    else:
        assert line.endswith(f"{out} keeps the rounds done so far (--resume continues)")
        assert sorted(os.listdir(out)) == [outputs.MARKER, "checkpoint.pt", "history.csv", "summary.json"]
        assert len(ck.load(str(out / "checkpoint.pt"))["history"]) == 1
        monkeypatch.setattr(ck.torch, "save", real)
        assert dnn.main(dnn_args(base, "--rounds", "3", "--out", str(out), "--resume")) == 0


# ------------------------------------------------------------------ 16. a damaged tuning-cache entry
def test_a_damaged_tuning_cache_entry_is_tuned_again(base, tmp_path, capsys):
    cache = tmp_path / "tuning.json"
    args = ["--dataset", str(base / "tiny.svm"), "--clients", "3", "--rounds", "2", "--quiet", "--jobs", "1"]
    args += ["--methods", "fedavg", "--cache", str(cache)]
    assert superlinear.main(args + ["--out", str(tmp_path / "first")]) == 0
    good = json.loads(cache.read_text())
    (key,) = good
    first = json.loads((tmp_path / "first" / "summary.json").read_text())["methods"]["fedavg"]
    for k, entry in enumerate([{"lr": -1.0, "local_steps": 1}, {"lr": "fast"}]):
        cache.write_text(json.dumps({key: entry}))
        assert superlinear.main(args + ["--out", str(tmp_path / f"again{k}")]) == 0
        again = json.loads((tmp_path / f"again{k}" / "summary.json").read_text())["methods"]["fedavg"]
        assert again["tuned_from_cache"] is False and again["params"] == first["params"]
        assert again["final_f_gap"] == first["final_f_gap"] and json.loads(cache.read_text()) == good  # rewritten


def test_a_tuning_cache_of_another_shape_names_cache(tmp_path, capsys):
    cache = tmp_path / "tuning.json"
    cache.write_text(json.dumps({"k": "not an entry"}))
    argv = [a for a in S if a != "--no-cache"] + ["--cache", str(cache), "--out", str(tmp_path / "o")]
    line = one_line(superlinear, argv, capsys)
    assert f"--cache {cache}: is not a tuning cache of this tool" in line


# ------------------------------------------------------------------ 17. a resume never cuts a run short
def test_resume_with_fewer_rounds_than_done_is_refused_and_changes_nothing(base, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(base / "run", out)
    assert dnn.main(dnn_args(base, "--rounds", "2", "--resume", "--out", str(out))) == 0
    before = snapshot(tmp_path)
    line = one_line(dnn, dnn_args(base, "--rounds", "1", "--resume", "--out", str(out)), capsys)
    assert f"--rounds 1: {out / 'checkpoint.pt'} already holds 2 rounds" in line
    assert snapshot(tmp_path) == before
