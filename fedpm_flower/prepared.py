"""Prepared image partitions for the CNN on Flower: one folder per client, one for the server.

    DIR/meta.json              what every side needs: classes, image shape, normalisation, the split
    DIR/client-<i>/train.npz   client i's images (uint8, N x C x H x W) and labels; its meta.json
    DIR/server/test.npz        the test set the ServerApp evaluates the final model on; its meta.json

Written by ``python -m validation.flower prepare``.  A SuperNode is given its own folder in its node
config (``data-dir``) and reads nothing else; the server reads only ``server/``.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
import zlib

import numpy as np

from fedconvex.files import memory_bytes, open_regular, read_json_object
from fedconvex.screening import index_problem


def write(folder: str, name: str, x, y, meta: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    np.savez(os.path.join(folder, name), x=np.ascontiguousarray(x, dtype=np.uint8), y=np.asarray(y, dtype=np.int64))
    with open(os.path.join(folder, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)


def meta(folder: str) -> dict:
    return read_json_object(os.path.join(folder, "meta.json"))  # a regular file holding a JSON object


MEMBERS = ("x.npy", "y.npy")  # what ``write`` puts into an archive, nothing else
ZIP_MAGIC = b"PK\x03\x04"


def _read_arrays(path: str):
    """(x, y) of the archive ``path``, or ValueError naming it and what is wrong: not a regular file, not a zip,
    truncated, members other than x and y, a member that would inflate beyond half the machine's memory (checked
    on its declared size, before it is read), an object array (allow_pickle stays False)."""
    with open_regular(path, error=ValueError) as fh:
        if fh.read(4) != ZIP_MAGIC:
            raise ValueError(f"{path}: damaged (not an .npz archive)")
        fh.seek(0)
        try:
            with zipfile.ZipFile(fh) as zf:
                names = sorted(zf.namelist())
                if names != list(MEMBERS):
                    raise ValueError(f"{path}: damaged (holds {', '.join(names) or 'nothing'}, not the arrays x and y)")
                limit = memory_bytes() // 2
                for info in zf.infolist():
                    if info.file_size > limit:
                        raise ValueError(
                            f"{path}: member {info.filename} declares {info.file_size} bytes, more than half this "
                            "machine's memory; not a prepared partition"
                        )
            fh.seek(0)
            with np.load(fh, allow_pickle=False) as z:
                arrays = z["x"], z["y"]
        except ValueError as exc:
            if str(exc).startswith(path):
                raise
            raise ValueError(f"{path}: damaged ({exc})") from None
        except (zipfile.BadZipFile, OSError, EOFError, KeyError, zlib.error, NotImplementedError) as exc:
            raise ValueError(f"{path}: damaged ({type(exc).__name__}: {exc})") from None
    for name, a in zip("xy", arrays, strict=True):
        if not isinstance(a, np.ndarray):  # NumPy hands a member that is not a .npy over as its bytes
            raise ValueError(f"{path}: damaged (member {name}.npy is not an array)")
    return arrays


def _meta_problem(m: dict, x) -> str | None:
    """Why a folder's meta.json does not describe its images ``x``, or None."""
    for key in ("num_classes", "channels", "image_size"):
        v = m.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{key} must be a positive integer, got {v!r}"
    channels, size = m["channels"], m["image_size"]
    if x.shape[1:] != (channels, size, size):
        return f"images of shape {tuple(x.shape[1:])}, but channels {channels} and image_size {size}"
    for key in ("mean", "std"):
        v = m.get(key)
        ok = isinstance(v, list) and len(v) == channels
        ok = ok and all(isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e) for e in v)
        if not ok or (key == "std" and min(v) <= 0):
            sign = " > 0" if key == "std" else ""
            return f"{key} must be {channels} finite numbers{sign} (one a channel), got {v!r}"
    return None


def load(folder: str, name: str):
    """(x uint8, y int64, meta) of a prepared folder; no pickled objects are read, no FIFO or device; anything
    else is ValueError naming the file and what is wrong with it."""
    path = os.path.join(folder, name)
    x, y = _read_arrays(path)
    if x.dtype != np.uint8 or x.ndim != 4 or y.ndim != 1 or y.shape != (len(x),):
        raise ValueError(
            f"{path}: expected uint8 images (N, C, H, W) and N labels, got x {x.dtype} {x.shape}, y {y.dtype} {y.shape}"
        )
    m = meta(folder)
    bad = _meta_problem(m, x)
    if bad:
        raise ValueError(f"{folder}/meta.json: {bad}")
    bad = index_problem(y, f"{path}: labels", m["num_classes"])  # the model has num_classes outputs
    if bad:
        raise ValueError(bad)
    return x, y, m


def check(root: str, clients: int) -> None:
    """Before a run starts: ``root`` holds at least ``clients`` client folders whose partitions load, and the
    server's test set (read at the end) fits the model.  Raises ValueError naming the cause."""
    have = meta(root).get("clients")
    if isinstance(have, int) and clients > have:
        raise ValueError(f"--clients {clients} exceeds the {have} client folders prepared there")
    for i in range(clients):
        if not os.path.isfile(os.path.join(client_folder(root, i), "train.npz")):
            raise ValueError(f"{client_folder(root, i)}/train.npz does not exist")
        load(client_folder(root, i), "train.npz")  # as the node will: a damaged one is named before any round
    load(server_folder(root), "test.npz")


def client_folder(root: str, partition: int) -> str:
    return os.path.join(root, f"client-{partition}")


def server_folder(root: str) -> str:
    return os.path.join(root, "server")
