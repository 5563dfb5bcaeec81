"""One function per paper figure.  Each reads result folders, draws, saves PNG + PDF, and returns
(paths, matplotlib figure) so tests can check axes and labels."""

from __future__ import annotations

import os
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from fedconvex.algorithms import PAPER_TEST1 as TEST1  # noqa: E402
from fedconvex.algorithms import REGISTRY as CONVEX_REGISTRY  # noqa: E402
from fedconvex.data.splits import effective_classes  # noqa: E402
from fedconvex.files import DamagedFile  # noqa: E402
from fedpm_dnn.method_names import METHOD_NAMES as ORDER  # noqa: E402  (the paper's order of Test 2)

from .results import best_by_seed, curves_by_seed, machines_of, read_summary  # noqa: E402
from .tables import LABELS  # noqa: E402

TEST1_LABELS = {m: CONVEX_REGISTRY[m].label for m in TEST1}


def save(fig, out_dir, stem):
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("png", "pdf")]
    for p in paths:
        fig.savefig(p, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return paths


def seed_std(values, axis=None):
    """The spread over seeds every figure and table shows: the sample standard deviation (n - 1), 0 for one seed
    (figures.tables.mean_std is the same)."""
    v = np.asarray(values, dtype=float)
    n = v.shape[axis] if axis is not None else v.size
    return v.std(axis=axis, ddof=1) if n > 1 else np.zeros_like(v.mean(axis=axis))


def _integer_rounds(ax):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole: no 1.5 tick between rounds 1 and 2


def _style(method):
    if method == "fedpm":
        return dict(color="black", linewidth=2.2)
    return dict(linewidth=1.3)


def test1(folders: dict, out_dir, note=""):
    """Figure 'Convergence curves for Test 1': rows w8a / a9a, columns |f - f*| and ||theta - theta*||."""
    from validation.report import read_history as read_convex

    names = [d for d in ("w8a", "a9a") if d in folders]
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 3.6 * len(names)), squeeze=False)
    styles = ["-", "--", "-.", ":"]
    under = None  # {method: the later-drawn method whose curves are exactly its own in every row}
    for row, ds in enumerate(names):
        try:
            hist = read_convex(os.path.join(folders[ds], "history.csv"))
        except ValueError as exc:
            raise DamagedFile(f"damaged result: {exc}") from None
        f_star = read_summary(folders[ds])["f_star"]
        floor = 2.2e-16 * max(1.0, abs(f_star))
        drawn = [x for x in TEST1 if x in hist]
        same = {
            m: next((o for o in drawn[i + 1 :] if _same_curve(hist[m], hist[o])), None) for i, m in enumerate(drawn)
        }
        under = {m: o for m, o in same.items() if o and (under is None or under.get(m) == o)}
        for k, m in enumerate(drawn):
            r = [h["round"] for h in hist[m]]
            st = dict(linestyle=styles[k % 4], label=TEST1_LABELS[m], **_style(m))
            axes[row, 0].semilogy(r, [max(h["f_gap"], floor) for h in hist[m]], **st)
            axes[row, 1].semilogy(r, [max(h["dist"], 1e-300) for h in hist[m]], **st)
        axes[row, 0].set_ylabel(f"{ds}: " + r"$|f(\theta_t)-f^*|$")
        axes[row, 1].set_ylabel(f"{ds}: " + r"$\|\theta_t-\theta^*\|$")
        for ax in axes[row]:
            ax.set_xlabel("communication round")
            _integer_rounds(ax)
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    # a curve drawn exactly under a later one is invisible: the legend says where it is
    hidden = {TEST1_LABELS[m]: TEST1_LABELS[o] for m, o in (under or {}).items()}
    labels = [f"{x} (under {hidden[x]}: the same curve)" if x in hidden else x for x in labels]
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Test 1 (K=1): convergence on w8a and a9a" + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save(fig, out_dir, "test1_convergence"), fig


def _same_curve(a, b) -> bool:
    """Two methods' Test 1 histories draw the same curves: f-gap and distance equal to 1e-6 relative in every round,
    far below what a log-scale line shows (with K = 1, SCAFFOLD's corrections cancel and it is FedAvg to
    round-off)."""
    if len(a) != len(b):
        return False
    x = np.array([[h["f_gap"], h["dist"]] for h in a], dtype=float)
    y = np.array([[h["f_gap"], h["dist"]] for h in b], dtype=float)
    return bool(np.allclose(x, y, rtol=1e-6, atol=0.0))


def _mean_band(ax, xs, ys, label, method):
    n = min(len(y) for y in ys)
    Y = np.stack([y[:n] for y in ys]) * 100
    X = np.mean(np.stack([x[:n] for x in xs]), axis=0)
    mu, sd = Y.mean(0), seed_std(Y, axis=0)
    (line,) = ax.plot(X, mu, label=label, **_style(method))
    ax.fill_between(X, mu - sd, mu + sd, alpha=0.2, color=line.get_color())


def test2_curves(root, dataset, alpha, out_dir, note=""):
    """Test accuracy vs rounds (a) and vs wall-clock seconds (b), mean +- one std over seeds."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    drawn = 0
    for m in ORDER:
        runs = curves_by_seed(root, f"main-{dataset}-a{alpha}", m)
        if not runs:
            continue
        drawn += 1
        _mean_band(axes[0], [r[0] for r in runs], [r[2] for r in runs], LABELS[m], m)
        _mean_band(axes[1], [r[1] for r in runs], [r[2] for r in runs], LABELS[m], m)
    if not drawn:
        plt.close(fig)
        return [], None
    axes[0].set_xlabel("communication round")
    _integer_rounds(axes[0])
    # the seconds each run recorded where it ran (shipped runs: their machine, not the one drawing the figure)
    where = " and ".join(machines_of(root, f"main-{dataset}-a{alpha}"))
    axes[1].set_xlabel(f"wall-clock time [s] as recorded on {where} (all clients in one process)")
    for ax, tag in zip(axes, "ab", strict=False):
        ax.set_ylabel("test accuracy [%]")
        ax.set_title(f"({tag})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(
        f"Test 2: {dataset.upper()}, alpha={alpha}, 5 local epochs (mean ± std over seeds)"
        + (f"\n{note}" if note else ""),
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, out_dir, f"test2_{dataset}_a{alpha}_curves"), fig


def _best_line(ax, xs, by_x, method, label):
    pts = [(x, 100 * np.mean(v), 100 * seed_std(v)) for x, v in zip(xs, by_x, strict=False) if v]
    if not pts:
        return
    x, mu, sd = map(np.array, zip(*pts, strict=False))
    (line,) = ax.plot(x, mu, marker="o", label=label, **_style(method))
    ax.fill_between(x, mu - sd, mu + sd, alpha=0.2, color=line.get_color())


def _sweep(root, prefix, values, xlabel, title, stem, out_dir, note):
    """Best accuracy (mean +- std over seeds) of each method over one swept setting."""
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for m in ORDER:
        _best_line(ax, values, [best_by_seed(root, prefix.format(v), [m]).get(m, []) for v in values], m, LABELS[m])
    if not ax.lines:
        plt.close(fig)
        return [], None
    ax.set_xlabel(xlabel)
    ax.set_ylabel("best test accuracy [%]")
    ax.set_xticks(values)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=9)
    return save(fig, out_dir, stem), fig


def local_epochs(root, out_dir, note=""):
    return _sweep(
        root,
        "epochs-{}",
        (1, 5, 10),
        "local epochs per round (total local epochs fixed)",
        "CIFAR-10, alpha=0.1: local epochs",
        "local_epochs",
        out_dir,
        note,
    )


def client_sampling(root, out_dir, note=""):
    return _sweep(
        root,
        "sampling-{}",
        (2, 5, 8, 10),
        "participating clients per round (of 10)",
        "CIFAR-10, alpha=0.1: client sampling",
        "client_sampling",
        out_dir,
        note,
    )


def foof_samples(root, out_dir, note=""):
    from .results import runs_matching

    ks = ("64", "256", "1024", "all")
    acc, secs = [], []
    for k in ks:
        folders = runs_matching(root, rf"foof-{k}-fedpm-s\d+")
        acc.append([read_summary(f)["best_test_acc"] for f in folders.values()])
        secs.append([read_summary(f)["mean_client_seconds_per_round"] for f in folders.values()])
    if not any(acc):
        return [], None
    fig, ax = plt.subplots(figsize=(5.5, 4))
    x = np.arange(len(ks))
    ax2 = ax.twinx()
    ax2.bar(x, [np.mean(s) if s else 0 for s in secs], color="lightgray", label="client time / round")
    ax2.set_ylabel("total client training time per round [s]")
    _best_line(ax, x, acc, "fedpm", "FedPM best accuracy")
    ax.set_zorder(ax2.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_xticks(x, ks)
    ax.set_xlabel("samples per client for the FOOF matrices")
    ax.set_ylabel("best test accuracy [%]")
    ax.set_title("FedPM, CIFAR-10, alpha=0.1: FOOF sample count" + (f"\n{note}" if note else ""), fontsize=9)
    return save(fig, out_dir, "foof_samples"), fig


def _round_count(x: float) -> int:
    """``x`` rounded to one or two significant digits (a key's bubble sizes: 4,000, 2,000, 400 rather than 3,971)."""
    if x < 1:
        return 0
    digits = 10 ** max(int(np.floor(np.log10(x))) - 1, 0)
    return int(round(x / digits) * digits)


def data_distribution(folders: dict, out_dir, note=""):
    """Per-client class counts (bubble plot) and client sizes for each alpha, from the runs' summary.json."""
    items = [(a, read_summary(f)) for a, f in folders.items()]
    if not items:
        return [], None
    fig, axes = plt.subplots(1, len(items), figsize=(5 * len(items), 4.4), squeeze=False)
    splits = set()
    # one scale for every panel, so that equal bubbles are equal counts across the alphas; the key shows it
    most = max(int(np.asarray(summary["class_counts"]).max()) for _, summary in items) or 1
    for ax, (alpha, summary) in zip(axes[0], items, strict=False):
        c = np.asarray(summary["class_counts"])
        splits.add(summary.get("partition", "dirichlet"))
        ci, ki = np.nonzero(c)
        ax.scatter(ci, ki, s=600 * c[ci, ki] / most, alpha=0.6, color="tab:red")
        ax.set_xlabel("client (samples held, effective classes)")
        ax.set_ylabel("class")
        eff = effective_classes(c)
        ticks = [f"{i}\n{n}\n{e:.1f}" for i, (n, e) in enumerate(zip(c.sum(1), eff, strict=True))]
        ax.set_xticks(range(c.shape[0]), ticks, fontsize=7)
        seed = f", split seed {summary['split_seed']}" if summary.get("split_seed") is not None else ""
        ax.set_title(
            f"alpha = {alpha} ({c.sum()} samples, sizes {c.sum(1).min()}..{c.sum(1).max()}{seed})\n"
            f"{eff.mean():.2f} effective classes per client (exp of the class-share entropy)",
            fontsize=9,
        )
    key = sorted({_round_count(most * f) for f in (1.0, 0.5, 0.1)} - {0}, reverse=True)
    marks = [axes[0, -1].scatter([], [], s=600 * k / most, alpha=0.6, color="tab:red") for k in key]
    axes[0, -1].legend(
        marks,
        [str(k) for k in key],
        title="images of a class\nheld by a client",
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        fontsize=8,
        title_fontsize=8,
        labelspacing=1.6,
        borderpad=1.0,
        frameon=False,
    )
    how = {
        "relaysum": "RelaySum Dirichlet split, Vogels et al. 2021",
        "relaysum-even": "RelaySum Dirichlet draw re-cut into equal clients (its distribute_evenly)",
        "dirichlet": "plain per-class Dirichlet split",
    }
    fig.suptitle(
        "Data distribution over clients ("
        + "; ".join(how.get(s, s) for s in sorted(splits))
        + ")"
        + (f"\n{note}" if note else ""),
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, out_dir, "data_distribution"), fig


CELL_CHARS = 44  # a cell's text is wrapped at this many characters (a verdict runs to ~90)
TITLE_CHARS = 80  # a table's title is wrapped at this many characters at least
FONT_PT = 8


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.fill(part, width) or part for part in text.split("\n"))


def table_figure(header, rows, title, out_dir, stem):
    """A table rendered as PNG/PDF (Markdown and LaTeX are written beside it).  Every column is as wide as its
    longest line, long cells are wrapped (CELL_CHARS) and rows are as tall as their most wrapped cell, and the title
    is wrapped to the table's width: no text runs over a cell's border or into another text."""
    bold = [[c.startswith("**") for c in r] for r in rows]
    body = [[_wrap(c.replace("**", ""), CELL_CHARS) for c in r] for r in rows]
    head = [_wrap(h, 18) for h in header]
    lines = [head] + body
    chars = [max(len(line) for r in lines for line in r[j].split("\n")) for j in range(len(header))]
    heights = [max(c.count("\n") + 1 for c in r) for r in lines]
    char_in = 0.62 * FONT_PT / 72  # a character's mean width in inches, generous for DejaVu Sans
    widths = [char_in * n + 0.25 for n in chars]  # + the cell's padding on both sides
    line_in = 1.5 * FONT_PT / 72
    table_w, table_h = sum(widths), sum(line_in * h + 0.08 for h in heights)
    # the title is wrapped at no fewer than TITLE_CHARS characters: above a narrow table (two columns) the figure is
    # widened for it rather than the title squeezed into a tall column of short lines
    title_char_in = char_in * 9 / FONT_PT
    title = _wrap(title, max(TITLE_CHARS, int(table_w / title_char_in)))
    fig_w = max(table_w, max(len(x) for x in title.split("\n")) * title_char_in) + 0.2
    title_h = (title.count("\n") + 1) * 1.5 * 9 / 72 + 0.15
    fig = plt.figure(figsize=(fig_w, table_h + title_h + 0.2))
    ax = fig.add_axes(
        ((fig_w - table_w) / 2 / fig_w, 0.1 / fig.get_figheight(), table_w / fig_w, table_h / fig.get_figheight())
    )
    ax.axis("off")
    table = ax.table(cellText=body, colLabels=head, cellLoc="center", colWidths=widths, bbox=(0, 0, 1, 1))
    table.auto_set_font_size(False)
    table.set_fontsize(FONT_PT)
    for (i, j), cell in table.get_celld().items():
        cell.set_height(line_in * heights[i] + 0.08)  # relative: the bbox scales the rows to the axes
        if i > 0 and bold[i - 1][j]:
            cell.set_text_props(fontweight="bold")
    fig.suptitle(title, fontsize=9, y=1 - 0.08 / fig.get_figheight(), va="top")
    return save(fig, out_dir, stem), fig
