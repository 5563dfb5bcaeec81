"""Outputs of the convex experiments: history.csv, summary.json, the two-panel figure, a table.

Everything is first written into a temporary folder next to ``--out`` and moved into place
at the end, so a failed run never leaves half-written results.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager

from fedconvex.files import write_error
from fedconvex.history import histories_csv
from fedconvex.history import read_history as _read
from fedconvex.results import check_rows
from fedconvex.run import COLUMNS

DIST_TARGET = 1e-10
RATIO_NOISE_FLOOR = 1e-12  # below this distance the ratios measure round-off, not the method


def rounds_to(history, key="dist", target=DIST_TARGET):
    for row in history:
        if row[key] < target:
            return row["round"]
    return None


def contraction_ratios(history, last: int = 5):
    """The last ``last`` ratios ||theta_{t+1}-theta*|| / ||theta_t-theta*|| taken while
    both distances are above the round-off floor (superlinear: they decrease to 0)."""
    ratios = [
        history[t + 1]["dist"] / history[t]["dist"]
        for t in range(len(history) - 1)
        if min(history[t]["dist"], history[t + 1]["dist"]) > RATIO_NOISE_FLOOR
    ]
    return ratios[-last:]


def method_summary(label, params, history, trials, cached):
    final = history[-1]
    return {
        "label": label,
        "params": params,
        "lr": params.get("lr"),
        "tuned_from_cache": cached,
        "final_f_gap": final["f_gap"],
        "final_dist": final["dist"],
        "final_grad_norm": final["grad_norm"],
        "rounds_to_dist_1e-10": rounds_to(history),
        "contraction_ratios": contraction_ratios(history),
        "bytes_up_per_round": final["bytes_up"] / max(final["round"], 1),
        "bytes_down_per_round": final["bytes_down"] / max(final["round"], 1),
        "seconds": final["seconds"],
        "trials": trials,
    }


def format_table(summary: dict) -> str:
    head = (
        f"{'method':<14}{'lr':>9}{'f_gap':>11}{'dist':>11}{'rounds<1e-10':>13}  "
        f"{'last ratios':<34}{'KB up/rnd':>10}{'sec':>7}"
    )
    lines = [head, "-" * len(head)]
    for m in summary["methods"].values():
        r = m["rounds_to_dist_1e-10"]
        ratios = " ".join(f"{x:.0e}" if x < 0.01 else f"{x:.2f}" for x in m["contraction_ratios"][-4:])
        lines.append(
            f"{m['label']:<14}{m['lr']:>9.3g}{m['f_gap_str']:>11}{m['dist_str']:>11}"
            f"{('-' if r is None else str(r)):>13}  {ratios:<34}{m['bytes_up_per_round'] / 1e3:>10.1f}"
            f"{m['seconds']:>7.2f}"
        )
    return "\n".join(lines)


def write_history(path, histories: dict) -> None:
    """{method: rows} in the one history format (fedconvex.history), with a method column."""
    with open(path, "w", newline="") as fh:
        fh.write(histories_csv(histories, COLUMNS))


def read_history(path) -> dict:
    """{method: rows}; columns added later (e.g. 'rejected') are optional, so older files still read.  A cell that
    is not a number, or a row without a method, is a ValueError naming the file."""
    out = {m: [{c: r[c] for c in COLUMNS if c in r} for r in rows] for m, rows in _read(path).items()}
    for m, rows in out.items():
        bad = [c for r in rows for c, v in r.items() if not isinstance(v, (int, float)) or isinstance(v, bool)]
        lacks = [c for c in ("round", "f_gap", "dist") if rows and c not in rows[0]]
        if m is None or bad or lacks:
            why = (
                f"column {bad[0]!r} holds a cell that is not a number"
                if bad
                else f"no {lacks[0]!r} column"
                if lacks
                else "no method column"
            )
            raise ValueError(f"{path}: not a history of this tool ({why})")
        check_rows(path, rows, m)  # each cell in its column's range, the rounds increasing (fedconvex.results)
    return out


def plot_convergence(histories: dict, labels: dict, title: str, path_stem: str, f_star: float = 1.0) -> list[str]:
    """Two panels (|f - f*| and ||theta - theta*|| vs round, log scale) as PNG and PDF.

    |f - f*| below the resolution of f itself (eps * max(1, |f*|)) is drawn at that level,
    with a dotted line marking it: smaller values are round-off, not progress."""
    plt = import_pyplot()
    resolution = 2.2e-16 * max(1.0, abs(f_star))
    styles = ["-", "--", "-.", ":"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for k, (method, hist) in enumerate(histories.items()):
        rounds = [r["round"] for r in hist]
        # methods that coincide by theory (FedAvg and SCAFFOLD at K=1) stay visible by style
        style = dict(linestyle=styles[k % len(styles)], label=labels.get(method, method))
        if method == "fedpm":  # the subject of the paper: solid, heavier, marked
            style.update(linestyle="-", linewidth=2.2, marker="o", markersize=3, color="black")
        axes[0].semilogy(rounds, [max(r["f_gap"], resolution) for r in hist], **style)
        axes[1].semilogy(rounds, [max(r["dist"], 1e-300) for r in hist], **style)
    axes[0].axhline(resolution, color="gray", linestyle=":", linewidth=0.8)
    axes[0].set_ylabel(r"$|f(\theta_t) - f^*|$")
    axes[1].set_ylabel(r"$\|\theta_t - \theta^*\|$")
    for ax in axes:
        ax.set_xlabel("communication round")
        ax.grid(True, which="major", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 5), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    paths = [f"{path_stem}.png", f"{path_stem}.pdf"]
    _save_each(fig, paths)
    plt.close(fig)
    return paths


def import_pyplot():
    """matplotlib.pyplot on the Agg backend (0.4 s of imports: the superlinear CLI does it while its
    workers run, where it costs half that)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_each(fig, paths) -> None:
    """``fig.savefig`` to every path; where the platform forks, the first path in a forked child while this
    process writes the others (each format draws the figure anew), else one after another.  A child
    that fails leaves its path to this process, which then raises the error itself; without a child every path is
    tried and the first error raised after."""
    import threading

    # fork only a single-threaded process: a fork while other threads (BLAS, torch) hold locks can hang the child
    single = threading.active_count() == 1
    pid = os.fork() if hasattr(os, "fork") and len(paths) > 1 and single else None
    if pid == 0:
        code = 1
        try:
            fig.savefig(paths[0], dpi=150)
            code = 0
        finally:
            os._exit(code)
    status, failed = 0, None
    try:
        for p in paths[1:] if pid else paths:
            try:  # every path that can be written is, whichever fails; the first failure is raised below
                fig.savefig(p, dpi=150)
            except Exception as exc:
                failed = failed or exc
    finally:
        if pid:  # reaped whatever happens here, before the caller discards its folder
            status = os.waitpid(pid, 0)[1]
    if pid and status != 0:
        fig.savefig(paths[0], dpi=150)
    if failed is not None:
        raise failed


def AtomicDir(path: str, kind=None):
    """Write into a temporary sibling folder; replace ``path`` only when everything succeeded
    and only when it is a previous result of ours (see validation.outputs)."""
    from validation.outputs import ResultDir

    return ResultDir(path, kind=kind)


@contextmanager
def writing(where: str):
    """Within the block, a failed write (a full disk, a read-only folder), also one that a writer reports as its
    own error (matplotlib's PDF writer on a full disk), is raised as one OSError naming ``where`` and the cause."""
    try:
        yield
    except Exception as exc:
        raised = write_error(where, exc)
        if raised is exc:
            raise
        raise raised from None


def dump_json(path, obj) -> None:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    with open(path, "w") as fh:
        json.dump(clean(obj), fh, indent=2)
