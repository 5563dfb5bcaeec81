"""Datasets and client splits for the convex experiments."""

from .bundled import BUNDLED, load_bundled, load_dataset, paper_split_sizes
from .libsvm import DataError, Dataset, parse_libsvm, read_libsvm
from .splits import client_class_counts, dirichlet_split, relaysum_split, sequential_split, shuffled_split

__all__ = [
    "BUNDLED",
    "DataError",
    "Dataset",
    "client_class_counts",
    "dirichlet_split",
    "relaysum_split",
    "load_bundled",
    "load_dataset",
    "paper_split_sizes",
    "parse_libsvm",
    "read_libsvm",
    "sequential_split",
    "shuffled_split",
]
