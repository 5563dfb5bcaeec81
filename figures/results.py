"""Reading saved runs: histories, summaries, and best accuracies grouped over seeds."""

from __future__ import annotations

import json
import os
import re

import numpy as np

from fedconvex.history import read_run


def read_history(folder):
    """{column: array} of a run folder's single-run history (fedconvex.history's format)."""
    rows = read_run(os.path.join(folder, "history.csv"))
    return {k: np.array([float(r[k]) for r in rows]) for k in rows[0]} if rows else {}


def read_summary(folder):
    with open(os.path.join(folder, "summary.json")) as fh:
        return json.load(fh)


def runs_matching(root, pattern):
    """{name: folder} of the result folders under ``root`` whose name matches the regex."""
    if not os.path.isdir(root):
        return {}
    rx = re.compile(pattern)
    return {
        n: os.path.join(root, n)
        for n in sorted(os.listdir(root))
        if rx.fullmatch(n) and os.path.isfile(os.path.join(root, n, "summary.json"))
    }


def best_by_seed(root, prefix, methods):
    """{method: [best test accuracy of each seed]} for runs named <prefix>-<method>-s<seed>."""
    out = {}
    for m in methods:
        vals = [
            read_summary(f)["best_test_acc"] for f in runs_matching(root, rf"{re.escape(prefix)}-{m}-s\d+").values()
        ]
        if vals:
            out[m] = vals
    return out


def curves_by_seed(root, prefix, method, key="test_acc"):
    """List of (x_rounds, x_seconds, y) per seed."""
    out = []
    for f in runs_matching(root, rf"{re.escape(prefix)}-{method}-s\d+").values():
        h = read_history(f)
        if h:
            out.append((h["round"], h["wall_seconds"], h[key]))
    return out
