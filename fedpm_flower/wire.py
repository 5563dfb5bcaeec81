"""Messages of any fedconvex method on Flower, encoded from their structure -- no method is packed by hand.

A stacked message (``client_update``'s reply, or a problem oracle's answer) is a dict of fields, each

    an array          with a leading client axis      -> 'name'                  the client's row
    ``ActiveBlocks``  blocks on active features       -> 'name/block', 'name/active'
    ``EncodedBlocks`` a codec's payloads              -> 'name/active', 'name/code/<key>'
    a tuple           one entry per client            -> 'name'                  the client's entry

``flatten`` turns one client's part into the flat name -> array mapping an ``ArrayRecord`` carries;
``unflatten`` rebuilds that client's one-row message and checks its *structure* first: the entries
the template says, real floating-point or integer dtypes, the template's shapes, integer entries in
the range the algorithm's ``message_fields`` declares (active features always in 0..d-1, distinct),
square blocks matching their indices.  The server's template comes from its own run of the method on
a stand-in problem (``template``): it is never taken from a client.  Content (NaN/Inf, PSD, magnitude)
is the round driver's screening, after the replies are joined (``fedconvex.messages.concat``).
"""

from __future__ import annotations

import numpy as np

from fedconvex.algorithms.fednl_blocks import BlockState
from fedconvex.blocks import ActiveBlocks, Layout
from fedconvex.precond_wire import EncodedBlocks
from fedconvex.screening import dtype_problem, index_problem

SEP = "/"


def structure(up: dict) -> dict:
    """The template of a stacked message: field -> (kind, dtype kind, shape of one client's part)."""
    out = {}
    for name, v in up.items():
        if SEP in name:
            raise ValueError(f"message field {name!r}: '/' is reserved for the wire format")
        if isinstance(v, ActiveBlocks):
            out[name] = ("blocks", "f", None)
        elif isinstance(v, EncodedBlocks):
            out[name] = ("encoded", None, None)
        elif isinstance(v, (tuple, list)):
            e = np.asarray(v[0])
            out[name] = ("tuple", "f" if e.dtype.kind == "f" else "i", tuple(e.shape))  # the stand-in's shape
        elif isinstance(v, np.ndarray):
            out[name] = ("array", "f" if v.dtype.kind == "f" else "i", tuple(v.shape[1:]))
        else:
            raise TypeError(f"message field {name!r}: cannot send a {type(v).__name__}")
    return out


def flatten(up: dict, k: int = 0, block_dtype=None) -> dict:
    """Client k's part of a stacked message as flat name -> contiguous array.  ``block_dtype``: how
    ``ActiveBlocks`` travel (FedPM's --precond-dtype); the server reads them back as float64."""
    out = {}
    for name, v in up.items():
        if isinstance(v, ActiveBlocks):
            out[name + "/block"] = np.asarray(v.blocks[k], dtype=block_dtype or v.blocks[k].dtype)
            out[name + "/active"] = np.asarray(v.active[k], dtype=np.int64)
        elif isinstance(v, EncodedBlocks):
            out[name + "/active"] = np.asarray(v.active[k], dtype=np.int64)
            out.update({f"{name}/code/{key}": np.asarray(a) for key, a in v.payloads[k].items()})
        else:
            out[name] = np.asarray(v[k])
    return {key: np.ascontiguousarray(a) for key, a in out.items()}


def _bound(role, d):
    return {"features": d, "entries": d * (d + 1) // 2}.get(role)


def unflatten(arrays: dict, template: dict, d: int, shift: float, roles: dict | None = None):
    """(one-client stacked message, None) or (None, the reason the reply is malformed)."""
    roles = roles or {}
    expected, msg = set(), {}
    for name, (kind, dkind, shape) in template.items():
        if kind == "blocks":
            keys = (name + "/block", name + "/active")
        elif kind == "encoded":
            keys = (name + "/active",)
        else:
            keys = (name,)
        expected.update(keys)
        for key in keys:
            if key not in arrays:
                return None, f"missing {key!r}"
            if not isinstance(arrays[key], np.ndarray):
                return None, f"{key} is a {type(arrays[key]).__name__}, not an array"
        if kind == "blocks":
            B, a = arrays[name + "/block"], arrays[name + "/active"]
            bad = index_problem(a, f"{name}: feature indices", d, distinct=True) or (
                f"{name}: block {dtype_problem(B)}" if dtype_problem(B) else None
            )
            if bad:
                return None, bad
            if B.shape != (len(a), len(a)):
                return None, f"{name}: block of shape {B.shape} for {len(a)} features"
            msg[name] = ActiveBlocks((B.astype(np.float64),), (a,), d, shift)
        elif kind == "encoded":
            a = arrays[name + "/active"]
            bad = index_problem(a, f"{name}: feature indices", d, distinct=True)
            if bad:
                return None, bad
            prefix = name + "/code/"
            payload = {key[len(prefix) :]: v for key, v in arrays.items() if key.startswith(prefix)}
            expected.update(prefix + key for key in payload)  # the codec's decode checks the payload itself
            msg[name] = EncodedBlocks((payload,), (a,), d)
        else:
            a = arrays[name]
            if dkind == "f":
                bad = dtype_problem(a)
                bad = f"{name} {bad}" if bad else None
            elif roles.get(name) in ("features", "entries"):
                bad = index_problem(a, name, _bound(roles[name], d))
            else:  # integer data without a declared range (e.g. Natural's bit codes): its dtype only
                bad = dtype_problem(a, "iu")
                bad = f"{name} {bad}" if bad else None
            if bad:
                return None, bad
            if kind == "array" and shape == () and a.shape == (1,):
                a = a.reshape(())  # Flower's Array carries a scalar as shape (1,)
            if kind == "array" and a.shape != shape:
                return None, f"{name} has shape {a.shape}, expected {shape}"
            if kind == "tuple" and a.ndim != len(shape):
                return None, f"{name} has {a.ndim} dimensions, expected {len(shape)}"
            msg[name] = (a,) if kind == "tuple" else a[None]
    extra = sorted(set(arrays) - expected)
    if extra:
        return None, f"unexpected entry {extra[0]!r}"
    return msg, _tied(msg, template, roles)


def _tied(msg, template, roles):
    """Per-client entries sized by the client's active features (FedNS's S_i A_i rows, FedNL's blocks)
    must match its feature indices: the dimensions that the stand-in's entry had equal to its number of
    active features (all of them) must here equal the client's number."""
    feats = [n for n, (kind, _, _) in template.items() if kind == "tuple" and roles.get(n) == "features"]
    if not feats:
        return None
    n_stand, n = template[feats[0]][2][0], len(msg[feats[0]][0])
    for name, (kind, dkind, shape) in template.items():
        if kind == "tuple" and dkind == "f":
            got = msg[name][0].shape
            for i, s in enumerate(shape):
                if s == n_stand and got[i] != n:
                    return f"{name} has shape {got} for {n} features"
    return None


# ------------------------------------------------------------------ per-client state in Context.state
def state_row(cstate: dict) -> tuple[dict, dict]:
    """A node's one-row client state as (arrays, kinds) for its Context: arrays keep their row; object
    rows (the delta codec's estimates, None before the first participation) their array, or nothing
    when None; FedNL's packed block estimates (``BlockState``) their numbers and feature indices."""
    arrays, kinds = {}, {}
    for key, v in cstate.items():
        if isinstance(v, BlockState):
            kinds[key] = f"blocks:{v.d}:{v.shift!r}"
            arrays[key] = np.ascontiguousarray(v.packed)
            arrays[key + "/active"] = np.asarray(v.active[0], dtype=np.int64)
        elif isinstance(v, np.ndarray) and v.dtype == object and isinstance(v[0], str):
            kinds[key] = "str:" + v[0]  # e.g. the delta codec's acknowledgement digest
        elif isinstance(v, np.ndarray) and v.dtype == object:
            kinds[key] = "none" if v[0] is None else "object"
            if v[0] is not None:
                arrays[key] = np.ascontiguousarray(v[0])
        elif isinstance(v, np.ndarray):
            kinds[key] = "array"
            arrays[key] = np.ascontiguousarray(v[0])
        else:
            raise TypeError(f"client state {key!r}: cannot keep a {type(v).__name__} in a node's Context")
    return arrays, kinds


def state_from_row(arrays: dict, kinds: dict) -> dict:
    out = {}
    for key, kind in kinds.items():
        if kind == "array":
            out[key] = arrays[key][None]
        elif kind.startswith("blocks:"):
            _, d, shift = kind.split(":")
            a, d = arrays[key + "/active"], int(d)
            layout = Layout([len(a)], [(a[:, None] * d + a[None, :]).reshape(-1)], d)
            out[key] = BlockState(np.array(arrays[key]), layout, [a], d, float(shift))
        else:
            row = np.empty(1, dtype=object)
            row[0] = arrays[key] if kind == "object" else kind[4:] if kind.startswith("str:") else None
            out[key] = row
    return out
