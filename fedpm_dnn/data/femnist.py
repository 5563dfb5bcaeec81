"""FEMNIST from LEAF's JSON files (Caldas et al. 2019).

A LEAF data folder holds ``train/*.json`` and ``test/*.json`` (or ``*.json.gz``), each
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats in 0..1]], "y": [int]}}}``.
Clients are the writers (the natural partition).  Images become uint8 (n, 1, 28, 28).

Every file is checked before its values are used: a regular file (no FIFO or device), read with bounded
memory (a gzip member may not inflate beyond ``MAX_JSON_BYTES``), LEAF's structure, finite pixels in 0..1,
integer labels in range, each writer once per split.
"""

from __future__ import annotations

import errno
import glob
import gzip
import json
import os
import stat
import zlib

import numpy as np

from .cifar import DatasetError, ImageData

PIXELS = 28 * 28
# one LEAF shard of the full FEMNIST is ~200 MB of JSON; a file claiming more is not a shard
MAX_JSON_BYTES = 1 << 30


def _split_files(folder):
    files = sorted(glob.glob(os.path.join(folder, "*.json")) + glob.glob(os.path.join(folder, "*.json.gz")))
    if not files:
        raise DatasetError(f"{folder}: no LEAF *.json or *.json.gz files")
    return files


def _read_bounded(path):
    """The bytes of ``path`` (inflated if it ends in .gz), at most MAX_JSON_BYTES of them."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the fstat below refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        why = "a symbolic link loop" if exc.errno == errno.ELOOP else exc.strerror
        raise DatasetError(f"{path}: cannot open ({why})") from None
    with os.fdopen(fd, "rb") as raw:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DatasetError(f"{path}: not a regular file (a FIFO, device or folder)")
        try:
            if path.endswith(".gz"):
                with gzip.GzipFile(fileobj=raw) as gz:
                    data = gz.read(MAX_JSON_BYTES + 1)
                what = "inflates to"
            else:
                data = raw.read(MAX_JSON_BYTES + 1)
                what = "holds"
        except (OSError, EOFError, zlib.error) as exc:
            raise DatasetError(f"{path}: damaged gzip file ({exc})") from None
    if len(data) > MAX_JSON_BYTES:
        raise DatasetError(f"{path}: {what} more than {MAX_JSON_BYTES} bytes of JSON; not a LEAF shard")
    return data


def _parse(path, data):
    try:
        return json.loads(data)
    except RecursionError:
        raise DatasetError(f"{path}: JSON nested too deeply; not a LEAF FEMNIST file") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: not JSON ({exc})") from None


def _labels(path, user, y, num_classes):
    # bool is an int in Python and 3.0 would pass a float check: LEAF's labels are plain ints
    if not isinstance(y, list) or any(type(v) is not int for v in y):
        raise DatasetError(f"{path}: writer {user}: labels must be a list of integers")
    if y and (min(y) < 0 or max(y) >= num_classes):
        raise DatasetError(f"{path}: writer {user}: labels outside 0..{num_classes - 1}")
    return np.asarray(y, dtype=np.int64)


def _pixels(path, user, x, n):
    try:
        arr = np.asarray(x, dtype=np.float32) if n else np.empty((0, PIXELS), np.float32)
    except (TypeError, ValueError, OverflowError):
        raise DatasetError(f"{path}: writer {user}: x is not a list of {PIXELS}-number rows") from None
    if arr.ndim != 2 or arr.shape != (n, PIXELS):
        raise DatasetError(f"{path}: writer {user}: x has shape {arr.shape}, y has {n} labels; expected (n, {PIXELS})")
    if not np.isfinite(arr).all():
        raise DatasetError(f"{path}: writer {user}: pixels not finite (NaN or inf)")
    if arr.size and (arr.min() < 0.0 or arr.max() > 1.0):
        raise DatasetError(f"{path}: writer {user}: pixels outside 0..1 (LEAF stores 0..1, not 0..255)")
    return arr


def _read_file(path, num_classes):
    d = _parse(path, _read_bounded(path))
    if not isinstance(d, dict) or not isinstance(d.get("users"), list) or not isinstance(d.get("user_data"), dict):
        raise DatasetError(f'{path}: not a LEAF FEMNIST file (needs "users" list and "user_data" object)')
    counts = d.get("num_samples")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(d["users"])):
        raise DatasetError(f"{path}: num_samples does not list one count per user")
    for i, u in enumerate(d["users"]):
        if not isinstance(u, str):
            raise DatasetError(f"{path}: user ids must be strings, got {type(u).__name__}")
        rec = d["user_data"].get(u)
        if not isinstance(rec, dict) or "x" not in rec or "y" not in rec:
            raise DatasetError(f'{path}: writer {u}: no user_data entry with "x" and "y"')
        y = _labels(path, u, rec["y"], num_classes)
        if counts is not None and counts[i] != len(y):
            raise DatasetError(f"{path}: writer {u}: num_samples says {counts[i]}, y has {len(y)} labels")
        yield u, _pixels(path, u, rec["x"], len(y)), y


def _read_split(folder, num_classes):
    users, xs, ys, seen = [], [], [], {}
    for f in _split_files(folder):
        for u, x, y in _read_file(f, num_classes):
            if u in seen:
                raise DatasetError(f"{f}: writer {u} appears twice in {folder} (also in {seen[u]})")
            seen[u] = f
            users.append(u)
            xs.append(x)
            ys.append(y)
    if not users:
        raise DatasetError(f"{folder}: the LEAF files list no writers")
    if not sum(len(y) for y in ys):
        raise DatasetError(f"{folder}: the LEAF files hold no images")
    return users, xs, ys


def _to_uint8(x):
    # LEAF stores pixels in [0, 1] with 1 = white background; keep the values, as bytes
    return np.rint(x * 255.0).astype(np.uint8).reshape(-1, 1, 28, 28)


def load_femnist(root: str, num_classes: int = 62):
    """(ImageData, client_parts, writers): the train rows of each writer form one client."""
    users, xs, ys = _read_split(os.path.join(root, "train"), num_classes)
    empty = [u for u, y in zip(users, ys, strict=True) if not len(y)]
    if empty:
        raise DatasetError(f"{os.path.join(root, 'train')}: writer {empty[0]} has no training images")
    _, xts, yts = _read_split(os.path.join(root, "test"), num_classes)
    x, y = _to_uint8(np.concatenate(xs)), np.concatenate(ys)
    xt, yt = _to_uint8(np.concatenate(xts)), np.concatenate(yts)
    bounds = np.concatenate([[0], np.cumsum([len(v) for v in ys])])
    parts = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(users))]
    data = ImageData(x, y, xt, yt, tuple(str(i) for i in range(num_classes)), "femnist", (0.5,), (0.5,), source="leaf")
    return data, parts, users
