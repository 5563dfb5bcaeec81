"""Hostile changes under a running command: an output folder swapped for a link or someone else's folder while a
DNN run writes into it round by round, and a damaged summary met on the way out.  Each case ends with one line
naming its cause (exit 2, no traceback), writes nothing through the swapped path and deletes nothing there."""

# ruff: noqa: F811  (the fixtures of test_hostile_inputs, imported, are the tests' arguments)

import json
import os

import pytest

torch = pytest.importorskip("torch")

from test_hostile_files import _results, dnn_args, one_line  # noqa: E402
from test_hostile_inputs import base, one_thread, snapshot  # noqa: E402, F401  (fixtures)

from fedconvex.files import FolderSwapped, held_folder, written_atomically  # noqa: E402
from fedpm_dnn.engine import checkpoint as ck  # noqa: E402
from figures import __main__ as figures_main  # noqa: E402
from validation import dnn, dnn_output, outputs  # noqa: E402


def _swap_for_link(out, theirs):
    os.rename(out, f"{out}.moved")
    os.symlink(theirs, out)


def _swap_for_folder(out, theirs):
    os.rename(out, f"{out}.moved")
    os.rename(theirs, out)


def _after_round(monkeypatch, at, act):
    """``act(history)`` once round ``at``'s files are written (the swap then meets the next round's checkpoint,
    written deep in the round driver)."""
    real = dnn_output.write_outputs

    def write_outputs(out, history, summary):
        real(out, history, summary)
        if len(history) == at:
            act(out, history)

    monkeypatch.setattr(dnn_output, "write_outputs", write_outputs)


@pytest.mark.parametrize("swap", [_swap_for_link, _swap_for_folder], ids=["link", "folder"])
def test_a_dnn_out_swapped_while_running_is_never_written_through(base, tmp_path, capsys, monkeypatch, swap):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("my thesis\n")
    out = tmp_path / "run"
    _after_round(monkeypatch, 1, lambda o, h: swap(o, theirs))
    line = one_line(dnn, dnn_args(base, "--rounds", "3", "--out", str(out)), capsys)
    what = "a symbolic link" if swap is _swap_for_link else "another folder"
    assert f"--out {out}: was replaced by {what} while this run was writing into it" in line
    # theirs: as it was (not one file added, replaced or removed); ours: round 1, whole, where it was moved
    mine = out if swap is _swap_for_folder else theirs
    assert sorted(os.listdir(mine)) == ["notes.txt"] and (mine / "notes.txt").read_text() == "my thesis\n"
    moved = tmp_path / "run.moved"
    assert sorted(os.listdir(moved)) == [outputs.MARKER, "checkpoint.pt", "history.csv", "summary.json"]
    assert len(ck.load(str(moved / "checkpoint.pt"))["history"]) == 1


def test_a_stacked_run_whose_folder_is_swapped_stops_alone(base, tmp_path, capsys, monkeypatch):
    """Two runs as one stack: the one whose folder is swapped says so in its line, the other completes."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("my thesis\n")
    out = tmp_path / "stack"

    def act(o, history):
        if o.endswith("-s1"):
            _swap_for_link(o, theirs)

    _after_round(monkeypatch, 1, act)
    rc = dnn.main(dnn_args(base, "--rounds", "2", "--seeds", "0,1", "--method", "fedavg", "--out", str(out)))
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    (swapped,) = [n for n in os.listdir(out) if n.endswith("-s1")]
    assert f"{out / swapped}: was replaced by a symbolic link while this run was writing into it" in err
    assert os.listdir(theirs) == ["notes.txt"]
    (done,) = [n for n in os.listdir(out) if n.endswith("-s0")]
    assert len(ck.load(str(out / done / "checkpoint.pt"))["history"]) == 2


def test_written_atomically_into_a_held_folder_goes_where_it_was_held(tmp_path):
    """The library's guarantee behind the commands: a held folder is written through its descriptor, and only
    while its path still names it."""
    out, theirs = tmp_path / "out", tmp_path / "theirs"
    out.mkdir()
    theirs.mkdir()
    with held_folder(str(out)):
        with written_atomically(str(out / "a.txt")) as fh:
            fh.write("one")
        os.rename(out, tmp_path / "moved")
        os.symlink(theirs, out)
        with pytest.raises(FolderSwapped, match="was replaced by a symbolic link"):
            with written_atomically(str(out / "a.txt")) as fh:
                fh.write("two")
        # swapped between the check and the rename: the file still lands in the held folder, then is refused
        os.remove(out)
        os.rename(tmp_path / "moved", out)
        with pytest.raises(FolderSwapped, match="was moved or removed"):
            with written_atomically(str(out / "b.txt")) as fh:
                fh.write("three")
                os.rename(out, tmp_path / "moved")
    assert os.listdir(theirs) == [] and sorted(os.listdir(tmp_path / "moved")) == ["a.txt"]
    assert (tmp_path / "moved" / "a.txt").read_text() == "one"


def test_a_diverged_run_whose_summary_was_damaged_says_both_in_one_line(base, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"

    def act(o, history):
        with open(os.path.join(o, "summary.json"), "w") as fh:
            fh.write('{"rounds_done": 1, ')  # cut short by someone else's writer

    _after_round(monkeypatch, 1, act)
    real = dnn_output.write_outputs

    def diverge(o, history, summary):
        if len(history) == 2:
            raise ArithmeticError("fedavg diverged at round 2 (injected)")
        real(o, history, summary)

    monkeypatch.setattr(dnn_output, "write_outputs", diverge)
    line = one_line(dnn, dnn_args(base, "--rounds", "3", "--method", "fedavg", "--out", str(out)), capsys)
    assert "fedavg diverged at round 2 (injected); not recorded in the summary: " in line
    assert f"{out / 'summary.json'}: damaged (not JSON" in line
    assert (out / "summary.json").read_text() == '{"rounds_done": 1, '  # left as it was found


def test_a_diverged_run_records_its_cause_in_its_summary(base, tmp_path, capsys, monkeypatch):
    """The healthy counterpart: the cause is added to the summary of the rounds done."""
    out = tmp_path / "run"
    real = dnn_output.write_outputs

    def diverge(o, history, summary):
        if len(history) == 2:
            raise ArithmeticError("fedavg diverged at round 2 (injected)")
        real(o, history, summary)

    monkeypatch.setattr(dnn_output, "write_outputs", diverge)
    line = one_line(dnn, dnn_args(base, "--rounds", "3", "--method", "fedavg", "--out", str(out)), capsys)
    assert line.endswith("error: fedavg diverged at round 2 (injected)")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == "fedavg diverged at round 2 (injected)" and summary["rounds_done"] == 1


@pytest.mark.parametrize("swap", [_swap_for_link, _swap_for_folder], ids=["link", "folder"])
def test_figures_out_swapped_while_drawing_is_never_written_through(base, tmp_path, monkeypatch, swap):
    """The figures are drawn file by file (matplotlib writes by path) into a private sibling, then moved into the
    folder --out named when the command took it (figures.__main__.draw_into, what main runs): none reaches a
    swapped --out."""
    _results(base, tmp_path / "results")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("my thesis\n")
    out = tmp_path / "figs"
    out.mkdir()
    outputs.mark(str(out), figures_main.PROG)
    real = figures_main.build_all

    def build_all(root, into, profile, log=print):
        drawn = real(root, into, profile, log)
        assert drawn  # something to write
        swap(str(out), theirs)
        return drawn

    monkeypatch.setattr(figures_main, "build_all", build_all)
    with pytest.raises(FolderSwapped) as exc:
        figures_main.draw_into(str(out), str(tmp_path / "results" / "quick"), "quick")
    what = "a symbolic link" if swap is _swap_for_link else "another folder"
    assert str(exc.value).startswith(f"--out {out}: was replaced by {what} while this run was writing into it")
    mine = out if swap is _swap_for_folder else theirs
    assert sorted(os.listdir(mine)) == ["notes.txt"] and (mine / "notes.txt").read_text() == "my thesis\n"
    assert sorted(os.listdir(tmp_path / "figs.moved")) == [outputs.MARKER]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary sibling left


def test_a_sigterm_while_the_temporary_result_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    """SIGTERM (raised as SystemExit by sigterm_as_exit) between making the private sibling and marking it: the
    sibling goes too (under load a SIGTERM sent as soon as the sibling appeared once left it behind)."""

    def interrupted(folder, command=""):
        raise SystemExit(143)

    monkeypatch.setattr(outputs, "mark", interrupted)
    with pytest.raises(SystemExit):
        with outputs.ResultDir(str(tmp_path / "o")):
            pass
    assert os.listdir(tmp_path) == []
