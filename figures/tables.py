"""Table 3 (best accuracy, mean +- std over seeds), the same beside the paper's values, the Mann-Whitney U table, the
profiling table."""

from __future__ import annotations

import numpy as np
from scipy.stats import kendalltau, mannwhitneyu

from fedpm_dnn.method_names import METHOD_LABELS

# the DNN methods' labels for Test 2's tables (fedpm_dnn.method_names: importable without torch)
LABELS = dict(METHOD_LABELS)


def mean_std(values):
    v = 100 * np.asarray(values, dtype=float)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def pvalues(best: dict, ours: str = "fedpm") -> dict:
    """{method: one-sided Mann-Whitney U p-value of ``ours`` > method} over the seeds' best accuracies."""
    if ours not in best:
        return {}
    return {m: float(mannwhitneyu(best[ours], v, alternative="greater").pvalue) for m, v in best.items() if m != ours}


def max_pvalue(best: dict, ours: str = "fedpm", exclude=()):
    """Largest one-sided Mann-Whitney U p-value of ``ours`` > each other method (paper appendix)."""
    ps = [p for m, p in pvalues(best, ours).items() if m not in exclude]
    return max(ps) if ps else None


def accuracy_table(columns: dict, methods):
    """columns: {column label: {method: [best acc per seed]}} -> (rows of strings, header)."""
    header = ["Method"] + list(columns)
    rows = []
    bests = {c: max((mean_std(v)[0] for v in col.values()), default=None) for c, col in columns.items()}
    for m in methods:
        if not any(m in col for col in columns.values()):
            continue  # a method with no results in any column is left out, not shown as dashes
        row = [LABELS.get(m, m)]
        for c, col in columns.items():
            if m in col:
                mu, sd = mean_std(col[m])
                cell = f"{mu:.1f} ± {sd:.1f}"
                row.append(f"**{cell}**" if bests[c] is not None and abs(mu - bests[c]) < 1e-9 else cell)
            else:
                row.append("–")
        rows.append(row)
    return header, rows


def to_markdown(header, rows, caption=""):
    out = ([f"{caption}", ""] if caption else []) + [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def to_latex(header, rows, caption="", label=""):
    def tex(cell):
        cell = cell.replace("±", r"$\pm$").replace("%", r"\%")
        if cell.startswith("**") and cell.endswith("**"):
            cell = r"\textbf{" + cell[2:-2] + "}"
        return cell.replace("–", "--")

    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\begin{tabular}{l" + "c" * (len(header) - 1) + "}",
        r"\toprule",
        " & ".join(tex(h) for h in header) + r" \\",
        r"\midrule",
    ]
    lines += [" & ".join(tex(c) for c in r) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    if caption:
        lines.append(r"\caption{" + caption + "}")
    if label:
        lines.append(r"\label{" + label + "}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


# The paper's Table 3 (best test accuracy [%], mean ± std over three seeds) and its FEMNIST table, by run-name
# column (results/<profile>/main-<column>-<method>-s<seed>)
PAPER_SEEDS = 3
PAPER = {
    "cifar10-a1.0": dict(
        fedavg=(70.1, 1.3),
        fedavgm=(72.6, 1.5),
        fedprox=(70.1, 1.1),
        scaffold=(71.4, 0.5),
        fedadam=(70.4, 1.6),
        localnewton=(73.4, 1.4),
        fedpm=(74.8, 0.5),
    ),
    "cifar10-a0.1": dict(
        fedavg=(63.1, 2.1),
        fedavgm=(64.8, 3.0),
        fedprox=(62.8, 1.3),
        scaffold=(65.3, 2.7),
        fedadam=(64.6, 2.8),
        localnewton=(62.4, 2.3),
        fedpm=(68.6, 2.0),
    ),
    "cifar100-a1.0": dict(
        fedavg=(59.8, 0.7),
        fedavgm=(61.2, 0.2),
        fedprox=(56.6, 0.7),
        scaffold=(64.7, 1.1),
        fedadam=(58.3, 0.3),
        localnewton=(70.2, 0.3),
        fedpm=(68.4, 2.2),
    ),
    "cifar100-a0.1": dict(
        fedavg=(52.4, 0.9),
        fedavgm=(54.9, 0.6),
        fedprox=(50.7, 0.9),
        scaffold=(58.2, 0.6),
        fedadam=(51.9, 0.4),
        localnewton=(61.9, 0.6),
        fedpm=(63.1, 0.8),
    ),
    "femnist": dict(
        fedavg=(75.83, 1.90),
        fedavgm=(78.46, 0.82),
        fedprox=(76.42, 0.43),
        scaffold=(78.30, 2.72),
        fedadam=(76.85, 1.46),
        localnewton=(77.36, 1.12),
        fedpm=(79.21, 1.69),
    ),
}
COLUMN_LABELS = {
    "cifar10-a1.0": "CIFAR-10 α=1.0",
    "cifar10-a0.1": "CIFAR-10 α=0.1",
    "cifar100-a1.0": "CIFAR-100 α=1.0",
    "cifar100-a0.1": "CIFAR-100 α=0.1",
    "femnist": "FEMNIST",
}
VERSUS_HEADER = ["Column", "Method", "ours [%]", "seeds", "paper [%]", "gap [paper σ]"]


def column_verdict(ours: dict, paper: dict, gaps: bool = True) -> str:
    """How a column compares: the best method (ours, the paper's), Kendall's τ between the two orderings of the
    methods we have, and (``gaps``) the largest gap in units of the paper's σ."""
    have = [m for m in paper if m in ours]
    if not have:
        return "no results"
    means = {m: mean_std(ours[m])[0] for m in have}
    best, paper_best = max(have, key=means.get), max(paper, key=lambda m: paper[m][0])
    parts = [f"best {LABELS.get(best, best)} (paper {LABELS.get(paper_best, paper_best)})"]
    if len(have) > 1:
        tau = kendalltau([means[m] for m in have], [paper[m][0] for m in have])[0]
        parts.append(f"Kendall τ {tau:.2f} over {len(have)} methods")
    if gaps:
        gap = {m: (means[m] - paper[m][0]) / paper[m][1] for m in have}
        worst = max(have, key=lambda m: abs(gap[m]))
        parts.append(f"largest gap {gap[worst]:+.1f}σ ({LABELS.get(worst, worst)})")  # no "|": a Markdown cell
    return "; ".join(parts)


def versus_paper(columns: dict, methods, paper=PAPER, seeds: int = PAPER_SEEDS, gaps: bool = True):
    """columns: {column key: {method: [best acc per seed]}} -> (header, rows): every method of every column the
    paper reports, ours as mean ± std over the seeds present ('n of N seeds' against the ``seeds`` the profile
    runs, INCOMPLETE below), the paper's value and, with ``gaps`` (only where the runs have the paper's setting:
    a gap between 4-round and 100-round accuracies measures the rounds, not the method), our gap to it in units of
    the paper's σ; then a verdict row per column (column_verdict)."""
    rows = []
    for key, ref in paper.items():
        ours = columns.get(key, {})
        label = COLUMN_LABELS.get(key, key)
        incomplete = 0
        for m in [m for m in methods if m in ref]:
            mu_p, sd_p = ref[m]
            vals = ours.get(m, [])
            n = len(vals)
            incomplete += n < seeds
            cell, gap = "–", "–"
            if n:
                mu, sd = mean_std(vals)
                cell = f"{mu:.1f} ± {sd:.1f}" if n > 1 else f"{mu:.1f}"  # one seed has no spread to show
                gap = f"{round((mu - mu_p) / sd_p, 1) + 0.0:+.1f}"  # no "-0.0"
            note = f"{n} of {seeds} seeds" + (" (INCOMPLETE)" if n < seeds else "")
            rows.append([label, LABELS.get(m, m), cell, note, f"{mu_p:.1f} ± {sd_p:.1f}"] + [gap] * gaps)
        verdict = column_verdict(ours, ref, gaps)
        done = f"{incomplete} cells incomplete" if incomplete else "complete"
        rows.append([label, "verdict", verdict, done, ""] + [""] * gaps)
    return (VERSUS_HEADER if gaps else VERSUS_HEADER[:-1]), rows
