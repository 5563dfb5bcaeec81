"""FedPM's FOOF matrices on the wire (``MethodConfig.precond_codec``, codecs in fedconvex.codecs).

The client encodes each block's matrix A (reply['foof'][block] becomes the codec's payload, a
dict of tensors, which is what the byte count sees); the server decodes every reply *before*
screening, so screening and ``aggregate`` see plain (d, d) matrices and a payload that does not
decode is a logged rejection of that client.  The FOOF damping is never sent: the decoded
matrices get the same PSD repair as the clients' own factorisation (negative eigenvalues to 0
when A + damping I has no Cholesky factor) and ``precond_mix`` adds the damping, as without a codec.

The ``delta`` codec keeps A_hat per block on the client (``cs['foof_hat']``) and per client and
block on the server (``state['foof_hat']``, saved in checkpoints with the rest of the state).
Local steps keep using the client's exact matrices.
"""
from __future__ import annotations

import logging

from fedconvex.codecs import CodecError, parse

log = logging.getLogger("fedpm.server")


def encode_foof(cfg, cs: dict, A: dict) -> dict:
    """block -> payload for the client's matrices ``A``; updates the client's delta estimates in ``cs``."""
    codec = parse(cfg.precond_codec)
    hats = cs.setdefault("foof_hat", {}) if codec.stateful else None
    out = {}
    for name, M in A.items():
        M = M.float()
        prev = hats.get(name) if hats is not None else None
        out[name] = codec.encode(M, prev)
        if hats is not None:   # the client's estimate moves exactly as the server's will
            hats[name] = codec.decode(out[name], M.shape[0], prev, cfg.damping)[1]
    return out


def decode_replies(cfg, state: dict, replies: list, clients, shapes: dict, round_=None):
    """Decode the payloads of ``replies`` (from ``clients``).  Returns (replies with plain matrices,
    None for a reply that does not decode; the rejected (client, reason) pairs; the new server state)."""
    codec = parse(cfg.precond_codec)
    hats = {c: dict(h) for c, h in state.get("foof_hat", {}).items()} if codec.stateful else None
    out, rejected = [], []
    for reply, client in zip(replies, clients):
        client = int(client)
        try:
            payloads = reply.get("foof") if isinstance(reply, dict) else None
            if not isinstance(payloads, dict) or set(payloads) != set(shapes["foof"]):
                raise CodecError(f"expected payloads for blocks {sorted(shapes['foof'])}")
            mats, new_hats = {}, {}
            prev_hats = hats.get(client, {}) if hats is not None else {}
            for name, (d, _) in shapes["foof"].items():
                est, hat = codec.decode(payloads[name], d, prev_hats.get(name), cfg.damping)
                mats[name] = est
                new_hats[name] = hat
            out.append({**reply, "foof": mats})
            if hats is not None:
                hats[client] = new_hats
        except (CodecError, ValueError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
            reason = f"undecodable preconditioner payload: {exc}"
            log.warning("%sclient %s rejected: %s", f"round {round_}: " if round_ is not None else "", client, reason)
            out.append(None)
            rejected.append((client, reason))
    new_state = state if hats is None else {**state, "foof_hat": hats}
    return out, rejected, new_state
