"""Batch augmentation on the device: random crop (padding 4) + horizontal flip, then normalise.

Done on whole uint8 batches with tensor indexing, never per sample in Python.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Handwriting is not mirror-symmetric (a flipped "b" is a "d") and LEAF's white background would be padded with
# black: FEMNIST trains un-augmented, as LEAF's reference models do.  Natural images get the CIFAR pipelines'
# crop and flip (RelaySum, MOON).  The paper does not say.
UNAUGMENTED_DATASETS = ("femnist",)


def default_augment(dataset: str) -> str:
    """The augmentation a data set trains with unless told otherwise: ``"none"`` or ``"crop-flip"``."""
    return "none" if dataset in UNAUGMENTED_DATASETS else "crop-flip"


def to_unit(x_uint8):
    """uint8 pixels -> float in [0, 1]."""
    return x_uint8.float().div_(255.0)


def standardize(x, mean, std):
    """Per-channel (x - mean) / std of a float batch."""
    m = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def normalize(x_uint8, mean, std):
    return standardize(to_unit(x_uint8), mean, std)


def crop_flip(x, oy, ox, flip, padding: int = 4):
    """Zero-pad x (B, C, H, W) by ``padding``, crop H x W at row/column offsets oy, ox (B,), mirror the
    images where ``flip`` (B,) bool is set.  One gather over the padded images: the crop and the flip
    are both index arithmetic (advanced indexing with four index tensors plus a where over a flipped
    copy took 18 ms per 640-image batch on this project's CPU)."""
    b, c, h, w = x.shape
    dev = x.device
    padded = F.pad(x, (padding, padding, padding, padding))
    W = w + 2 * padding
    j = torch.arange(w, device=dev)
    cols = ox[:, None] + torch.where(flip[:, None], (w - 1) - j[None, :], j[None, :])  # (B, W)
    rows = oy[:, None] + torch.arange(h, device=dev)[None, :]  # (B, H)
    idx = (rows[:, :, None] * W + cols[:, None, :]).view(b, 1, h * w).expand(b, c, h * w)
    return padded.view(b, c, -1).gather(2, idx).view(b, c, h, w)


def random_crop_flip(x, generator: torch.Generator, padding: int = 4, flip: bool = True):
    """x: (B, C, H, W) float.  Zero-pad, crop back to H x W at a random offset, flip half."""
    b, dev = x.shape[0], x.device
    oy = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device="cpu").to(dev)
    ox = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device="cpu").to(dev)
    mask = (
        (torch.rand(b, generator=generator, device="cpu") < 0.5).to(dev)
        if flip
        else torch.zeros(b, dtype=torch.bool, device=dev)
    )
    return crop_flip(x, oy, ox, mask, padding)
