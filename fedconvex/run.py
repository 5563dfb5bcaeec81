"""The one round loop: samples clients, drives an algorithm, counts bytes, records metrics.

Algorithms never loop over rounds, log or count; this module does, for every method alike.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from .algorithms.base import RoundInfo
from .backend import namespace, nbytes, to_numpy
from .messages import client_problem, keep
from .screening import log as server_log

COLUMNS = ("round", "f_gap", "dist", "grad_norm", "bytes_up", "bytes_down", "seconds", "rejected")


class Diverged(ArithmeticError):
    """The iterates left the finite numbers (learning rate too large, usually)."""


def message_bytes(msg: dict) -> int:
    total = 0
    for v in msg.values():
        if isinstance(v, (tuple, list)):
            total += sum(nbytes(a) for a in v)
        else:
            total += nbytes(v)
    return total


def sample_clients(rng, n_clients: int, participants: int | None) -> np.ndarray:
    if participants is None or participants >= n_clients:
        return np.arange(n_clients)
    if participants < 1:
        raise ValueError(f"participants must be >= 1, got {participants}")
    return np.sort(rng.choice(n_clients, participants, replace=False))


def _scatter(clients: dict, sel, new: dict, n: int) -> dict:
    if len(sel) == n:
        return dict(new)
    out = {}
    for k, v in clients.items():
        v = v.copy()
        v[sel] = new[k]
        out[k] = v
    return out


def metrics(problem, theta, theta_star, f_star) -> dict:
    f, g = problem.value_and_gradient(theta)
    return {"f_gap": abs(f - f_star) if f_star is not None else math.nan,
            "dist": float(np.linalg.norm(to_numpy(theta - theta_star))) if theta_star is not None else math.nan,
            "grad_norm": float(np.linalg.norm(to_numpy(g)))}


def blas_single_thread():
    """Per-client work is many small BLAS/LAPACK calls; OpenBLAS's thread hand-offs cost more
    than they gain there (measured on w8a: 2.5 s -> 1.1 s for 10 FedPM rounds on 2 cores)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def run(problem, algorithm, theta0, rounds: int, **kwargs):
    """Run ``rounds`` rounds; see ``_run`` (this wrapper pins BLAS to one thread on NumPy)."""
    # overflow on the way to divergence is reported once, as Diverged, not as NumPy warnings
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if problem.xp is np:
            with blas_single_thread():
                return _run(problem, algorithm, theta0, rounds, **kwargs)
        return _run(problem, algorithm, theta0, rounds, **kwargs)


def _magnitude_outliers(up: dict, rows: list, max_ratio: float) -> dict:
    """{position in ``rows``: reason} for replies whose preconditioner trace or parameter norm exceeds
    ``max_ratio`` x the round's lower median (fedconvex.screening's magnitude guard)."""
    from .blocks import ActiveBlocks
    from .screening import magnitude_rejections

    checks = []
    P = up.get("P")
    if isinstance(P, ActiveBlocks):
        checks.append(("preconditioner trace", [float(np.trace(to_numpy(P.blocks[k]).astype(np.float64)))
                                                + P.shift * P.d for k in rows]))
    if "theta" in up:
        checks.append(("parameter norm", [float(np.linalg.norm(to_numpy(up["theta"][k]).astype(np.float64)))
                                          for k in rows]))
    return magnitude_rejections(checks, max_ratio)


def screen_message(up: dict, info: RoundInfo, d: int, round_: int, tamper=None, label: str = "the method",
                   max_ratio: float | None = None):
    """Reject unusable client parts of a stacked message (logged, naming the client); with
    ``max_ratio`` also replies whose preconditioner trace or parameter norm is an outlier.

    Returns (message, info) restricted to the usable clients with renormalised weights, and the
    rejected client ids; the message is re-stacked only when something was rejected."""
    if tamper is not None:  # fault injection for tests: tamper(round, up) -> up
        up = tamper(round_, up)
    rejected, rows, reasons = [], [], []
    for k, client in enumerate(info.sel):
        problem = client_problem(up, k, d)
        if problem is None:
            rows.append(k)
        else:
            rejected.append(int(client))
            reasons.append(problem)
    if max_ratio and len(rows) > 1:
        outliers = _magnitude_outliers(up, rows, max_ratio)
        for pos in sorted(outliers):
            rejected.append(int(info.sel[rows[pos]]))
            reasons.append(outliers[pos])
        rows = [k for pos, k in enumerate(rows) if pos not in outliers]
    if not rejected:
        return up, info, rejected
    if not rows and all("NaN or Inf" in r for r in reasons):
        # in the simulator every client runs our own code: all of them blowing up is divergence
        raise Diverged(f"{label} diverged at round {round_}: every client returned non-finite values "
                       "(learning rate too large)")
    for client, problem in zip(rejected, reasons):
        server_log.warning("round %d: client %d rejected: %s", round_, client, problem)
    if not rows:
        return None, info, rejected
    w = info.weights[namespace(info.weights).asarray(rows)]
    return keep(up, rows), RoundInfo(sel=info.sel[rows], weights=w / w.sum(), n_clients=info.n_clients), rejected


def _run(problem, algorithm, theta0, rounds: int, *, participants: int | None = None, seed: int = 0,
         theta_star=None, f_star=None, stop=None, on_round=None, tamper=None, screen: bool = True,
         max_ratio: float | None = None):
    """Run ``rounds`` rounds; returns (final state, list of per-round metric dicts, round 0 first).

    ``screen`` (default on) rejects unusable client replies before the server step (see
    fedconvex.screening); ``tamper(round, up) -> up`` injects faults for tests; ``max_ratio`` R turns
    on the magnitude guard (off by default, as in the paper's runs).  ``stop(row) -> bool`` ends the run early (the tuner uses it); ``on_round(t)`` is called
    after each round (progress bars).  Raises ``Diverged`` when the iterate is not finite.
    bytes_up / bytes_down are per participating client and cumulative; ``seconds`` is the
    cumulative wall time of the rounds themselves (metric evaluation excluded).
    """
    rng = np.random.default_rng(seed)
    xp = problem.xp
    state = algorithm.init(problem, theta0)
    history = [{"round": 0, **metrics(problem, state.theta, theta_star, f_star),
                "bytes_up": 0, "bytes_down": 0, "seconds": 0.0, "rejected": 0}]
    up_total = down_total = 0
    seconds = 0.0
    for t in range(1, rounds + 1):
        start = time.perf_counter()
        sel = sample_clients(rng, problem.n_clients, participants)
        down = algorithm.broadcast(state)
        cstate = {k: v[sel] if len(sel) < problem.n_clients else v for k, v in state.clients.items()}
        up, cstate = algorithm.client_update(problem, down, cstate, sel, rng)
        w = problem.client_weights[xp.asarray(sel)] if len(sel) < problem.n_clients else problem.client_weights
        info = RoundInfo(sel=sel, weights=w / w.sum(), n_clients=problem.n_clients)
        state = replace(state, clients=_scatter(state.clients, sel, cstate, problem.n_clients))
        sent = up
        rejected = []
        if hasattr(algorithm, "receive"):   # decode compressed payloads before screening (fedconvex.codecs)
            up, state = algorithm.receive(problem, state, up, info)
        if screen or tamper is not None:
            up, info, rejected = screen_message(up, info, problem.d, t, tamper,
                                                label=f"{algorithm.label} (lr={algorithm.lr:g})", max_ratio=max_ratio)
        if up is not None:
            state = algorithm.server_update(problem, state, up, info)
        else:  # nobody usable: the round is skipped and the model kept
            server_log.warning("round %d: no usable client reply, round skipped, model unchanged", t)
            state = replace(state, round=state.round + 1)
        if xp is not np and hasattr(xp, "cuda"):
            xp.cuda.Stream.null.synchronize()  # count GPU work in the round's time
        seconds += time.perf_counter() - start
        up_total += message_bytes(sent) // len(sel)
        down_total += message_bytes(down)
        if not bool(xp.all(xp.isfinite(state.theta))):
            raise Diverged(f"{algorithm.label} diverged at round {t} (lr={algorithm.lr:g}): parameters are not finite")
        row = {"round": t, **metrics(problem, state.theta, theta_star, f_star),
               "bytes_up": up_total, "bytes_down": down_total, "seconds": seconds, "rejected": len(rejected)}
        history.append(row)
        if on_round is not None:
            on_round(t)
        if stop is not None and stop(row):
            break
    return state, history
