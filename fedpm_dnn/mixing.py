"""FedPM's server mixing of PyTorch models (paper eq. foof_mixing), shared by the FedPM method, the public
``mix`` over state dicts and the Flower strategy.

Per FOOF block (a Linear or Conv2d layer named ``b``, weight ``b.weight`` (d_out, ...) and optional
``b.bias``): Theta_i = [W_i b_i]^T of shape (d, d_out) and

    Theta = precond_mix(A_stack, Theta_stack, w, damping=lam)   (fedconvex.mixing, in float64)

-- the same damping lam as the clients' local steps, so that identical clients give back their own
model.  Every other floating-point entry is simply averaged (``simple_mix``).  A block is recognised
from its matrix alone: its side d is the weight's columns, plus one when the block has a bias.
"""

from __future__ import annotations

import numpy as np
import torch

from fedconvex.mixing import precond_mix, simple_mix

from .foof import DEFAULT_DAMPING, param_name


def block_entries(block: str, side: int, entries: dict, stacked: bool = True) -> tuple:
    """(weight name, bias name or None) of the block whose FOOF matrix has side ``side``, among the model's
    ``entries`` (name -> tensor; with ``stacked`` a leading client axis); a ValueError names what does not fit."""
    wname, bname = param_name(block, "weight"), param_name(block, "bias")
    if wname not in entries:
        raise ValueError(f"FOOF matrix {block!r} names no layer: the model has no entry {wname!r}")
    cols = int(np.prod(tuple(entries[wname].shape[2 if stacked else 1 :])))
    if side not in (cols, cols + 1):
        raise ValueError(f"FOOF matrix {block!r} is {side}x{side}, expected {cols} or {cols + 1} for {wname!r}")
    if side == cols + 1 and bname not in entries:
        raise ValueError(f"FOOF matrix {block!r} has a bias row but the model has no entry {bname!r}")
    return wname, (bname if side == cols + 1 else None)


def mix_blocks(params: dict, matrices: dict, w: torch.Tensor, damping: float) -> dict:
    """The mixed model from stacked client entries ``params`` (name -> (K, ...)) and their FOOF matrices
    ``matrices`` (block -> (K, d, d)), normalised weights ``w`` (K,): preconditioned mixing per block,
    ``simple_mix`` for the other floating-point entries, in the entries' order and dtypes."""
    out = {}
    w64 = w.to(torch.float64)
    for block, A in matrices.items():
        wname, bname = block_entries(block, A.shape[-1], params)
        W = params[wname]
        K, d_out = W.shape[:2]
        rows = W.reshape(K, d_out, -1)
        if bname is not None:
            rows = torch.cat([rows, params[bname][:, :, None]], 2)
        theta = precond_mix(A.to(torch.float64), rows.transpose(1, 2).to(torch.float64), w64, damping=damping)
        theta = theta.to(W.dtype)
        weight, bias = (theta[:-1], theta[-1]) if bname is not None else (theta, None)
        out[wname] = weight.T.reshape(W.shape[1:])
        if bname is not None:
            out[bname] = bias
    for k, v in params.items():
        if k not in out:
            out[k] = simple_mix(v, w.to(v.dtype)) if v.is_floating_point() else v[0]
    return {k: out[k] for k in params}


def normalised_weights(weights, n: int) -> torch.Tensor:
    """(n,) float64 weights summing to one (uniform, the paper's 1/N, when ``weights`` is None)."""
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
    if w.shape != (n,) or not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not float(w.sum()) > 0:
        raise ValueError(f"weights must be {n} finite non-negative numbers with a positive sum, got {weights!r}")
    return w / w.sum()


def mix(client_states: list, client_matrices: list, weights=None, damping: float = DEFAULT_DAMPING) -> dict:
    """FedPM's server step over PyTorch state dicts (paper eq. foof_mixing).

    client_states    one ``model.state_dict()`` (or ``named_parameters`` dict) per client, same entries
    client_matrices  one ``FOOF.matrices()`` dict (block name -> (d, d)) per client, same blocks
    weights          un-normalised mixing weights (default uniform 1/N, as the paper; sample counts as an option)
    damping          lam, the same as the clients' ``FOOF(damping=...)``

    Returns the mixed state dict: preconditioned mixing of every block with a matrix, the plain weighted mean
    of every other floating-point entry, and integer entries (counters) taken from the first client."""
    if not client_states or len(client_states) != len(client_matrices):
        raise ValueError(
            f"mix needs one state and one matrix dict per client, got {len(client_states)} and {len(client_matrices)}"
        )
    names, blocks = list(client_states[0]), list(client_matrices[0])
    for i, (s, m) in enumerate(zip(client_states, client_matrices, strict=True)):
        if list(s) != names:
            raise ValueError(f"client {i}'s state has entries {sorted(s)}, client 0's {sorted(names)}")
        if sorted(m) != sorted(blocks):
            raise ValueError(f"client {i}'s matrices name blocks {sorted(m)}, client 0's {sorted(blocks)}")
    try:
        stacked = {k: torch.stack([s[k].detach() for s in client_states]) for k in names}
        mats = {b: torch.stack([m[b].detach() for m in client_matrices]) for b in blocks}
    except RuntimeError as exc:
        raise ValueError(f"client entries differ in shape: {exc}") from None
    w = normalised_weights(weights, len(client_states)).to(torch.float32)
    return mix_blocks(stacked, mats, w, damping)
