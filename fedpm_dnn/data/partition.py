"""Client partitions: Dirichlet label skew (Vogels et al. 2021), shared with fedconvex."""
from __future__ import annotations

import numpy as np

from fedconvex.data.splits import client_class_counts, dirichlet_split


def dirichlet_partition(labels, clients: int, alpha: float, seed: int = 0):
    """Per class Dir(alpha) proportions over the clients; every sample once, no empty client."""
    return dirichlet_split(labels, clients, alpha, seed=seed)


def partition_table(labels, parts, num_classes: int) -> np.ndarray:
    """(clients, num_classes) sample counts per client and class (the data-distribution figure)."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


__all__ = ["client_class_counts", "dirichlet_partition", "partition_table"]
