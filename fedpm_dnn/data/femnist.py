"""FEMNIST from LEAF's JSON files (Caldas et al. 2019).

A LEAF data folder holds ``train/*.json`` and ``test/*.json``, each
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats]], "y": [int]}}}``.
Clients are the writers (the natural partition).  Images become uint8 (n, 1, 28, 28).
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from fedconvex.files import read_regular

from .cifar import DatasetError, ImageData


def _read_split(folder):
    files = sorted(glob.glob(os.path.join(folder, "*.json")))
    if not files:
        raise DatasetError(f"{folder}: no LEAF *.json files")
    users, xs, ys = [], [], []
    for f in files:
        try:
            d = json.loads(read_regular(f, error=DatasetError))  # never a FIFO or a device
            for u in d["users"]:
                x = np.asarray(d["user_data"][u]["x"], dtype=np.float32)
                y = np.asarray(d["user_data"][u]["y"], dtype=np.int64)
                if x.ndim != 2 or x.shape[1] != 784 or len(x) != len(y):
                    raise DatasetError(
                        f"{f}: user {u}: x has shape {x.shape}, y has {len(y)} labels; expected (n, 784)"
                    )
                users.append(u)
                xs.append(x)
                ys.append(y)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DatasetError):
                raise
            raise DatasetError(f"{f}: not a LEAF FEMNIST file ({type(exc).__name__}: {exc})") from None
    return users, xs, ys


def _to_uint8(x):
    # LEAF stores pixels in [0, 1] with 1 = white background; keep the values, as bytes
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8).reshape(-1, 1, 28, 28)


def load_femnist(root: str, num_classes: int = 62):
    """(ImageData, client_parts): the train rows of each writer form one client."""
    users, xs, ys = _read_split(os.path.join(root, "train"))
    _, xts, yts = _read_split(os.path.join(root, "test"))
    x, y = _to_uint8(np.concatenate(xs)), np.concatenate(ys)
    xt, yt = _to_uint8(np.concatenate(xts)), np.concatenate(yts)
    for arr in (y, yt):
        if arr.min() < 0 or arr.max() >= num_classes:
            raise DatasetError(f"{root}: labels outside 0..{num_classes - 1}")
    bounds = np.concatenate([[0], np.cumsum([len(v) for v in ys])])
    parts = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(users))]
    data = ImageData(x, y, xt, yt, tuple(str(i) for i in range(num_classes)), "femnist", (0.5,), (0.5,), source="leaf")
    return data, parts, users
