"""Matrix compressors for FedNL (Safaryan et al. 2022, section 3): identity, TopK, RandK, Rank-R.

Each has ``encode(xp, M, rng) -> message`` (the arrays a client actually sends for a stack
of symmetric (P, d, d) matrices) and ``decode(xp, message, d) -> (P, d, d)`` (what the server,
and the client for its own estimate, reconstruct).
TopK and RandK act on the upper triangle (the matrices are symmetric, so the lower one
carries no information) and are symmetrised on decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _upper(d):
    return np.triu_indices(d)


class _UpperEntries:
    """Shared decoding for compressors that send (values, index) of upper-triangular entries."""

    def decode(self, xp, msg, d):
        vals, idx = msg["values"], msg["index"]
        n = vals.shape[0]
        iu, ju = _upper(d)
        pos = xp.asarray((iu * d + ju).astype(np.int64))[idx.astype(xp.int64)]
        flat = xp.zeros((n, d * d), dtype=vals.dtype)
        flat[xp.arange(n)[:, None], pos] = vals
        M = flat.reshape(n, d, d)
        # symmetrise: upper + upper^T, counting the diagonal once
        return M + xp.swapaxes(M, 1, 2) - M * xp.eye(d, dtype=vals.dtype)[None]


@dataclass(frozen=True)
class Identity:
    def encode(self, xp, M, rng):
        return {"S": M}

    def decode(self, xp, msg, d):
        return msg["S"]


@dataclass(frozen=True)
class TopK(_UpperEntries):
    """Keep the k upper-triangular entries of largest magnitude (contractive)."""

    k: int

    def encode(self, xp, M, rng):
        iu, ju = _upper(M.shape[1])
        U = M[:, iu, ju]
        idx = xp.argsort(-xp.abs(U), axis=1)[:, :min(self.k, U.shape[1])]
        return {"values": xp.take_along_axis(U, idx, 1), "index": idx.astype(xp.int32)}


@dataclass(frozen=True)
class RandK(_UpperEntries):
    """k random upper-triangular entries scaled by (#entries / k): unbiased, so use alpha = k / #entries."""

    k: int

    def encode(self, xp, M, rng):
        iu, ju = _upper(M.shape[1])
        U = M[:, iu, ju]
        k = min(self.k, U.shape[1])
        idx = xp.asarray(np.stack([np.sort(rng.choice(U.shape[1], k, replace=False)) for _ in range(M.shape[0])]))
        return {"values": xp.take_along_axis(U, idx, 1) * (U.shape[1] / k), "index": idx.astype(xp.int32)}


@dataclass(frozen=True)
class RankR:
    """Best rank-r approximation: the r eigenpairs of largest |eigenvalue| (contractive)."""

    r: int

    def encode(self, xp, M, rng):
        lam, V = xp.linalg.eigh(M)
        idx = xp.argsort(-xp.abs(lam), axis=1)[:, :min(self.r, M.shape[1])]
        return {"eigvals": xp.take_along_axis(lam, idx, 1), "eigvecs": xp.take_along_axis(V, idx[:, None, :], 2)}

    def decode(self, xp, msg, d):
        V, lam = msg["eigvecs"], msg["eigvals"]
        M = (V * lam[:, None, :]) @ xp.swapaxes(V, 1, 2)
        return 0.5 * (M + xp.swapaxes(M, 1, 2))


def make_compressor(name: str, k: int | None = None, rank: int | None = None):
    if name == "identity":
        return Identity()
    if name in ("topk", "randk"):
        if not k or k < 1:
            raise ValueError(f"compressor {name!r} needs k >= 1")
        return TopK(k) if name == "topk" else RandK(k)
    if name == "rankr":
        if not rank or rank < 1:
            raise ValueError("compressor 'rankr' needs rank >= 1")
        return RankR(rank)
    raise ValueError(f"unknown compressor {name!r}; choose identity, topk, randk or rankr")
