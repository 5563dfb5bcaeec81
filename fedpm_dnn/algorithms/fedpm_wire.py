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

The estimates advance on acknowledged rounds only (fedconvex.codecs: ``resync``).  The client keeps the
estimate its upload leads to in ``cs['foof_hat_pending']``; ``receive`` decodes into
``State.server['foof_hat_pending']`` and acknowledges every participant with the digest of what the
server holds for it (``cs['foof_ack']``: the simulator's stand-in for 8 bytes to that client, not
counted in ``bytes_down``); ``commit`` -- called by ``FedPM.server_update``, i.e. after screening, with
the kept clients -- makes their pending estimates the server's and acknowledges them again.  The client
resolves pending / committed / full resend against its acknowledgement before its next upload
(``encode_foof``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fedconvex.codecs import CodecError, DecodeProblems, digest, parse, resync

from ..foof import block_sizes

PENDING = "foof_hat_pending"


def encode_foof(alg, cs: dict, A: dict) -> dict:
    """block -> payload for the client's matrices ``A``; for the delta codec first resolves the client's
    estimate against the server's last acknowledgement, then keeps the new one as pending in ``cs``."""
    codec = parse(alg.precond_codec)
    hats = None
    if codec.stateful:
        hats = client_estimate(cs)
        cs["foof_hat"], pending = hats, {}
    out = {}
    for name, M in A.items():
        M = M.float()
        prev = hats.get(name) if hats is not None else None
        out[name] = codec.encode(M, prev)
        if hats is not None:  # what the server's estimate becomes if it accepts this reply
            pending[name] = codec.decode(out[name], M.shape[0], prev, alg.damping)[1]
    if hats is not None:
        cs[PENDING] = pending
    return out


def client_estimate(cs: dict) -> dict:
    """The client's delta estimates (block -> matrix; {} for none) after reading its acknowledgement."""
    return resync(cs.get("foof_hat") or None, cs.get(PENDING) or None, cs.get("foof_ack")) or {}


def _acknowledge(clients: list, hats: dict, who) -> list:
    out = list(clients)
    for c in who:
        out[c] = {**out[c], "foof_ack": digest(hats.get(c))}
    return out


def commit(alg, state, info):
    """Server side, after screening: the kept clients' (``info.sel``) pending estimates become the
    server's and those clients are acknowledged with their digest; rejected clients keep the server's
    previous estimate and the acknowledgement ``receive`` gave them.  No-op for stateless codecs."""
    codec = parse(getattr(alg, "precond_codec", "none"))
    if codec is None or not codec.stateful:
        return state
    hats, pending = dict(state.server.get("foof_hat", {})), dict(state.server.get(PENDING, {}))
    kept = [int(c) for c in info.sel]
    for c in kept:
        hats[c] = pending.pop(c)
    return replace(
        state,
        server={**state.server, "foof_hat": hats, PENDING: pending},
        clients=_acknowledge(state.clients, hats, kept),
    )


def receive(alg, task, state, up: dict, info):
    """Decode the participants' payloads (server side, before screening).  Returns (message whose 'foof'
    holds plain (K, d, d) stacks and whose 'decode' names the clients whose payload did not decode --
    screening rejects those --, state with the server's updated delta estimates)."""
    codec = parse(alg.precond_codec)
    hats = state.server.get("foof_hat", {}) if codec.stateful else None
    pending = {} if codec.stateful else None
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
            if pending is not None:  # committed by ``commit`` only if this reply survives screening
                pending[client] = new_hats
        except (CodecError, ValueError, TypeError, IndexError, AttributeError, RuntimeError, KeyError) as exc:
            for name, d in sizes.items():  # a placeholder row; screening rejects the client
                mats[name].append(torch.zeros(d, d))
            problems.append(f"undecodable preconditioner payload: {exc}")
    foof = {}
    for name, rows in mats.items():
        dtype = next((m.dtype for m, p in zip(rows, problems, strict=False) if p is None), torch.float32)
        foof[name] = torch.stack([m.to(dtype) for m in rows])
    new_state = state
    if pending is not None:
        # every participant learns what the server holds for it now (a rejection leaves that unchanged;
        # ``commit`` updates the kept ones), also when no reply is usable and server_update never runs
        new_state = replace(
            state,
            server={**state.server, PENDING: pending},
            clients=_acknowledge(state.clients, hats, [int(c) for c in info.sel]),
        )
    return {**up, "foof": foof, "decode": DecodeProblems(problems)}, new_state
