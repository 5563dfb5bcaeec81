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
from fedconvex.screening import index_problem


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
    m = meta(folder)
    classes = m.get("num_classes")
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
        raise ValueError(f"{folder}/meta.json: num_classes must be a positive integer, got {classes!r}")
    bad = index_problem(y, f"{folder}/{name}: labels", classes)  # the model has num_classes outputs
    if bad:
        raise ValueError(bad)
    return x, y, m


def check(root: str, clients: int) -> None:
    """Before a run starts: ``root`` holds at least ``clients`` client folders, and the server's test set (read
    at the end) fits the model.  Raises ValueError naming the cause."""
    have = meta(root).get("clients")
    if isinstance(have, int) and clients > have:
        raise ValueError(f"--clients {clients} exceeds the {have} client folders prepared there")
    for i in range(clients):
        if not os.path.isfile(os.path.join(client_folder(root, i), "train.npz")):
            raise ValueError(f"{client_folder(root, i)}/train.npz does not exist")
    load(server_folder(root), "test.npz")


def client_folder(root: str, partition: int) -> str:
    return os.path.join(root, f"client-{partition}")


def server_folder(root: str) -> str:
    return os.path.join(root, "server")
