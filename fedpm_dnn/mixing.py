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

import math

import numpy as np
import torch

from fedconvex.mixing import precond_mix, simple_mix

from .foof import DEFAULT_DAMPING, matrix_problem, param_name


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
        theta64 = rows.transpose(1, 2).to(torch.float64)
        if damping > 0:
            theta = precond_mix(A.to(torch.float64), theta64, w64, damping=damping)
        else:
            theta = undamped_mix(A.to(torch.float64), theta64, w64)
        theta = theta.to(W.dtype)
        weight, bias = (theta[:-1], theta[-1]) if bname is not None else (theta, None)
        out[wname] = weight.T.reshape(W.shape[1:])
        if bname is not None:
            out[bname] = bias
    for k, v in params.items():
        if k not in out:  # floats: the weighted mean in their dtype; integers (counters): rounded, dtype kept
            out[k] = simple_mix(v, w.to(v.dtype) if v.is_floating_point() else w64)
    return {k: out[k] for k in params}


def undamped_mix(A: torch.Tensor, theta: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Eq. foof_mixing at lam = 0 for (K, d, d) float64 matrices A, blocks theta (K, d, k) and weights w (K,):
    M^+ sum_i w_i A_i theta_i on the range of M = sum_i w_i A_i, and the weighted mean of the theta_i on its null
    space (directions no client's data reaches, e.g. a unit that never fires) -- the plain solve there is
    undetermined; this keeps the identities (identical clients give back their own block; a full-rank M gives
    the plain solve)."""
    M = torch.einsum("k,kij->ij", w, A)
    M = 0.5 * (M + M.T)
    b = torch.einsum("k,kij,kjc->ic", w, A, theta)
    mean = torch.einsum("k,kic->ic", w, theta)
    e, V = torch.linalg.eigh(M)
    keep = e > e.abs().max() * M.shape[0] * torch.finfo(torch.float64).eps
    Vr, er = V[:, keep], e[keep]
    return Vr @ ((Vr.T @ b) / er[:, None]) + mean - Vr @ (Vr.T @ mean)


def normalised_weights(weights, n: int) -> torch.Tensor:
    """(n,) float64 weights summing to one (uniform, the paper's 1/N, when ``weights`` is None)."""
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    try:
        w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
    except (TypeError, ValueError):
        raise ValueError(
            f"weights must be {n} finite non-negative numbers with a positive sum, got {weights!r}"
        ) from None
    if w.shape != (n,) or not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not float(w.sum()) > 0:
        raise ValueError(f"weights must be {n} finite non-negative numbers with a positive sum, got {weights!r}")
    return w / w.sum()


def _check_damping(damping) -> float:
    if isinstance(damping, bool) or not isinstance(damping, (int, float)):
        raise TypeError(f"damping must be a number >= 0 (the clients' FOOF damping), got {damping!r}")
    if not (math.isfinite(damping) and damping >= 0):
        raise ValueError(f"damping must be a finite number >= 0 (the clients' FOOF damping), got {damping!r}")
    return float(damping)


def _aliases(state: dict, prefer: set) -> dict:
    """name -> the name standing for its tensor, for entries that share storage (tied weights): a block's weight
    (a name in ``prefer``) when one of them is, else the first."""
    groups: dict = {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()), v.dtype)
        groups.setdefault(key, []).append(k)
    out = {}
    for members in groups.values():
        rep = next((k for k in members if k in prefer), members[0])
        out.update(dict.fromkeys(members, rep))
    return out


def _check_states(client_states: list, client_matrices: list) -> list:
    """The entry names of client 0, every state checked against them; a ValueError/TypeError naming the cause."""
    for i, (s, m) in enumerate(zip(client_states, client_matrices, strict=True)):
        if not isinstance(s, dict) or not all(torch.is_tensor(v) for v in s.values()):
            raise TypeError(
                f"client {i}'s state must be a dict of tensors (model.state_dict()), got {type(s).__name__}"
            )
        if not isinstance(m, dict) or not all(torch.is_tensor(v) for v in m.values()):
            raise TypeError(
                f"client {i}'s matrices must be a dict of tensors (FOOF.matrices()), got {type(m).__name__}"
            )
    names, blocks = list(client_states[0]), sorted(client_matrices[0])
    ref = client_states[0]
    for i, (s, m) in enumerate(zip(client_states, client_matrices, strict=True)):
        if set(s) != set(names):
            missing, extra = sorted(set(names) - set(s)), sorted(set(s) - set(names))
            raise ValueError(
                f"client {i}'s state lacks entries {missing} and has entries {extra} that client 0's has not"
            )
        if sorted(m) != blocks:
            raise ValueError(f"client {i}'s matrices name blocks {sorted(m)}, client 0's {blocks}")
        for k in names:
            a, b = ref[k], s[k]
            if b.device != a.device:
                raise ValueError(
                    f"client {i}'s entry {k!r} is on {b.device}, client 0's on {a.device}: move them to one device"
                )
            if b.shape != a.shape:
                raise ValueError(f"client {i}'s entry {k!r} has shape {tuple(b.shape)}, client 0's {tuple(a.shape)}")
            if b.dtype != a.dtype:
                raise ValueError(f"client {i}'s entry {k!r} has dtype {b.dtype}, client 0's {a.dtype}")
            if b.is_complex():
                raise TypeError(f"client {i}'s entry {k!r} is complex ({b.dtype}): mix takes real models")
            if b.is_floating_point() and not bool(torch.isfinite(b).all()):  # every entry is averaged into the model
                raise ValueError(f"client {i}'s entry {k!r} contains NaN or Inf")
        for b in blocks:
            if m[b].shape != client_matrices[0][b].shape or m[b].ndim != 2 or m[b].shape[0] != m[b].shape[1]:
                raise ValueError(
                    f"client {i}'s matrix {b!r} has shape {tuple(m[b].shape)}, expected square and as client 0's"
                )
            if m[b].device != client_matrices[0][b].device:
                raise ValueError(
                    f"client {i}'s matrix {b!r} is on {m[b].device}, client 0's on {client_matrices[0][b].device}"
                )
            if not m[b].is_floating_point():
                raise TypeError(f"client {i}'s matrix {b!r} has dtype {m[b].dtype}: FOOF matrices are real floats")
            problem = matrix_problem(m[b].detach().to(torch.float64))
            if problem:
                raise ValueError(f"client {i}'s matrix {b!r} {problem}")
    return names


def mix(client_states: list, client_matrices: list, weights=None, damping: float = DEFAULT_DAMPING) -> dict:
    """FedPM's server step over PyTorch state dicts (paper eq. foof_mixing).

    client_states    one ``model.state_dict()`` (or ``named_parameters`` dict) per client, same entries (in any order)
    client_matrices  one ``FOOF.matrices()`` dict (block name -> (d, d)) per client, same blocks
    weights          un-normalised mixing weights (default uniform 1/N, as the paper; sample counts as an option)
    damping          lam >= 0, the same as the clients' ``FOOF(damping=...)``; at 0 a direction no client's data
                     reaches (a singular sum of matrices) takes the weighted mean (``undamped_mix``)

    Returns the mixed state dict, in client 0's entry order: preconditioned mixing of every block with a matrix;
    the weighted mean of every other floating-point entry (BatchNorm's running mean and variance included); the
    weighted mean rounded to the nearest integer, dtype kept, of every integer entry (BatchNorm's
    num_batches_tracked).  Entries that share one tensor in client 0's state (tied weights) come back as one
    tensor: a block's mixing when one of them is a block's weight, else the mean."""
    if not isinstance(client_states, (list, tuple)) or not isinstance(client_matrices, (list, tuple)):
        raise TypeError("mix takes a list of client states and a list of client matrix dicts")
    if not client_states or len(client_states) != len(client_matrices):
        raise ValueError(
            f"mix needs one state and one matrix dict per client, got {len(client_states)} and {len(client_matrices)}"
        )
    damping = _check_damping(damping)
    names = _check_states(client_states, client_matrices)
    blocks = sorted(client_matrices[0])
    aliases = _aliases(client_states[0], {param_name(b, "weight") for b in blocks})
    own = [k for k in names if aliases[k] == k]
    stacked = {k: torch.stack([s[k].detach() for s in client_states]) for k in own}
    mats = {b: torch.stack([m[b].detach() for m in client_matrices]) for b in blocks}
    w = normalised_weights(weights, len(client_states)).to(torch.float32)
    mixed = mix_blocks(stacked, mats, w, damping)
    return {k: mixed[aliases[k]] for k in names}
