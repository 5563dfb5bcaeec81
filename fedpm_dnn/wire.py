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

The estimates advance on acknowledged rounds only (fedconvex.codecs: ``resync``): the client keeps
the estimate its upload leads to in ``cs['foof_hat_pending']``; the server decodes into pending
estimates (``decode_replies``) and ``commit``s those of the clients it keeps after screening;
``acknowledge`` hands every participant the digest of what the server now holds for it
(``cs['foof_ack']``, 8 bytes, not counted in ``bytes_down``), and the client resolves pending /
committed / full resend against it at its next upload (``encode_foof``).
"""
from __future__ import annotations

import logging

from fedconvex.codecs import CodecError, digest, parse, resync

log = logging.getLogger("fedpm.server")


def encode_foof(cfg, cs: dict, A: dict) -> dict:
    """block -> payload for the client's matrices ``A``; for the delta codec first resolves the client's
    estimate against the server's last acknowledgement, then keeps the new one as pending in ``cs``."""
    codec = parse(cfg.precond_codec)
    hats = None
    if codec.stateful:
        hats = client_estimate(cs)
        cs["foof_hat"], pending = hats, {}
    out = {}
    for name, M in A.items():
        M = M.float()
        prev = hats.get(name) if hats is not None else None
        out[name] = codec.encode(M, prev)
        if hats is not None:   # what the server's estimate becomes if it accepts this reply
            pending[name] = codec.decode(out[name], M.shape[0], prev, cfg.damping)[1]
    if hats is not None:
        cs["foof_hat_pending"] = pending
    return out


def client_estimate(cs: dict) -> dict:
    """The client's delta estimates (block -> matrix; {} for none) after reading its acknowledgement."""
    return resync(cs.get("foof_hat") or None, cs.get("foof_hat_pending") or None, cs.get("foof_ack")) or {}


def acknowledge(cfg, state: dict, client_state: list, clients) -> None:
    """Server -> each participant of the round: the digest of the estimates the server now holds for it
    (delta codec only; the simulator writes it into the client's state)."""
    if cfg.name != "fedpm" or cfg.precond_codec == "none" or not parse(cfg.precond_codec).stateful:
        return
    hats = state.get("foof_hat", {})
    for c in clients:
        client_state[int(c)]["foof_ack"] = digest(hats.get(int(c)))


def commit(state: dict, pending, kept_clients) -> dict:
    """The server state with the pending estimates of ``kept_clients`` (those that passed screening)
    committed; ``pending`` from ``decode_replies`` (None for stateless codecs)."""
    if pending is None:
        return state
    hats = dict(state.get("foof_hat", {}))
    for c in kept_clients:
        hats[int(c)] = pending[int(c)]
    return {**state, "foof_hat": hats}


def decode_replies(cfg, state: dict, replies: list, clients, shapes: dict, round_=None):
    """Decode the payloads of ``replies`` (from ``clients``).  Returns (replies with plain matrices,
    None for a reply that does not decode; the rejected (client, reason) pairs; the server state,
    unchanged; the delta codec's pending estimates {client: {block: matrix}} of the decoded replies,
    None for stateless codecs -- ``commit`` them for the clients that survive screening)."""
    codec = parse(cfg.precond_codec)
    hats = state.get("foof_hat", {}) if codec.stateful else None
    pending = {} if codec.stateful else None
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
            if pending is not None:
                pending[client] = new_hats
        except (CodecError, ValueError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
            reason = f"undecodable preconditioner payload: {exc}"
            log.warning("%sclient %s rejected: %s", f"round {round_}: " if round_ is not None else "", client, reason)
            out.append(None)
            rejected.append((client, reason))
    return out, rejected, state, pending
