"""Prepared image partitions for the CNN on Flower: one folder per client, one for the server.

    DIR/meta.json              what every side needs: classes, image shape, normalisation, the split
    DIR/client-<i>/train.npz   client i's images (uint8, N x C x H x W) and labels; its meta.json
    DIR/server/test.npz        the test set the ServerApp evaluates the final model on; its meta.json

Written by ``python -m validation.flower prepare``.  A SuperNode is given its own folder in its node
config (``data-dir``) and reads nothing else; the server reads only ``server/``.
"""

from __future__ import annotations

import json
import os

import numpy as np

from fedconvex.files import open_regular, read_json_object


def write(folder: str, name: str, x, y, meta: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    np.savez(os.path.join(folder, name), x=np.ascontiguousarray(x, dtype=np.uint8), y=np.asarray(y, dtype=np.int64))
    with open(os.path.join(folder, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)


def meta(folder: str) -> dict:
    return read_json_object(os.path.join(folder, "meta.json"))  # a regular file holding a JSON object


def load(folder: str, name: str):
    """(x uint8, y int64, meta) of a prepared folder; no pickled objects are read, no FIFO or device."""
    with open_regular(os.path.join(folder, name), error=ValueError) as fh, np.load(fh, allow_pickle=False) as z:
        x, y = z["x"], z["y"]
    if x.dtype != np.uint8 or x.ndim != 4 or y.shape != (len(x),):
        raise ValueError(f"{folder}/{name}: expected uint8 images (N, C, H, W) and N labels")
    return x, y, meta(folder)


def client_folder(root: str, partition: int) -> str:
    return os.path.join(root, f"client-{partition}")


def server_folder(root: str) -> str:
    return os.path.join(root, "server")
