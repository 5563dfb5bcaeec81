"""Table 3 (best accuracy, mean +- std over seeds), the Mann-Whitney U table, the profiling table."""

from __future__ import annotations

import numpy as np
from scipy.stats import mannwhitneyu

from fedpm_dnn.algorithms import REGISTRY as DNN_REGISTRY

# method labels come from the registries (one place each): the DNN methods' for Test 2's tables
LABELS = {name: cls.label for name, cls in DNN_REGISTRY.items()}


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
