"""The superlinear command as a user runs it: outputs, cache, and one-line errors."""

import csv
import json
import os
import subprocess
import sys

import pytest

from validation import superlinear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--dataset", "a9a", "--clients", "8", "--per-client", "200", "--rounds", "6", "--quiet", "--jobs", "1"]


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "validation.superlinear", *args],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def test_outputs_and_table(tmp_path, capsys):
    out = tmp_path / "run"
    cache = tmp_path / "cache.json"
    assert superlinear.main(SMALL + ["--methods", "fedpm,fedavg,newton", "--out", str(out), "--cache", str(cache)]) == 0
    printed = capsys.readouterr().out
    assert "FedPM" in printed and "reproduce: python -m validation.superlinear" in printed
    with open(out / "history.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert set(rows[0]) >= {"method", "round", "f_gap", "dist", "grad_norm", "bytes_up", "bytes_down", "seconds"}
    assert {r["method"] for r in rows} == {"fedpm", "fedavg", "newton"}
    assert [int(r["round"]) for r in rows if r["method"] == "fedpm"] == list(range(7))
    summary = json.loads((out / "summary.json").read_text())
    for key in ("dataset", "n", "d", "clients", "per_client", "lam", "f_star", "command"):
        assert key in summary
    assert summary["clients"] == 8 and summary["per_client"] == 200 and summary["d"] == 123
    fedpm = summary["methods"]["fedpm"]
    assert fedpm["lr"] == 1.0 and fedpm["rounds_to_dist_1e-10"] is not None
    assert fedpm["contraction_ratios"] and fedpm["contraction_ratios"][-1] < 0.1
    assert summary["methods"]["fedavg"]["rounds_to_dist_1e-10"] is None
    for ext in ("png", "pdf"):
        assert (out / f"convergence.{ext}").stat().st_size > 5000
    # the tuned values are cached: a second run re-uses them and gives the same history
    assert superlinear.main(SMALL + ["--methods", "fedpm,fedavg", "--out", str(out), "--cache", str(cache)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["methods"]["fedavg"]["tuned_from_cache"] is True
    assert again["methods"]["fedavg"]["lr"] == summary["methods"]["fedavg"]["lr"]
    assert again["methods"]["fedavg"]["final_f_gap"] == summary["methods"]["fedavg"]["final_f_gap"]


def test_parallel_workers_give_the_same_results(tmp_path):
    args = SMALL[:-2] + ["--methods", "fedpm,fedavg,fednl", "--lr", "0.5", "--no-cache"]
    superlinear.main(args + ["--jobs", "1", "--out", str(tmp_path / "a")])
    superlinear.main(args + ["--jobs", "2", "--out", str(tmp_path / "b")])
    a = json.loads((tmp_path / "a" / "summary.json").read_text())["methods"]
    b = json.loads((tmp_path / "b" / "summary.json").read_text())["methods"]
    assert {m: a[m]["final_dist"] for m in a} == {m: b[m]["final_dist"] for m in b}


def test_dirichlet_split_and_sampling_from_a_file_path(tmp_path):
    data = tmp_path / "tiny.svm"
    data.write_text("".join(f"{1 if i % 3 else 0} {1 + i % 4}:1 {5 + i % 3}:0.5\n" for i in range(60)))
    out = tmp_path / "o"
    assert (
        superlinear.main(
            [
                "--dataset",
                str(data),
                "--clients",
                "5",
                "--split",
                "dirichlet",
                "--alpha",
                "0.5",
                "--participants",
                "3",
                "--local-steps",
                "2",
                "--methods",
                "fedpm,localnewton,scaffold",
                "--rounds",
                "4",
                "--quiet",
                "--jobs",
                "1",
                "--out",
                str(out),
                "--no-cache",
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["split"] == "dirichlet" and summary["participants"] == 3 and summary["d"] == 7


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--rounds", "0"], "--rounds: must be a positive integer"),
        (["--methods", "fedpm,fedxyz"], "unknown method(s) fedxyz"),
        (["--lam", "-1"], "--lam: must be a number > 0"),
        (["--lam", "0"], "--lam: must be a number > 0"),
        (["--init", "far"], "invalid choice: 'far'"),
        (["--dataset", "nowhere.svm"], "nowhere.svm: neither a bundled dataset"),
        (["--clients", "100000"], "exceeds the 32561 rows"),
        (["--device", "cuda"], "--device cuda: backend 'cupy'"),
        (["--backend", "jax"], "unknown backend 'jax'"),
        (["--dataset", "a9a", "--methods", "fedavg", "--lr", "1e300", "--init", "zero"], "diverged at round"),
    ],
)
def test_errors_are_one_line_and_write_nothing(tmp_path, args, fragment):
    out = tmp_path / "out"
    base = ["--dataset", "a9a", "--clients", "8", "--per-client", "100", "--rounds", "3", "--quiet", "--no-cache"]
    res = cli(*(base + args + ["--out", str(out)]))
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], res.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".partial")]


def test_malformed_file_error_names_the_line(tmp_path):
    bad = tmp_path / "bad.svm"
    bad.write_text("-1 1:1\n+1 2:1\n+1 3:oops\n")
    res = cli("--dataset", str(bad), "--quiet", "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and f"{bad}:3: token '3:oops'" in res.stderr
