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


# ---- arrays given to the convex problem ------------------------------------------------------------------------


def _dense_problem(seed=0, n=12, d=4):
    g = np.random.default_rng(seed)
    X = g.normal(size=(n, d)) * (g.random((n, d)) < 0.6)
    y = np.where(g.random(n) < 0.5, -1.0, 1.0)
    return X, y, [np.arange(0, 6), np.arange(6, n)]


@pytest.mark.parametrize("where", ["X dense", "X sparse", "y"])
def test_complex_data_is_refused_not_cast_to_its_real_part(where):
    import scipy.sparse as sp

    from fedconvex.data.libsvm import DataError
    from fedconvex.problem import FederatedLogReg

    X, y, parts = _dense_problem()
    if where == "X dense":
        X = X + 1j
    elif where == "X sparse":
        X = sp.csr_matrix(X.astype(np.complex128))
    else:
        y = y.astype(np.complex128)
    with pytest.raises(DataError, match=r"is complex \(complex128\); pass its real part"):
        FederatedLogReg(X, y, parts)


def test_a_non_canonical_sparse_matrix_means_what_scipy_says_it_means():
    """Duplicate entries (summed by toarray) and unsorted column indices: the problem equals the one on the dense
    matrix they stand for; and an inf + -inf pair is the NaN it sums to, refused."""
    import scipy.sparse as sp

    from fedconvex.data.libsvm import DataError
    from fedconvex.problem import FederatedLogReg

    X, y, parts = _dense_problem()
    dup = sp.coo_matrix(X)
    dup = sp.coo_matrix(
        (np.r_[dup.data / 2, dup.data / 2], (np.r_[dup.row, dup.row], np.r_[dup.col, dup.col])), X.shape
    )
    csr = sp.csr_matrix(X)
    data, indices = [], []  # each row's entries stored twice as halves, columns in reverse order
    for r in range(X.shape[0]):
        lo, hi = csr.indptr[r], csr.indptr[r + 1]
        data += [csr.data[lo:hi][::-1] / 2] * 2
        indices += [csr.indices[lo:hi][::-1]] * 2
    raw = sp.csr_matrix((np.concatenate(data), np.concatenate(indices), 2 * csr.indptr), shape=X.shape)
    assert not raw.has_canonical_format and np.allclose(raw.toarray(), X)  # stored as given: not summed, not sorted
    theta = np.random.default_rng(1).normal(size=(2, X.shape[1]))
    ref = FederatedLogReg(X, y, parts)
    for M in (dup, raw):
        got = FederatedLogReg(M, y, parts)
        assert np.allclose(got.values(theta), ref.values(theta), rtol=1e-13, atol=0)
        assert np.allclose(got.gradients(theta), ref.gradients(theta), rtol=1e-12, atol=1e-15)
    bad = sp.csr_matrix((np.array([np.inf, -np.inf, 1.0]), np.array([0, 0, 1]), np.array([0, 2, 3])), shape=(2, 2))
    with pytest.raises(DataError, match="NaN or Inf"):
        FederatedLogReg(bad, np.array([1.0, -1.0]), [np.array([0]), np.array([1])])
