"""Image datasets for the DNN experiments (CIFAR-10/100, FEMNIST) and their client partitions."""

from .cifar import DatasetError, ImageData, load_cifar_jpeg, load_cifar_pickle
from .femnist import load_femnist
from .loaders import load_image_dataset
from .partition import dirichlet_partition, effective_classes, partition_table

__all__ = [
    "DatasetError",
    "ImageData",
    "dirichlet_partition",
    "effective_classes",
    "load_cifar_jpeg",
    "load_cifar_pickle",
    "load_femnist",
    "load_image_dataset",
    "partition_table",
]
