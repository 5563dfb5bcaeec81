"""The command lines at their boundary: one canonical form of a setting wherever it is named, compared or put in
a folder name (the run, its default --out, a stack's run folders, the sweep's comparison of a finished run with a
profile)."""

import json
import os
import shutil
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from fake_cifar import cifar_pickle  # noqa: E402
from test_hostile_runs import call  # noqa: E402  (validation.dnn in this process: exit status, stdout, stderr)

from validation import dnn, dnn_cli, outputs, sweep  # noqa: E402

PRESET = ["--preset", "cifar10-a0.1", "--method", "fedavg"]


def sweep_result(folder, command, rounds=2):
    """A finished run's folder as validation.dnn leaves it (summary.json recording ``command``, ``rounds`` rows)."""
    os.makedirs(folder, exist_ok=True)
    header = "round,test_acc,train_loss,client_seconds,server_seconds,bytes_up,bytes_down,peak_memory_mb,wall_seconds"
    rows = [f"{r},0.5,1.0,0.1,0.1,10,10,1.0,{r}.0" for r in range(1, rounds + 1)]
    with open(os.path.join(folder, "history.csv"), "w") as fh:
        fh.write("\n".join([header, *rows]) + "\n")
    with open(os.path.join(folder, "summary.json"), "w") as fh:
        # the method as trained (its last batch kept or dropped: the default of the version that trained it)
        config = {"last_batch": dnn_cli.command_fingerprint(PRESET)["config.last_batch"]}
        json.dump({"command": command, "best_test_acc": 0.5, "config": config}, fh)


def checkpointed(folder):
    """A folder of validation.dnn's holding a checkpoint (its content is not read by the checks here)."""
    folder.mkdir(parents=True)
    outputs.mark(str(folder), dnn_cli.PROG)
    (folder / "checkpoint.pt").write_bytes(b"x")


def profile_run(name, argv, rounds=2):
    return types.SimpleNamespace(name=name, kind="dnn", argv=tuple(argv), rounds=rounds)


@pytest.mark.parametrize(
    "recorded",
    [
        PRESET + ["--seed", "0"],  # --alpha left to the preset
        PRESET + ["--seed", "0", "--alpha", "0.10"],  # another spelling of the same number
        PRESET + ["--seed", "0", "--alpha", "1e-1"],
        # the run trained in a stack: the recorded command is the stack's, read for this folder's run
        PRESET + ["--seeds", "1,0", "--alpha", "1,0.1"],
    ],
)
def test_the_sweep_compares_a_finished_run_resolved_not_as_typed(tmp_path, recorded):
    run = profile_run("main-cifar10-a0.1-fedavg-s0", PRESET + ["--seed", "0", "--alpha", "0.1"])
    folder = tmp_path / run.name
    sweep_result(folder, "python -m validation.dnn " + " ".join(recorded))
    st = sweep.status(run, str(folder))
    assert (st.state, st.why) == (sweep.DONE, "")


@pytest.mark.parametrize(
    "recorded, differs",
    [
        (PRESET + ["--seed", "0", "--alpha", "0.2"], "--alpha is 0.2, the profile's 0.1"),
        (PRESET + ["--seed", "1"], "--seed is 1, the profile's 0"),
        (PRESET + ["--seeds", "1,2", "--alpha", "0.1"], "its recorded command does not parse"),  # no run s0 there
    ],
)
def test_the_sweep_still_calls_another_run_stale(tmp_path, recorded, differs):
    run = profile_run("main-cifar10-a0.1-fedavg-s0", PRESET + ["--seed", "0", "--alpha", "0.1"])
    folder = tmp_path / run.name
    sweep_result(folder, "python -m validation.dnn " + " ".join(recorded))
    st = sweep.status(run, str(folder))
    assert (st.state, st.why) == (sweep.STALE, differs)


@pytest.mark.parametrize("spellings", [("1", "1.0"), ("0.1", "0.10"), ("1", "1e0"), ("2.5", "2.50")])
def test_one_alpha_written_twice_is_refused_not_run_twice(tmp_path, capsys, spellings):
    argv = PRESET + ["--alpha", ",".join(spellings), "--out", str(tmp_path / "stack")]
    with pytest.raises(SystemExit) as exc:
        dnn_cli.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--alpha: repeated value" in err and len(err.splitlines()) == 1


def test_a_stacks_run_folders_name_alpha_canonically(tmp_path):
    args = dnn_cli.parse_args(PRESET + ["--alpha", "1,0.10", "--seeds", "0", "--out", str(tmp_path / "stack")])
    names = [os.path.basename(r.out) for r in args.runs]
    assert names == ["main-cifar10-a1.0-fedavg-s0", "main-cifar10-a0.1-fedavg-s0"]
    assert [r.alpha for r in args.runs] == [1.0, 0.1]


def test_a_stack_resumes_its_run_folder_named_as_typed(tmp_path):
    """A folder an earlier version named with the alpha as typed (a1) is the one --resume continues."""
    old = tmp_path / "stack" / "main-cifar10-a1-fedavg-s0"
    checkpointed(old)
    stack = ["--alpha", "1,0.1", "--seeds", "0", "--out", str(tmp_path / "stack"), "--resume"]
    args = dnn_cli.parse_args(PRESET + stack)
    names = [os.path.basename(r.out) for r in args.runs]
    assert names == ["main-cifar10-a1-fedavg-s0", "main-cifar10-a0.1-fedavg-s0"]
    assert [r.resume for r in args.runs] == [True, False]


@pytest.mark.parametrize("alpha", ["1", "1.0", "1.00", "1e0"])
def test_the_default_out_names_alpha_canonically(tmp_path, monkeypatch, alpha):
    monkeypatch.chdir(tmp_path)
    args = dnn_cli.parse_args(PRESET + ["--alpha", alpha, "--rounds", "3"])
    assert args.out == os.path.join("results", "dnn-cifar10-a0.1-fedavg-s0-r3-a1.0")
    # the preset's own alpha, given or not, in any spelling, is no difference
    for given in ([], ["--alpha", "0.1"], ["--alpha", "0.100"]):
        assert dnn_cli.parse_args(PRESET + given + ["--rounds", "3"]).out == os.path.join(
            "results", "dnn-cifar10-a0.1-fedavg-s0-r3"
        )


def test_the_default_out_finds_a_folder_named_with_alpha_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "results" / "dnn-cifar10-a0.1-fedavg-s0-r3-a1"
    checkpointed(old)
    assert dnn_cli.parse_args(PRESET + ["--alpha", "1", "--rounds", "3"]).out == os.path.join("results", old.name)
    # another spelling of the value never named that folder
    assert dnn_cli.parse_args(PRESET + ["--alpha", "1.00", "--rounds", "3"]).out.endswith("-a1.0")


@pytest.mark.parametrize("alpha", [None, "0.1", "0.10", "1e-1"])
def test_a_run_and_the_sweep_see_one_fingerprint(alpha):
    given = [] if alpha is None else ["--alpha", alpha]
    args = dnn_cli.parse_args(PRESET + given + ["--out", "x"])
    assert dnn_cli.resolved_fingerprint(args) == dnn_cli.command_fingerprint(PRESET + given)
    assert dnn_cli.command_fingerprint(PRESET + given) == dnn_cli.command_fingerprint(PRESET)


# ------------------------------------------------------------------ the shipped results are only read
def tree(folder) -> list:
    return sorted((d, sorted(fs)) for d, _, fs in os.walk(folder))


@pytest.mark.parametrize("below", ["", "quick", "no-such-profile-folder", "quick/.."])
def test_the_sweep_does_not_compute_into_the_shipped_results(capsys, below):
    from validation import experiments

    before = tree(experiments.REFERENCE)
    root = os.path.join(experiments.REFERENCE, below)
    with pytest.raises(SystemExit) as exc:
        experiments.main(["--profile", "smoke", "--out", root, "--data-dir", "no-such-data"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "is the folder of the shipped results, which is only read" in err and "\n" not in err
    assert tree(experiments.REFERENCE) == before


def test_figures_compute_not_into_the_shipped_results_but_draw_from_them(tmp_path, capsys):
    from figures.__main__ import main as figures_main
    from validation import experiments

    before = tree(experiments.REFERENCE)
    argv = ["--profile", "smoke", "--results", experiments.REFERENCE, "--out", str(tmp_path / "figs")]
    with pytest.raises(SystemExit) as exc:
        figures_main(argv + ["--compute", "--data-dir", "no-such-data"])
    assert exc.value.code == 2 and "only read" in capsys.readouterr().err
    assert tree(experiments.REFERENCE) == before
    # healthy counterparts: drawing from them, listing them
    figures_main(argv + ["--no-compute"])
    assert experiments.main(["--profile", "smoke", "--out", experiments.REFERENCE, "--list"]) == 0
    assert tree(experiments.REFERENCE) == before


# ------------------------------------------------------------------ one rule for old and new spellings
def spellings():
    """(command's main, arguments before the pair, the new spelling and a value, the old one and a value)."""
    from validation import experiments, superlinear

    return [
        (experiments.main, ["--profile", "smoke", "--list"], ["--out", "A"], ["--results", "B"]),
        (superlinear.main, ["--dataset", "w8a"], ["--device", "cpu"], ["--backend", "numpy"]),
    ]


@pytest.mark.parametrize("case", range(2))
@pytest.mark.parametrize("old_first", [False, True])
def test_an_old_spelling_given_with_its_new_one_is_refused(tmp_path, monkeypatch, capsys, case, old_first):
    monkeypatch.chdir(tmp_path)
    main, base, new, old = spellings()[case]
    with pytest.raises(SystemExit) as exc:
        main(base + (old + new if old_first else new + old))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{old[0]} is the earlier spelling of {new[0]}: give one of them" in err
    assert os.listdir(tmp_path) == []


def test_the_centralised_benchmark_refuses_both_spellings_of_its_subsets():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", "foof_centralised.py")
    spec = importlib.util.spec_from_file_location("foof_centralised_spellings", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for argv in (["--train", "3", "--train-subset", "4"], ["--test-subset", "4", "--test", "3"]):
        with pytest.raises(SystemExit) as exc:
            mod.parse_args(["--synthetic", "--out", "x", *argv])
        assert exc.value.code == 2
    # healthy counterparts: either spelling alone, the same spelling twice (the last wins, as argparse does)
    base = ["--synthetic", "--out", "x"]
    assert mod.parse_args(base + ["--train", "3"]).train == 3
    assert mod.parse_args(base + ["--train-subset", "3", "--train-subset", "5"]).train == 5
    assert "_spelled_as" not in vars(mod.parse_args(base + ["--test", "7"]))


def test_an_old_spelling_alone_still_works_with_one_warning(tmp_path, capsys):
    from validation import experiments

    assert experiments.main(["--profile", "smoke", "--list", "--results", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert err == "python -m validation.experiments: warning: --results is deprecated; use --out\n"


# ------------------------------------------------------------------ runs re-run: advice that works, files restored
BASE = ["--dataset", "cifar10", "--method", "fedavg", "--clients", "2", "--local-epochs", "1"]
BASE += ["--batch-size", "16", "--quiet", "--threads", "1", "--train-subset", "20", "--test-subset", "10"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    cifar_pickle(str(root / "cifar-10-batches-py"), n=24)
    threads = torch.get_num_threads()
    yield str(root)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data):
    """A finished one-round run with the default --out (its results folder, to be copied)."""
    here = tmp_path_factory.mktemp("finished")
    cwd = os.getcwd()
    os.chdir(here)
    try:
        assert dnn.main(BASE + ["--data-dir", data, "--rounds", "1"]) == 0
    finally:
        os.chdir(cwd)
    (folder,) = os.listdir(here / "results")
    return here / "results", folder


def test_the_advice_to_extend_a_finished_default_out_run_finds_it(tmp_path, monkeypatch, data, finished, capsys):
    results, folder = finished
    shutil.copytree(results, tmp_path / "results")
    monkeypatch.chdir(tmp_path)
    rc, out, err = call(BASE + ["--data-dir", data, "--rounds", "1"], capsys)
    assert rc == 0 and "nothing to compute" in out, err
    advice = out.split("--resume --rounds N", 1)[1].split(",")[0]
    assert advice.startswith(" --out ") and folder in advice, out
    extend = advice.split()  # --out and the folder, as the advice gives them
    rc, out, err = call(BASE + ["--data-dir", data, "--rounds", "2", "--resume", *extend], capsys)
    assert rc == 0, err
    rows = (tmp_path / "results" / folder / "history.csv").read_text().splitlines()
    assert len(rows) == 3  # the header and two rounds: extended in place, not started again elsewhere
    assert os.listdir(tmp_path / "results") == [folder]


def test_the_advice_for_a_run_in_a_given_out_adds_nothing_to_it(tmp_path, data, finished, capsys):
    results, folder = finished
    shutil.copytree(results / folder, tmp_path / "run")
    rc, out, _ = call(BASE + ["--data-dir", data, "--rounds", "1", "--out", str(tmp_path / "run")], capsys)
    assert rc == 0 and "--resume --rounds N, N more than now, extends it" in out and "--out" not in out


def damage(folder, how):
    path = folder / ("summary.json" if "summary" in how else "history.csv")
    if how.startswith("missing"):
        path.unlink()
    elif how == "damaged-summary":
        path.write_text('{"best_test_acc": ')
    elif how == "damaged-history":
        path.write_text(path.read_text().splitlines()[0] + "\n")  # the header alone: no round
    else:
        path.write_bytes(b"\xff\xfe not text")


@pytest.mark.parametrize("how", ["missing-summary", "missing-history", "damaged-summary", "damaged-history", "bytes"])
def test_a_finished_run_whose_files_were_lost_gets_them_back(tmp_path, data, finished, capsys, how):
    results, folder = finished
    run = tmp_path / "run"
    shutil.copytree(results / folder, run)
    history, summary = (run / "history.csv").read_text(), json.loads((run / "summary.json").read_text())
    damage(run, how)
    rc, out, err = call(BASE + ["--data-dir", data, "--rounds", "1", "--out", str(run)], capsys)
    assert rc == 0 and "history.csv and summary.json written again from checkpoint.pt (1 round)" in out, err
    assert "nothing to compute" not in out
    assert (run / "history.csv").read_text() == history  # every round's row, as the run measured it
    restored = json.loads((run / "summary.json").read_text())
    assert restored["best_test_acc"] == summary["best_test_acc"] and restored["rounds_done"] == 1
    # and now it is whole: a re-run has nothing to do
    rc, out, _ = call(BASE + ["--data-dir", data, "--rounds", "1", "--out", str(run)], capsys)
    assert rc == 0 and "nothing to compute" in out


def test_a_run_asked_for_fewer_rounds_than_its_lost_files_held_is_told_how(tmp_path, data, finished, capsys):
    results, folder = finished
    run = tmp_path / "run"
    shutil.copytree(results / folder, run)
    (run / "summary.json").unlink()
    # a checkpoint of 1 round, asked for 1: restored; one asked for fewer cannot be: --rounds 0 is no run, so
    # the case is one round held and asked for via a checkpoint of 2
    assert dnn.main(BASE + ["--data-dir", data, "--rounds", "2", "--resume", "--out", str(run)]) == 0
    (run / "history.csv").unlink()
    rc, _, err = call(BASE + ["--data-dir", data, "--rounds", "1", "--out", str(run)], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert "history.csv is missing; --rounds 2 writes history.csv and summary.json again" in err
    assert not (run / "history.csv").exists()


# ------------------------------------------------------------------ flags of the vectorized engine, resolved
@pytest.mark.parametrize("flags", [["--step-graph", "on"], ["--step-graph", "off"], ["--client-chunk", "2"]])
def test_vectorized_flags_are_refused_when_auto_resolves_to_sequential(tmp_path, capsys, flags):
    out = tmp_path / "out"
    # no data: the refusal comes first, at the engine's resolution
    rc, _, err = call(BASE + ["--data-dir", str(tmp_path), "--rounds", "1", "--out", str(out), *flags], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{flags[0]}" in err and "--engine auto is the sequential one on this cpu" in err
    assert not out.exists()


def test_vectorized_flags_on_the_vectorized_engine_run(tmp_path, data, capsys):
    flags = ["--engine", "vectorized", "--client-chunk", "1", "--step-graph", "off"]
    rc, _, err = call(BASE + ["--data-dir", data, "--rounds", "1", "--out", str(tmp_path / "v"), *flags], capsys)
    assert rc == 0, err


# ------------------------------------------------------------------ a data path that is not a file is named
def not_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    return [(fifo, "is a FIFO, not a regular file"), (dangling, "")]


@pytest.mark.parametrize("command", ["superlinear", "flower"])
def test_a_dataset_path_that_is_a_fifo_is_named_as_one(tmp_path, monkeypatch, capsys, command):
    import importlib

    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"validation.{command}").main
    (fifo, what), (dangling, _) = not_files(tmp_path)
    for path, fragment in ((fifo, what), (dangling, "")):
        with pytest.raises(SystemExit) as exc:
            main(["--dataset", str(path), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1, err
        assert f"--dataset {path}: " in err and "no such file" not in err and fragment in err, err
    assert sorted(os.listdir(tmp_path)) == ["dangling", "fifo"]


def test_the_libsvm_reader_names_what_a_path_is():
    import tempfile

    from fedconvex.data import DataError, read_libsvm

    with tempfile.TemporaryDirectory() as d:
        fifo = os.path.join(d, "f")
        os.mkfifo(fifo)
        with pytest.raises(DataError, match="f: is a FIFO, not a regular file"):
            read_libsvm(fifo)
        with pytest.raises(DataError, match="is a folder, not a regular file"):
            read_libsvm(d)
        with pytest.raises(DataError, match="nothing: no such file"):
            read_libsvm(os.path.join(d, "nothing"))


# ------------------------------------------------------------------ Flower keys: hosts as addresses name them
@pytest.mark.parametrize(
    "host, address, san",
    [("::1", "[::1]:9092", "::1"), ("[::1]", "[::1]:9092", "::1"), ("10.0.0.5", "10.0.0.5:9092", "10.0.0.5")]
    + [("server.example.org", "server.example.org:9092", "server.example.org")],
)
def test_flower_keys_writes_each_host_as_an_address(tmp_path, capsys, host, address, san):
    pytest.importorskip("cryptography")
    from cryptography import x509

    from validation import flower_keys

    out = tmp_path / "keys"
    assert flower_keys.main(["--out", str(out), "--nodes", "1", "--host", host]) == 0
    text = (out / "COMMANDS.txt").read_text()
    assert f'address = "{address}"' in text and f"--superlink {address} " in text
    cert = x509.load_pem_x509_certificate((out / "superlink" / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san in [str(n.value) for n in names]


@pytest.mark.parametrize("host", ["example.org:9092", "https://example.org", "a b", "ex_ample.org", "-x.org", "a..b"])
def test_flower_keys_refuses_what_is_no_host(tmp_path, capsys, host):
    pytest.importorskip("cryptography")
    from fedpm_flower.credentials import write_credentials
    from validation import flower_keys

    with pytest.raises(SystemExit) as exc:
        flower_keys.main(["--out", str(tmp_path / "keys"), "--nodes", "1", f"--host={host}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "neither a DNS name nor an IP address" in err, err
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="neither a DNS name nor an IP address"):  # the library's one check
        write_credentials(str(tmp_path / "lib"), 1, hosts=[host])


# ------------------------------------------------------------------ signals: one wording each, advice that works
def test_a_sigterm_reported_by_a_library_as_a_plain_interrupt_is_still_a_sigterm(capsys):
    import signal

    from validation import common

    def main():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecode boundary
                pass
        except KeyboardInterrupt:
            raise KeyboardInterrupt() from None  # as Ray's waits report any interruption

    assert common.run_command("prog", main) == 143
    assert capsys.readouterr().err == "prog: error: terminated (SIGTERM); nothing was written\n"


def test_ctrl_c_stays_ctrl_c(capsys):
    from validation import common

    def main():
        raise KeyboardInterrupt()

    assert common.run_command("prog", main) == 130
    assert capsys.readouterr().err == "prog: error: interrupted (Ctrl-C); nothing was written\n"


def test_ray_starting_keeps_the_commands_sigterm_handler():
    """ray.init installs Python handlers that end the driver by sys.exit: while it starts, a SIGTERM would end the
    command without its line.  The command's handler stays in place throughout; a signal there stops what Ray
    started."""
    pytest.importorskip("ray")
    import signal

    from ray._private import utils

    from validation import common, executors

    seen, stopped = [], []

    def init(**kw):
        utils.set_sigterm_handler(lambda signum, frame: os._exit(signum))  # as ray.init does for the driver
        seen.append(signal.getsignal(signal.SIGTERM))
        raise common.Terminated()

    fake = types.SimpleNamespace(init=init, shutdown=lambda: stopped.append(True))

    def ours(signum, frame):
        raise common.Terminated()

    before = signal.signal(signal.SIGTERM, ours)
    try:
        with pytest.raises(common.Terminated):
            executors._connect(fake, None, 1.0)
        assert seen == [ours] and stopped == [True] and signal.getsignal(signal.SIGTERM) is ours
        assert utils.set_sigterm_handler.__name__ == "set_sigterm_handler"  # Ray's own again after the start
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("signalled", ["KeyboardInterrupt", "Terminated"])
def test_an_interrupted_sweep_names_the_command_that_continues_it(tmp_path, monkeypatch, capsys, signalled):
    from validation import common, experiments

    exc = KeyboardInterrupt if signalled == "KeyboardInterrupt" else common.Terminated

    def interrupted(*a, **kw):  # a run in the sweep, stopped: validation.dnn's own advice is for itself alone
        raise exc(f"{tmp_path} keeps the rounds done so far; --resume continues")

    monkeypatch.setattr(experiments, "ensure", interrupted)
    argv = ["--profile", "smoke", "--out", str(tmp_path / "r")]
    rc = common.run_command("python -m validation.experiments", lambda: experiments.main(argv))
    err = capsys.readouterr().err
    assert rc == (130 if exc is KeyboardInterrupt else 143) and err.count("\n") == 1, err
    assert "--resume" not in err and err.rstrip().endswith("the same command continues"), err


# ------------------------------------------------------------------ a sweep's runs: the profile's flags, one bar
SMOKE_LIKE = ["--dataset", "cifar10", "--method", "fedavg", "--preset", "cifar10-a0.1", "--rounds", "1"]
SMOKE_LIKE += ["--train-subset", "20", "--test-subset", "10", "--clients", "2", "--local-epochs", "1", "--threads", "1"]


def test_a_sweep_warns_about_no_flag_its_profile_set(tmp_path, data, capsys):
    from validation import executors
    from validation.experiments import Run

    run = Run("main-cifar10-a0.1-fedavg-s0", "dnn", tuple(SMOKE_LIKE), rounds=1)
    rounds = []
    from validation.progress import sweep_runs

    with sweep_runs(lambda *a: rounds.append(a)):
        outcomes = executors.run_unit((run,), executors.Job(str(tmp_path), data), {})
    assert outcomes == [(run.name, "done")]
    assert "warning" not in capsys.readouterr().err
    assert rounds == [(run.name, 1, 1)]  # each round told to the sweep, which shows it beside its bar
    # healthy counterpart: typed by the user, the same flags are warned about
    rc, _, err = call(SMOKE_LIKE + ["--data-dir", data, "--out", str(tmp_path / "alone")], capsys)
    assert rc == 0 and "warning: --clients 2, --local-epochs 1 override preset cifar10-a0.1's" in err


def test_what_a_sweep_prints_goes_above_its_bar(tmp_path, data, monkeypatch, capsys):
    import re

    from test_cli_vocabulary import FakeTerminal

    from validation import experiments, progress

    class Printing:
        def map(self, units, job, estimates):
            for unit in units:
                print("a run's line on stderr", file=sys.stderr)
                progress.round_done(unit[0].name, 1, 3)
                yield unit, [(r.name, "failed (exit 2)") for r in unit]

    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    result = experiments.ensure("smoke", data, str(tmp_path / "r"), executor=Printing())
    monkeypatch.undo()
    assert result.failed
    segments = re.split(r"[\r\n]", term.getvalue())
    assert "a run's line on stderr" in segments, term.getvalue()  # a line of its own, not glued to the bar
    assert any("main-cifar10-a0.1-fedpm-s0: round 1 of 3" in s for s in segments), term.getvalue()
    out = capsys.readouterr().out
    assert "run main-cifar10-a0.1-fedpm-s0 failed (exit 2); its figures will lack it" in out.splitlines()


# ------------------------------------------------------------------ a recorded command carries a relative budget
@pytest.mark.parametrize("spelled", [["--deadline", "{T}"], ["--deadline={T}"], ["--dead", "{T}"]])
def test_a_runs_recorded_command_gives_its_deadline_as_a_budget(tmp_path, data, capsys, spelled):
    import time

    end = time.time() + 3600.0
    deadline = [w.replace("{T}", repr(end)) for w in spelled]
    rc, out, err = call(BASE + ["--data-dir", data, "--rounds", "1", "--out", str(tmp_path / "r"), *deadline], capsys)
    assert rc == 0, err
    command = json.loads((tmp_path / "r" / "summary.json").read_text())["command"]
    assert f"reproduce: {command}" in out.splitlines()
    assert "--dead" not in command and "--budget-minutes 60" in command, command
    # the recorded line, run again later, stops as late after its own start
    argv = command.split()[3:]
    again = dnn_cli.parse_args(argv)
    assert 3590 < again.deadline - time.time() <= 3601
    assert dnn_cli.command_fingerprint(argv) == dnn_cli.command_fingerprint(argv[: argv.index("--budget-minutes")])


def test_deadline_and_budget_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        dnn_cli.parse_args(PRESET + ["--out", str(tmp_path / "x"), "--deadline", "1e10", "--budget-minutes", "5"])
    assert exc.value.code == 2 and "--deadline and --budget-minutes exclude each other" in capsys.readouterr().err


# ------------------------------------------------------------------ the default --out names a non-default engine
def test_the_default_out_of_another_engine_is_another_folder(tmp_path, monkeypatch, data, capsys):
    monkeypatch.chdir(tmp_path)
    run = BASE + ["--data-dir", data, "--rounds", "1", "--device", "cpu"]
    assert call(run, capsys)[0] == 0
    rc, out, err = call(run + ["--engine", "vectorized"], capsys)
    assert rc == 0 and "nothing to compute" not in out, err
    folders = sorted(os.listdir("results"))
    assert len(folders) == 2 and folders[1] == folders[0] + "-vectorized", folders
    # --engine sequential is what auto gives on a CPU: the same run, the same folder
    assert dnn_cli.parse_args(run + ["--engine", "sequential"]).out == os.path.join("results", folders[0])
    rc, out, _ = call(run + ["--engine", "sequential"], capsys)
    assert rc == 0 and "nothing to compute" in out


def test_a_run_of_another_engine_under_the_earlier_name_is_still_found(tmp_path, monkeypatch, data, capsys):
    monkeypatch.chdir(tmp_path)
    run = BASE + ["--data-dir", data, "--rounds", "1", "--device", "cpu", "--engine", "vectorized"]
    untagged = dnn_cli.parse_args(run).out[: -len("-vectorized")]
    assert call(run + ["--out", untagged], capsys)[0] == 0  # as the earlier default named it
    assert dnn_cli.parse_args(run).out == untagged
    rc, out, _ = call(run, capsys)
    assert rc == 0 and "nothing to compute" in out and os.listdir("results") == [os.path.basename(untagged)]


# ------------------------------------------------------------------ settings resolved once
def test_a_runs_settings_are_resolved_once_and_read_by_every_reader(tmp_path, data, monkeypatch):
    calls = []
    original = dnn_cli.lr_schedule
    monkeypatch.setattr(dnn_cli, "lr_schedule", lambda args: calls.append(1) or original(args))
    argv = BASE + ["--data-dir", data, "--rounds", "4", "--lr-milestones", "50:0.1", "--split-seed", "3"]
    settings = dnn_cli.parse_args(argv + ["--out", str(tmp_path / "r"), "--alpha", "0.50"])
    assert len(calls) == 1
    exp, desc = dnn.build(settings)
    fingerprint = dnn_cli.run_fingerprint(settings)
    assert len(calls) == 1  # the experiment and the fingerprint read the settings, they do not resolve again
    assert exp.lr_schedule == settings.lr_schedule and exp.lr_schedule.milestones == ((3, 0.1),)
    assert desc["augment"] == settings.augment == fingerprint["augment"] == "crop-flip"
    assert desc["split_seed"] == settings.split_seed == 3 and desc["alpha"] == settings.alpha == 0.5
    assert settings.alpha_text == "0.5" and fingerprint["lr_schedule"] == settings.lr_schedule.as_dict()
