"""Checkpoints that run no code and resume only the run that wrote them.

* Loading uses ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain
  containers (dict, list, str, int, float, bool, None) only, so a crafted file cannot execute
  code; anything else is refused.
* Every checkpoint stores a *fingerprint* of what shapes the run (model, method and its
  hyper-parameters, seed, participants, number of clients, a hash of every client's data and of
  the test set, and whatever the caller adds in ``Experiment.meta["fingerprint"]`` -- the CLI adds
  its flags: dataset, split, alpha, subsets, ...).  Resuming with any difference is refused with
  the first differing entry named.  The number of rounds is not part of it: a finished run may be
  extended.  A caller's entry that a checkpoint holds and the caller no longer records is passed over: the
  command line now records its hyper-parameters and client counts resolved, in the entries above, where older
  checkpoints also hold the flags as given.
* A truncated, corrupted or structurally wrong file is one ``CheckpointError`` naming the file.
* The FOOF matrices the clients keep (and the delta codec's estimates) are stored as their upper triangles, in
  the dtype they are kept in: they are exactly symmetric (``foof.StatsAccumulator`` averages with the transpose),
  so loading mirrors them back bit for bit, in half the bytes.  A matrix that is not exactly symmetric is stored
  whole.
* Where a client's matrices can be remade bit for bit (the vectorized engine checks this once: ``foof_at``), and
  the parameters they were taken at are smaller than their triangles (a SimpleCNN client: 248 KB against 848 KB),
  the checkpoint holds those parameters, the shape of the pass that took them and a SHA-256 digest of the matrices
  instead (``compact_client``); resuming remakes them and compares the digest.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict

import numpy as np
import torch

from fedconvex.files import written_atomically

FORMAT = 2
ENGINE_ADVICE = "resume with --engine {}"  # what first_difference advises when only the engine differs


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the message names the file and why."""


def _tensor_digest(h, t: torch.Tensor) -> None:
    a = t.detach().to("cpu").contiguous().numpy()
    h.update(f"{a.dtype}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes())


def data_hash(clients, x_test=None, y_test=None) -> str:
    """SHA-256 of every client's images and labels (in client order) and of the test set."""
    h = hashlib.sha256()
    for c in clients:
        _tensor_digest(h, c.x)
        _tensor_digest(h, c.y)
    for t in (x_test, y_test):
        if t is not None:
            _tensor_digest(h, t)
    return h.hexdigest()


def fingerprint(exp) -> dict:
    """Flat dict of everything that shapes the run of ``exp`` (values are plain JSON-like types)."""
    fp = {f"run.{k}": v for k, v in (exp.meta or {}).get("fingerprint", {}).items()}
    fp.update(
        {
            "model": exp.model,
            "num_classes": int(exp.num_classes),
            "in_channels": int(exp.in_channels),
            "image_size": int(exp.image_size),
            "seed": int(exp.seed),
            "n_clients": len(exp.clients),
            "participants": None if exp.participants is None else int(exp.participants),
            "client_sizes": [len(c) for c in exp.clients],
            "engine": exp.engine,  # the resolved one (--engine auto)
            "data_hash": data_hash(exp.clients, exp.x_test, exp.y_test),
        }
    )
    if exp.gn_groups != 2:  # recorded only off its default, so checkpoints from before the flag still resume
        fp["gn_groups"] = int(exp.gn_groups)
    fp["config.name"] = exp.cfg.name
    fp.update({f"config.{k}": v for k, v in asdict(exp.cfg).items()})
    return fp


def _show(key: str) -> str:
    if key == "run.lr_schedule":  # resolved from two flags, milestones as rounds of --rounds
        return "learning-rate schedule (--lr-warmup-rounds, --lr-milestones as rounds of --rounds)"
    if key.startswith("run."):
        return "--" + key[4:].replace("_", "-")
    if key.startswith("config."):
        return key[7:].replace("_", " ")
    return {
        "data_hash": "the data (partition, subsets or files)",
        "client_sizes": "client sizes",
        "n_clients": "number of clients",
    }.get(key, key.replace("_", " "))


def first_difference(saved: dict, now: dict) -> str | None:
    """'<what>: checkpoint has X, this run Y' for the first differing entry, or None."""
    if "engine" not in saved and "run.engine" in saved:  # a checkpoint from before the resolved engine was kept
        saved = {**{k: v for k, v in saved.items() if k != "run.engine"}, "engine": saved["run.engine"]}
    if "config.damping" in saved and "config.foof_apply" not in saved:  # written before --foof-apply: solves
        saved = {**saved, "config.foof_apply": "solve"}
    if saved.get("run.split_seed") is not None and saved.get("run.split_seed") == saved.get("seed"):
        saved = {**saved, "run.split_seed": None}  # spelled out as the --seed it defaults to: recorded so since
    if "config.foof_precision" in now and "config.foof_precision" not in saved:  # before --foof-precision: float32
        saved = {**saved, "config.foof_precision": "fp32"}
    if "config.foof_state_dtype" in now and "config.foof_state_dtype" not in saved:  # before the option: float64
        saved = {**saved, "config.foof_state_dtype": "float64"}
    if "config.last_batch" in now and "config.last_batch" not in saved:  # before the option: every batch kept
        saved = {**saved, "config.last_batch": "keep"}
    # a flag added since the checkpoint was written, and not given now, is the same run as before it existed
    saved = {**{k: None for k, v in now.items() if k.startswith("run.") and v is None and k not in saved}, **saved}
    order = list(now) + [k for k in saved if k not in now]
    for key in order:
        if key.startswith("run.") and key not in saved and now[key] is None:
            continue  # a flag added since the checkpoint was written, not given now: the run it wrote
        if key.startswith("run.") and key not in now:
            continue  # recorded as the flag was given; now compared resolved, in the run's own entries
        a, b = saved.get(key, "(absent)"), now.get(key, "(absent)")
        if a != b:
            if key == "data_hash":
                return f"{_show(key)} differ"
            if key == "engine":
                return f"engine: checkpoint has {a!r}, this run {b!r} ({ENGINE_ADVICE.format(a)})"
            return f"{_show(key)}: checkpoint has {a!r}, this run {b!r}"
    return None


PACKED = "symmetric_upper"  # the key of a packed matrix: {PACKED: its upper triangle row by row, "size": n}
PACKED_KEYS = ("foof", "foof_static")  # the client-state entries holding FOOF matrices


def pack_symmetric(m):
    """A square, exactly symmetric tensor as {PACKED: upper triangle, "size": n}; anything else as it is."""
    if not (isinstance(m, torch.Tensor) and m.dim() == 2 and m.shape[0] == m.shape[1] > 1 and m.is_floating_point()):
        return m
    if not bool(torch.equal(m, m.mT)):
        return m
    i, j = torch.triu_indices(m.shape[0], m.shape[0], device=m.device)
    return {PACKED: m[i, j].clone(), "size": int(m.shape[0])}


def unpack_symmetric(v):
    """``pack_symmetric``'s inverse (exact); anything else as it is."""
    if not (isinstance(v, dict) and set(v) == {PACKED, "size"}):
        return v
    upper, n = v[PACKED], v["size"]
    if not (isinstance(upper, torch.Tensor) and isinstance(n, int) and n > 1 and upper.shape == (n * (n + 1) // 2,)):
        raise ValueError("a packed symmetric matrix whose triangle does not match its size")
    m = upper.new_empty(n, n)
    i, j = torch.triu_indices(n, n, device=upper.device)
    m[i, j] = upper
    m[j, i] = upper
    return m


def _map_matrices(payload: dict, fn) -> dict:
    """``payload`` with ``fn`` applied to every FOOF matrix of its client states and server estimates."""
    out = dict(payload)
    if isinstance(payload.get("clients"), list):
        out["clients"] = [
            {
                k: {b: fn(m) for b, m in v.items()} if k in PACKED_KEYS and isinstance(v, dict) else v
                for k, v in c.items()
            }
            if isinstance(c, dict)
            else c
            for c in payload["clients"]
        ]
    server = payload.get("server")
    if isinstance(server, dict) and isinstance(server.get("foof_hat"), dict):
        hats = {
            c: {b: fn(m) for b, m in h.items()} if isinstance(h, dict) else h for c, h in server["foof_hat"].items()
        }
        out["server"] = {**server, "foof_hat": hats}
    return out


ORIGIN_KEYS = ("foof_at", "foof_made")  # a client's parameters its kept matrices were taken at, and the pass's shape
DIGEST = "foof_digest"  # in a compact client state, the SHA-256 of the kept matrices it stands for


def matrices_digest(mats: dict) -> str:
    """SHA-256 of a client's kept FOOF matrices (block names in order, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name in sorted(mats):
        h.update(name.encode())
        _tensor_digest(h, mats[name])
    return h.hexdigest()


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def compact_client(cs: dict) -> dict:
    """A client state as a checkpoint holds it: where its kept matrices can be remade from ``foof_at`` and those
    parameters take fewer bytes than the matrices' triangles, the parameters, the pass's shape and the matrices'
    digest instead of the matrices; else the matrices, without the parameters."""
    if DIGEST in cs and "foof" not in cs:  # resumed compact and not remade since (it has not trained again)
        return cs
    if not all(k in cs for k in ("foof", *ORIGIN_KEYS)):
        return {k: v for k, v in cs.items() if k not in ORIGIN_KEYS}
    triangles = sum(m.shape[0] * (m.shape[0] + 1) // 2 * m.element_size() for m in cs["foof"].values())
    if _nbytes(cs["foof_at"]) >= triangles:
        return {k: v for k, v in cs.items() if k not in ORIGIN_KEYS}
    return {**{k: v for k, v in cs.items() if k != "foof"}, DIGEST: matrices_digest(cs["foof"])}


def save(path: str, payload: dict) -> None:
    """Write atomically (a kill leaves the previous checkpoint or the new one, never half of one; a full disk or a
    Ctrl-C, which torch's zip writer reports as its own RuntimeError, is raised as itself: replaced_atomically)."""
    payload = _map_matrices(payload, pack_symmetric)
    with written_atomically(path, "wb") as fh:  # into a held --out only while it stands (fedconvex.files)
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())


def load(path: str, map_location=None) -> dict:
    """The checkpoint's contents, loaded without running code; CheckpointError if unusable."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a folder, not a checkpoint file; move it away or choose another --out")
    try:
        ck = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated, corrupted, foreign, or holding arbitrary objects
        text = str(exc)
        if "weights_only" in text or "Unsupported global" in text or "GLOBAL" in text:
            why = "it holds objects other than tensors and plain containers; refused, since loading it could run code"
        else:
            why = f"truncated or corrupted ({type(exc).__name__})"
        raise CheckpointError(f"{path}: not a usable checkpoint: {why}; remove it or choose another --out") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT or not isinstance(ck.get("fingerprint"), dict):
        raise CheckpointError(
            f"{path}: not a checkpoint of this version (no fingerprint); remove it or choose another --out"
        )
    try:
        return _map_matrices(ck, unpack_symmetric)
    except ValueError as exc:
        raise CheckpointError(f"{path}: damaged checkpoint ({exc}); remove it or choose another --out") from None


def stored(path: str, exp) -> tuple[int, str | None]:
    """What the checkpoint at ``path`` holds, for a run of ``exp`` not asked to resume it: the rounds it has done,
    and the first difference between its run and ``exp`` (None: it is this run); CheckpointError if unusable."""
    ck = load(path, map_location="cpu")
    if not isinstance(ck.get("history"), list):
        raise CheckpointError(f"{path}: damaged checkpoint (no history); remove it or choose another --out")
    return len(ck["history"]), first_difference(ck["fingerprint"], fingerprint(exp))


def check_structure(path: str, ck: dict, fresh_state: dict, n_clients: int) -> None:
    """The loaded state must look like the one this run would build (names, shapes, dtypes)."""

    def bad(why):
        return CheckpointError(f"{path}: damaged checkpoint ({why}); remove it or choose another --out")

    for key in ("server", "clients", "history", "np_rng"):
        if key not in ck:
            raise bad(f"no {key!r} entry")
    server = ck["server"]
    if not isinstance(server, dict) or set(server) != set(fresh_state):
        raise bad("server state entries differ")
    hats = server.get("foof_hat", {})  # the delta codec's estimates (fedpm_dnn.algorithms.fedpm_wire)
    if not isinstance(hats, dict) or not all(
        isinstance(c, int)
        and 0 <= c < n_clients
        and isinstance(h, dict)
        and all(isinstance(m, torch.Tensor) for m in h.values())
        for c, h in hats.items()
    ):
        raise bad("delta-codec estimates are not {client: {block: tensor}}")
    why = _params_problem(server.get("params"), fresh_state["params"])
    if why:
        raise bad(why)
    if (
        not isinstance(ck["clients"], list)
        or len(ck["clients"]) != n_clients
        or not all(isinstance(c, dict) for c in ck["clients"])
    ):
        raise bad(f"client states are not {n_clients} dicts")
    for i, c in enumerate(ck["clients"]):
        why = _origin_problem(c, fresh_state["params"])
        if why:
            raise bad(f"client {i}: {why}")
    hist = ck["history"]
    if not isinstance(hist, list) or not all(
        isinstance(r, dict) and r.get("round") == i + 1 for i, r in enumerate(hist)
    ):
        raise bad("history is not rounds 1, 2, ...")
    if server.get("round") != len(hist):
        raise bad(f"server round {server.get('round')!r} but {len(hist)} history rows")
    rng = ck["np_rng"]
    if not isinstance(rng, dict) or not isinstance(rng.get("state"), dict):
        raise bad("no random generator state")


def _params_problem(params, fresh: dict, whose: str = "") -> str | None:
    """What keeps ``params`` from being the model's parameters ``fresh`` (names in order, dtypes, shapes), or None."""
    if not isinstance(params, dict) or list(params) != list(fresh):
        return f"{whose}parameter names differ"
    for k, v in fresh.items():
        p = params[k]
        if not isinstance(p, torch.Tensor) or p.shape != v.shape or p.dtype != v.dtype:
            return f"{whose}parameter {k} is not a {v.dtype} tensor of shape {tuple(v.shape)}"
    return None


def _origin_problem(c: dict, params: dict) -> str | None:
    """What is wrong with a compact client state's stand-in for its matrices (``compact_client``), or None."""
    if DIGEST not in c and not any(k in c for k in ORIGIN_KEYS):
        return None
    if DIGEST not in c or "foof" in c or not all(k in c for k in ORIGIN_KEYS):
        return f"a compact state needs {DIGEST}, foof_at and foof_made and no foof"
    digest, at, made = c[DIGEST], c["foof_at"], c["foof_made"]
    if not (isinstance(digest, str) and len(digest) == 64 and all(ch in "0123456789abcdef" for ch in digest)):
        return f"{DIGEST} is not a SHA-256 digest"
    why = _params_problem(at, params, "foof_at's ")
    if why:
        return why
    if not all(bool(torch.isfinite(v).all()) for v in at.values()):
        return "foof_at's parameters are not all finite"
    if not (
        isinstance(made, dict)
        and set(made) == {"clients", "rows"}
        and all(type(v) is int and 1 <= v <= bound for v, bound in ((made["clients"], 2**12), (made["rows"], 10**7)))
    ):
        return "foof_made is not {'clients': 1 to 4096, 'rows': 1 to 10**7}"
    return None
