"""Reading saved runs: histories, summaries, and best accuracies grouped over seeds.

A damaged file (not JSON, a missing or non-numeric entry, a history whose cells are not numbers) is one
``DamagedFile`` naming it, whichever figure reads it first."""

from __future__ import annotations

import numbers
import os
import re

import numpy as np

from fedconvex import results
from fedconvex.files import DamagedFile

# the summary entries the figures and tables read as numbers (None where a run recorded none)
NUMBERS = (
    "best_test_acc",
    "final_test_acc",
    "mean_client_seconds_per_round",
    "mean_server_seconds_per_round",
    "bytes_up_per_round",
    "bytes_down_per_round",
    "peak_memory_mb",
    "clients",
    "rounds_done",
    "f_star",
)


class Entries(dict):
    """A file's entries; asking for one it lacks is a DamagedFile naming the file (not a bare KeyError)."""

    def __init__(self, path, entries):
        super().__init__(entries)
        self.path = path

    def __missing__(self, key):
        raise DamagedFile(f"{self.path}: damaged (no {key!r} entry)")


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def read_history(folder):
    """{column: array} of a run folder's single-run history (``fedconvex.results``: every cell in its range, the
    rounds increasing)."""
    path = os.path.join(folder, "history.csv")
    runs = results.read_history(path)
    if len(runs) != 1:
        raise DamagedFile(f"{path}: damaged (holds {len(runs)} runs, expected one)")
    rows = next(iter(runs.values()))
    out = {}
    for k in rows[0] if rows else ():
        if not all(_is_number(r[k]) for r in rows):
            raise DamagedFile(f"{path}: damaged (column {k!r} holds a cell that is not a number)")
        out[k] = np.array([float(r[k]) for r in rows])
    return Entries(path, out)


def read_summary(folder):
    path = os.path.join(folder, "summary.json")
    summary = results.read_summary(path)  # every field the figures read within its range (fedconvex.results)
    for k in NUMBERS:
        v = summary.get(k)
        if v is not None and not _is_number(v):
            raise DamagedFile(f"{path}: damaged ({k} is {v!r}, not a number)")
    counts = summary.get("class_counts")
    if counts is not None:
        try:
            a = np.asarray(counts)
            ok = a.ndim == 2 and a.size > 0 and a.dtype.kind in "iu" and a.min() >= 0
        except (ValueError, TypeError):
            ok = False
        if not ok:
            raise DamagedFile(f"{path}: damaged (class_counts is not a table of counts)")
    return Entries(path, summary)


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


def machines_of(root, prefix) -> list[str]:
    """The machines the runs named <prefix>-* ran on, as their summary.json records them (the GPU's name for a
    CUDA run, the CPU's otherwise; "an unrecorded machine" where it says nothing), sorted."""
    out = set()
    for f in runs_matching(root, rf"{re.escape(prefix)}-.+").values():
        s = read_summary(f)
        name = s.get("gpu") if s.get("device") == "cuda" else s.get("cpu")
        out.add(name if isinstance(name, str) and name != "unknown" else "an unrecorded machine")
    return sorted(out)
