import json

import numpy as np
import pytest

from validation import bench_convex


def test_benchmark_reports_ratios_and_matches_the_naive_loop(capsys):
    assert bench_convex.main(["--dataset", "a9a", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("seconds_per_round", "seconds_to_1e-9", "loop_ratio"):
        assert r[key] > 0
    assert r["naive_vs_ours_relative_difference"] < 1e-10  # same algorithm, same iterates
    assert r["rounds_to_1e-9"] <= 12


def test_all_methods_rows_on_a_small_problem():
    from naive import random_data

    from fedconvex.problem import FederatedLogReg

    rng = np.random.default_rng(0)
    X, y, parts = random_data(rng, 4, 6, sizes=[20, 30, 25, 15])
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    rows = bench_convex.measure_all(pb, np.zeros(6) + 0.1, rounds=2)
    by = {r["label"]: r for r in rows}
    assert {
        "FedPM",
        "FedNL Rank-1",
        "FedNL-LS identity",
        "FedNL-PP identity (all clients)",
        "FedNS SRHT",
        "FedNL Natural",
        "FedNL TopLEK (k=d)",
        "FedNL RandSeqK (k=d)",
    } <= set(by)
    for label in ("FedPM", "FedNL identity", "FedNL-LS identity", "FedNL-PP identity (all clients)"):
        assert by[label]["rounds_to_1e-9"] is not None and by[label]["seconds_to_1e-9"] > 0
        assert by[label]["round_vs_fedpm"] > 0
    for r in rows:
        if r.get("seconds_per_round") is not None:  # each ratio is against the FedPM rounds timed beside it
            assert r["round_vs_fedpm"] == r["seconds_per_round"] / r["fedpm_seconds_per_round_beside"]
    json.dumps(rows)  # serialisable as it is


def test_each_method_is_timed_alternately_with_fedpm(monkeypatch):
    """round_vs_fedpm divides by FedPM rounds run between the method's own runs, not by one FedPM
    measurement taken minutes earlier: the order of the timed runs, and the medians the ratio is made of."""
    from naive import random_data

    from fedconvex.problem import FederatedLogReg

    rng = np.random.default_rng(2)
    X, y, parts = random_data(rng, 3, 5, sizes=[20, 30, 25])
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    # each run returns other times, so a ratio made of one run only (the last, say) is told apart
    order, fake = [], {"fedpm": iter([[1.0], [3.0]]), "fednl": iter([[4.0], [8.0]])}

    def timed(problem, alg, theta0, rounds):
        order.append(alg.name)
        return next(fake[alg.name])

    monkeypatch.setattr(bench_convex, "_round_times", timed)
    monkeypatch.setattr(bench_convex, "all_methods", lambda d: [("FedNL identity", "fednl", {})])
    (row,) = bench_convex.measure_all(pb, np.zeros(5) + 0.1, rounds=2)
    assert order == ["fednl", "fedpm"] * bench_convex.ALTERNATIONS
    assert row["seconds_per_round"] == 6.0 and row["fedpm_seconds_per_round_beside"] == 2.0  # medians of both runs
    assert row["round_vs_fedpm"] == 3.0


def test_a_method_that_fails_is_reported_in_its_row_and_the_others_still_run(monkeypatch):
    """One method raising (e.g. a backend it cannot run on) gives that row an 'error' and the rest their
    numbers; Diverged stays a measurement (None), not an error."""
    from naive import random_data

    from fedconvex.problem import FederatedLogReg

    rng = np.random.default_rng(1)
    X, y, parts = random_data(rng, 3, 5, sizes=[20, 30, 25])
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    real = bench_convex._measure_method

    def flaky(problem, alg, *a, **k):
        if alg.name == "fedns":
            raise TypeError("Implicit conversion to a NumPy array is not allowed")
        return real(problem, alg, *a, **k)

    monkeypatch.setattr(bench_convex, "_measure_method", flaky)
    rows = bench_convex.measure_all(pb, np.zeros(5) + 0.1, rounds=2)
    failed = [r for r in rows if "error" in r]
    assert failed and all(r["method"] == "fedns" and "Implicit conversion" in r["error"] for r in failed)
    assert all(r.get("seconds_per_round") is not None for r in rows if r["method"] == "fedpm")


def test_the_table_says_how_far_each_method_got(monkeypatch, capsys):
    """A method that did not reach 1e-9 shows its last gradient norm (a blow-up to 1e18 reads as one, not as
    a plain '-'), one whose run raised Diverged says so."""
    rows = [
        {
            "label": "FedNL Top-K (k=d)",
            "seconds_per_round": 0.05,
            "round_vs_fedpm": 1.2,
            "seconds_to_1e-9": None,
            "rounds_to_1e-9": None,
            "final_grad_norm": 1.1e18,
        },
        {
            "label": "FedAvg",
            "seconds_per_round": None,
            "round_vs_fedpm": None,
            "seconds_to_1e-9": None,
            "rounds_to_1e-9": None,
            "final_grad_norm": "diverged",
        },
        {
            "label": "FedPM",
            "seconds_per_round": 0.04,
            "round_vs_fedpm": 1.0,
            "seconds_to_1e-9": 0.3,
            "rounds_to_1e-9": 8,
            "final_grad_norm": 9.4e-12,
        },
    ]
    fake = {
        "methods": rows,
        "max_rounds_to_1e-9": 40,
        "dataset": "w8a",
        "clients": 142,
        "per_client": 350,
        "d": 300,
        "seconds_per_round": 0.04,
        "seconds_per_round_without_screening": 0.038,
        "seconds_to_1e-9": 0.3,
        "rounds_to_1e-9": 8,
        "naive_seconds_per_round": 0.3,
        "loop_ratio": 8.0,
        "naive_vs_ours_relative_difference": 1e-15,
        "backend": "numpy",
        "device": "cpu",
        "command": "x",
    }
    monkeypatch.setattr(bench_convex, "measure", lambda *a, **k: fake)
    assert bench_convex.main(["--all-methods"]) == 0
    lines = {ln.split("  ")[1].strip(): ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  F")}
    assert lines["FedNL Top-K (k=d)"].rstrip().endswith("1.1e+18")
    assert lines["FedAvg"].rstrip().endswith("diverged")
    assert lines["FedPM"].rstrip().endswith("9.4e-12")


def test_dnn_benchmark_prints_both_engines(capsys):
    pytest.importorskip("torch")
    from validation import bench_dnn

    assert bench_dnn.main(["--models", "cnn", "--sizes", "2,20,1,2", "--repeats", "1", "--threads", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["device"] == "cpu" and r["torch_threads"] == 1
    for key in (
        "images_per_second_sequential",
        "images_per_second_vectorized",
        "fedpm_over_fedavg",
        "foof_seconds_share",
        "peak_memory_mb",
        "projected_100_round_minutes",
    ):
        assert r[key] > 0


def test_dnn_benchmark_drops_the_last_partial_batch_when_asked(capsys, monkeypatch):
    """--last-batch reaches every measured run's method and is recorded; the command keeps no state behind it: the
    next measurement in the process (no flag) keeps its last batches again."""
    pytest.importorskip("torch")
    from fedpm_dnn.engine import simulation
    from validation import bench_dnn

    seen = []
    real = simulation.run_experiment

    def spy(exp, *a, **kw):
        seen.append(exp.cfg.last_batch)
        return real(exp, *a, **kw)

    monkeypatch.setattr(simulation, "run_experiment", spy)
    argv = ["--models", "cnn", "--sizes", "2,20,1,2", "--repeats", "1", "--threads", "1", "--engine", "vectorized"]
    assert bench_dnn.main([*argv, "--foof-apply", "solve", "--last-batch", "drop", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["last_batch"] == "drop"
    assert seen and set(seen) == {"drop"}
    seen.clear()
    assert bench_dnn.main([*argv, "--foof-apply", "solve", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["last_batch"] == "keep" and seen and set(seen) == {"keep"}


def test_dnn_benchmark_measures_only_the_engines_asked_for(capsys):
    pytest.importorskip("torch")
    from validation import bench_dnn

    argv = ["--models", "cnn", "--sizes", "2,20,1,3", "--repeats", "2", "--threads", "1", "--engines", "vectorized"]
    argv += ["--foof-applies", "solve"]  # the inverse side by side: the next test
    assert bench_dnn.main(argv + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)["results"][0]
    assert r["engines"] == ["vectorized"] and r["timed_rounds_per_method"] == 4
    assert r["fedpm_over_fedavg"] > 0 and r["images_per_second_vectorized"] > 0 and r["client_chunk"] == 2
    assert r["images_per_second_sequential"] is None and r["vectorized_speedup"] is None
    assert r["fedpm_over_fedavg_sequential"] is None and r["projected_100_round_minutes_sequential"] is None
    # per measured run (2 repeats x FedAvg, FedPM): peak memory per phase, null on a CPU, and the engine's plan
    runs = r["memory_by_run"]
    assert [(m["engine"], m["method"]) for m in runs] == [("vectorized", "fedavg"), ("vectorized", "fedpm")] * 2
    for m in runs:
        assert m["peak_memory_mb"] > 0
        assert m["peak_memory_mb_by_phase"] == dict.fromkeys(bench_dnn.PHASES)
        plan = m["memory_plan"]
        assert plan["client_chunk"] == 2 and plan["free_bytes"] > 0 and plan["predicted_train_bytes_per_client"] > 0
        if m["method"] == "fedpm":  # its statistics pass took both clients at once; its own bytes per client
            assert plan["stats_client_chunk"] == 2 and plan["predicted_stats_bytes_per_client"] > 0
        else:
            assert plan["stats_client_chunk"] is None and plan["predicted_stats_bytes_per_client"] == 0
    assert bench_dnn.main(argv) == 0  # the table prints a dash where an engine was left out
    assert "sequential - img/s" in capsys.readouterr().out


def test_dnn_benchmark_times_the_methods_asked_for(capsys, monkeypatch):
    """--method: any registered method; a key named after FedAvg or FedPM only where that method was timed, and
    FedPM/FedAvg only where both were (absent, not wrong); the per-method times are the named keys' own.  On a
    terminal the bar counts each measured run."""
    pytest.importorskip("torch")
    from test_cli_vocabulary import FakeTerminal, bar_lines

    from validation import bench_dnn

    argv = ["--models", "cnn", "--sizes", "2,20,1,2", "--repeats", "1", "--threads", "1", "--engines", "vectorized"]
    argv += ["--foof-applies", "solve"]
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    assert bench_dnn.main(argv + ["--method", "fedpm,scaffold", "--json"]) == 0
    monkeypatch.undo()
    assert "2/2" in bar_lines(term, "cnn: ")[-1]  # one run of each method
    out = json.loads(capsys.readouterr().out)
    r = out["results"][0]
    times = r["round_seconds_by_method"]
    assert r["methods"] == ["fedpm", "scaffold"] and set(times["vectorized"]) == {"fedpm", "scaffold"}
    assert times["vectorized"]["fedpm"] == r["fedpm_round_seconds_vectorized"] and times["vectorized"]["scaffold"] > 0
    assert times["sequential"] == {"fedpm": None, "scaffold": None}  # an engine left out: null, as before
    assert r["foof_seconds_share"] > 0 and set(r["peak_memory_mb_by_method"]) == {"fedpm", "scaffold"}
    fedavg_keys = [k for k in {**r, **out} if "fedavg" in k or k.startswith("images_per_second")]
    assert fedavg_keys == []
    assert bench_dnn.main(argv + ["--method", "fedavgm"]) == 0  # neither FedAvg nor FedPM: the table still prints
    text = capsys.readouterr().out
    assert "round seconds, vectorized: fedavgm " in text and "FedPM" not in text and "img/s" not in text


def test_the_paper_round_projection_scales_each_part_by_what_it_reads():
    from validation.bench_dnn import paper_round_seconds

    parts = {"seconds": 10.0, "statistics": 1.0, "factorisations": 2.0, "server": 3.0}  # training: 4 s
    assert paper_round_seconds(parts, 10, 5000, 5) == pytest.approx(10.0)  # the paper's own size: the round itself
    # 2 clients x 100 images x 1 epoch: training x 1250 (image-epochs), statistics x 250 (images), the rest x 5
    assert paper_round_seconds(parts, 2, 100, 1) == pytest.approx(4 * 1250 + 1 * 250 + (2 + 3) * 5)
    more_epochs = paper_round_seconds(parts, 2, 100, 2)
    assert paper_round_seconds(parts, 2, 100, 1) - more_epochs == pytest.approx(4 * 1250 / 2)  # only training moved


def test_the_foof_timer_counts_a_nested_factorisation_once(monkeypatch):
    """The batched factorisation repairs a non-PSD matrix (foof.repaired_factor); with the repair calling the timed
    foof.factorize, 0.5 s spent there must count 0.5 s in factorisations, not 1.0."""
    torch = pytest.importorskip("torch")
    import time

    from fedpm_dnn import foof
    from fedpm_dnn.foof import batched
    from validation.bench_dnn import FoofTimer

    A = torch.eye(3, dtype=torch.float64)[None].repeat(2, 1, 1)
    A[1] = -A[1]  # not PSD: repaired inside the batched factorisation
    real_factorize = foof.factorize
    monkeypatch.setattr(foof, "factorize", lambda *a, **k: time.sleep(0.5) or real_factorize(*a, **k))
    # the repair goes through the (timed) factorize of a PSD matrix: a wrapped call inside a wrapped call
    monkeypatch.setattr(foof, "repaired_factor", lambda name, M, lam: foof.factorize({name: M.abs()}, lam)[name])
    with FoofTimer("cpu") as timer:
        batched.factorize_stacked({"b": A}, 1.0, torch.float32)
    assert 0.5 <= timer.seconds["factorisations"] < 0.95 and timer.seconds["statistics"] == 0.0


def test_dnn_benchmark_stacks_runs_and_puts_both_foof_applies_side_by_side(capsys):
    """--stack 2: one run alone and two stacked, timed in this process; stack_speedup = S x single / stacked.
    FedPM/FedAvg by --foof-apply: solve's is the plain key."""
    pytest.importorskip("torch")
    from validation import bench_dnn

    argv = ["--models", "cnn", "--sizes", "2,20,1,2", "--repeats", "1", "--threads", "1", "--engines", "vectorized"]
    assert bench_dnn.main(argv + ["--stack", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["results"][0]
    assert r["runs_stacked"] == 2 and r["seconds_per_round_single"] > 0 and r["seconds_per_round_stacked"] > 0
    assert r["stack_speedup"] == pytest.approx(2 * r["seconds_per_round_single"] / r["seconds_per_round_stacked"])
    assert out["stack_speedup"] == r["stack_speedup"]  # a headline key (SimpleCNN)
    by = r["fedpm_over_fedavg_by_apply"]
    assert set(by) == {"solve", "inverse"} and by["solve"] == r["fedpm_over_fedavg"] and by["inverse"] > 0


def test_the_singular_flags_take_comma_lists_the_old_spelling_warns_and_any_apply_may_come_first(capsys):
    """--engine / --foof-apply as elsewhere (comma lists here); --engines / --foof-applies still work with one warning
    line; the first apply listed gives the plain keys, so solve need not come first."""
    pytest.importorskip("torch")
    from validation import bench_dnn

    argv = ["--models", "cnn", "--sizes", "2,20,1,2", "--repeats", "1", "--threads", "1", "--json"]
    assert bench_dnn.main(argv + ["--engine", "vectorized", "--foof-apply", "inverse,solve"]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)["results"][0]
    assert "warning" not in captured.err and r["engines"] == ["vectorized"] and r["plain_apply"] == "inverse"
    times = r["round_seconds_by_method"]["vectorized"]
    assert set(times) == {"fedavg", "fedpm", "fedpm-solve"} and r["fedpm_round_seconds_vectorized"] == times["fedpm"]
    assert r["fedpm_over_fedavg_by_apply"]["inverse"] == r["fedpm_over_fedavg"]
    assert r["foof_precision"] == "fp32"  # auto on a CPU
    assert bench_dnn.main(argv + ["--engines", "vectorized", "--foof-applies", "solve"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert warnings == [
        "python -m validation.bench_dnn: warning: --engines is spelled --engine now (a comma list, as before)",
        "python -m validation.bench_dnn: warning: --foof-applies is spelled --foof-apply now (a comma list, as before)",
    ]
    assert json.loads(captured.out)["results"][0]["engines"] == ["vectorized"]


def test_the_json_holds_no_nan(capsys, monkeypatch):
    """A measurement that could not be made is null, never NaN (which is no JSON)."""
    pytest.importorskip("torch")
    from validation import bench_dnn

    monkeypatch.setattr(bench_dnn, "measure", lambda *a, **k: {"model": "cnn", "x": float("nan"), "y": [float("inf")]})
    assert bench_dnn.main(["--models", "cnn", "--sizes", "2,20,1,2", "--threads", "1", "--json"]) == 0
    out = capsys.readouterr().out
    r = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))["results"][0]
    assert r["x"] is None and r["y"] == [None]


def test_the_foof_cost_model_matches_hand_counts_on_small_layers():
    """fedpm_dnn.foof.cost on a Linear(3, 2) with bias and a Conv2d(2, 3, 3, padding=1) on 4 x 4 images, counted by
    hand; the Gram's count is the product the statistics pass makes (conv_patches' shape)."""
    torch = pytest.importorskip("torch")
    from fedpm_dnn import foof
    from fedpm_dnn.foof.cost import block_shapes, foof_cost

    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(48, 2))
    shapes = block_shapes(model, torch.zeros(2, 4, 4))
    assert [(s["d"], s["d_in"], s["rows"], s["L"]) for s in shapes] == [(19, 18, 3, 16), (49, 48, 2, 1)]
    patches = foof.conv_patches(model[0], torch.zeros(1, 2, 4, 4))
    # 2 clients x 5 images, 2 epochs of batches of 2: 3 steps an epoch, 6 a round
    c = foof_cost(shapes, clients=2, per_client=5, epochs=2, batch=2, apply="inverse", mode="fp32")
    conv, fc = c["blocks"]
    assert c["steps_per_client"] == 6
    assert conv["apply_flop_per_step"] == 2 * 3 * 19 * 19 == 2166 and fc["apply_flop_per_step"] == 2 * 2 * 49 * 49
    assert conv["gram_flop_per_image"] == 2 * patches.shape[1] * patches.shape[2] ** 2 == 2 * 16 * 18 * 18
    assert fc["gram_flop_per_image"] == 2 * 48 * 48
    assert conv["factorisation_flop"] == 2 * (2 * 19**3 // 3)  # Cholesky + cholesky_inverse, d^3/3 MAs each
    assert conv["apply_flop"] == 2 * 6 * 2166 and conv["gram_flop"] == 2 * 5 * 10368
    assert c["total"]["state_bytes"] == 2 * 8 * (19 * 19 + 49 * 49)  # float64 A per client
    assert c["total"]["operator_bytes"] == 2 * 4 * (19 * 19 + 49 * 49)  # one float32 inverse per block
    assert c["total"]["stats_patch_bytes_peak"] == 4 * 2 * 5 * 16 * 18  # the conv's patches, both clients
    split = foof_cost(shapes, 2, 5, 2, 2, apply="inverse", mode="split-tf32")
    assert split["blocks"][0]["apply_flop_per_step"] == 3 * 2166  # three TF32 products
    assert split["blocks"][0]["gram_flop_per_image"] == 2 * 2 * 16 * 18 * 18  # hi^T hi and C = hi^T lo
    # CUDA's half products: an 18-wide block is one block row, the full product (two in split-tf32), and this
    # small conv keeps the patch form
    half = foof_cost(shapes, 2, 5, 2, 2, apply="inverse", mode="split-tf32", gram_form="half")
    assert [b["gram_form"] for b in half["blocks"]] == ["patch", "patch"]
    assert half["blocks"][0]["gram_flop_per_image"] == 2 * 2 * 16 * 18 * 18
    wide = block_shapes(torch.nn.Linear(1200, 2), torch.zeros(1200))
    # 1,200 = 4 block rows of 300: (1 + 2 + 3 + 4) / 16 of the product; split-tf32: 3 such products, not 2 whole
    for mode, products in (("fp32", 1), ("tf32", 1), ("split-tf32", 3)):
        b = foof_cost(wide, 2, 5, 2, 2, mode=mode, gram_form="half")["blocks"][0]
        assert b["gram_flop_per_image"] == 2 * 1200**2 * 10 // 16 * products
    solve = foof_cost(shapes, 2, 5, 2, 2, apply="solve", mode="split-tf32")
    assert solve["blocks"][0]["apply_flop_per_step"] == 2166  # two triangular solves: rows d^2 each, in float32
    assert solve["blocks"][0]["factorisation_flop"] == 2 * 19**3 // 3 and solve["total"][
        "operator_bytes"
    ] == 2 * 2 * 4 * (19 * 19 + 49 * 49)


def test_the_cost_model_counts_the_splits_memory_traffic_and_auto_takes_split_tf32_only_where_it_pays():
    """split-tf32 moves more bytes than the fp32 product (the rows' split, both parts of the inverse read by three
    products), and its statistics pass splits the patches; on SimpleCNN's small blocks that traffic and the
    launches outweigh the tensor cores (auto: fp32), on ResNet18-GN's wide ones the tensor cores win (auto:
    split-tf32); off CUDA auto is fp32."""
    torch = pytest.importorskip("torch")
    from fedpm_dnn.foof.cost import apply_bytes, auto_mode, block_shapes, foof_cost, split_pays
    from fedpm_dnn.models import make_model

    assert apply_bytes(19, 3, "inverse", "fp32") == 4 * (19 * 19 + 2 * 3 * 19)
    assert apply_bytes(19, 3, "inverse", "split-tf32") == 4 * (3 * 19 * 19 + 17 * 3 * 19)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(48, 2))
    shapes = block_shapes(model, torch.zeros(2, 4, 4))
    fp32 = foof_cost(shapes, 2, 5, 2, 2, apply="inverse", mode="fp32")
    split = foof_cost(shapes, 2, 5, 2, 2, apply="inverse", mode="split-tf32")
    assert fp32["total"]["gram_split_bytes"] == 0 and split["total"]["gram_split_bytes"] == 2 * 5 * 4 * 5 * (
        16 * 18 + 48
    )
    assert split["total"]["apply_bytes"] > 2 * fp32["total"]["apply_bytes"] > 0
    for name, pays in (("cnn", False), ("resnet18gn", True)):
        blocks = block_shapes(make_model(name, 10, 3, 32), torch.zeros(3, 32, 32))
        assert split_pays(blocks, 10, "NVIDIA H100 80GB HBM3") is pays, name
        assert auto_mode("cuda", name) == ("split-tf32" if pays else "fp32")
        assert auto_mode("cpu", name) == "fp32"


def test_the_paper_cost_reproduces_the_resnet_products_at_the_papers_size():
    """ResNet18-GN, CIFAR-100, 10 x 5,000 images x 5 epochs, batch 64 (395 steps): the per-step apply products
    ~320 TFLOP and the statistics Gram ~468 TFLOP a round in plain fp32, the three 4,608-wide blocks 81 % of the
    apply's."""
    pytest.importorskip("torch")
    from fedpm_dnn.foof.cost import paper_cost

    c = paper_cost("resnet18gn", "inverse", "fp32")
    assert c["steps_per_client"] == 395
    assert c["total"]["apply_flop"] == pytest.approx(320e12, rel=0.01)
    assert c["total"]["gram_flop"] == pytest.approx(468e12, rel=0.01)
    wide = sum(b["apply_flop"] for b in c["blocks"] if b["d"] == 4608)
    assert 0.80 < wide / c["total"]["apply_flop"] < 0.82  # 81 % of the apply products
    # CUDA's forms: the first stage's 3x3 convs in the row form, the three 4,608-wide blocks with half products:
    # 18 block rows of 256, (1 + ... + 18) / 18^2 = 19 / 36 of the product, over 4 x 4 output positions
    half = paper_cost("resnet18gn", "inverse", "fp32", gram_form="half")
    assert [b["name"] for b in half["blocks"] if b["gram_form"] == "row"] == [
        f"layers.0.{i}.conv{j}" for i in (0, 1) for j in (1, 2)
    ]
    last = [b for b in half["blocks"] if b["d"] == 4608]
    assert len(last) == 3 and all(b["gram_form"] == "patch" for b in last)
    assert all(b["gram_flop_per_image"] == round(2 * 16 * 4608**2 * 19 / 36) for b in last)
    assert half["total"]["gram_flop"] < 0.55 * c["total"]["gram_flop"]


def test_proxies_count_operators_per_local_step_and_round(capsys):
    """--proxies in the JSON: operators per local step (the difference of a one- and a two-epoch run, per step) and
    per round; FedPM's step issues more operators than FedAvg's (its preconditioning), a round at least its steps'.
    Both forms of the step side by side (step_forms): the static function issues no more operators than the loop,
    and once it is one graph replay the host is left with fewer; the plain keys are the CPU's form, the loop."""
    pytest.importorskip("torch")
    import json

    from validation import bench_dnn

    argv = ["--models", "cnn", "--engine", "vectorized", "--sizes", "1,32,1,2", "--repeats", "1", "--threads", "1"]
    assert bench_dnn.main([*argv, "--foof-apply", "inverse", "--proxies", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    p = result["proxies"]
    assert result["step_graph"] == "off" and set(p) == {"fedavg", "fedpm"}
    for m in p.values():
        assert m["local_steps_per_epoch"] == 1 and m["operators_per_local_step"] > 0
        assert m["operators_per_round"] >= m["operators_per_local_step"]
        # a difference of two runs' times, one step apart: its sign is the machine's noise at this size
        assert isinstance(m["host_operator_ms_per_local_step"], float)
        assert m["kernel_launches_per_local_step"] is None  # a CPU launches no kernels
        loop, static = m["step_forms"]["loop"], m["step_forms"]["static"]
        assert m["step_form"] == "loop" and all(m[k] == v for k, v in loop.items())
        assert set(static) == set(loop) and static["kernel_launches_per_local_step"] is None
        assert static["graph_replays_per_local_step"] == loop["graph_replays_per_local_step"] == 0  # no CUDA here
        assert 0 < static["operators_per_local_step"] <= loop["operators_per_local_step"]
        assert loop["operators_per_local_step_graphed"] == loop["operators_per_local_step"]
        assert 1 <= static["operators_per_local_step_graphed"] < loop["operators_per_local_step"] / 2
        assert isinstance(static["host_operator_ms_per_local_step"], float)
        assert isinstance(static["wall_ms_per_local_step"], float)
    assert p["fedpm"]["operators_per_local_step"] > p["fedavg"]["operators_per_local_step"]


def test_phase_peaks_credit_each_part_of_a_run_to_its_innermost_phase():
    """PhasePeaks with a fake allocator (the CUDA counters' arithmetic): memory held by the outer phase counts in
    the inner phase's peak; the outer phase's peak is the largest of its parts outside the inner one; the round's
    peak is the largest of all; leaving restores every wrapped function (an inherited one is removed again)."""
    pytest.importorskip("torch")
    import types

    from fedpm_dnn import foof
    from fedpm_dnn.algorithms import method_class
    from fedpm_dnn.engine import vectorized
    from validation import bench_dnn

    class Allocator:
        def __init__(self):
            self.now = self.top = 0

        def take(self, n):
            self.now += n
            self.top = max(self.top, self.now)

        def reset(self):
            self.top = self.now

    mem = Allocator()
    server_cls = type("Inherits", (method_class("fedavg"),), {})  # server_update inherited, not its own
    originals = (vectorized.VectorizedEngine.round, vectorized.VectorizedEngine.foof_for, foof.operators)
    peaks = bench_dnn.PhasePeaks("cpu", server_cls, reset=mem.reset, peak=lambda: mem.top)
    ns = types.SimpleNamespace()

    def stats():
        mem.take(50)  # 100 held by training + 50
        mem.take(-50)

    def train():
        mem.take(100)
        ns.stats()
        mem.take(300)  # training's own peak: 400
        mem.take(-400)

    ns.train, ns.stats = train, stats
    with peaks:
        peaks._wrap(ns, "train", "local_training")
        peaks._wrap(ns, "stats", "statistics")
        ns.train()
        assert vectorized.VectorizedEngine.foof_for is not originals[1] and "server_update" in vars(server_cls)
    assert peaks.bytes == {"local_training": 400, "statistics": 150, "factorisations": 0, "server": 0}
    assert peaks.round_peak == 400 and peaks.mb()["statistics"] == 150 / 2**20
    assert (vectorized.VectorizedEngine.round, vectorized.VectorizedEngine.foof_for, foof.operators) == originals
    assert "server_update" not in vars(server_cls)
    assert bench_dnn.PhasePeaks("cpu", server_cls).mb() == dict.fromkeys(bench_dnn.PHASES)  # a CPU: null
