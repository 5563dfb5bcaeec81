"""The figures module renders from a tiny synthetic results folder; the p-value table matches scipy."""

import json
import os

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from figures import draw
from figures.__main__ import build_all
from figures.tables import accuracy_table, max_pvalue, to_latex, to_markdown

DNN_COLUMNS = "round,test_acc,train_loss,client_seconds,server_seconds,bytes_up,bytes_down,peak_memory_mb,wall_seconds"


def _dnn_run(root, name, acc, rounds=3, clients=4):
    os.makedirs(os.path.join(root, name))
    rows = [DNN_COLUMNS] + [
        f"{t},{acc * t / rounds},{1.0 / t},{0.5},{0.01},{1000 * t},{900 * t},{50.0},{0.6 * t}"
        for t in range(1, rounds + 1)
    ]
    open(os.path.join(root, name, "history.csv"), "w").write("\n".join(rows) + "\n")
    json.dump(
        {
            "best_test_acc": acc,
            "final_test_acc": acc,
            "mean_client_seconds_per_round": 0.5,
            "bytes_up_per_round": 1000,
            "bytes_down_per_round": 900,
            "peak_memory_mb": 50.0,
            "clients": clients,
            "class_counts": np.random.default_rng(0).integers(0, 20, (clients, 10)).tolist(),
            "rounds_done": rounds,
        },
        open(os.path.join(root, name, "summary.json"), "w"),
    )


def _convex_run(root, name):
    os.makedirs(os.path.join(root, name))
    lines = ["method,round,f_gap,dist,grad_norm,bytes_up,bytes_down,seconds"]
    for m in ("fedavg", "fedpm"):
        lines += [f"{m},{t},{10.0**-t},{10.0**-t},{1.0},{8 * t},{8 * t},{0.1 * t}" for t in range(4)]
    open(os.path.join(root, name, "history.csv"), "w").write("\n".join(lines) + "\n")
    json.dump({"f_star": 0.3}, open(os.path.join(root, name, "summary.json"), "w"))


@pytest.fixture
def results(tmp_path):
    root = str(tmp_path / "results")
    for ds in ("w8a", "a9a"):
        _convex_run(root, f"superlinear-{ds}")
    for alpha in ("1.0", "0.1"):
        for k, m in enumerate(("fedavg", "localnewton", "fedpm")):
            for s in (0, 1, 2):
                _dnn_run(root, f"main-cifar10-a{alpha}-{m}-s{s}", 0.3 + 0.1 * k + 0.01 * s)
    for e in (1, 5, 10):
        for m in ("fedavg", "fedpm"):
            for s in (0, 1):
                _dnn_run(root, f"epochs-{e}-{m}-s{s}", 0.4 + 0.01 * e + (0.1 if m == "fedpm" else 0))
    for p in (2, 5, 8, 10):
        for s in (0, 1):
            _dnn_run(root, f"sampling-{p}-fedpm-s{s}", 0.3 + 0.02 * p)
    for k in ("64", "256", "1024", "all"):
        _dnn_run(root, f"foof-{k}-fedpm-s0", 0.5)
    return root


def test_every_figure_and_table_renders(results, tmp_path):
    out = str(tmp_path / "out")
    produced = build_all(results, out, "quick", log=lambda msg: None)
    stems = {os.path.splitext(os.path.basename(p))[0] for p in produced}
    assert stems >= {
        "test1_convergence",
        "test2_cifar10_a0.1_curves",
        "table3_accuracy",
        "table_pvalues",
        "local_epochs",
        "client_sampling",
        "foof_samples",
        "data_distribution",
        "table_profiling",
    }
    for p in produced:
        assert os.path.getsize(p) > 200, p
    assert all(os.path.exists(os.path.join(out, f"{s}.{e}")) for s in stems for e in ("png", "pdf"))
    md = open(os.path.join(out, "table3_accuracy.md")).read()
    assert "**51.0 ± 1.0**" in md and "FedAvg" in md and "SCAFFOLD" not in md  # FedPM best in bold; no empty rows


def test_figure_axes_are_labelled(results, tmp_path):
    out = str(tmp_path / "o")
    _, fig = draw.test2_curves(results, "cifar10", "0.1", out)
    assert fig.axes[0].get_xlabel() == "communication round" and "accuracy" in fig.axes[0].get_ylabel()
    assert "wall-clock" in fig.axes[1].get_xlabel()
    assert {t.get_text() for t in fig.axes[1].get_legend().get_texts()} == {"FedAvg", "LocalNewton", "FedPM"}
    _, fig = draw.test1({"w8a": os.path.join(results, "superlinear-w8a")}, out)
    assert "f^*" in fig.axes[0].get_ylabel() and fig.axes[1].get_xlabel() == "communication round"
    assert fig.axes[0].get_yscale() == "log"


def test_missing_results_are_skipped_with_a_message(tmp_path):
    messages = []
    produced = build_all(str(tmp_path / "empty"), str(tmp_path / "out"), "quick", log=messages.append)
    assert produced == [] and any("Table 3" in m for m in messages) and any("Test 1" in m for m in messages)


def test_max_pvalue_matches_scipy():
    best = {"fedpm": [0.70, 0.72, 0.71], "fedavg": [0.60, 0.61, 0.65], "localnewton": [0.69, 0.73, 0.70]}
    expect = max(mannwhitneyu(best["fedpm"], best[m], alternative="greater").pvalue for m in ("fedavg", "localnewton"))
    assert max_pvalue(best) == pytest.approx(expect)
    assert max_pvalue(best, exclude=("localnewton",)) == pytest.approx(
        mannwhitneyu(best["fedpm"], best["fedavg"], alternative="greater").pvalue
    )
    # three seeds that all beat three seeds: the smallest p a 3-vs-3 test can give, 1/20
    assert max_pvalue({"fedpm": [3, 4, 5], "x": [0, 1, 2]}) == pytest.approx(0.05)


def test_table_formats():
    header, rows = accuracy_table({"C10": {"fedavg": [0.5, 0.6], "fedpm": [0.7, 0.7]}}, ("fedavg", "fedpm"))
    assert rows == [["FedAvg", "55.0 ± 7.1"], ["FedPM", "**70.0 ± 0.0**"]]
    tex = to_latex(header, rows, "cap", "tab:x")
    assert r"\textbf{70.0 $\pm$ 0.0}" in tex and r"\label{tab:x}" in tex
    assert to_markdown(header, rows).splitlines()[0] == "| Method | C10 |"


def test_a_failing_run_does_not_stop_the_others(tmp_path, monkeypatch):
    import validation.dnn as dnn
    import validation.experiments as ex

    runs = [ex.Run("bad", "dnn", ("--x",), 1), ex.Run("good", "dnn", ("--y",), 1)]
    monkeypatch.setattr(ex, "plan", lambda profile: runs)
    monkeypatch.setattr(ex, "data_available", lambda ds, d: True)
    calls = []

    def fake_main(argv):
        calls.append(argv[0])
        if argv[0] == "--x":
            raise SystemExit(2)
        out = argv[argv.index("--out") + 1]
        os.makedirs(out)
        json.dump({"rounds_done": 1}, open(os.path.join(out, "summary.json"), "w"))

    monkeypatch.setattr(dnn, "main", fake_main)
    messages = []
    done = ex.ensure("quick", "data", str(tmp_path), log=messages.append)
    assert calls == ["--x", "--y"] and list(done) == ["good"] and any("bad failed" in m for m in messages)


def test_compression_bytes_table_has_float16_parameter_rows():
    pytest.importorskip("torch")
    from fedpm_dnn.models import make_model
    from figures.compression import resnet_table

    n = sum(p.numel() for p in make_model("cnn", 10).parameters())
    header, rows, caption = resnet_table(("none", "lowrank:0.02"), "cnn", 10, "SimpleCNN", ("none", "lowrank:0.02"))
    assert [r[1].split()[0] for r in rows] == ["float32", "float32", "float16", "float16"]
    MiB = 2**20
    for r32, r16 in zip(rows[:2], rows[2:], strict=False):  # same matrices, parameters halved
        assert r16[2] == r32[2]
        assert float(r32[3]) - float(r16[3]) == pytest.approx(2 * n / MiB, abs=2e-3)
    assert rows[0][4] == "100.0 %" and f"{n:,} parameters" in caption


def test_a_table_drawn_from_part_of_its_runs_says_so(tmp_path):
    """Table 3 of a profile whose main runs are not all done is marked INCOMPLETE (how many are missing); with
    every planned main run present it is not."""
    from validation.experiments import plan

    root = str(tmp_path / "results")
    main_runs = [r for r in plan("quick") if r.name.startswith("main-")]
    for k, r in enumerate(main_runs):
        _dnn_run(root, r.name, 0.3 + 0.001 * k, rounds=r.rounds)
    out = str(tmp_path / "out")
    build_all(root, out, "quick", log=lambda msg: None)
    assert "INCOMPLETE" not in open(os.path.join(out, "table3_accuracy.md")).read()
    os.remove(os.path.join(root, main_runs[-1].name, "summary.json"))
    messages = []
    build_all(root, out, "quick", log=messages.append)
    md = open(os.path.join(out, "table3_accuracy.md")).read()
    assert f"INCOMPLETE: 1 of the profile's {len(main_runs)} runs missing (e.g. {main_runs[-1].name}" in md
    assert "INCOMPLETE" in open(os.path.join(out, "table_pvalues.md")).read()
    assert any("missing" in m for m in messages)


def test_data_distribution_shows_the_effective_classes_per_client(tmp_path):
    root = str(tmp_path / "r")
    _dnn_run(root, "main-cifar10-a0.1-fedavg-s0", 0.3, clients=3)
    path = os.path.join(root, "main-cifar10-a0.1-fedavg-s0", "summary.json")
    summary = json.load(open(path))
    summary["class_counts"] = [[5, 5, 0, 0, 0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0, 0, 0, 0], [2, 1, 1] + [0] * 7]
    summary["split_seed"] = 7
    json.dump(summary, open(path, "w"))
    _, fig = draw.data_distribution({"0.1": os.path.join(root, "main-cifar10-a0.1-fedavg-s0")}, str(tmp_path / "o"))
    title = fig.axes[0].get_title()
    # per client 2, 1 and 2^1.5 effective classes (exp of the entropy of its class shares): mean 1.94
    assert "1.94 effective classes per client" in title and "split seed 7" in title
    assert [t.get_text().split("\n")[2] for t in fig.axes[0].get_xticklabels()] == ["2.0", "1.0", "2.8"]


def test_femnist_table_counts_finished_runs_and_gives_each_pvalue(tmp_path):
    from figures.__main__ import femnist_table

    root = str(tmp_path / "femnist")
    accs = {"fedpm": [0.72, 0.74, 0.70], "fedavg": [0.53, 0.52, 0.55], "scaffold": [0.71, 0.75]}
    for m, vals in accs.items():
        for s, a in enumerate(vals):
            _dnn_run(root, f"femnist-{m}-s{s}", a, rounds=100)
    _dnn_run(root, "femnist-scaffold-s2", 0.99, rounds=40)  # in progress: its summary is not a result yet
    messages = []
    os.makedirs(tmp_path / "out")
    femnist_table(root, str(tmp_path / "out"), "femnist", "", log=messages.append)
    lines = (tmp_path / "out" / "table_femnist.md").read_text().splitlines()
    rows = {
        ln.split(" | ")[0].strip("| "): ln.split(" | ") for ln in lines if ln.startswith("| Fed") or "SCAFFOLD" in ln
    }
    assert rows["SCAFFOLD"][1:3] == ["73.0 ± 2.8", "2"] and rows["FedPM"][3] == "79.2 ± 1.7"
    for label, m in (("FedAvg", "fedavg"), ("SCAFFOLD", "scaffold")):
        p = mannwhitneyu(accs["fedpm"], accs[m], alternative="greater").pvalue
        assert rows[label][4].strip(" |") == f"{p:.2f}"
    assert "INCOMPLETE: 13 of the profile's 21 runs missing" in lines[0] and any("8 of 21" in m for m in messages)


def test_the_femnist_profile_is_the_papers_table_and_only_selects_runs(tmp_path, capsys, monkeypatch):
    import validation.experiments as ex
    from fedpm_dnn.presets import PRESETS

    runs = ex.plan("femnist")
    assert [r.name for r in runs] == [f"femnist-{m}-s{s}" for m in ex.DNN_METHODS for s in (0, 1, 2)]
    assert set(PRESETS["femnist"]["methods"]) == set(ex.DNN_METHODS)  # the table has a row for every method
    for r in runs:
        args = dict(zip(r.argv[::2], r.argv[1::2], strict=True))
        assert args["--preset"] == "femnist" and args["--rounds"] == "100" and args["--threads"] == "1"
        assert r.rounds == 100 and r.dataset == "femnist"
    calls = []
    monkeypatch.setattr(
        ex, "ensure", lambda profile, data_dir, results, only=None, **kw: calls.append(only) or ex.Outcome()
    )
    assert ex.main(["--profile", "femnist", "--out", str(tmp_path), "--only", "femnist-fedpm-*"]) == 0
    assert [r.name for r in runs if calls[0](r)] == ["femnist-fedpm-s0", "femnist-fedpm-s1", "femnist-fedpm-s2"]
    ex.main(["--profile", "femnist", "--out", str(tmp_path), "--list", "--only", "*-s2"])
    listed = [w for w in capsys.readouterr().out.split() if w.startswith("femnist-")]
    assert sorted(listed) == sorted(f"femnist-{m}-s2" for m in ex.DNN_METHODS)
    with pytest.raises(SystemExit):
        ex.main(["--profile", "femnist", "--only", "femnist-fedpn-*"])
    assert "matches no run of profile femnist" in capsys.readouterr().err


def _text_boxes(fig):
    """(text, window extent) of every visible text of a drawn figure, the table's cells included, and the cells'
    own extents by text."""
    import matplotlib.text
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.table import Table

    canvas = FigureCanvasAgg(fig)  # the figure was closed after saving: draw it again
    canvas.draw()
    renderer = canvas.get_renderer()
    (table,) = [a for ax in fig.axes for a in ax.get_children() if isinstance(a, Table)]
    cells = [c for c in table.get_celld().values() if c.get_text().get_text().strip()]
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    texts += [c.get_text() for c in cells]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    return boxes, [(c.get_text().get_text(), c.get_window_extent(renderer)) for c in cells], fig.bbox


def test_the_table_beside_the_paper_is_drawn_without_overlapping_or_clipped_text(tmp_path):
    """Every text box of table3_vs_paper (the title, each cell's text) measured in the drawn figure: no two
    overlap, each cell's text lies within its cell, and everything lies within the figure -- with the longest
    verdicts a column can have."""
    from figures.tables import PAPER, versus_paper

    ours = {
        key: {m: [mu / 100 + 0.01 * k for k in range(2)] for m, (mu, sd) in ref.items()} for key, ref in PAPER.items()
    }
    header, rows = versus_paper(ours, list(PAPER["cifar10-a0.1"]))
    title = "Best test accuracy [%], ours beside the paper's Table 3 and FEMNIST table; gap = (ours − paper) / σ " * 2
    _, fig = draw.table_figure(header, rows, title, str(tmp_path), "t")
    boxes, cells, figure = _text_boxes(fig)
    assert len(cells) == sum(bool(c.strip()) for r in [header] + rows for c in r)  # every text of the table measured
    for i, (a, box_a) in enumerate(boxes):
        assert figure.x0 <= box_a.x0 and box_a.x1 <= figure.x1 and figure.y0 <= box_a.y0 and box_a.y1 <= figure.y1, a
        for b, box_b in boxes[i + 1 :]:
            assert not box_a.overlaps(box_b), (a, b)
    for (text, cell), (_, box) in zip(cells, boxes[-len(cells) :], strict=True):
        assert cell.x0 <= box.x0 and box.x1 <= cell.x1 and cell.y0 <= box.y0 and box.y1 <= cell.y1, text


def test_a_profile_of_two_seeds_and_few_rounds_is_neither_incomplete_nor_measured_in_the_papers_sigma(tmp_path):
    """The quick profile runs 2 seeds of 4 rounds by design: its table counts seeds against 2 and gives no gap in
    the paper's σ (those measure 4 rounds against 100); the paper profile's table does."""
    from figures.__main__ import versus_paper_table
    from validation.experiments import PROFILES

    root = str(tmp_path / "results")
    for m in ("fedavg", "fedpm"):
        for s in PROFILES["quick"]["seeds"]:
            _dnn_run(root, f"main-cifar10-a0.1-{m}-s{s}", 0.3 + 0.01 * s, rounds=4)
    for profile in ("quick", "paper"):
        out = tmp_path / profile
        out.mkdir()
        versus_paper_table(root, str(out), "", profile)
        md = (out / "table3_vs_paper.md").read_text()
        fedpm = next(ln for ln in md.splitlines() if ln.startswith("| CIFAR-10 α=0.1 | FedPM |"))
        if profile == "quick":
            assert "2 of 2 seeds |" in fedpm and "INCOMPLETE" not in fedpm and "gap" not in md.splitlines()[2]
            assert "σ" not in fedpm and "largest gap" not in md
        else:
            assert "2 of 3 seeds (INCOMPLETE)" in fedpm and md.splitlines()[2].endswith("gap [paper σ] |")


def _tick_values(ax):
    ax.figure.canvas.draw()
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi]


def test_round_axes_tick_whole_rounds_and_the_time_axis_names_the_runs_machine(results, tmp_path):
    for name in os.listdir(results):
        if name.startswith("main-cifar10-a0.1-"):
            path = os.path.join(results, name, "summary.json")
            summary = json.load(open(path))
            summary.update(device="cpu", cpu="Some CPU, 2 cores", gpu="none")
            json.dump(summary, open(path, "w"))
    _, fig = draw.test2_curves(results, "cifar10", "0.1", str(tmp_path / "o"))
    assert all(float(t).is_integer() for t in _tick_values(fig.axes[0]))  # 3 rounds: no 1.5 or 2.5 tick
    assert (
        "recorded on Some CPU, 2 cores" in fig.axes[1].get_xlabel() and "this machine" not in fig.axes[1].get_xlabel()
    )
    _, fig = draw.test1({"w8a": os.path.join(results, "superlinear-w8a")}, str(tmp_path / "o"))
    assert all(float(t).is_integer() for t in _tick_values(fig.axes[0]))


def test_a_test1_curve_drawn_exactly_under_another_says_so_in_the_legend(tmp_path):
    root = str(tmp_path / "r")
    os.makedirs(os.path.join(root, "superlinear-w8a"))
    lines = ["method,round,f_gap,dist,grad_norm,bytes_up,bytes_down,seconds"]
    for m, rate in (("fedavg", 0.5), ("scaffold", 0.5), ("fedpm", 0.1)):
        lines += [f"{m},{t},{rate**t},{rate**t * (1 + 1e-12 * (m == 'scaffold'))},1,8,8,0.1" for t in range(4)]
    open(os.path.join(root, "superlinear-w8a", "history.csv"), "w").write("\n".join(lines) + "\n")
    json.dump({"f_star": 0.3}, open(os.path.join(root, "superlinear-w8a", "summary.json"), "w"))
    _, fig = draw.test1({"w8a": os.path.join(root, "superlinear-w8a")}, str(tmp_path / "o"))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    fedavg, scaffold = draw.TEST1_LABELS["fedavg"], draw.TEST1_LABELS["scaffold"]
    assert f"{fedavg} (under {scaffold}: the same curve)" in labels and scaffold in labels
    assert draw.TEST1_LABELS["fedpm"] in labels  # a different curve keeps its plain label


def test_spreads_over_seeds_are_the_sample_std_in_the_figures_as_in_the_tables(results, tmp_path):
    from figures.tables import mean_std

    seeds = [0.3 + 0.01 * s for s in (0, 1, 2)]  # the fixture's FedAvg best accuracies
    assert 100 * draw.seed_std(seeds) == pytest.approx(mean_std(seeds)[1])  # the tables give percent
    assert draw.seed_std(seeds) == pytest.approx(np.std(seeds, ddof=1))
    assert draw.seed_std([0.4]) == 0.0
    _, fig = draw.test2_curves(results, "cifar10", "0.1", str(tmp_path / "o"))
    band = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]  # FedAvg's band, in %
    last = [100 * a for a in seeds]  # the last round's accuracies are the best ones
    assert band.max() == pytest.approx(np.mean(last) + np.std(last, ddof=1))


def test_the_data_distribution_has_one_bubble_scale_with_a_key(tmp_path):
    root = str(tmp_path / "r")
    folders = {}
    for alpha, most in (("1.0", 40), ("0.1", 400)):
        name = f"main-cifar10-a{alpha}-fedavg-s0"
        _dnn_run(root, name, 0.3, clients=2)
        path = os.path.join(root, name, "summary.json")
        summary = json.load(open(path))
        summary["class_counts"] = [[most, 10] + [0] * 8, [0, 20] + [0] * 8]
        json.dump(summary, open(path, "w"))
        folders[alpha] = os.path.join(root, name)
    _, fig = draw.data_distribution(folders, str(tmp_path / "o"))
    key = fig.axes[-1].get_legend()
    assert [t.get_text() for t in key.get_texts()] == ["400", "200", "40"]
    sizes = {round(float(h.get_sizes()[0])) for h in key.legend_handles}
    # the 40-image bubble of alpha = 1.0 is as large as the key's 40, not as the 400 of its own panel
    assert 60 in sizes and max(fig.axes[0].collections[0].get_sizes()) == pytest.approx(60)


def test_the_profiling_table_shows_the_first_rounds_peak_memory_apart(tmp_path):
    root = str(tmp_path / "r")
    for s in (0, 1):
        _dnn_run(root, f"main-cifar10-a0.1-fedpm-s{s}", 0.3)
        path = os.path.join(root, f"main-cifar10-a0.1-fedpm-s{s}", "history.csv")
        rows = open(path).read().splitlines()
        for i, mb in ((1, 3000.0 + s), (2, 1100.0), (3, 1200.0 - s)):
            cells = rows[i].split(",")
            cells[7] = str(mb)
            rows[i] = ",".join(cells)
        open(path, "w").write("\n".join(rows) + "\n")
    build_all(root, str(tmp_path / "out"), "quick", log=lambda msg: None)
    md = open(os.path.join(tmp_path, "out", "table_profiling.md")).read()
    assert "| FedPM |" in md and "| 3001 / 1200 |" in md and "round 1 / later" in md
