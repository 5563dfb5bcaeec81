"""fedpmexample: the model and the data of the app.

Model: the paper's SimpleCNN for CIFAR-10 (``fedpm_dnn.models.SimpleCNN``: two 5x5 convolutions with max-pooling,
three Linear layers; all five are FOOF blocks, the widest of side 401), its input channels, image size and classes
taken from the data.
Data, from the run config's ``data-dir`` (or the FEDPM_DATA environment variable when it is empty):
  CIFAR-10 (the default; any layout ``fedpm_dnn.data.load_image_dataset`` reads): a fixed random subset of
  ``train-images`` training images (0: all 50,000), node ``partition-id`` of ``num-partitions`` holding its share of
  a Dirichlet(``alpha``) label-skewed split of them (seeded);
  FEMNIST, when ``data-dir`` is a LEAF folder (``train/*.json``, ``test/*.json``): node ``partition-id`` holds the
  writers partition-id, partition-id + num-partitions, ... (all their images).
The server evaluates the global model after every round on a fixed random subset of ``test-images`` test images
(0: all).
"""

import os
from functools import lru_cache

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from fedpm_dnn.data import dirichlet_partition, load_image_dataset
from fedpm_dnn.data.femnist import load_femnist
from fedpm_dnn.models import SimpleCNN


def data_folder(data_dir: str) -> str:
    """The run config's data folder, or FEDPM_DATA; a ValueError naming both when neither is set."""
    folder = data_dir or os.environ.get("FEDPM_DATA", "")
    if not folder:
        raise ValueError("no data: set the run config's data-dir (or the FEDPM_DATA environment variable)")
    return folder


def is_leaf(folder: str) -> bool:
    train = os.path.join(folder, "train")
    return os.path.isdir(train) and any(f.endswith(".json") for f in os.listdir(train))


def _subset(n: int, size: int, seed: int) -> np.ndarray:
    """A fixed random subset of ``size`` of ``n`` rows (all, in order, when ``size`` is 0 or at least n)."""
    if size < 0:
        raise ValueError(f"a subset size must be >= 0 (0: all), got {size}")
    if size == 0 or size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).permutation(n)[:size])


@lru_cache(maxsize=1)
def _images(folder: str):
    """(ImageData, writers or None) of the folder: FEMNIST when it is a LEAF folder, else CIFAR-10."""
    if is_leaf(folder):
        data, writers, _ = load_femnist(folder)
        return data, writers
    return load_image_dataset("cifar10", folder)[0], None


def _scaled(data, x) -> torch.Tensor:
    """uint8 images as float32, standardised per channel (FEMNIST's mean and std 0.5: scaled to [-1, 1])."""
    mean = torch.tensor(data.mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(data.std, dtype=torch.float32)[:, None, None]
    return (torch.as_tensor(x).float() / 255.0 - mean) / std


@lru_cache(maxsize=2)
def _train_set(folder: str, train_images: int = 0):
    """(x, y, writers or None): CIFAR-10's training images cut to their fixed subset before they are converted
    (FEMNIST keeps every writer's images: its writers are the nodes' shares)."""
    data, writers = _images(folder)
    rows = np.arange(len(data.y_train)) if writers is not None else _subset(len(data.y_train), train_images, seed=1)
    return _scaled(data, data.x_train[rows]), torch.as_tensor(data.y_train[rows]), writers


@lru_cache(maxsize=2)
def _test_set(folder: str, test_images: int = 0):
    data, _ = _images(folder)
    rows = _subset(len(data.y_test), test_images, seed=2)
    return _scaled(data, data.x_test[rows]), torch.as_tensor(data.y_test[rows])


def make_net(data_dir: str) -> SimpleCNN:
    """The app's model for the data in ``data_dir``: SimpleCNN for its channels, image size and classes."""
    data, _ = _images(data_folder(data_dir))
    return SimpleCNN(data.num_classes, in_channels=data.x_train.shape[1], image_size=data.x_train.shape[2])


def load_data(data_dir: str, partition_id: int, num_partitions: int, batch_size: int, seed: int,
              alpha: float = 0.1, train_images: int = 0) -> DataLoader:  # fmt: skip
    """The training loader of one node, shuffled by a generator seeded from (seed, node)."""
    x, y, writers = _train_set(data_folder(data_dir), train_images)
    if writers is not None:
        if not 0 <= partition_id < num_partitions <= len(writers):
            raise ValueError(f"partition {partition_id} of {num_partitions}: the data hold {len(writers)} writers")
        rows = np.concatenate(writers[partition_id::num_partitions])
    else:
        if not 0 <= partition_id < num_partitions <= len(y):
            raise ValueError(f"partition {partition_id} of {num_partitions}: the data hold {len(y)} images")
        rows = dirichlet_partition(y.numpy(), num_partitions, alpha, seed=0)[partition_id]  # the same split each round
    gen = torch.Generator().manual_seed(seed * 100_003 + partition_id)
    return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=batch_size, shuffle=True, generator=gen)


def test_accuracy(model: torch.nn.Module, data_dir: str, test_images: int = 0) -> float:
    """Accuracy of ``model`` on the test subset."""
    xt, yt = _test_set(data_folder(data_dir), test_images)
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(xt[i : i + 1000]).argmax(1) == yt[i : i + 1000]).sum()) for i in range(0, len(yt), 1000))
    return hits / len(yt)
