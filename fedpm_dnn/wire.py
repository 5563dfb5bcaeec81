"""FedPM's FOOF matrices on the wire (``FedPM.precond_codec``, codecs in fedconvex.codecs).

The client encodes each block's matrix A (reply['foof'][block] becomes the codec's payload, a
dict of tensors, which is what the byte count sees); the server decodes every reply *before*
screening, so screening and ``aggregate`` see plain (d, d) matrices and a payload that does not
decode is a logged rejection of that client.  The FOOF damping is never sent: the decoded
matrices get the same PSD repair as the clients' own factorisation (negative eigenvalues to 0
when A + damping I has no Cholesky factor) and ``precond_mix`` adds the damping, as without a codec.

The ``delta`` codec keeps A_hat per block on the client (``cs['foof_hat']``) and per client and
block on the server (``State.server['foof_hat']``, saved in checkpoints with the rest of the state).
Local steps keep using the client's exact matrices.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from fedconvex.codecs import CodecError, DecodeProblems, parse


def encode_foof(alg, cs: dict, A: dict) -> dict:
    """block -> payload for the client's matrices ``A``; updates the client's delta estimates in ``cs``."""
    codec = parse(alg.precond_codec)
    hats = cs.setdefault("foof_hat", {}) if codec.stateful else None
    out = {}
    for name, M in A.items():
        M = M.float()
        prev = hats.get(name) if hats is not None else None
        out[name] = codec.encode(M, prev)
        if hats is not None:   # the client's estimate moves exactly as the server's will
            hats[name] = codec.decode(out[name], M.shape[0], prev, alg.damping)[1]
    return out


def receive(alg, task, state, up: dict, info):
    """Decode the participants' payloads (server side, before screening).  Returns (message whose 'foof'
    holds plain (K, d, d) stacks and whose 'decode' names the clients whose payload did not decode --
    screening rejects those --, state with the server's updated delta estimates)."""
    from .algorithms.fedpm import block_sizes

    codec = parse(alg.precond_codec)
    hats = {c: dict(h) for c, h in state.server.get("foof_hat", {}).items()} if codec.stateful else None
    sizes = block_sizes(task.blocks)
    payloads = up.get("foof")
    mats, problems = {name: [] for name in sizes}, []
    for k, client in enumerate(info.sel):
        client = int(client)
        try:
            if not isinstance(payloads, dict) or set(payloads) != set(sizes):
                raise CodecError(f"expected payloads for blocks {sorted(sizes)}")
            decoded, new_hats = {}, {}
            prev_hats = hats.get(client, {}) if hats is not None else {}
            for name, d in sizes.items():
                decoded[name], new_hats[name] = codec.decode(payloads[name][k], d, prev_hats.get(name), alg.damping)
            for name, est in decoded.items():
                mats[name].append(est)
            problems.append(None)
            if hats is not None:
                hats[client] = new_hats
        except (CodecError, ValueError, TypeError, IndexError, AttributeError, RuntimeError, KeyError) as exc:
            for name, d in sizes.items():   # a placeholder row; screening rejects the client
                mats[name].append(torch.zeros(d, d))
            problems.append(f"undecodable preconditioner payload: {exc}")
    foof = {}
    for name, rows in mats.items():
        dtype = next((m.dtype for m, p in zip(rows, problems) if p is None), torch.float32)
        foof[name] = torch.stack([m.to(dtype) for m in rows])
    new_state = state if hats is None else replace(state, server={**state.server, "foof_hat": hats})
    return {**up, "foof": foof, "decode": DecodeProblems(problems)}, new_state
