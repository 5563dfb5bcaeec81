"""benchmarks/foof_centralised.py as a hostile user runs it: an existing --out is replaced only when told, a
missing folder or a folder as --out is refused before any training (one line, exit 2, nothing left behind), and
subsets larger than the data and repeated seeds or optimizers are refused."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "foof_centralised.py"
PROG = "python benchmarks/foof_centralised.py"
TINY = ["--synthetic", "--train-subset", "16", "--test-subset", "8", "--epochs", "1", "--batch-size", "8"]
TINY += ["--seeds", "0", "--configs", "sgd", "--eval-every", "1"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("foof_centralised_hostile", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_training(bench, monkeypatch):
    """Any training reached fails the test: the refusals come before it."""
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("trained before refusing"))


def one_line(bench, argv, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"{PROG}: error: "), lines[0]
    return lines[0]


def test_an_existing_out_file_is_kept_unless_overwrite_is_given(bench, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text("someone's notes")
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("trained before refusing"))
    line = one_line(bench, TINY + ["--out", str(out)], capsys)
    assert "exists" in line and "--overwrite" in line and out.read_text() == "someone's notes"
    monkeypatch.undo()
    assert bench.main(TINY + ["--out", str(out), "--overwrite"]) == 0  # told: replaced by the result
    assert json.loads(out.read_text())["partial"] is False and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("where", ["missing-parent", "folder", "figure-missing-parent", "parent-is-a-file"])
def test_an_unwritable_out_is_refused_before_training_and_leaves_nothing(bench, tmp_path, capsys, no_training, where):
    argv = TINY + ["--out", str(tmp_path / "r.json")]
    if where == "missing-parent":
        argv = TINY + ["--out", str(tmp_path / "nowhere" / "r.json")]
    elif where == "folder":
        (tmp_path / "a-folder").mkdir()
        argv = TINY + ["--out", str(tmp_path / "a-folder")]
    elif where == "figure-missing-parent":
        argv += ["--figure", str(tmp_path / "nowhere" / "fig")]
    elif where == "parent-is-a-file":
        (tmp_path / "file").write_text("x")
        argv = TINY + ["--out", str(tmp_path / "file" / "r.json")]
    before = sorted(os.listdir(tmp_path))
    line = one_line(bench, argv, capsys)
    assert "does not exist" in line or "is a folder" in line, line
    assert sorted(os.listdir(tmp_path)) == before  # no r.json, no r.json.tmp


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--seeds", "0", "1", "0"], "--seeds names 0 more than once"),
        (["--configs", "sgd", "sgd"], "--configs names sgd more than once"),
    ],
)
def test_repeated_seeds_or_optimizers_are_refused(bench, tmp_path, capsys, no_training, extra, words):
    line = one_line(bench, TINY + extra + ["--out", str(tmp_path / "r.json")], capsys)
    assert words in line


def test_a_subset_larger_than_the_data_is_refused_before_training(bench, tmp_path, capsys, no_training, monkeypatch):
    import torch

    small = (torch.zeros(10, 3, 32, 32), torch.zeros(10, dtype=torch.long), torch.zeros(4, 3, 32, 32), torch.zeros(4))
    monkeypatch.setattr(bench, "load", lambda args: small)  # CIFAR-10 as read: 10 training images
    argv = ["--data-dir", str(tmp_path), "--train-subset", "50", "--test-subset", "4", "--out", str(tmp_path / "r")]
    line = one_line(bench, argv, capsys)
    assert "--train-subset 50: the data holds only 10 images" in line
    assert not list(tmp_path.iterdir())


def test_a_negative_seed_and_a_damaged_replot_file_are_one_line(bench, tmp_path, capsys):
    line = one_line(bench, TINY + ["--seeds", "-1", "--out", str(tmp_path / "r.json")], capsys)
    assert "--seeds" in line
    (tmp_path / "r.json").write_text("{not json")
    line = one_line(bench, ["--replot", "--out", str(tmp_path / "r.json")], capsys)
    assert "r.json" in line
