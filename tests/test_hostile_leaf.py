"""Hostile LEAF (FEMNIST) folders: each damage is one clear line from ``python -m validation.dnn`` naming the
file and the cause, exit code 2, no traceback, and no output folder.

A valid two-writer folder is generated per case and then damaged: values out of their domain (NaN, inf,
0..255 pixels, float or huge labels), duplicated writers, a split with no writers, JSON nested beyond
Python's recursion limit, and files that are not what their names claim (a FIFO, a link to /dev/zero, a
gzip member that inflates beyond the loader's bound, a truncated gzip)."""

import gzip
import json
import os

import pytest

torch = pytest.importorskip("torch")

from fedpm_dnn.data import femnist  # noqa: E402
from validation import dnn  # noqa: E402

PROG = "python -m validation.dnn"


def leaf(root, users=("w1", "w2"), n=3):
    """A valid LEAF folder: train/ and test/ with one plain JSON shard each; returns the train shard's dict."""
    shards = {}
    for split in ("train", "test"):
        os.makedirs(os.path.join(root, split))
        shards[split] = {
            "users": list(users),
            "num_samples": [n] * len(users),
            "user_data": {u: {"x": [[0.5] * 784 for _ in range(n)], "y": list(range(n))} for u in users},
        }
        write(root, split, shards[split])
    return shards["train"]


def write(root, split, data, name=None):
    path = os.path.join(root, split, name or f"all_data_0_{split}.json")
    with open(path, "w") as fh:
        json.dump(data, fh)  # writes NaN / Infinity literals as Python's json does
    return path


def train_shard(root):
    return os.path.join(root, "train", "all_data_0_train.json")


def _set(key, value, row=0, col=0):
    def damage(root):
        d = leaf(root)
        if key == "x":
            d["user_data"]["w1"]["x"][row][col] = value
        else:
            d["user_data"]["w1"]["y"][row] = value
        return write(root, "train", d)

    return damage


def _scaled_255(root):
    d = leaf(root)
    d["user_data"]["w2"]["x"] = [[127.0] * 784 for _ in range(3)]
    return write(root, "train", d)


def _duplicate_in_file(root):
    d = leaf(root)
    d["users"].append("w1")
    d["num_samples"].append(3)
    return write(root, "train", d)


def _duplicate_across_files(root):
    d = leaf(root)
    write(root, "train", d, name="all_data_1_train.json")
    return os.path.join(root, "train", "all_data_1_train.json")


def _no_users(split):
    def damage(root):
        leaf(root)
        return write(root, split, {"users": [], "num_samples": [], "user_data": {}})

    return damage


def _deep(root):
    leaf(root)
    path = train_shard(root)
    with open(path, "w") as fh:
        fh.write("[" * 200_000 + "]" * 200_000)
    return path


def _fifo(root):
    leaf(root)
    path = os.path.join(root, "train", "all_data_1_train.json")
    os.mkfifo(path)
    return path


def _dev_zero(suffix):
    def damage(root):
        leaf(root)
        path = os.path.join(root, "test", "all_data_1_test" + suffix)
        os.symlink("/dev/zero", path)
        return path

    return damage


def _gzip_bomb(root, monkeypatch):
    # the bound is lowered so that the test stays small; the code path is the one a 2 GiB bomb takes
    monkeypatch.setattr(femnist, "MAX_JSON_BYTES", 64 * 1024)
    leaf(root)
    path = os.path.join(root, "train", "all_data_1_train.json.gz")
    with gzip.open(path, "wb") as fh:
        fh.write(b" " * (1 << 20))  # 1 MiB of JSON whitespace: 1 KiB on disk
    return path


def _truncated_gzip(root):
    leaf(root)
    path = os.path.join(root, "train", "all_data_1_train.json.gz")
    with open(path, "wb") as fh:
        fh.write(gzip.compress(json.dumps({"users": []}).encode())[:-12])
    return path


def _count_mismatch(root):
    d = leaf(root)
    d["num_samples"][1] = 7
    return write(root, "train", d)


def _string_pixels(root):
    d = leaf(root)
    d["user_data"]["w1"]["x"][2] = ["white"] * 784
    return write(root, "train", d)


CASES = [
    ("nan-pixel", _set("x", float("nan")), "pixels not finite"),
    ("inf-pixel", _set("x", float("inf"), row=1, col=300), "pixels not finite"),
    ("pixels-0-255", _scaled_255, "pixels outside 0..1"),
    ("float-label", _set("y", 2.0), "labels must be a list of integers"),
    ("bool-label", _set("y", True), "labels must be a list of integers"),
    ("label-2^70", _set("y", 2**70), "labels outside 0..61"),
    ("negative-label", _set("y", -1), "labels outside 0..61"),
    ("duplicate-writer-in-file", _duplicate_in_file, "writer w1 appears twice"),
    ("duplicate-writer-across-files", _duplicate_across_files, "writer w1 appears twice"),
    ("train-without-writers", _no_users("train"), "list no writers"),
    ("test-without-writers", _no_users("test"), "list no writers"),
    ("deeply-nested", _deep, "nested too deeply"),
    ("fifo", _fifo, "not a regular file"),
    ("dev-zero-json", _dev_zero(".json"), "not a regular file"),
    ("dev-zero-json-gz", _dev_zero(".json.gz"), "not a regular file"),
    ("gzip-bomb", _gzip_bomb, "inflates to more than 65536 bytes"),
    ("truncated-gzip", _truncated_gzip, "damaged gzip file"),
    ("num-samples-mismatch", _count_mismatch, "num_samples says 7, y has 3 labels"),
    ("string-pixels", _string_pixels, "x is not a list of 784-number rows"),
]


@pytest.mark.parametrize("damage,cause", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_leaf_folder_is_one_line_naming_file_and_cause(tmp_path, capsys, monkeypatch, damage, cause):
    root = str(tmp_path / "leaf")
    bad = damage(root, monkeypatch) if damage is _gzip_bomb else damage(root)
    out = tmp_path / "out"
    capsys.readouterr()
    try:
        rc = dnn.main(["--dataset", "femnist", "--data-dir", root, "--device", "cpu", "--out", str(out), "--quiet"])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    # the file named is the damaged one (a split with no writers names its folder)
    named = os.path.dirname(bad) if cause == "list no writers" else bad
    assert lines[0].startswith(f"{PROG}: error: ") and named in lines[0] and cause in lines[0], lines[0]
    assert not out.exists()


def test_the_valid_folder_the_cases_damage_loads():
    """The cases above fail because of their damage alone: the undamaged folder is accepted."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        leaf(root)
        data, parts, users = femnist.load_femnist(root)
        assert users == ["w1", "w2"] and [len(p) for p in parts] == [3, 3] and len(data.y_test) == 6
        assert int(data.x_train.max()) == 128  # 0.5 -> 127.5 -> rounded to even
