"""Data a user points the commands at, with what a disk or a tool leaves beside it: hidden entries and macOS's
zip copies are not images, a folder that is not a CIFAR-10 class is not a class, two copies of a split are not
one, and a class-balanced subset is the size asked for or refused (never rounded)."""

import os
import shutil
import zipfile

import numpy as np
import pytest
from fake_cifar import cifar_images, cifar_pickle
from test_hostile_files import one_line

from fedpm_dnn.data import cifar as cifar_mod
from fedpm_dnn.data.cifar import DatasetError
from validation import dnn, splits


def _load(root, cache):
    return cifar_mod.load_cifar_jpeg(str(root), str(root), str(cache))


def test_hidden_entries_and_macos_copies_beside_the_images_are_not_read_as_images_or_classes(tmp_path):
    cifar_images(str(tmp_path / "d"), n_train=2, n_test=1)
    clean = _load(tmp_path / "d", tmp_path / "c1")
    for rel in ("train/.ipynb_checkpoints/0.jpg", "train/cat/._0.jpg", "__MACOSX/train/cat/._1.jpg"):
        os.makedirs(os.path.dirname(tmp_path / "d" / rel), exist_ok=True)
        (tmp_path / "d" / rel).write_bytes(b"\x00\x05\x16\x07 AppleDouble, not an image")
    shutil.make_archive(str(tmp_path / "z"), "zip", str(tmp_path / "d"))
    for got in (_load(tmp_path / "d", tmp_path / "c2"), _load(tmp_path / "z.zip", tmp_path / "c3")):
        assert got.classes == clean.classes
        assert np.array_equal(got.x_train, clean.x_train) and np.array_equal(got.y_train, clean.y_train)


def test_a_folder_that_is_no_cifar10_class_is_named_not_taken_as_a_class(tmp_path):
    cifar_images(str(tmp_path / "d"), n_train=2, n_test=1)
    shutil.copytree(tmp_path / "d" / "train" / "cat", tmp_path / "d" / "train" / "notes")
    with pytest.raises(DatasetError, match=r"train/notes/ is not a CIFAR-10 class"):
        _load(tmp_path / "d", tmp_path / "c")


def test_two_copies_of_a_split_are_refused_rather_than_read_twice(tmp_path):
    cifar_images(str(tmp_path / "d"), n_train=2, n_test=1)
    shutil.copytree(tmp_path / "d" / "train", tmp_path / "d" / "backup" / "train")
    with pytest.raises(DatasetError, match=r"train images under two folders, backup/train/ and train/"):
        _load(tmp_path / "d", tmp_path / "c")
    with zipfile.ZipFile(tmp_path / "z.zip", "w") as z:  # the same inside a zip
        for d, _, fs in os.walk(tmp_path / "d"):
            for f in fs:
                z.write(os.path.join(d, f), os.path.relpath(os.path.join(d, f), tmp_path / "d"))
    with pytest.raises(DatasetError, match="under two folders"):
        _load(tmp_path / "z.zip", tmp_path / "c2")


@pytest.fixture
def pickles(tmp_path):
    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"), n=40, balanced=True)
    return str(tmp_path / "data")


@pytest.mark.parametrize(
    "flag, value, fragment",
    [
        ("--train-subset", "105", "same number of each of the 10 classes: 100 or 110"),
        ("--test-subset", "33", "same number of each of the 10 classes: 30 or 40"),
        ("--train-subset", "5", "between the 10 classes and the 200 training images"),
    ],
)
def test_a_subset_that_is_not_class_balanced_is_refused_not_rounded(tmp_path, pickles, capsys, flag, value, fragment):
    argv = ["--data-dir", pickles, "--clients", "2", "--rounds", "1", "--quiet", "--out", str(tmp_path / "o")]
    line = one_line(dnn, argv + [flag, value], capsys)
    assert f"{flag} {value}: " in line and fragment in line and not (tmp_path / "o").exists()


def test_the_seed_table_refuses_an_unbalanced_subset_too(pickles, capsys):
    with pytest.raises(SystemExit) as exc:
        splits.main(["--data-dir", pickles, "--train-subset", "105", "--seeds", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("python -m validation.splits: error: --train-subset 105: ")
    assert "100 or 110" in err and len(err.strip().splitlines()) == 1


def test_a_class_short_of_its_share_is_named():
    labels = np.array([0] * 5 + [1] * 1)
    assert "class 1 has fewer than the 3 images" in dnn.subset_problem(6, labels, 2)
    with pytest.raises(ValueError, match="class 1 has fewer"):
        dnn.balanced_subset(labels, 6, 2, seed=0)
    got = dnn.balanced_subset(np.repeat([0, 1], 5), 6, 2, seed=0)
    assert np.bincount(np.repeat([0, 1], 5)[got]).tolist() == [3, 3]
