"""Small generated CIFAR-10 files in the python-pickle release's format (tests never touch real data)."""

import os
import pickle

import numpy as np


def cifar_pickle(root, n=30, seed=0, balanced=False, learnable=False):
    """``root``/data_batch_1..5 and test_batch, each ``n`` random 32x32 RGB images with labels 0..9 (random,
    or with ``balanced`` cycling 0..9 so that every class is present).  ``learnable``: each image is its
    class's fixed random picture blended with the noise (60/40), so that a model can learn the labels as on
    real images; otherwise the pixels are noise and say nothing of the label."""
    g = np.random.default_rng(seed)
    templates = np.random.default_rng([seed, 1]).integers(0, 256, (10, 3072)).astype(np.float64)
    os.makedirs(root)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        pixels = g.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = (np.arange(n) % 10) if balanced else g.integers(0, 10, n)
        if learnable:
            pixels = np.rint(0.6 * templates[labels] + 0.4 * pixels).astype(np.uint8)
        with open(os.path.join(root, name), "wb") as fh:
            pickle.dump({b"data": pixels, b"labels": labels.tolist()}, fh)


def cifar_images(root, classes=("cat", "dog", "frog", "ship"), n_train=12, n_test=4, seed=0):
    """``root``/train/<class>/<i>.png and test/<class>/<i>.png: random 32x32 RGB images (the JPEG copy's layout).
    Stored uncompressed, so an image's size depends only on its dimensions: new pixels keep every size."""
    from PIL import Image

    g = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        for c in classes:
            folder = os.path.join(root, split, c)
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                img = Image.fromarray(g.integers(0, 256, (32, 32, 3), dtype=np.uint8))
                img.save(os.path.join(folder, f"{i}.png"), compress_level=0)
