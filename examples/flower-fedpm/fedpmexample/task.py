"""fedpmexample: the model and the data of the app.

Model: an MLP with a LayerNorm (784 -> 128 -> LayerNorm -> ReLU -> 62).  Its two Linear layers are FOOF blocks;
the LayerNorm's scale and shift are plain parameters (SGD steps, averaged by the server).
Data: FEMNIST from LEAF's JSON files (``train/*.json``, ``test/*.json``); node ``partition-id`` of
``num-partitions`` holds the writers partition-id, partition-id + num-partitions, ...
"""

from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from fedpm_dnn.data.femnist import load_femnist


class Net(nn.Module):
    def __init__(self, hidden: int = 128, classes: int = 62):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x.flatten(1)))))


@lru_cache(maxsize=2)
def _femnist(data_dir: str):
    data, parts, _ = load_femnist(data_dir)
    scale = lambda x: (torch.as_tensor(x).float() / 255.0 - 0.5) / 0.5  # noqa: E731  pixels to [-1, 1]
    return scale(data.x_train), torch.as_tensor(data.y_train), parts, scale(data.x_test), torch.as_tensor(data.y_test)


def load_data(data_dir: str, partition_id: int, num_partitions: int, batch_size: int, seed: int) -> DataLoader:
    """The training loader of one node: its writers' images, shuffled by a generator seeded from (seed, node)."""
    x, y, parts, _, _ = _femnist(data_dir)
    if not 0 <= partition_id < num_partitions <= len(parts):
        raise ValueError(f"partition {partition_id} of {num_partitions}: the data hold {len(parts)} writers")
    rows = np.concatenate(parts[partition_id::num_partitions])
    gen = torch.Generator().manual_seed(seed * 100_003 + partition_id)
    return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=batch_size, shuffle=True, generator=gen)


def test_accuracy(model: nn.Module, data_dir: str) -> float:
    """Accuracy of ``model`` on the pooled test split."""
    _, _, _, xt, yt = _femnist(data_dir)
    model.eval()
    with torch.no_grad():
        return float((model(xt).argmax(1) == yt).float().mean())
