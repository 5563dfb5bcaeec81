"""Batch augmentation on the device: random crop (padding 4) + horizontal flip, then normalise.

Done on whole uint8 batches with tensor indexing, never per sample in Python.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def random_crop_flip(x, generator: torch.Generator, padding: int = 4, flip: bool = True):
    """x: (B, C, H, W) float.  Zero-pad, crop back to H x W at a random offset, flip half."""
    b, c, h, w = x.shape
    dev = x.device
    padded = F.pad(x, (padding, padding, padding, padding))
    oy = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device="cpu").to(dev)
    ox = torch.randint(0, 2 * padding + 1, (b,), generator=generator, device="cpu").to(dev)
    rows = (oy[:, None] + torch.arange(h, device=dev)[None, :])[:, None, :, None]
    cols = (ox[:, None] + torch.arange(w, device=dev)[None, :])[:, None, None, :]
    out = padded[torch.arange(b, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None],
                 rows, cols]
    if flip:
        mask = (torch.rand(b, generator=generator, device="cpu") < 0.5).to(dev)
        out = torch.where(mask[:, None, None, None], out.flip(3), out)
    return out
