"""Logistic regression on Flower, any registered fedconvex method: what a SuperNode runs on its partition
and what the ServerApp knows of the problem.

A SuperNode holds a one-client ``FederatedLogReg`` of its partition and runs the method's
``client_update`` on it, with its per-client state (SCAFFOLD's c_i, FedNL's H_i, the delta codec's
estimates) kept between rounds by the caller (the node's ``Context.state``).  The ServerApp holds no
data: ``ServerView`` gives the method the dimension, lam, the client weights and, for the methods whose
server needs client quantities (FedNL's H^0, FedNL-LS's line search, the centralized references), the
client oracles, answered by the nodes (``ask``).
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import scipy.sparse as sp

from fedconvex.algorithms import applicable, make_algorithm
from fedconvex.algorithms.base import RoundInfo
from fedconvex.codecs import parse as parse_codec
from fedconvex.data import load_dataset, sequential_split
from fedconvex.driver import client_rng, gather
from fedconvex.problem import FederatedLogReg
from fedconvex.run import blas_single_thread

from . import wire

ORACLES = ("values", "gradients", "hessians")  # what a node answers besides training: nothing else
_LOCAL = {}


def hyperparameters(cfg) -> dict:
    """The method's hyper-parameters: the shared settings it has, then ``cfg.params`` (JSON) on top."""
    shared = applicable(cfg.method, {"lr": cfg.lr, "local_steps": cfg.local_steps, "precond_codec": cfg.precond_codec})
    extra = json.loads(cfg.params) if cfg.params else {}
    if not isinstance(extra, dict):
        raise ValueError(f"params {cfg.params!r}: expected a JSON object of hyper-parameters")
    return {**shared, **extra}


def algorithm(cfg):
    codec = parse_codec(cfg.precond_codec)
    if codec is not None and cfg.precond_dtype != "float64":
        raise ValueError(
            f"precond codec {cfg.precond_codec!r} with precond_dtype {cfg.precond_dtype}: a codec "
            "sets its own precision; use precond_dtype float64"
        )
    return make_algorithm(cfg.method, **hyperparameters(cfg))


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


def theta0(d: int) -> np.ndarray:
    return np.zeros(d)


def init_client_state(cfg, partition: int, theta) -> dict:
    """The node's own rows of the method's initial per-client state (e.g. FedNL's H_i^0 at x^0)."""
    with blas_single_thread():
        return algorithm(cfg).init(local_problem(cfg, partition), theta).clients


def client_reply(cfg, partition: int, down: dict, cstate: dict, round_: int):
    """One client's ``client_update``: (its one-row stacked reply, its new state rows)."""
    alg = algorithm(cfg)
    with blas_single_thread():
        return alg.client_update(
            local_problem(cfg, partition), down, cstate, np.array([0]), client_rng(cfg.seed, round_, partition)
        )


def client_oracle(cfg, partition: int, oracle: str, theta) -> dict:
    """A node's answer to an oracle query at ``theta``, as a one-row message {'value': ...}."""
    if oracle not in ORACLES:
        raise ValueError(f"unknown oracle {oracle!r}")
    problem = local_problem(cfg, partition)
    with blas_single_thread():
        return {"value": getattr(problem, oracle)(np.asarray(theta, dtype=np.float64)[None], np.array([0]))}


# ------------------------------------------------------------------------------------- server side
def stand_in(d: int, lam: float) -> FederatedLogReg:
    """Two samples touching every feature: a problem of the true dimension on which the server learns
    the structure of the method's messages (``wire.structure``) without any client data."""
    rows = 2 if d != 2 else 3  # never as many samples as features: sample-sized dimensions stay apart
    X = np.vstack([np.ones(d)] + [np.linspace(-1.0, 1.0, d) * (k + 1) for k in range(rows - 1)])
    return FederatedLogReg(sp.csr_matrix(X), np.array([1.0, -1.0, 1.0][:rows]), [np.arange(rows)], lam=lam)


def templates(alg, d: int, lam: float) -> dict:
    """Wire templates of the method's reply ('train') and of every oracle's answer, and 'server_keys': the
    per-client state entries the server's own steps write (the delta codec's acknowledgements), which
    the server keeps and sends each client with its next 'train' message -- found by one round on the
    stand-in, so that no method has to be named."""
    p = stand_in(d, lam)
    with blas_single_thread():
        state = alg.init(p, theta0(d))
        up, new = alg.client_update(
            p, alg.broadcast(state), gather(state.clients, [0], 1), np.array([0]), np.random.default_rng(0)
        )
        out = {"train": wire.structure(up)}
        before = {**state.clients, **new}
        after = replace(state, clients=before)
        info = RoundInfo(sel=np.array([0]), weights=np.ones(1), n_clients=1)
        if hasattr(alg, "receive"):
            up, after = alg.receive(p, after, up, info)
        after = alg.server_update(p, after, up, info)
        out["server_keys"] = sorted(k for k in before if after.clients.get(k) is not before[k])
        for oracle in ORACLES:
            out[oracle] = wire.structure({"value": getattr(p, oracle)(theta0(d)[None], np.array([0]))})
    return out


def client_weights(cfg, counts) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    return counts / counts.sum() if cfg.weighting == "samples" else np.full(len(counts), 1.0 / len(counts))


class ServerView:
    """The problem as the ServerApp sees it.  ``ask(oracle, thetas, sel)`` returns the stacked answers of
    the clients ``sel`` at their rows of ``thetas`` (Flower: a query round to the nodes)."""

    xp = np

    def __init__(self, d: int, lam: float, weights, ask):
        self.d, self.lam = int(d), float(lam)
        self.client_weights = self.client_weights_host = np.asarray(weights, dtype=np.float64)
        self.n_clients = len(self.client_weights)
        self._ask = ask

    def _oracle(self, oracle, thetas, sel):
        sel = np.arange(self.n_clients) if sel is None else np.asarray(sel)
        return self._ask(oracle, np.asarray(thetas), sel)

    def values(self, thetas, sel=None):
        return self._oracle("values", thetas, sel)

    def gradients(self, thetas, sel=None):
        return self._oracle("gradients", thetas, sel)

    def hessians(self, thetas, sel=None):
        return self._oracle("hessians", thetas, sel)

    def _stack(self, theta):
        return np.broadcast_to(theta[None, :], (self.n_clients, self.d)) * 1.0

    def value(self, theta) -> float:
        return float((self.client_weights * self.values(self._stack(theta))).sum())

    def gradient(self, theta):
        return (self.client_weights[:, None] * self.gradients(self._stack(theta))).sum(0)

    def hessian(self, theta):
        H = self.hessians(self._stack(theta)).weighted_sum(self.client_weights)
        return 0.5 * (H + H.T)


def server_problem(cfg):
    """(d, client sample counts) of the run: read from the data file's shape and the split, not from the
    clients (a client could claim any number of samples to weigh more)."""
    ds = load_dataset(cfg.dataset)
    return ds.d, [len(p) for p in split(cfg, ds.n)]
