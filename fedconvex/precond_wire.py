"""FedPM's preconditioners on the wire in fedconvex: encoding on the clients, decoding on the server.

With a codec (``FedPM(precond_codec=...)``, see fedconvex.codecs) a client sends, per participant,
its parameters, its active feature indices and the codec's payload of its Hessian block B_c
(P_c = E_c B_c E_c^T + lam I: the damping lam is never sent, both sides add it).

Lossless codecs (``sym``) keep FedPM's client step untouched and only change the framing, so
the mixed model is bit-identical to the uncompressed one.  For a lossy codec the client takes
its last local Newton step with the *decoded* block B~_c, the very matrix the server mixes with:

    theta_c = theta_c' - lr (B~_c + lam I)^{-1} g_c,   theta = (sum w_c P~_c)^{-1} sum w_c P~_c theta_c,

so with K = 1 the round is theta - lr P~^{-1} g (an inexact Newton step with the exact gradient,
fixed point theta*).  Mixing with P~ after steps taken with P would move the fixed point.

The server decodes every payload *before* screening (``receive``); a payload that does not decode
becomes a rejection of that client (``DecodeProblems``), never an exception.  The ``delta``
codec's estimates A_hat_c live in ``State.clients['precond_hat']`` (client side) and
``State.server['precond_hat']`` (server side), both object arrays over the N clients.

They advance on acknowledged rounds only (fedconvex.codecs: ``resync``).  ``receive`` decodes into
``State.server['precond_hat_pending']``; ``commit`` -- called by ``FedPM.server_update``, i.e. after
screening, with the kept clients -- moves the kept clients' pending estimates to ``precond_hat``.
Every participant is acknowledged with the digest of what the server holds for it after the round
(``receive`` writes the digest of the unchanged estimate, ``commit`` that of the new one for the kept
clients) in ``State.clients['precond_ack']``: the simulator's stand-in for the 8 bytes the server
returns to that client (not counted in ``bytes_down``).  The client keeps the estimate of its last upload in
``State.clients['precond_hat_pending']`` and resolves it against the acknowledgement at its next
participation (``client_update``; ``client_estimate`` for inspection).  A round skipped because no reply
was usable commits nothing; its participants read their acknowledgement as a rejection.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .backend import nbytes
from .blocks import ActiveBlocks
from .codecs import NO_ESTIMATE, CodecError, DecodeProblems, digest, parse, payload_nbytes, resync
from .local import newton_steps

HAT = "precond_hat"
PENDING = "precond_hat_pending"
ACK = "precond_ack"


@dataclass(frozen=True, eq=False)
class EncodedBlocks:
    """Per participant: the codec payload of its block and its active feature indices."""

    payloads: tuple
    active: tuple
    d: int

    def __len__(self):
        return len(self.payloads)

    @property
    def nbytes(self) -> int:
        return sum(payload_nbytes(p) + nbytes(a) for p, a in zip(self.payloads, self.active, strict=False))

    def take(self, idx) -> EncodedBlocks:
        return EncodedBlocks(tuple(self.payloads[i] for i in idx), tuple(self.active[i] for i in idx), self.d)


def _empty_hats(n):
    return np.empty(n, dtype=object)


def init_state(alg, problem, state):
    """Add the delta codec's (empty) estimates and acknowledgements to an initial state."""
    codec = parse(alg.precond_codec)
    if codec is None or not codec.stateful:
        return state
    n = problem.n_clients
    acks = _empty_hats(n)
    acks[:] = NO_ESTIMATE
    return replace(
        state,
        server={**state.server, HAT: _empty_hats(n), PENDING: _empty_hats(n)},
        clients={**state.clients, HAT: _empty_hats(n), PENDING: _empty_hats(n), ACK: acks},
    )


def client_estimate(clients: dict, c: int):
    """Client ``c``'s estimate after it has read its last acknowledgement (what its next delta is
    relative to): ``clients`` is ``State.clients``."""
    return resync(clients[HAT][c], clients[PENDING][c], clients[ACK][c])


def commit(alg, state, info):
    """Server side, after screening: the kept clients' (``info.sel``) pending estimates become the
    server's, and every kept client is acknowledged with their digest.  Rejected clients keep the
    server's previous estimate and the acknowledgement ``receive`` gave them.  No-op for stateless codecs."""
    codec = parse(getattr(alg, "precond_codec", "none"))
    if codec is None or not codec.stateful or PENDING not in state.server:
        return state
    hats, pending, acks = state.server[HAT].copy(), state.server[PENDING].copy(), state.clients[ACK].copy()
    for c in np.asarray(info.sel).tolist():
        hats[c] = pending[c]
        pending[c] = None
        acks[c] = digest(hats[c])
    return replace(state, server={**state.server, HAT: hats, PENDING: pending}, clients={**state.clients, ACK: acks})


def client_update(alg, problem, down, cstate, sel, start):
    """FedPM's client step with the codec; returns (message, new client state)."""
    codec = parse(alg.precond_codec)
    lam = problem.lam
    if codec.lossless:
        thetas, P = newton_steps(problem, start, sel, alg.lr, alg.local_steps)
        enc = EncodedBlocks(tuple(codec.encode(B) for B in P.blocks), P.active, P.d)
        return {"theta": thetas, "P": enc}, cstate
    thetas, _ = newton_steps(problem, start, sel, alg.lr, alg.local_steps - 1)
    g = problem.gradients(thetas, sel)
    H = problem.hessians(thetas, sel)
    hats = cstate.get(HAT)
    stateful = hats is not None
    committed, pending = (_empty_hats(len(sel)), _empty_hats(len(sel))) if stateful else (None, None)
    payloads, decoded = [], []
    for k, B in enumerate(H.blocks):
        # the server's verdict on the last upload decides what this delta is relative to
        prev = resync(hats[k], cstate[PENDING][k], cstate[ACK][k]) if stateful else None
        p = codec.encode(B, prev)
        est, hat = codec.decode(p, B.shape[0], prev, lam)  # exactly what the server will compute
        payloads.append(p)
        decoded.append(np.asarray(est, dtype=B.dtype))
        if stateful:
            committed[k], pending[k] = prev, hat
    Pt = ActiveBlocks(tuple(decoded), H.active, H.d, H.shift, H.flat)
    thetas = thetas - alg.lr * Pt.solve(g)
    new_cstate = dict(cstate)
    if stateful:
        new_cstate[HAT], new_cstate[PENDING] = committed, pending
    return {"theta": thetas, "P": EncodedBlocks(tuple(payloads), H.active, H.d)}, new_cstate


def receive(alg, problem, state, up, info):
    """Decode the participants' payloads (server side).  Returns (message with an ActiveBlocks 'P'
    and per-client ``DecodeProblems``, state with the participants' pending server estimates)."""
    enc = up["P"]
    if not isinstance(enc, EncodedBlocks):
        return up, state
    codec = parse(alg.precond_codec)
    hats = state.server.get(HAT)
    pending = state.server[PENDING].copy() if hats is not None else None
    blocks, active, problems = [], [], []
    like = up["theta"]
    for k, (payload, a) in enumerate(zip(enc.payloads, enc.active, strict=False)):
        client = int(info.sel[k])
        try:
            a = np.asarray(a)
            if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
                raise CodecError("feature indices are not a 1-d integer array")
            prev = hats[client] if hats is not None else None
            est, hat = codec.decode(payload, a.shape[0], prev, problem.lam)
            blocks.append(np.asarray(est, dtype=like.dtype))
            active.append(a)
            problems.append(None)
            if pending is not None:  # committed by ``commit`` only if this reply survives screening
                pending[client] = hat
        except (CodecError, ValueError, TypeError, IndexError) as exc:
            blocks.append(np.zeros((0, 0), dtype=like.dtype))
            active.append(np.zeros(0, dtype=np.int64))
            problems.append(f"undecodable preconditioner payload: {exc}")
            if pending is not None:
                pending[client] = None
    P = ActiveBlocks(tuple(blocks), tuple(active), enc.d, problem.lam)
    same_support = (
        hasattr(problem, "blocks_like_hessians")
        and all(p is None for p in problems)
        and all(
            len(a) == len(problem.active[int(c)]) and np.array_equal(a, problem.active[int(c)])
            for a, c in zip(active, info.sel, strict=False)
        )
    )
    if codec.lossless and same_support:
        # lossless: the server must mix exactly what it would have mixed uncompressed, to the last bit
        P = problem.blocks_like_hessians(blocks, info.sel)
    new_state = state
    if pending is not None:
        # every participant is acknowledged with what the server holds for it *now* (a rejection leaves
        # that unchanged); ``commit`` updates the kept ones.  Also when no reply is usable and
        # server_update never runs, the client learns where the server stands.
        acks = state.clients[ACK].copy()
        for c in np.asarray(info.sel).tolist():
            acks[c] = digest(hats[c])
        new_state = replace(state, server={**state.server, PENDING: pending}, clients={**state.clients, ACK: acks})
    return {**up, "P": P, "decode": DecodeProblems(problems)}, new_state
