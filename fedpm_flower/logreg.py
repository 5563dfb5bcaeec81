"""Logistic regression on Flower: the fedconvex algorithms, split into what a SuperNode runs and
what the ServerApp runs.  The client runs ``client_update`` on a one-client problem holding its
partition; the server screens the replies and calls the same ``server_update`` (FedPM: precond_mix)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np

from fedconvex.algorithms import applicable, make_algorithm
from fedconvex.algorithms.base import RoundInfo
from fedconvex.blocks import ActiveBlocks
from fedconvex.codecs import CodecError, parse as parse_codec
from fedconvex.data import load_dataset, sequential_split
from fedconvex.problem import FederatedLogReg
from fedconvex.run import blas_single_thread
from fedconvex.screening import dtype_problem, id_problems, magnitude_rejections, psd_problem, reply_problem

log = logging.getLogger("fedpm.server")
METHODS = ("fedpm", "localnewton", "fedavg")
_LOCAL = {}


def algorithm(cfg):
    if cfg.method not in METHODS:
        raise ValueError(f"method {cfg.method!r} is not available on Flower; choose {', '.join(METHODS)}")
    codec = parse_codec(cfg.precond_codec)
    if codec is not None and (codec.stateful or cfg.precond_dtype != "float64"):
        raise ValueError(f"precond codec {cfg.precond_codec!r} on Flower: only stateless codecs (sym, fp16, bf16, "
                         "lowrank:R) with precond_dtype float64")
    return make_algorithm(cfg.method, **applicable(cfg.method, {"lr": cfg.lr, "local_steps": cfg.local_steps,
                                                           "precond_codec": cfg.precond_codec}))


def split(cfg, n_rows):
    return sequential_split(n_rows, cfg.clients)


def local_problem(cfg, partition: int) -> FederatedLogReg:
    """The partition a SuperNode holds: rows [p M, (p+1) M) of the file (cached per process)."""
    key = (cfg.dataset, cfg.clients, partition, cfg.lam)
    if key not in _LOCAL:
        ds = load_dataset(cfg.dataset)
        part = split(cfg, ds.n)[partition]
        _LOCAL[key] = FederatedLogReg(ds.X, ds.y, [part], lam=cfg.lam)
    return _LOCAL[key]


def client_train(cfg, partition: int, theta: np.ndarray, round_: int) -> dict:
    """One client's update; returns the arrays it sends."""
    problem = local_problem(cfg, partition)
    alg = algorithm(cfg)
    rng = np.random.default_rng([cfg.seed, round_, partition])
    with blas_single_thread():
        up, _ = alg.client_update(problem, {"theta": theta}, {}, np.array([0]), rng)
    out = {"theta": np.ascontiguousarray(up["theta"][0])}
    if "P" in up and hasattr(up["P"], "payloads"):    # a codec's payload (fedconvex.codecs)
        out.update({f"P_code/{k}": np.ascontiguousarray(v) for k, v in up["P"].payloads[0].items()})
        out["P_active"] = np.asarray(up["P"].active[0], dtype=np.int64)
    elif "P" in up:
        out["P_block"] = np.ascontiguousarray(up["P"].blocks[0], dtype=cfg.precond_dtype)
        out["P_active"] = np.asarray(up["P"].active[0], dtype=np.int64)
    return out


def decode_reply(cfg, reply: dict) -> dict:
    """With a codec: the reply with its payload decoded into P_block (float64), or with the reason it
    cannot be ('P_problem').  Runs before screening."""
    codec = parse_codec(cfg.precond_codec)
    if codec is None or cfg.method != "fedpm":
        return reply
    out = {k: v for k, v in reply.items() if not k.startswith("P_code/")}
    payload = {k.split("/", 1)[1]: v for k, v in reply.items() if k.startswith("P_code/")}
    try:
        a = reply.get("P_active")
        if a is None or a.ndim != 1:
            raise CodecError("missing or malformed feature indices")
        out["P_block"] = np.asarray(codec.decode(payload, len(a), None, cfg.lam)[0], dtype=np.float64)
    except (CodecError, ValueError, TypeError, IndexError) as exc:
        out["P_problem"] = f"undecodable preconditioner payload: {exc}"
    return out


def reply_issue(cfg, reply: dict, d: int) -> str | None:
    """None if a client's reply is usable, else the reason (dtype, shape, NaN/Inf, preconditioner)."""
    if not isinstance(reply, dict):
        return f"reply is a {type(reply).__name__}, not a mapping"
    problem = reply_problem(reply, {"theta": (d,)})
    if problem or cfg.method != "fedpm":
        return problem
    if "P_problem" in reply:
        return reply["P_problem"]
    if "P_block" not in reply or "P_active" not in reply:
        return "missing the preconditioner"
    B, a = reply["P_block"], reply["P_active"]
    bad = dtype_problem(B)
    if bad:
        return f"preconditioner block {bad}"
    bad = dtype_problem(a, "iu")
    if bad:
        return f"preconditioner feature indices {bad}"
    if a.ndim != 1 or (len(a) and (a.min() < 0 or a.max() >= d or len(np.unique(a)) != len(a))):
        return f"preconditioner feature indices are not distinct values in 0..{d - 1}"
    if B.shape != (len(a), len(a)):
        return f"preconditioner block has shape {B.shape} for {len(a)} features"
    problem = psd_problem(B)
    return None if problem is None else f"preconditioner {problem}"


class Server:
    """The ServerApp's state between rounds (global parameters and algorithm state)."""

    def __init__(self, cfg):
        self.cfg = cfg
        ds = load_dataset(cfg.dataset)   # only the number of features is read on the server
        self.d = ds.d
        self.alg = algorithm(cfg)
        self.stub = SimpleNamespace(xp=np, d=self.d, lam=cfg.lam, n_clients=cfg.clients,
                                    client_weights=np.full(cfg.clients, 1.0 / cfg.clients))
        self.state = self.alg.init(self.stub, np.zeros(self.d))

    @property
    def theta(self):
        return self.state.theta

    def broadcast(self) -> dict:
        return {"theta": self.theta}

    def step(self, replies: dict, round_: int) -> dict:
        """replies: partition -> arrays.  Screens, then applies the method's server update."""
        kept, rejected = [], []
        # a codec's payload is decoded first: what is screened is what would be mixed
        replies = {p: decode_reply(self.cfg, r) if isinstance(r, dict) else r for p, r in replies.items()}
        ids = sorted(replies, key=lambda p: (0, p, "") if isinstance(p, (int, np.integer)) else (1, 0, repr(p)))
        for p, bad_id in zip(ids, id_problems(ids, self.cfg.clients)):
            issue = bad_id or reply_issue(self.cfg, replies[p], self.d)
            if issue:
                rejected.append(p)
                log.warning("round %d: client %s rejected: %s", round_, p, issue)
            else:
                kept.append(p)
        if self.cfg.max_ratio and len(kept) > 1:
            checks = [("parameter norm", [float(np.linalg.norm(replies[p]["theta"])) for p in kept])]
            if self.cfg.method == "fedpm":
                checks.insert(0, ("preconditioner trace",
                                  [float(np.trace(replies[p]["P_block"].astype(np.float64))) for p in kept]))
            out = magnitude_rejections(checks, self.cfg.max_ratio)
            for pos, reason in out.items():
                rejected.append(kept[pos])
                log.warning("round %d: client %s rejected: %s", round_, kept[pos], reason)
            kept = [p for pos, p in enumerate(kept) if pos not in out]
        if not kept:
            log.warning("round %d: no usable client reply, round skipped, model unchanged", round_)
            return {"used": 0, "rejected": len(rejected)}
        up = {"theta": np.stack([replies[p]["theta"] for p in kept])}
        if self.cfg.method == "fedpm":
            up["P"] = ActiveBlocks(tuple(replies[p]["P_block"].astype(np.float64) for p in kept),
                                   tuple(replies[p]["P_active"] for p in kept), self.d, self.cfg.lam)
        info = RoundInfo(sel=np.array(kept), weights=np.full(len(kept), 1.0 / len(kept)), n_clients=self.cfg.clients)
        self.state = self.alg.server_update(self.stub, self.state, up, info)
        return {"used": len(kept), "rejected": len(rejected)}
