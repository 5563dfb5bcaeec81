"""The one history format of every front-end (convex, DNN, Flower) and its one reader.

A run's history is a CSV file, one row per round (round 0 = before training where the front-end
records it), columns in this order: an optional ``method`` (files holding several methods' runs),
``round``, the front-end's metrics (convex: f_gap, dist, grad_norm; DNN: test_acc, train_loss, ...),
then the round driver's accounting -- ``bytes_up`` / ``bytes_down`` (per participating client,
cumulative), ``seconds`` (cumulative), ``rejected`` -- and any further measurements.  Floats are
written with ``repr`` so that reading a file back gives the very numbers that were written.
"""

from __future__ import annotations

import csv
import io
import math

INT_COLUMNS = ("round", "bytes_up", "bytes_down", "rejected", "dropped")


def columns_of(rows) -> list:
    """Every column that occurs in ``rows``, in order of first appearance."""
    out: dict = {}
    for r in rows:
        for k in r:
            out.setdefault(k, None)
    return list(out)


def round_seconds(rows) -> list:
    """Each training round's own wall seconds, from the cumulative ``seconds`` column: one value per row of round
    >= 1, in order (a round-0 row, where the front-end records one, only sets the start)."""
    out, before = [], 0.0
    for r in rows:
        if r["round"] >= 1:
            out.append(r["seconds"] - before)
        before = r["seconds"]
    return out


def _cell(v) -> str:
    if isinstance(v, float):
        return repr(v)
    return "" if v is None else str(v)


def history_csv(rows, method: str | None = None, columns=None) -> str:
    """The CSV text of ``rows`` (dicts); with ``method``, a leading method column."""
    return histories_csv({method: rows} if method is not None else {None: rows}, columns)


def histories_csv(histories: dict, columns=None) -> str:
    """Several runs in one file: {method: rows} (a None key writes no method column)."""
    cols = list(columns) if columns is not None else columns_of(r for rows in histories.values() for r in rows)
    named = any(m is not None for m in histories)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow((["method"] if named else []) + cols)
    for method, rows in histories.items():
        for r in rows:
            w.writerow(([method] if named else []) + [_cell(r.get(c)) for c in cols])
    return buf.getvalue()


def _value(column: str, text: str):
    if text == "":
        return math.nan
    if column == "method":
        return text
    if column in INT_COLUMNS:
        try:
            return int(text)
        except ValueError:
            v = float(text)  # "3.0" is 3; "1.5" stays 1.5, for the readers to refuse (never truncated to 1)
            return int(v) if v.is_integer() else v
    try:
        return float(text)
    except ValueError:
        return text


def read_history(path) -> dict:
    """{method: [row dicts]} of a history file (method None for a single run without a method column)."""
    out: dict = {}
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            for row in reader:
                if None in row or None in row.values():  # more or fewer cells than the header names
                    raise ValueError(f"line {reader.line_num}: not one cell per column of the header")
                rec = {c: _value(c, v) for c, v in row.items() if c != "method"}
                out.setdefault(row.get("method"), []).append(rec)
    except (ValueError, csv.Error) as exc:  # UnicodeDecodeError included
        raise ValueError(f"{path}: not a history file ({exc})") from None
    return out


def read_run(path) -> list:
    """The rows of a single-run history file."""
    runs = read_history(path)
    if len(runs) != 1:
        raise ValueError(f"{path}: holds {len(runs)} runs ({', '.join(map(str, runs))}); name the method")
    return next(iter(runs.values()))
