"""The one reader of saved results -- a run's ``summary.json`` and ``history.csv`` -- which treats them as
untrusted input: every field the tools read has the range it may take, written once as a JSON Schema (checked with
``jsonschema``) for the summary and as a column table for the history.  A file outside them is one ``DamagedFile``
naming the file and the field (``.../summary.json: damaged (best_test_acc is 55.0, above 1: an accuracy is a
fraction, not a percentage)``), whichever command reads it first; nothing is drawn or tabled from it.

Why a schema and not code: the ranges are data -- one table the figures, the sweep and the tests read -- and
``jsonschema`` reports every violation with its path.  JSON numbers that Python's ``json`` reads as NaN or infinity
(``NaN``, ``Infinity``) are no numbers here: the type checker refuses them, so ``minimum`` cannot be passed by a NaN.
"""

from __future__ import annotations

import math
import numbers
import os

import numpy as np

from .files import DamagedFile, read_json_object
from .history import read_history as _read_history

FRACTION = {"type": "number", "minimum": 0, "maximum": 1}
TABLE = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
}
NONNEGATIVE = {"type": "number", "minimum": 0}
COUNT = {"type": "integer", "minimum": 0}


def _or_null(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


# the summary entries any tool reads, with the values each may take (None where a run recorded none); other entries
# (settings, versions, the command) are read by their own readers
SUMMARY_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "best_test_acc": _or_null(FRACTION),
        "final_test_acc": _or_null(FRACTION),
        "mean_client_seconds_per_round": _or_null(NONNEGATIVE),
        "mean_server_seconds_per_round": _or_null(NONNEGATIVE),
        "bytes_up_per_round": _or_null(NONNEGATIVE),
        "bytes_down_per_round": _or_null(NONNEGATIVE),
        "peak_memory_mb": _or_null(NONNEGATIVE),
        "wall_seconds": _or_null(NONNEGATIVE),
        "clients": _or_null({"type": "integer", "minimum": 1}),
        "rounds_done": _or_null(COUNT),
        "f_star": _or_null({"type": "number"}),
        "class_counts": _or_null(TABLE),
        "client_sizes": _or_null({"type": "array", "items": COUNT}),
    },
}

# history.csv: the range of each column the tools write (fedconvex.history's format); a column not named here must
# hold finite numbers.  ``round`` must increase strictly down the file (per method in a multi-method file).
HISTORY_COLUMNS = {
    "round": COUNT,
    "test_acc": FRACTION,
    # NaN where a client's local training diverged in that round (its reply is then rejected and counted in
    # ``rejected``): the mean over the clients is a true record of it, not damage
    "train_loss": {**NONNEGATIVE, "nan_records_divergence": True},
    "client_seconds": NONNEGATIVE,
    "server_seconds": NONNEGATIVE,
    "seconds": NONNEGATIVE,
    "wall_seconds": NONNEGATIVE,
    "bytes_up": NONNEGATIVE,
    "bytes_down": NONNEGATIVE,
    "peak_memory_mb": NONNEGATIVE,
    "rejected": COUNT,
    "f_gap": NONNEGATIVE,
    "dist": NONNEGATIVE,
    "grad_norm": NONNEGATIVE,
}


def _finite_number(checker, instance) -> bool:
    return isinstance(instance, numbers.Real) and not isinstance(instance, bool) and math.isfinite(instance)


def _finite_integer(checker, instance) -> bool:
    # JSON's 3.0 is an integer to JSON Schema; a count written as 3.5 is not
    return _finite_number(checker, instance) and float(instance).is_integer()


def _validator(schema: dict):
    try:
        import jsonschema
    except ImportError:  # declared in pyproject.toml; an environment without it says so rather than reading unchecked
        raise DamagedFile(
            "results cannot be checked: the jsonschema package is missing (pip install jsonschema, or reinstall "
            "this toolkit, which declares it)"
        ) from None
    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine_many({"number": _finite_number, "integer": _finite_integer})
    return jsonschema.validators.extend(base, type_checker=checker)(schema)


def _why(error, value) -> str:
    """One reason for a schema error, in the words of the field's range."""
    if error.validator in ("anyOf", "oneOf") and error.context:  # a nullable field: the non-null branch's reason
        first = min(error.context, key=lambda e: e.validator == "type")
        return _why(first, value)
    if error.validator == "type":
        return f"not a finite {error.validator_value}" if isinstance(error.validator_value, str) else "of a wrong kind"
    if error.validator == "maximum" and error.validator_value == 1 and isinstance(value, (int, float)) and value <= 100:
        return "above 1: an accuracy is a fraction, not a percentage"
    if error.validator == "minimum":
        return f"below {error.validator_value}"
    if error.validator == "maximum":
        return f"above {error.validator_value}"
    return error.message


def _field(error) -> tuple:
    path = list(error.absolute_path)
    shown = "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + str(p) for i, p in enumerate(path))
    value = error.instance
    return shown or "the file", value


def check_value(path: str, value, schema: dict, what: str = "") -> None:
    """A DamagedFile naming ``path`` and the first field of ``value`` outside ``schema``."""
    errors = sorted(_validator(schema).iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        field, shown = _field(errors[0])
        name = f"{what}{field}" if what else field
        raise DamagedFile(f"{path}: damaged ({name} is {shown!r}, {_why(errors[0], shown)})")


# tables of counts: checked by NumPy against the same spec (jsonschema spends seconds on FEMNIST's 3,500 x 62)
TABLES = {"class_counts": 2, "client_sizes": 1}


def _table_problem(value, dims: int) -> tuple | None:
    """(index, value, why) of the first cell of a ``dims``-dimensional table of counts that is none, or None."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError):  # ragged rows
        return (), value, f"not a {dims}-dimensional table"
    if a.ndim != dims or (dims == 2 and a.size == 0):
        return (), value, f"not a {dims}-dimensional table"
    if a.dtype.kind not in "iu":
        cells = (i for i in np.ndindex(a.shape) if a.dtype.kind == "b" or not _finite_integer(None, a[i].item()))
        bad = next(cells, None)
        if bad is not None:
            return bad, a[bad].item(), "not a finite integer"
    if a.size and a.min() < 0:
        bad = tuple(int(i) for i in np.unravel_index(int(np.argmin(a)), a.shape))
        return bad, int(a[bad]), "below 0"
    return None


def read_summary(path: str) -> dict:
    """A run's ``summary.json`` (a JSON object, regular file, bounded size: ``read_json_object``), its fields within
    ``SUMMARY_SCHEMA``; a DamagedFile naming the file and field otherwise."""
    summary = read_json_object(path)
    check_value(path, {k: v for k, v in summary.items() if k not in TABLES}, SUMMARY_SCHEMA)
    for key, dims in TABLES.items():
        if summary.get(key) is not None:
            problem = _table_problem(summary[key], dims)
            if problem:
                index, value, why = problem
                cell = "".join(f"[{i}]" for i in index)
                raise DamagedFile(f"{path}: damaged ({key}{cell} is {value!r}, {why})")
    return summary


def _cell_problem(value, spec: dict) -> str | None:
    """Why one history cell is outside its column's ``spec`` (a JSON Schema of type, minimum, maximum), or None."""
    if spec.get("nan_records_divergence") and isinstance(value, float) and math.isnan(value):
        return None
    if not _finite_number(None, value) or (spec["type"] == "integer" and not float(value).is_integer()):
        return f"not a finite {spec['type']}"
    if "minimum" in spec and value < spec["minimum"]:
        return f"below {spec['minimum']}"
    if "maximum" in spec and value > spec["maximum"]:
        if spec["maximum"] == 1 and value <= 100:
            return "above 1: an accuracy is a fraction, not a percentage"
        return f"above {spec['maximum']}"
    return None


def check_rows(path: str, rows: list, method=None) -> None:
    """Every row of one run's history within ``HISTORY_COLUMNS`` and its rounds strictly increasing.  The
    columns' specs are JSON Schemas as the summary's are, checked here cell by cell (``jsonschema`` takes a
    thousand times longer over the tens of thousands of cells of a long run)."""
    where = f" (method {method})" if method is not None else ""
    for column in rows[0] if rows else ():
        if column == "method":
            continue
        spec = HISTORY_COLUMNS.get(column, {"type": "number"})
        for i, row in enumerate(rows):
            why = _cell_problem(row.get(column), spec)
            if why:
                line = f"line {i + 2}" if method is None else f"row {i + 1}{where}"  # line 1 is the header
                raise DamagedFile(f"{path}: damaged ({line}: {column} is {row.get(column)!r}, {why})")
    rounds = [row["round"] for row in rows if "round" in row]
    for before, after in zip(rounds, rounds[1:], strict=False):
        if not after > before:
            kind = "repeated" if after == before else "going back"
            raise DamagedFile(f"{path}: damaged (round {after} after round {before}{where}: rounds {kind})")


def read_history(path: str) -> dict:
    """{method (None for a single run's file): rows} of a ``history.csv`` (``fedconvex.history``'s format), every
    cell within ``HISTORY_COLUMNS`` and the rounds of each method strictly increasing; a DamagedFile naming the file,
    line and column otherwise."""
    try:
        runs = _read_history(path)
    except ValueError as exc:
        raise DamagedFile(f"damaged result: {exc}") from None
    for method, rows in runs.items():
        check_rows(path, rows, method)
    return runs


def summary_path(folder: str) -> str:
    return os.path.join(folder, "summary.json")
