"""Client partitions: Dirichlet label skew, shared with fedconvex.

``relaysum`` (the paper's, and the default of Test 2) is the split of Vogels et al. 2021 with its
cap on full clients and its 50 %-of-mean floor; ``relaysum-even`` is the same draw re-cut into K
equal clients, as RelaySum's own CIFAR task trains (``distribute_evenly=True``); ``dirichlet`` is the
plain per-class Dir(alpha) split, whose clients can hold 17 images next to 12,790.
"""

from __future__ import annotations

import numpy as np

from fedconvex.data.splits import (
    client_class_counts,
    dirichlet_split,
    effective_classes,
    relaysum_even_split,
    relaysum_split,
)

SPLITS = ("relaysum", "relaysum-even", "dirichlet")


def dirichlet_partition(labels, clients: int, alpha: float, seed: int = 0):
    """Per class Dir(alpha) proportions over the clients; every sample once, no empty client."""
    return dirichlet_split(labels, clients, alpha, seed=seed)


def relaysum_partition(labels, clients: int, alpha: float, seed: int = 0):
    """Vogels et al. 2021 (RelaySum): capped Dir(alpha) shares, every client >= 50 % of the mean size."""
    return relaysum_split(labels, clients, alpha, seed=seed)


def make_partition(split: str, labels, clients: int, alpha: float, seed: int = 0):
    if split == "relaysum":
        return relaysum_partition(labels, clients, alpha, seed)
    if split == "relaysum-even":
        return relaysum_even_split(labels, clients, alpha, seed=seed)
    if split == "dirichlet":
        return dirichlet_partition(labels, clients, alpha, seed)
    raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")


def partition_table(labels, parts, num_classes: int) -> np.ndarray:
    """(clients, num_classes) sample counts per client and class (the data-distribution figure)."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


__all__ = [
    "SPLITS",
    "client_class_counts",
    "effective_classes",
    "dirichlet_partition",
    "make_partition",
    "partition_table",
    "relaysum_partition",
]
