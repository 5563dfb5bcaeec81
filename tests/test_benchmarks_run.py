"""Every measurement script under benchmarks/ runs, at a tiny size on the CPU (FEDPM_BENCH_TINY=1 shrinks the ones
without size flags; the CUDA benchmarks take --device cpu).  The Flower scripts, which start processes and need
prepared data, print their help here; the deployment one runs twenty SuperNodes for a round in
tests/test_flower_many_nodes.py.  The three that validation/gpu_checks.sh runs print their help here too: its tiny
run below runs them and reads what they wrote."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "convex_round_time.py": ['{"compressor": "natural"}', "fednl"],
    "cuda_fedavg_fedpm_round_ratio.py": ["1", "--device", "cpu", "--sizes", "1,8,1,2"],
    "cuda_round_profile.py": ["--help"],  # run at a tiny size in validation/gpu_checks.sh's test below
    "fednl_step_options_from_zero.py": [],
    "fedns_draws_vs_fedpm.py": [],
    "flower_deployment_scale.py": ["--help"],
    "flower_simulation_scale.py": ["--help"],
    "foof_apply.py": ["--models", "cnn", "--repeats", "1"],
    "foof_centralised.py": ["--help"],  # trained end to end at a tiny size by tests/test_foof_optimizer.py
    "foof_conv_gram_rule.py": [],
    "foof_gram_forms.py": ["--help"],  # the same
    "mixing_solve_forms.py": ["--model", "cnn", "--clients", "2", "--repeats", "1"],
    "profile_fedpm_parts.py": ["--model", "cnn", "--sizes", "1,8,1,2"],
    "stack_chunks_cpu.py": [],
    "step_graph_round.py": ["--help"],  # the same
}


def run(script, argv):
    env = {**os.environ, "PYTHONPATH": ROOT, "FEDPM_BENCH_TINY": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [sys.executable, os.path.join("benchmarks", script), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_script_has_a_tiny_run():
    scripts = sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py"))
    assert scripts == sorted(TINY)


@pytest.mark.parametrize("script", sorted(TINY))
def test_each_benchmark_runs_at_a_tiny_size_on_the_cpu(script):
    r = run(script, TINY[script])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.strip(), script  # it printed its measurement (or its help)


@pytest.mark.slow
def test_the_gpu_script_runs_every_step_at_a_tiny_size_on_the_cpu(tmp_path):
    """validation/gpu_checks.sh with GPU_CHECKS_TINY=1, twice: a first job runs one unit and hands back its archive,
    a second job (another output folder, a fresh scratch folder) continues from that archive (PREVIOUS) and runs
    the rest.  Each job's output folder holds only what a GPU job can hand back (the archive's volumes and the log:
    under 8 files, none over 16 MiB, none in a folder); the final archive holds every figure's file (the benchmark
    JSONs parse), a done marker per finished step, the first job's unit as it wrote it, and the 100-round stacks'
    units (the a1.0 ones finish, FedAvg's with the last partial batch dropped and kept; the relaysum-even ones are given
    that split)."""
    import json

    from fake_cifar import cifar_pickle

    from validation import gpu_archive

    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"), n=20, balanced=True)  # class-balanced subsets exist
    env = {**os.environ, "PYTHONPATH": ROOT, "GPU_CHECKS_TINY": "1", "PYTHON": sys.executable}
    script = ["bash", os.path.join(ROOT, "validation", "gpu_checks.sh"), str(tmp_path / "data")]

    def job(n, *extra, **more):
        out = tmp_path / f"out{n}"
        r = subprocess.run(
            [*script, str(out), "3000", *extra],
            cwd=ROOT,
            env={**env, "GPU_CHECKS_WORK": str(tmp_path / f"work{n}"), **more},
            capture_output=True,
            text=True,
            timeout=3300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        names = sorted(os.listdir(out))
        assert len(names) < 8 and all((out / f).is_file() for f in names), names
        assert all((out / f).stat().st_size <= gpu_archive.MAX_BYTES for f in names)
        return r, out

    first, out1 = job(1, ONLY="cnn_paper")
    assert "=== cnn_paper" in first.stdout and "=== stack" not in first.stdout
    second, out2 = job(2, str(out1 / gpu_archive.NAME))
    assert "cnn_paper: done earlier" in second.stdout and "=== cnn_paper" not in second.stdout
    out = tmp_path / "unpacked"
    gpu_archive.unpack(str(out2 / gpu_archive.NAME), str(out), gpu_archive.device_name())
    assert (out / "cnn_paper.json").read_text() == (tmp_path / "work1" / "cnn_paper.json").read_text()
    for name in ("resnet_split_tf32", "cnn_paper", "stack6_cnn"):
        result = json.loads((out / f"{name}.json").read_text())["results"][0]
        assert (out / "done" / name).is_file() and result["fedpm_round_seconds_vectorized"] > 0, name
    assert json.loads((out / "cnn_paper.json").read_text())["results"][0]["proxies"]["fedpm"]["operators_per_round"] > 0
    assert "aten operators" in (out / "cuda_round_profile.txt").read_text()
    assert (out / "done" / "gram_forms").is_file() and (out / "foof_gram_forms.txt").read_text().strip()
    graph = json.loads((out / "step_graph.json").read_text())
    assert (out / "done" / "step_graph").is_file() and all(graph[m]["agree"] for m in ("fedavg", "fedpm"))
    # the a1.0 stacks run the presets' drop, and the pair's other half keeps the last partial batch
    for unit, last_batch in (
        ("stack_fedavg_a1.0", "drop"),
        ("stack_fedavg_a1.0_keep", "keep"),
        ("stack_fedpm_a1.0", "drop"),
    ):
        assert (out / "done" / unit).is_file()
        runs = sorted(p.name for p in (out / "stacks" / unit).iterdir())
        assert len(runs) == 3 and all((out / "stacks" / unit / p / "history.csv").is_file() for p in runs), runs
        for p in runs:
            summary = json.loads((out / "stacks" / unit / p / "summary.json").read_text())
            assert summary["config"]["last_batch"] == last_batch, (unit, p)
    log = (out / "log.txt").read_text()
    assert log.count("--split relaysum-even") >= 2 and "continued from" in log
    again = subprocess.run(
        [*script, str(out2), "3000"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )  # the same output folder again: its archive is continued, nothing is left to run
    assert again.returncode == 0 and "cnn_paper: done earlier" in again.stdout and "=== stack" not in again.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "0"], "--nodes: must be a positive integer"),
        (["--rounds", "1.5"], "--rounds: must be an integer"),
        (["--timeout", "0"], "--timeout: must be a number > 0"),
        (["--timeout", "nan"], "--timeout: must be a finite number"),
        (["--method", "nope"], "--method: invalid choice"),
        (["--result", "{tmp}/none/run.json"], "--result {tmp}/none/run.json: its folder does not exist"),
        (["--out", "{tmp}/none/scale.json"], "--out {tmp}/none/scale.json: its folder does not exist"),
        (["--log-dir", "{tmp}/file"], "--log-dir {tmp}/file: not a folder"),
    ],
)
def test_the_deployment_benchmark_refuses_a_bad_flag_in_one_line_before_starting_anything(tmp_path, argv, message):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = run("flower_deployment_scale.py", argv)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and message.replace("{tmp}", str(tmp_path)) in err[0], r.stderr
    assert r.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_simulation_benchmark_refuses_an_out_in_a_missing_folder_before_it_starts(tmp_path):
    r = run("flower_simulation_scale.py", ["--data-dir", str(tmp_path), "--out", str(tmp_path / "none" / "s.json")])
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "--out" in err[0] and "its folder does not exist" in err[0], err
    assert "simulation" not in r.stdout and sorted(tmp_path.iterdir()) == []
