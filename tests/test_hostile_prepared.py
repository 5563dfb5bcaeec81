"""Hostile partitions in a folder written by ``python -m validation.flower prepare``: a damaged ``.npz`` (truncated,
not an archive, a pickled member, other members, wrong shapes, dtypes or labels) or a meta.json that does not
describe its images.  Each is one ValueError naming the file, as a SuperNode reads it (``cnn.client_data``), and one
line from the command before any round; nothing is unpickled."""

import json
import os
import pickle
import zipfile

import numpy as np
import pytest

pytest.importorskip("torch")

from test_hostile_params import _one_line_error, _prepared  # noqa: E402

from fedpm_flower import prepared  # noqa: E402


class Evil:
    """Unpickling this creates a folder: proof that loading ran code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _savez(path, **arrays):
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


X = np.zeros((4, 3, 4, 4), dtype=np.uint8)
Y = np.array([0, 1, 0, 1])


def _truncated(p, w):
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])


def _pickled_member(p, w):
    _savez(p, x=np.array([Evil(str(w / "PWNED"))], dtype=object), y=Y)


def _pickle_file(p, w):
    p.write_bytes(pickle.dumps(Evil(str(w / "PWNED"))))


def _extra_member(p, w):
    _savez(p, x=X, y=Y, z=Y)


def _member_not_npy(p, w):
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("x.npy", b"not an array")
        zf.writestr("y.npy", b"not an array")


DAMAGES = [
    ("truncated", _truncated, "damaged ("),
    ("text", lambda p, w: p.write_text("hello\n"), "damaged (not an .npz archive)"),
    ("npy", lambda p, w: np.save(p.open("wb"), X), "damaged (not an .npz archive)"),
    ("pickle", _pickle_file, "damaged (not an .npz archive)"),
    ("object-member", _pickled_member, "damaged (Object arrays cannot be loaded when allow_pickle=False)"),
    ("extra-member", _extra_member, "damaged (holds x.npy, y.npy, z.npy, not the arrays x and y)"),
    ("no-y", lambda p, w: _savez(p, x=X), "damaged (holds x.npy, not the arrays x and y)"),
    ("member-not-npy", _member_not_npy, "damaged (member x.npy is not an array)"),
    ("x-3d", lambda p, w: _savez(p, x=X[:, 0], y=Y), "expected uint8 images (N, C, H, W) and N labels"),
    (
        "nan-pixels",
        lambda p, w: _savez(p, x=np.full(X.shape, np.nan, np.float32), y=Y),
        "expected uint8 images (N, C, H, W) and N labels, got x float32",
    ),
    ("y-2d", lambda p, w: _savez(p, x=X, y=Y[:, None]), "expected uint8 images (N, C, H, W) and N labels"),
    ("y-short", lambda p, w: _savez(p, x=X, y=Y[:3]), "expected uint8 images (N, C, H, W) and N labels"),
    ("float-labels", lambda p, w: _savez(p, x=X, y=Y + 0.5), "labels has dtype float64"),
    ("label-out-of-range", lambda p, w: _savez(p, x=X, y=Y + 1), "labels outside 0..1"),
    ("negative-label", lambda p, w: _savez(p, x=X, y=Y - 1), "labels outside 0..1"),
]


def _meta(change):
    def damage(p, w):
        m = p.parent / "meta.json"
        meta = json.loads(m.read_text())
        change(meta)
        m.write_text(json.dumps(meta))

    return damage


META_DAMAGES = [
    ("meta-channels", _meta(lambda m: m.update(channels=1)), "images of shape (3, 4, 4), but channels 1"),
    ("meta-no-mean", _meta(lambda m: m.pop("mean")), "mean must be 3 finite numbers"),
    ("meta-std-zero", _meta(lambda m: m.update(std=[0.0] * 3)), "std must be 3 finite numbers > 0"),
    ("meta-classes-str", _meta(lambda m: m.update(num_classes="2")), "num_classes must be a positive integer"),
]


@pytest.mark.parametrize("name,damage,fragment", DAMAGES + META_DAMAGES, ids=[c[0] for c in DAMAGES + META_DAMAGES])
def test_a_damaged_partition_is_named_by_the_node_and_by_the_command(tmp_path, capsys, name, damage, fragment):
    from fedpm_flower import cnn
    from fedpm_flower.config import FlowerRunConfig
    from validation import flower

    root = _prepared(tmp_path / "parts", clients=2)
    folder = prepared.client_folder(root, 1)
    npz = tmp_path / "parts" / "client-1" / "train.npz"
    damage(npz, tmp_path)
    named = f"{folder}/meta.json" if name.startswith("meta-") else str(npz)
    # the node, as a SuperNode given this folder in its node config reads it
    with pytest.raises(ValueError) as exc:
        cnn.client_data(FlowerRunConfig(problem="cnn", method="fedavg"), 1, folder)
    assert str(exc.value).startswith(named + ": ") and fragment in str(exc.value), str(exc.value)
    # the command, before a SuperNode or a simulation starts
    argv = [
        "--problem",
        "cnn",
        "--method",
        "fedavg",
        "--data-dir",
        root,
        "--clients",
        "2",
        "--out",
        str(tmp_path / "o"),
    ]
    capsys.readouterr()
    rc = _one_line_error(flower, argv, tmp_path)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"python -m validation.flower: error: --data-dir {root}: {named}: "), lines[0]
    assert not (tmp_path / "PWNED").exists()  # nothing was unpickled


def test_a_member_declaring_more_than_half_the_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    root = _prepared(tmp_path / "parts", clients=1)
    monkeypatch.setattr(prepared, "memory_bytes", lambda: 2 * 200)  # x.npy of 4x3x4x4 bytes declares 320
    with pytest.raises(ValueError, match=r"client-0/train.npz: member x.npy declares \d+ bytes, more than half"):
        prepared.load(prepared.client_folder(root, 0), "train.npz")


def test_an_intact_partition_loads_as_written(tmp_path):
    """The healthy counterpart of every case above: what ``write`` wrote is what ``load`` returns."""
    root = _prepared(tmp_path / "parts", clients=1)
    x, y, meta = prepared.load(prepared.client_folder(root, 0), "train.npz")
    assert x.dtype == np.uint8 and x.shape == (4, 3, 4, 4) and y.tolist() == [0, 1, 0, 1] and meta["channels"] == 3
