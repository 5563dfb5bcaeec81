"""A small synthetic image task, rebuilt identically from its seed in any process (tests, Flower
SuperNodes): class c is a bright patch at a class-specific place on noise; clients see skewed
label mixes."""

from __future__ import annotations

import numpy as np


def _images(rng, labels, size):
    x = rng.integers(0, 60, (len(labels), 3, size, size))
    step = max(2, size // 3)
    for k, c in enumerate(labels):
        r, col = divmod(int(c), 2)
        x[k, :, 2 + step * r : 2 + step * r + step, 2 + step * col : 2 + step * col + step] += 180
    return x.clip(0, 255).astype(np.uint8)


def synthetic_task(clients=3, per_client=48, classes=3, image_size=16, seed=0, test_per_class=40):
    """([(x, y) per client], (x_test, y_test)) as uint8 / int64 numpy arrays."""
    rng = np.random.default_rng(seed)
    parts = []
    for i in range(clients):
        p = np.full(classes, 0.1) + 0.9 * np.eye(classes)[i % classes]
        y = rng.choice(classes, per_client, p=p / p.sum())
        parts.append((_images(rng, y, image_size), y.astype(np.int64)))
    yt = np.repeat(np.arange(classes), test_per_class)
    return parts, (_images(rng, yt, image_size), yt.astype(np.int64))


MEAN, STD = (0.2, 0.2, 0.2), (0.3, 0.3, 0.3)
