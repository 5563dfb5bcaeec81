"""One command-line vocabulary across the front-ends, and the progress bar of their long runs (docs/cli.md)."""

from __future__ import annotations

import importlib
import io
import json
import re
from dataclasses import replace

import pytest

import validation.bench_convex as bench_convex
import validation.flower as flower
from validation import common, superlinear
from validation.progress import Progress

MODULES = {
    "superlinear": "validation.superlinear",
    "dnn": "validation.dnn",
    "flower": "validation.flower",
    "bench_convex": "validation.bench_convex",
    "bench_dnn": "validation.bench_dnn",
    "experiments": "validation.experiments",
    "figures": "figures.__main__",
}


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def help_of(module: str, monkeypatch, capsys, *argv) -> str:
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps at the terminal's width: one flag a line
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def first_example(module: str) -> str:
    doc = importlib.import_module(module).__doc__
    return next(ln.strip() for ln in doc.splitlines()[1:] if ln.strip().startswith(("python -m", "make ")))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_help_shows_the_shared_flags_their_defaults_and_the_examples(name, monkeypatch, capsys):
    text = help_of(MODULES[name], monkeypatch, capsys)
    for flag in ("--seed", "--quiet", "--device {auto,cpu,cuda}"):
        assert flag in text, f"{name}: {flag} missing"
    entry = re.search(r"\n  --device \{auto,cpu,cuda\}(.*?)\n  -", text, re.S).group(1)  # its help, maybe wrapped
    assert re.search(r"default: (auto|cpu)\)?$", entry.strip()), entry
    assert first_example(MODULES[name]) in text  # the module docstring's examples are the epilog


def test_help_formatter_names_a_default_once_in_one_style_and_skips_flags_without_one(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    p = common.OneLineParser(prog="x", doc="One line.\n\n    x --rounds 3\n")
    p.add_argument("--rounds", type=int, default=7, help="rounds")
    p.add_argument("--lr", type=float, default=0.5, help="step (default: 0.5, the paper's)")
    p.add_argument("--out", default=None, help="folder")
    p.add_argument("--check", action="store_true", help="check")
    text = p.format_help()
    assert "--rounds ROUNDS  rounds (default: 7)" in text
    assert text.count("default") == text.count("(default: ") == 2  # --lr's own words, not repeated; none for --out
    assert text.rstrip().endswith("x --rounds 3")


def test_flower_help_lists_its_subcommands(monkeypatch, capsys):
    text = help_of("validation.flower", monkeypatch, capsys)
    assert re.search(r"commands:\n\s+prepare\s", text)


def test_method_takes_a_comma_list_and_methods_is_its_alias(tmp_path):
    from validation import bench_dnn

    a = superlinear.parse_args(["--method", "fedpm,fedavg", "--out", str(tmp_path / "a")])
    b = superlinear.parse_args(["--methods", "fedpm,fedavg", "--out", str(tmp_path / "b")])
    assert a.methods == b.methods == ["fedpm", "fedavg"]
    a, b = bench_dnn.parse_args(["--method", "fedpm,scaffold"]), bench_dnn.parse_args(["--methods", "fedpm,scaffold"])
    assert a.methods == b.methods == ["fedpm", "scaffold"]
    assert bench_dnn.parse_args([]).methods == ["fedavg", "fedpm"]  # the paper's ratio by default


def test_backend_is_a_deprecated_alias_of_device(tmp_path, capsys):
    old = superlinear.parse_args(["--backend", "numpy", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.splitlines()
    new = superlinear.parse_args(["--device", "cpu", "--out", str(tmp_path / "b")])
    assert capsys.readouterr().err == ""
    assert (old.device, old.backend) == (new.device, new.backend) == ("cpu", "numpy")
    assert err == ["python -m validation.superlinear: warning: --backend is deprecated; use --device"]


def test_bench_convex_backend_alias_reaches_the_measurement(monkeypatch, capsys):
    seen = {}

    def measure(dataset, **kw):
        seen.update(kw)
        raise ValueError("measured nothing")

    monkeypatch.setattr(bench_convex, "measure", measure)
    with pytest.raises(SystemExit):
        bench_convex.main(["--backend", "numpy", "--seed", "3", "--quiet"])
    err = capsys.readouterr().err.splitlines()
    assert (seen["backend"], seen["seed"], seen["quiet"]) == ("numpy", 3, True)
    assert err[0].endswith("--backend is deprecated; use --device") and len(err) == 2


def test_experiments_names_the_runs_root_out_and_results_is_its_deprecated_alias(tmp_path, monkeypatch, capsys):
    """The folder experiments writes (the runs' root) is --out, as on every command; --results reaches the same
    root with one warning line."""
    from validation import experiments

    roots = []
    monkeypatch.setattr(
        experiments,
        "ensure",
        lambda profile, data_dir, root, only=None, **kw: roots.append(root) or experiments.Outcome(),
    )
    warned = {}
    for flag in ("--out", "--results"):
        assert experiments.main(["--profile", "smoke", flag, str(tmp_path / flag[2:])]) == 0
        warned[flag] = capsys.readouterr().err.splitlines()
    assert roots == [str(tmp_path / "out"), str(tmp_path / "results")]
    assert warned == {
        "--out": [],
        "--results": ["python -m validation.experiments: warning: --results is deprecated; use --out"],
    }


def test_max_ratio_has_one_default_on_every_command_off_in_process_and_on_flower(tmp_path, monkeypatch):
    """--max-ratio's default is ``auto`` on every command that runs a server (it was 0 in-process and 1000 on Flower:
    two defaults for one guard); auto is off where every client runs in this process and 1000 on Flower, as before,
    and an explicit R is R everywhere."""
    from test_cli_help import parser_of

    from validation import dnn

    names = ("superlinear", "dnn", "flower")
    assert {n: parser_of(n, monkeypatch).get_default("max_ratio") for n in names} == dict.fromkeys(names, "auto")
    parse = {"superlinear": superlinear.parse_args, "dnn": dnn.parse_args, "flower": flower.parse_args}
    auto = {"superlinear": 0.0, "dnn": 0.0, "flower": 1000.0}
    for given, want in (([], auto), (["--max-ratio", "auto"], auto), (["--max-ratio", "7"], dict.fromkeys(names, 7.0))):
        got = {n: f([*given, "--out", str(tmp_path / n)]).max_ratio for n, f in parse.items()}
        assert got == want, given


def test_logistic_regression_defaults_to_w8a_on_every_command(monkeypatch):
    """Test 1's data set, the paper's w8a, is the --dataset default of superlinear, bench_convex and flower (flower's
    was a9a)."""
    from test_cli_help import parser_of

    names = ("superlinear", "bench_convex", "flower")
    assert {n: parser_of(n, monkeypatch).get_default("dataset") for n in names} == dict.fromkeys(names, "w8a")


def test_the_centralised_benchmark_names_its_subsets_as_dnn_does_and_the_old_spellings_warn(capsys):
    """benchmarks/foof_centralised.py: --train-subset / --test-subset (validation.dnn's names for the images used);
    --train / --test give the same arguments, with one warning line each."""
    pytest.importorskip("torch")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "foof_centralised.py"
    spec = importlib.util.spec_from_file_location("foof_centralised", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    new = bench.parse_args(["--train-subset", "48", "--test-subset", "16", "--out", "r.json"])
    assert capsys.readouterr().err == ""
    old = bench.parse_args(["--train", "48", "--test", "16", "--out", "r.json"])
    assert vars(old) == vars(new) and (new.train, new.test) == (48, 16)
    assert capsys.readouterr().err.splitlines() == [
        f"python benchmarks/foof_centralised.py: warning: --{name} is deprecated; use --{name}-subset"
        for name in ("train", "test")
    ]


def flower_cfg(monkeypatch, tmp_path, *argv):
    """The FlowerRunConfig validation.flower builds for ``argv`` (the run itself replaced)."""
    seen = {}
    monkeypatch.setattr(flower, "finish", lambda args, cfg, tmp, final: seen.update(cfg=cfg))
    assert flower.main([*argv, "--out", str(tmp_path / "out")]) == 0
    return seen["cfg"]


def test_flower_cnn_local_steps_is_a_deprecated_alias_of_local_epochs(monkeypatch, tmp_path, capsys):
    old = flower_cfg(monkeypatch, tmp_path, "--problem", "cnn", "--local-steps", "2")
    assert "--local-steps with --problem cnn is deprecated; use --local-epochs" in capsys.readouterr().err
    new = flower_cfg(monkeypatch, tmp_path, "--problem", "cnn", "--local-epochs", "2")
    assert "deprecated" not in capsys.readouterr().err
    assert (
        replace(old, out="") == replace(new, out="") and new.local_steps == 2
    )  # the config carries the cnn's epochs in local_steps


def test_flower_seed_and_preset_reach_the_run_config(monkeypatch, tmp_path):
    from fedpm_dnn.presets import PRESETS

    table = PRESETS["cifar10-a0.1"]
    cfg = flower_cfg(monkeypatch, tmp_path, "--problem", "cnn", "--preset", "cifar10-a0.1", "--seed", "7")
    row = table["methods"]["fedpm"]
    assert cfg.seed == 7 and cfg.lr == row["lr"] and cfg.local_steps == table["setting"]["local_epochs"]
    # the row's hyper-parameters and the presets' last-batch rule (fedpm_dnn.presets.PRESET_LAST_BATCH)
    assert json.loads(cfg.params) == {**{k: v for k, v in row.items() if k != "lr"}, "last_batch": "drop"}
    mine = flower_cfg(monkeypatch, tmp_path, "--problem", "cnn", "--preset", "cifar10-a0.1", "--lr", "0.01")
    assert mine.lr == 0.01  # an explicit flag wins over the preset


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--local-epochs", "2"], "--local-epochs applies to --problem cnn only"),
        (["--preset", "cifar10-a0.1"], "--preset applies to --problem cnn only"),
        (["--device", "cuda"], "--device cuda: the Flower clients train on the CPU"),
    ],
)
def test_flower_refuses_flags_that_do_not_apply_in_one_line(argv, fragment, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        flower.main([*argv, "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and fragment in lines[0]


def test_the_bar_on_a_terminal_has_a_count_and_an_eta():
    term = FakeTerminal()
    bar = Progress(4, "runs", stream=term)
    for i in range(4):
        bar.update(1, f"run {i}")
    text = term.getvalue()
    assert "runs" in text and "4/4" in text and "run 3" in text
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", text)  # elapsed < remaining (the ETA)


@pytest.mark.parametrize("stream,enabled", [(FakeTerminal(), False), (io.StringIO(), True)])
def test_no_bar_when_quiet_or_not_a_terminal(stream, enabled):
    bar = Progress(3, "runs", stream=stream, enabled=enabled)
    bar.done = 1  # a resumed run
    bar.update(2)
    assert stream.getvalue() == "" and bar.done == 3


@pytest.mark.parametrize("quiet", [True, False])
def test_a_command_draws_on_a_terminal_and_is_silent_with_quiet(quiet, tmp_path, monkeypatch):
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    argv = ["--dataset", "a9a", "--clients", "4", "--per-client", "100", "--rounds", "3", "--jobs", "1"]
    argv += ["--method", "fedpm,fedavg", "--lr", "1", "--out", str(tmp_path / "o")] + (["--quiet"] * quiet)
    assert superlinear.main(argv) == 0
    text = term.getvalue()
    assert text == "" if quiet else ("2/2" in text and re.search(r"<\d\d:\d\d", text))


@pytest.mark.parametrize("name", ["experiments", "figures"])
@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--seed", "7"], "--seed 7: the quick profile runs seeds 0, 1"),
        (["--device", "cuda"], "--device cuda: no CUDA device is visible to torch"),
    ],
)
def test_profile_commands_refuse_a_seed_or_device_they_cannot_run_in_one_line(name, argv, fragment, tmp_path, capsys):
    if "cuda" in argv:
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as exc:
        root = "--out" if name == "experiments" else "--results"  # the runs' root (figures' --out: its drawings)
        importlib.import_module(MODULES[name]).main([*argv, root, str(tmp_path / "r")])
    lines = capsys.readouterr().err.splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and fragment in lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("gpu", [True, False])
def test_convex_device_picks_cupy_only_where_it_can_run(gpu, monkeypatch):
    def get_backend(name):
        if not gpu:
            raise common.BackendError("backend 'cupy': CuPy is installed but no GPU is visible")

    monkeypatch.setattr(common, "get_backend", get_backend)
    assert common.convex_backend("cpu") == "numpy"
    assert common.convex_backend("auto") == ("cupy" if gpu else "numpy")
    if gpu:
        assert common.convex_backend("cuda") == "cupy"
    else:
        with pytest.raises(common.BackendError, match="^--device cuda: backend 'cupy': .* no GPU is visible$"):
            common.convex_backend("cuda")


def test_bench_convex_all_methods_counts_every_method_on_its_bar(monkeypatch):
    import numpy as np
    from naive import random_data

    from fedconvex.problem import FederatedLogReg

    X, y, parts = random_data(np.random.default_rng(0), 3, 5, sizes=[20, 25, 15])
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    quiet = bench_convex.measure_all(pb, np.zeros(5) + 0.1, rounds=2, quiet=True)
    assert term.getvalue() == ""
    rows = bench_convex.measure_all(pb, np.zeros(5) + 0.1, rounds=2, quiet=False)
    n = len(bench_convex.all_methods(pb.d))
    assert len(rows) == n and f"{n}/{n}" in term.getvalue()
    same = ("label", "rounds_to_1e-9", "final_grad_norm")  # the bar changes no result
    assert [[r.get(k) for k in same] for r in rows] == [[r.get(k) for k in same] for r in quiet]


def bar_lines(term, label: str) -> list:
    return [ln for ln in term.getvalue().replace("\r", "\n").splitlines() if ln.startswith(label)]


def test_dnn_draws_its_rounds_alone_and_stacked_and_counts_the_rounds_of_a_resumed_run(tmp_path, monkeypatch):
    """One run and a stack of two, each resumed after its first round: the bar ends at every round of every run."""
    torch = pytest.importorskip("torch")
    from fake_cifar import cifar_pickle

    from validation import dnn

    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"))
    argv = ["--data-dir", str(tmp_path / "data"), "--clients", "3", "--local-epochs", "1", "--foof-samples", "64"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for label, extra in (("fedpm: ", []), ("fedpm x2 runs", ["--seeds", "0,1"])):
            out = str(tmp_path / label.split(":")[0].replace(" ", "-"))
            assert dnn.main(argv + extra + ["--rounds", "1", "--out", out, "--quiet"]) == 0
            term = FakeTerminal()
            monkeypatch.setattr("sys.stderr", term)
            assert dnn.main(argv + extra + ["--rounds", "2", "--resume", "--out", out]) == 0
            monkeypatch.undo()
            total = 2 * (len(extra) or 1)
            lines = bar_lines(term, label)
            assert lines and f"{total}/{total}" in lines[-1] and re.search(r"<\d\d:\d\d", lines[-1]), term.getvalue()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_flower_simulation_draws_one_bar_over_its_rounds(flower_check_runs):
    """`python -m validation.flower ... --mode simulation` with a terminal as stderr (README's check command,
    shared with tests/test_flower.py: tests/conftest.py)."""
    code, out, drawn, _ = flower_check_runs["fedpm"]
    assert code == 0
    rounds = json.loads((out / "result.json").read_text())["config"]["rounds"]
    lines = [ln for ln in drawn.replace("\r", "\n").splitlines() if ln.startswith("fedpm rounds")]
    assert rounds >= 2 and lines and f"{rounds}/{rounds}" in lines[-1]
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", lines[-1])


@pytest.mark.slow
def test_a_simulation_keeps_flowers_and_rays_output_out_of_the_terminal(flower_check_runs):
    """No deprecation banner, no Flower log, no Ray warning reaches the user's terminal or the command's stdout,
    whichever of the simulation's processes writes it: they are in the run's logs/flower.log; the terminal shows the
    bar alone and stdout the command's own lines (the check run of tests/conftest.py, stderr a pseudo-terminal)."""
    code, out, drawn, stdout = flower_check_runs["fedpm"]
    assert code == 0
    shown = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn).replace("\r", "\n").splitlines()]
    assert [ln for ln in shown if ln and not ln.startswith("fedpm rounds")] == [], drawn
    lines = stdout.splitlines()
    assert [ln.split(" ")[0] for ln in lines] == ["fedpm", "largest", "wrote"], stdout
    assert "deprecated" not in stdout + drawn
    # what Flower and Ray printed (Ray's warnings; Flower's INFO lines where its logger emits them) is kept
    assert (out / "logs" / "flower.log").read_text().strip()
