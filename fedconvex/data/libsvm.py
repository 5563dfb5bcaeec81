"""LibSVM/SVMlight reader for binary classification files.

Every malformed input is reported as one ``DataError`` line naming the file and the line
(1-based), so a user can open the file at the right place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp


class DataError(ValueError):
    """A data file or split request is unusable; the message names the cause."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """Rows of a binary classification file: X (CSR, float64) and labels y in {-1, +1}."""

    X: sp.csr_matrix
    y: np.ndarray
    source: str
    labels: tuple  # the file's original (negative, positive) label values

    @property
    def n(self) -> int:
        return self.X.shape[0]

    @property
    def d(self) -> int:
        return self.X.shape[1]


def parse_libsvm(lines, source: str, n_features: int | None = None) -> Dataset:
    """Parse LibSVM text lines.  Labels (any two distinct values) map smaller -> -1, larger -> +1.

    ``n_features`` fixes the number of columns (a test split may never use the last feature);
    when omitted it is the largest index seen.
    """
    if n_features is not None and (not isinstance(n_features, (int, np.integer)) or n_features < 1):
        raise DataError(f"{source}: n_features must be a positive integer, got {n_features!r}")
    indptr, indices, values, raw_labels = [0], [], [], []
    label_set: dict[float, int] = {}
    for lineno, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue  # blank lines (e.g. a trailing newline) carry no sample
        where = f"{source}:{lineno}"
        try:
            label = float(parts[0])
        except ValueError:
            raise DataError(f"{where}: label {parts[0]!r} is not a number") from None
        if not math.isfinite(label):
            raise DataError(f"{where}: label {parts[0]!r} is not finite")
        if label not in label_set:
            if len(label_set) == 2:
                seen = ", ".join(f"{v:g}" for v in sorted(label_set))
                raise DataError(f"{where}: third label {label:g} (already saw {seen}); only binary files are supported")
            label_set[label] = lineno
        last = 0
        for tok in parts[1:]:
            key, sep, val = tok.partition(":")
            if not sep:
                raise DataError(f"{where}: token {tok!r} is not of the form index:value")
            try:
                idx = int(key)
                v = float(val)
            except ValueError:
                raise DataError(f"{where}: token {tok!r} is not of the form index:value") from None
            if idx < 1:
                raise DataError(f"{where}: feature index {idx} must be >= 1")
            if idx <= last:
                raise DataError(f"{where}: feature indices must increase ({idx} after {last})")
            if n_features is not None and idx > n_features:
                raise DataError(f"{where}: feature index {idx} exceeds n_features={n_features}")
            if not math.isfinite(v):
                raise DataError(f"{where}: value {val!r} of feature {idx} is not finite")
            last = idx
            if v != 0.0:
                indices.append(idx - 1)
                values.append(v)
        raw_labels.append(label)
        indptr.append(len(indices))
    if not raw_labels:
        raise DataError(f"{source}: no samples (empty file)")
    if len(label_set) < 2:
        raise DataError(f"{source}: only one label ({next(iter(label_set)):g}); binary classification needs two")
    d = n_features if n_features is not None else (max(indices) + 1 if indices else 1)
    try:
        cols = np.asarray(indices, dtype=np.int32)
    except OverflowError:
        raise DataError(f"{source}: a feature index exceeds {np.iinfo(np.int32).max}") from None
    X = sp.csr_matrix(
        (np.asarray(values, dtype=np.float64), cols, np.asarray(indptr, dtype=np.int64)),
        shape=(len(raw_labels), d),
    )
    lo, hi = sorted(label_set)
    y = np.where(np.asarray(raw_labels) == hi, 1.0, -1.0)
    return Dataset(X=X, y=y, source=source, labels=(lo, hi))


def read_libsvm(path, n_features: int | None = None) -> Dataset:
    """Read a LibSVM file from disk (plain text, or .bz2 / .gz by extension)."""
    import bz2
    import gzip
    import os

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    opener = bz2.open if path.endswith(".bz2") else gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            return parse_libsvm(fh, path, n_features)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not a text file ({exc.reason} at byte {exc.start})") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read ({exc})") from None
