"""Hostile flags of validation.bench_dnn: flags that would be silently ignored, or give a JSON with NaN, are refused
in one line (exit 2) before anything is measured."""

import pytest

pytest.importorskip("torch")

from validation import bench_dnn  # noqa: E402

TINY = ["--models", "cnn", "--sizes", "2,20,1,2", "--repeats", "1", "--threads", "1"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--stack-method", "fedavg"], "--stack-method applies to the runs of --stack S; give --stack too"),
        (["--engine", "sequential", "--client-chunk", "2"], "--client-chunk applies to the vectorized engine"),
        (["--engines", "sequential", "--stack", "2"], "--stack times runs stacked on the vectorized engine"),
        (["--stack", "2", "--sizes", "2,20,1,1"], "--stack times the rounds after the first"),
        (["--engine", "vectorized", "--engines", "sequential"], "--engines is the earlier spelling of --engine"),
        (["--foof-apply", "solve", "--foof-applies", "inverse"], "--foof-applies is the earlier spelling of"),
        (["--foof-apply", "solve,lu"], "--foof-apply: unknown apply(s) lu; choose from solve, inverse"),
        (["--foof-precision", "fp16"], "argument --foof-precision: invalid choice: 'fp16'"),
    ],
)
def test_a_flag_that_would_be_ignored_or_give_nan_is_one_line(capsys, monkeypatch, argv, fragment):
    measured = []
    monkeypatch.setattr(bench_dnn, "measure", lambda *a, **k: measured.append(a))
    with pytest.raises(SystemExit) as exc:
        bench_dnn.main(TINY + argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and measured == []
