"""The command lines at their boundary: one canonical form of a setting wherever it is named, compared or put in
a folder name (the run, its default --out, a stack's run folders, the sweep's comparison of a finished run with a
profile)."""

import json
import os
import types

import pytest

from validation import dnn_cli, outputs, sweep

PRESET = ["--preset", "cifar10-a0.1", "--method", "fedavg"]


def finished(folder, command, rounds=2):
    """A finished run's folder as validation.dnn leaves it (summary.json recording ``command``, ``rounds`` rows)."""
    os.makedirs(folder, exist_ok=True)
    header = "round,test_acc,train_loss,client_seconds,server_seconds,bytes_up,bytes_down,peak_memory_mb,wall_seconds"
    rows = [f"{r},0.5,1.0,0.1,0.1,10,10,1.0,{r}.0" for r in range(1, rounds + 1)]
    with open(os.path.join(folder, "history.csv"), "w") as fh:
        fh.write("\n".join([header, *rows]) + "\n")
    with open(os.path.join(folder, "summary.json"), "w") as fh:
        json.dump({"command": command, "best_test_acc": 0.5}, fh)


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
    finished(folder, "python -m validation.dnn " + " ".join(recorded))
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
    finished(folder, "python -m validation.dnn " + " ".join(recorded))
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
