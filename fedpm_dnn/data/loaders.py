"""One entry point: a dataset name and a data directory -> ImageData (+ natural clients for FEMNIST)."""

from __future__ import annotations

import os

from .cifar import DatasetError, load_cifar_jpeg, load_cifar_pickle
from .femnist import load_femnist

DATA_ENV = "FEDPM_DATA"


def _find(root, *names):
    for n in names:
        p = os.path.join(root, n)
        if os.path.exists(p):
            return p
    return None


def load_image_dataset(name: str, data_dir: str | None, cache_dir: str | None = None):
    """Return (ImageData, natural_parts or None).

    cifar10: ``data_dir`` holds ``cifar-10-batches-py/`` (or is it), or the JPEG copy
    (``cifar10_jpeg_train.zip`` + ``cifar10_jpeg_test.zip``, or a folder with train/ and test/).
    cifar100: ``cifar-100-python/`` (or is it).  femnist: a LEAF folder with train/ and test/.
    ``data_dir`` defaults to the FEDPM_DATA environment variable.
    """
    data_dir = data_dir or os.environ.get(DATA_ENV)
    if not data_dir:
        raise DatasetError(f"no data directory: pass --data-dir or set {DATA_ENV}")
    if not os.path.isdir(data_dir):
        raise DatasetError(f"{data_dir}: no such folder")
    if name not in LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; choose {', '.join(LOADERS)}")
    return LOADERS[name](data_dir, cache_dir)


def _cifar10(data_dir, cache_dir):
    pk = _find(data_dir, "cifar-10-batches-py")
    if pk or os.path.isfile(os.path.join(data_dir, "data_batch_1")):
        return load_cifar_pickle(pk or data_dir, "cifar10"), None
    tr = _find(data_dir, "cifar10_jpeg_train.zip", "cifar10/cifar10_jpeg_train.zip")
    te = _find(data_dir, "cifar10_jpeg_test.zip", "cifar10/cifar10_jpeg_test.zip")
    if tr and te:
        return load_cifar_jpeg(tr, te, cache_dir), None
    if os.path.isdir(os.path.join(data_dir, "train")) and os.path.isdir(os.path.join(data_dir, "test")):
        return load_cifar_jpeg(data_dir, data_dir, cache_dir), None
    raise DatasetError(f"{data_dir}: no CIFAR-10 (cifar-10-batches-py/, cifar10_jpeg_*.zip or train/+test/ JPEGs)")


def _cifar100(data_dir, cache_dir):
    pk = _find(data_dir, "cifar-100-python")
    if pk or os.path.isfile(os.path.join(data_dir, "train")):
        return load_cifar_pickle(pk or data_dir, "cifar100"), None
    raise DatasetError(f"{data_dir}: no cifar-100-python/ folder")


def _femnist(data_dir, cache_dir):
    data, parts, _ = load_femnist(data_dir)
    return data, parts


LOADERS = {"cifar10": _cifar10, "cifar100": _cifar100, "femnist": _femnist}
