"""Saved results read as untrusted input: one reader (``fedconvex.results``: a JSON Schema for summary.json, a
column table for history.csv) used by the figures, the sweep and the convex report.  A value outside its field's
range is one DamagedFile naming the file and the field -- never drawn as given, never a crash; every shipped
result passes it (the healthy counterparts)."""

import csv
import glob
import json
import math
import os
import shutil

import pytest

from fedconvex import results
from fedconvex.files import DamagedFile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "reference", "cpu-full", "main-cifar10-a0.1-fedpm-s0")
NAN, INF = float("nan"), float("inf")


def _run(tmp_path):
    run = tmp_path / "results" / "quick" / "main-cifar10-a0.1-fedpm-s0"
    shutil.copytree(SHIPPED, run)
    return run


def _summary(run, **change):
    s = json.loads((run / "summary.json").read_text())
    s.update(change)
    (run / "summary.json").write_text(json.dumps(s))  # NaN and Infinity as Python's json writes them


def _history(run, column, value, row=0):
    with open(run / "history.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    if column == "round-order":
        rows = rows[::-1] if value == "reversed" else rows[:2] + rows[1:]
    else:
        rows[row][column] = value
    with open(run / "history.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("best_test_acc", 55.0, "above 1: an accuracy is a fraction, not a percentage"),
        ("final_test_acc", 101.0, "above 1"),
        ("best_test_acc", -0.1, "below 0"),
        ("best_test_acc", NAN, "not a finite number"),
        ("final_test_acc", INF, "not a finite number"),
        ("best_test_acc", "0.3", "not a finite number"),
        ("bytes_up_per_round", -5, "below 0"),
        ("bytes_down_per_round", -INF, "not a finite number"),
        ("mean_client_seconds_per_round", -1.0, "below 0"),
        ("peak_memory_mb", NAN, "not a finite number"),
        ("clients", 0, "below 1"),
        ("rounds_done", 2.5, "not a finite integer"),
        ("clients", True, "not a finite integer"),
    ],
)
def test_a_summary_field_out_of_its_range_is_named_with_its_file(tmp_path, field, value, why):
    run = _run(tmp_path)
    _summary(run, **{field: value})
    with pytest.raises(DamagedFile) as exc:
        results.read_summary(str(run / "summary.json"))
    text = str(exc.value)
    assert text.startswith(f"{run / 'summary.json'}: damaged ({field} is ") and why in text, text
    from figures import results as figure_results

    with pytest.raises(DamagedFile, match=field):
        figure_results.read_summary(str(run))


def test_a_negative_class_count_is_named_by_its_cell(tmp_path):
    run = _run(tmp_path)
    counts = json.loads((run / "summary.json").read_text())["class_counts"]
    counts[1][2] = -3
    _summary(run, class_counts=counts)
    with pytest.raises(DamagedFile, match=r"class_counts\[1\]\[2\] is -3, below 0"):
        results.read_summary(str(run / "summary.json"))


def test_a_nan_training_loss_records_a_diverged_client_and_is_read_as_such(tmp_path):
    """The round's mean training loss is NaN when a client's training diverged (its reply rejected): a record, read
    back; NaN in any other column is still damage (the parametrized cases below)."""
    run = _run(tmp_path)
    _history(run, "train_loss", "nan", row=1)
    rows = results.read_history(str(run / "history.csv"))[None]
    assert math.isnan(rows[1]["train_loss"])
    _history(run, "wall_seconds", "nan", row=1)
    with pytest.raises(DamagedFile, match="wall_seconds is nan, not a finite number"):
        results.read_history(str(run / "history.csv"))


@pytest.mark.parametrize(
    "column, value, why",
    [
        ("test_acc", "nan", "not a finite number"),
        ("test_acc", "", "not a finite number"),
        ("test_acc", "45.0", "above 1: an accuracy is a fraction, not a percentage"),
        ("test_acc", "-0.5", "below 0"),
        ("bytes_up", "-1", "below 0"),
        ("train_loss", "inf", "not a finite number"),
        ("wall_seconds", "-3", "below 0"),
        ("rejected", "1.5", "not a finite integer"),
        ("round-order", "reversed", "rounds going back"),
        ("round-order", "repeated", "rounds repeated"),
    ],
)
def test_a_history_cell_out_of_its_range_or_rounds_out_of_order_are_refused(tmp_path, column, value, why):
    run = _run(tmp_path)
    _history(run, column, value, row=1)
    with pytest.raises(DamagedFile) as exc:
        results.read_history(str(run / "history.csv"))
    assert str(exc.value).startswith(f"{run / 'history.csv'}: damaged (") and why in str(exc.value), exc.value
    from figures import results as figure_results

    with pytest.raises(DamagedFile, match="history.csv: damaged"):
        figure_results.read_history(str(run))


def test_the_figures_command_names_a_percentage_accuracy_in_one_line(tmp_path, capsys):
    from figures import __main__ as figures_main

    run = _run(tmp_path)
    _summary(run, best_test_acc=55.0)
    args = ["--no-compute", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "figs")]
    with pytest.raises(SystemExit) as exc:
        figures_main.main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{run / 'summary.json'}: damaged (best_test_acc is 55.0, above 1: an accuracy is a fraction" in err


def test_the_sweep_counts_nothing_of_a_damaged_history_or_summary(tmp_path):
    from validation import experiments, sweep

    run = _run(tmp_path)
    plan = experiments.Run("r", "dnn", ("--seed", "0"), 3)
    summary = json.loads((run / "summary.json").read_text())
    del summary["command"]  # not compared with the plan's: the history is what is read here
    (run / "summary.json").write_text(json.dumps(summary))
    _history(run, "test_acc", "nan", row=0)
    st = sweep.status(plan, str(run))
    assert st.rounds_done == 0 and "test_acc is nan, not a finite number" in st.why, st
    _summary(run, best_test_acc=55.0)
    st = sweep.status(plan, str(run))
    assert st.state == sweep.STALE and "best_test_acc is 55.0, above 1" in st.why, st


def test_a_reference_without_bytes_is_no_division_by_zero():
    """The compression table's ratios to FedPM's bytes: a reference that sent 0 bytes gives '–', not a crash."""
    from figures.compression import cnn_table

    curve = [0.1, 0.2]
    points = [("FedPM none", 0.2, [0.2], 0.0, [2], [curve], 0.0), ("FedPM fp16", 0.2, [0.2], 1.0, [2], [curve], 1.0)]
    header, rows = cnn_table(points)
    assert rows[1][4] == "–" and rows[1][6] == "–"
    points[0] = ("FedPM none", 0.2, [0.2], 2.0, [2], [curve], 2.0)  # healthy: the ratio
    assert cnn_table(points)[1][1][4] == "50.0 %"


def test_every_shipped_result_passes_the_reader():
    summaries = glob.glob(os.path.join(ROOT, "reference", "**", "summary.json"), recursive=True)
    histories = glob.glob(os.path.join(ROOT, "reference", "**", "history.csv"), recursive=True)
    assert summaries and histories
    for path in summaries:
        results.read_summary(path)
    for path in histories:
        results.read_history(path)


def test_the_reader_says_what_is_missing_without_jsonschema(tmp_path, monkeypatch):
    import sys

    run = _run(tmp_path)
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(DamagedFile, match="jsonschema package is missing"):
        results.read_summary(str(run / "summary.json"))


def test_a_finished_run_with_a_percentage_in_its_summary_is_not_quoted_as_its_accuracy(tmp_path, capsys):
    pytest.importorskip("torch")
    from tests.fake_cifar import cifar_pickle
    from validation import dnn

    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"), n=30)
    argv = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--method", "fedavg", "--clients", "2"]
    argv += ["--local-epochs", "1", "--train-subset", "20", "--test-subset", "10", "--rounds", "1", "--quiet"]
    argv += ["--threads", "1", "--out", str(tmp_path / "out")]
    assert dnn.main(argv) == 0
    capsys.readouterr()
    _summary(tmp_path / "out", best_test_acc=55.0)
    assert dnn.main(argv) == 0  # nothing to compute: the same run, done
    out = capsys.readouterr().out
    assert "already holds this run (1 round)" in out and "best test accuracy" not in out, out
