"""Hostile --step-graph values: a mode that does not apply (the sequential engine) or does not exist is refused in
one line (exit 2) before anything runs; the library refuses an unknown mode with a ValueError naming it."""

import pytest

torch = pytest.importorskip("torch")

from fedpm_dnn.engine.training_task import DnnTask  # noqa: E402
from validation import bench_dnn, dnn  # noqa: E402


def one_line(capsys, main, argv, fragment):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("mode", ["on", "off"])
def test_dnn_refuses_a_step_graph_on_the_sequential_engine(capsys, tmp_path, mode):
    out = tmp_path / "out"
    argv = ["--engine", "sequential", "--step-graph", mode, "--data-dir", str(tmp_path), "--out", str(out)]
    one_line(capsys, dnn.main, argv, f"--step-graph {mode} applies to --engine vectorized")
    assert not out.exists()


def test_dnn_refuses_an_unknown_step_graph(capsys, tmp_path):
    argv = ["--step-graph", "yes", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out")]
    one_line(capsys, dnn.main, argv, "argument --step-graph: invalid choice: 'yes'")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--engine", "sequential", "--step-graph", "on"], "--step-graph on applies to the vectorized engine"),
        (["--step-graph", "maybe"], "argument --step-graph: invalid choice: 'maybe'"),
    ],
)
def test_bench_refuses_a_step_graph_that_would_be_ignored(capsys, monkeypatch, argv, fragment):
    measured = []
    monkeypatch.setattr(bench_dnn, "measure", lambda *a, **k: measured.append(a))
    one_line(capsys, bench_dnn.main, ["--models", "cnn", "--sizes", "2,20,1,2", *argv], fragment)
    assert measured == []


def test_the_library_refuses_an_unknown_step_graph_mode():
    with pytest.raises(ValueError, match="^step graph must be auto or on or off, got 'yes'$"):
        DnnTask(torch.nn.Linear(2, 2), [], step_graph="yes")
