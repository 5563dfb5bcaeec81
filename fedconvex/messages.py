"""Per-client views of the stacked messages of one round, for screening (fedconvex.screening).

Messages in the simulator are stacked over the participants; screening looks at each client's
part, and only when a reply is rejected is the message re-stacked from the remaining ones.
"""

from __future__ import annotations

import numpy as np

from .backend import namespace, to_numpy
from .blocks import ActiveBlocks
from .codecs import DecodeProblems
from .screening import index_problem, psd_problem


def _certified_psd(v: ActiveBlocks) -> bool:
    """True when the stack is exactly symmetric and finite by construction and every B_c + shift I has
    been Cholesky-factorised already (the client step's factorisation, see ``ActiveBlocks.solve``):
    then each preconditioner P_c = E_c B_c E_c^T + shift I is positive definite, which is more than the
    screening's test asks, and factorising it again would only repeat that work.  Any stack built
    elsewhere (e.g. tampered with) carries no certificate and is factorised here."""
    cert = v.certificate
    return bool(
        cert.get("symmetric")
        and cert.get("finite")
        and cert.get("pd_shift") is not None
        and cert["pd_shift"] <= v.shift
    )


def _items(up: dict):
    """(name, value) over a message, nested dicts flattened to 'outer[inner]' (DNN messages hold a dict
    of tensors per field; the name is the one fedconvex.screening.reply_problem gives the same entry)."""
    for key, v in up.items():
        if isinstance(v, dict):
            for sub, a in v.items():
                yield key, f"{key}[{sub}]", a
        else:
            yield key, key, v


def all_usable(up: dict, n: int, d: int | None, psd_keys=()) -> bool:
    """True only if ``client_problem`` is None for every one of the n participants, checked a whole stack at a
    time (NumPy arrays stacked over the clients, certified ``ActiveBlocks``, decode reports); False whenever
    that cannot be decided so cheaply -- the caller then looks at each client (the reasons come from there)."""
    for field, _key, v in _items(up):
        if isinstance(v, DecodeProblems):
            if any(p is not None for p in v):
                return False
        elif isinstance(v, ActiveBlocks):
            if len(v) != n or v.packed is None or not _certified_psd(v):
                return False
            active = [a for a in v.active if isinstance(a, np.ndarray) and a.ndim == 1]
            if len(active) != n or any(
                tuple(B.shape) != (a.shape[0], a.shape[0]) for B, a in zip(v.blocks, active, strict=False)
            ):
                return False
            if d is not None:
                nonempty = [a for a in active if a.shape[0]]
                if nonempty:
                    cat = np.concatenate(nonempty)
                    if int(cat.min()) < 0 or int(cat.max()) >= d:
                        return False
            if not all(a.shape[0] < 2 or bool((np.diff(a) > 0).all()) for a in active):
                return False  # not increasing: perhaps a repeated feature, which client_problem names
        elif field not in psd_keys and isinstance(v, (tuple, list)) and len(v) == n:
            # per-client arrays of different shapes (e.g. FedNS's sketched roots and feature indices): the
            # per-client test below is their finiteness, checked here array by array
            if not all(isinstance(a, np.ndarray) and a.dtype.kind in "biuf" and bool(np.isfinite(a).all()) for a in v):
                return False
        elif field in psd_keys or not isinstance(v, np.ndarray) or v.ndim < 1 or v.shape[0] != n:
            return False
        elif not bool(np.isfinite(v).all()):
            return False
    return True


def client_problem(up: dict, k: int, d: int | None, psd_keys=()) -> str | None:
    """None if participant k's part of ``up`` is usable, else the reason.  Fields named in ``psd_keys``
    hold stacks of matrices that must be symmetric PSD (an ``ActiveBlocks`` stack always must)."""
    for field, key, v in _items(up):
        if isinstance(v, DecodeProblems):  # payloads the server could not decode (fedconvex.codecs)
            if v[k] is not None:
                return v[k]
            continue
        if isinstance(v, ActiveBlocks):
            B, a = v.blocks[k], v.active[k]
            bad = index_problem(a, f"{key}: feature indices", d, distinct=True)  # as Flower's wire checks
            if bad:
                return bad
            if tuple(B.shape) != (a.shape[0], a.shape[0]):
                return f"{key}: block of shape {tuple(B.shape)} for {a.shape[0]} features"
            if _certified_psd(v):
                continue  # the stack's own factorisation already proved it
            problem = psd_problem(B, shift=v.shift)  # P_c = B + shift I must be PSD; also reports NaN / Inf
            if problem:
                return f"preconditioner {key} {problem}"
        elif field in psd_keys:
            problem = psd_problem(v[k])  # also reports NaN / Inf
            if problem:
                return f"preconditioner {key} {problem}"
        else:
            a = v[k]
            xp = namespace(a)
            if not bool(xp.all(xp.isfinite(a))):
                return f"{key} contains NaN or Inf"
    return None


def _f64(a):
    xp = namespace(a)
    return a.to(xp.float64) if xp.__name__ == "torch" else xp.asarray(a, dtype=xp.float64)


def preconditioner_trace(v, k: int) -> float:
    """Trace of participant k's preconditioner(s) in field value ``v`` (a stack, a dict of stacks, or
    ``ActiveBlocks`` whose matrices are B_k + shift I)."""
    if isinstance(v, ActiveBlocks):
        return float(np.trace(to_numpy(v.blocks[k]).astype(np.float64))) + v.shift * v.d
    if isinstance(v, dict):
        return sum(preconditioner_trace(a, k) for a in v.values())
    xp = namespace(v)
    return float(xp.sum(xp.diagonal(_f64(v[k]))))


def model_norm(v, k: int) -> float:
    """Euclidean norm of participant k's part of field value ``v`` (an array stack or a dict of them)."""
    if isinstance(v, dict):
        return float(np.sqrt(sum(model_norm(a, k) ** 2 for a in v.values())))
    xp = namespace(v)
    return float(xp.sqrt(xp.sum(_f64(v[k]) ** 2)))


def concat(msgs: list) -> dict:
    """One stacked message from stacked messages over disjoint clients, in order: the inverse of splitting
    a message with ``keep`` (used where clients reply one at a time: Flower, per-client random streams).
    Structure follows the first message: arrays are concatenated along the client axis; ``ActiveBlocks``,
    encoded payloads and tuples are joined.  Producer certificates are dropped (nothing is certified
    about a stack assembled from parts), so screening checks every block itself."""
    from .algorithms.fednl_blocks import BlockState
    from .blocks import Layout
    from .precond_wire import EncodedBlocks

    out = {}
    for key, v in msgs[0].items():
        vs = [m[key] for m in msgs]
        if isinstance(v, dict):
            out[key] = concat(vs)
        elif isinstance(v, BlockState):  # FedNL's per-client estimates on the active blocks
            active = [a for x in vs for a in x.active]
            layout = Layout([len(a) for a in active], [f for x in vs for f in x.layout.flat], v.d)
            out[key] = BlockState(np.concatenate([x.packed for x in vs]), layout, active, v.d, v.shift)
        elif isinstance(v, ActiveBlocks):
            flat = tuple(f for x in vs for f in x.flat) if all(x.flat is not None for x in vs) else None
            out[key] = ActiveBlocks(
                tuple(b for x in vs for b in x.blocks), tuple(a for x in vs for a in x.active), v.d, v.shift, flat
            )
        elif isinstance(v, EncodedBlocks):
            out[key] = EncodedBlocks(
                tuple(p for x in vs for p in x.payloads), tuple(a for x in vs for a in x.active), v.d
            )
        elif isinstance(v, DecodeProblems):
            out[key] = DecodeProblems(tuple(p for x in vs for p in x))
        elif isinstance(v, (tuple, list)):
            out[key] = type(v)(e for x in vs for e in x)
        else:
            xp = namespace(v)
            out[key] = xp.cat(vs) if xp.__name__ == "torch" else xp.concatenate(vs)
    return out


def keep(up: dict, rows) -> dict:
    """The message restricted to the participants at positions ``rows``."""
    out = {}
    for key, v in up.items():
        if isinstance(v, dict):
            out[key] = keep(v, rows)
        elif isinstance(v, ActiveBlocks):
            out[key] = v.take(rows)
        elif isinstance(v, (tuple, list)):
            out[key] = type(v)(v[r] for r in rows)
        else:
            xp = namespace(v)
            out[key] = v[xp.asarray(rows)] if xp.__name__ != "torch" else v[rows]
    return out
