"""fedpmexample: the model and the data of the app.

Model: an MLP with a LayerNorm (inputs -> 128 -> LayerNorm -> ReLU -> classes), its input size and number of classes
taken from the data.  Its two Linear layers are FOOF blocks; the LayerNorm's scale and shift are plain parameters
(SGD steps, averaged by the server).
Data, from the run config's ``data-dir`` (or the FEDPM_DATA environment variable when it is empty):
  CIFAR-10 (the default; any layout ``fedpm_dnn.data.load_image_dataset`` reads): node ``partition-id`` of
  ``num-partitions`` holds its share of a Dirichlet(``alpha``) label-skewed split of the training images (seeded);
  FEMNIST, when ``data-dir`` is a LEAF folder (``train/*.json``, ``test/*.json``): node ``partition-id`` holds the
  writers partition-id, partition-id + num-partitions, ...
The server evaluates the global model on the test split after every round.
"""

import os
from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from fedpm_dnn.data import dirichlet_partition, load_image_dataset
from fedpm_dnn.data.femnist import load_femnist


class Net(nn.Module):
    def __init__(self, hidden: int = 128, classes: int = 62, inputs: int = 28 * 28):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x.flatten(1)))))


def data_folder(data_dir: str) -> str:
    """The run config's data folder, or FEDPM_DATA; a ValueError naming both when neither is set."""
    folder = data_dir or os.environ.get("FEDPM_DATA", "")
    if not folder:
        raise ValueError("no data: set the run config's data-dir (or the FEDPM_DATA environment variable)")
    return folder


def is_leaf(folder: str) -> bool:
    train = os.path.join(folder, "train")
    return os.path.isdir(train) and any(f.endswith(".json") for f in os.listdir(train))


@lru_cache(maxsize=2)
def _dataset(folder: str):
    """(x_train, y_train, x_test, y_test, classes, writers or None) as tensors scaled to [-1, 1] (FEMNIST) or
    standardised (CIFAR-10)."""
    if is_leaf(folder):
        data, writers, _ = load_femnist(folder)
        scale = lambda x: (torch.as_tensor(x).float() / 255.0 - 0.5) / 0.5  # noqa: E731
    else:
        data, writers = load_image_dataset("cifar10", folder)[0], None
        mean, std = torch.tensor(data.mean)[:, None, None], torch.tensor(data.std)[:, None, None]
        scale = lambda x: (torch.as_tensor(x).float() / 255.0 - mean) / std  # noqa: E731
    y, yt = torch.as_tensor(data.y_train), torch.as_tensor(data.y_test)
    return scale(data.x_train), y, scale(data.x_test), yt, data.num_classes, writers


def make_net(data_dir: str) -> Net:
    """The app's model for the data in ``data_dir``: the input size and classes of that data."""
    x, _, _, _, classes, _ = _dataset(data_folder(data_dir))
    return Net(classes=classes, inputs=int(np.prod(x.shape[1:])))


def load_data(data_dir: str, partition_id: int, num_partitions: int, batch_size: int, seed: int,
              alpha: float = 0.1) -> DataLoader:  # fmt: skip
    """The training loader of one node, shuffled by a generator seeded from (seed, node)."""
    x, y, _, _, _, writers = _dataset(data_folder(data_dir))
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


def test_accuracy(model: nn.Module, data_dir: str) -> float:
    """Accuracy of ``model`` on the test split."""
    _, _, xt, yt, _, _ = _dataset(data_folder(data_dir))
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(xt[i : i + 1000]).argmax(1) == yt[i : i + 1000]).sum()) for i in range(0, len(yt), 1000))
    return hits / len(yt)
