"""The one round driver, shared by every front-end: in-process convex (``fedconvex.run``),
in-process DNN (``fedpm_dnn.engine.simulation``) and Flower's ServerApp (``fedpm_flower.apps``).

Per round it samples the participants, broadcasts, has a *transport* run the clients, decodes and
screens the replies, weights and mixes them through the algorithm's ``server_update``, counts bytes,
checks for divergence, appends one history row, and offers the round to a checkpoint hook.  The
front-ends differ only in their transport (where ``client_update`` runs: here on a stacked problem,
on a DNN engine, or on SuperNodes) and in what ``evaluate`` measures.  Algorithms follow the protocol
of ``fedconvex.algorithms.base``; their ``message_fields`` declaration says which reply fields hold
the model and which hold PSD preconditioners, and screening follows from it.

A transport is ``transport(algorithm, down, cstate, sel, rng, round) -> Delivery``; the in-process one
is ``InProcess(problem)``.  A transport whose clients keep their own state may define
``acknowledge(used, unused)``: after screening it learns whose replies the server used, so that those
clients commit the state the server tracks and the others roll it back (as the driver does here).  Replies travel as
one *stacked* message: every field has a leading axis
over the clients that replied (``Delivery.sel``), which may be fewer than were asked (dropped
nodes, replies rejected for their structure before they could be stacked).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .algorithms.base import RoundInfo
from .backend import namespace, nbytes
from .messages import all_usable, client_problem, concat, keep, model_norm, preconditioner_trace
from .screening import log as server_log
from .screening import magnitude_rejections, max_ratio_problem


class Diverged(ArithmeticError):
    """The iterates left the finite numbers (learning rate too large, usually)."""


@dataclass
class Delivery:
    """What a transport brings back from one round's clients."""

    up: Any  # stacked message over ``sel`` (None when nobody replied)
    cstate: Any  # participants' new per-client state (None: kept by the clients themselves)
    sel: np.ndarray  # client ids that replied, in the order of ``up``'s leading axis
    rejected: list = field(default_factory=list)  # (client id, reason) rejected before stacking
    extra: dict = field(default_factory=dict)  # front-end measurements for the history row
    wire_bytes: int | None = None  # bytes of ``up`` as they travelled, when that is not its in-memory size


def client_rng(seed: int, round_: int, client: int):
    """Client ``client``'s own random stream in round ``round_``: what a Flower SuperNode draws from, and
    what ``InProcess(client_seed=seed)`` gives each client so that both runs draw the same numbers."""
    return np.random.default_rng([int(seed), int(round_), int(client)])


class InProcess:
    """Clients run here, stacked: ``algorithm.client_update(problem, ...)`` over all participants.

    By default every participant draws from the round's one generator (the paper's runs; their histories
    depend on it).  With ``client_seed`` each client runs alone with its own stream ``client_rng(client_seed,
    round, client)`` and the replies are joined (``messages.concat``): the streams a federated deployment
    has, so methods that draw random numbers (FedNS sketches, random compressors) match a Flower run."""

    def __init__(self, problem, client_seed: int | None = None):
        self.problem = problem
        self.client_seed = client_seed

    def __call__(self, algorithm, down, cstate, sel, rng, round_):
        if self.client_seed is None:
            up, cstate = algorithm.client_update(self.problem, down, cstate, sel, rng)
            return Delivery(up=up, cstate=cstate, sel=sel)
        ups, states = [], []
        for k, c in enumerate(sel):
            mine = gather(cstate, [k], len(sel)) if len(sel) > 1 else cstate
            up, new = algorithm.client_update(
                self.problem, down, mine, np.asarray([c]), client_rng(self.client_seed, round_, c)
            )
            ups.append(up)
            states.append(new)
        return Delivery(up=concat(ups), cstate=concat(states) if isinstance(cstate, dict) else cstate, sel=sel)


def message_bytes(msg) -> int:
    """Bytes of the arrays in a message (nested dicts, tuples and structured stacks with ``nbytes``)."""
    if isinstance(msg, dict):
        return sum(message_bytes(v) for v in msg.values())
    if isinstance(msg, (tuple, list)):
        return sum(message_bytes(v) for v in msg)
    return nbytes(msg)


def sample_clients(rng, n_clients: int, participants: int | None) -> np.ndarray:
    if participants is None or participants >= n_clients:
        return np.arange(n_clients)
    if participants < 1:
        raise ValueError(f"participants must be >= 1, got {participants}")
    return np.sort(rng.choice(n_clients, participants, replace=False))


def gather(clients, sel, n: int):
    """The participants' rows of the per-client state (arrays with a leading client axis, or a list)."""
    if isinstance(clients, list):
        return [clients[i] for i in sel]
    return {k: v[sel] if len(sel) < n else v for k, v in clients.items()}


def scatter(clients, sel, new, n: int):
    if new is None:
        return clients
    if isinstance(clients, list):
        out = list(clients)
        for i, s in zip(sel, new, strict=False):
            out[int(i)] = s
        return out
    if len(sel) == n:
        return dict(new)
    out = {}
    for k, v in clients.items():
        v = v.copy()
        v[sel] = new[k]
        out[k] = v
    return out


def _snapshot(clients, sel):
    """What ``_restore`` needs to undo this round's client-state update for any of ``sel``: per-client dicts
    are copied (engines rebind their entries in place); stacked arrays are replaced, not written, by the
    update, so the current stack is kept as it is."""
    if isinstance(clients, list):
        return {int(i): dict(clients[int(i)]) for i in sel}
    return clients


def _restore(clients, before, ids, keys):
    """``clients`` with the entries ``keys`` of the rows ``ids`` as they were in ``before`` (``_snapshot``)."""
    if isinstance(clients, list):
        out = list(clients)
        for i in ids:
            cs = dict(out[i])
            for k in keys:
                if k in before[i]:
                    cs[k] = before[i][k]
                else:  # created by this round (a first participation): not yet the client's
                    cs.pop(k, None)
            out[i] = cs
        return out
    idx = np.asarray(ids)
    out = dict(clients)
    for k in keys:
        if k in clients:
            v = clients[k].copy()
            v[idx] = before[k][idx]
            out[k] = v
    return out


def normalised(w):
    return w / w.sum()


def _magnitude_outliers(up: dict, fields: dict, rows: list, max_ratio: float) -> dict:
    """{position in ``rows``: reason} for replies whose preconditioner trace or model norm exceeds
    ``max_ratio`` x the round's lower median (fedconvex.screening's magnitude guard)."""
    checks = []
    psd = [k for k, role in fields.items() if role == "psd" and k in up]
    if psd:
        checks.append(("preconditioner trace", [sum(preconditioner_trace(up[k], r) for k in psd) for r in rows]))
    for role, what in (("model", "parameter norm"), ("update", "update norm")):
        keys = [k for k, r in fields.items() if r == role and k in up]
        if keys:
            checks.append((what, [math.sqrt(sum(model_norm(up[k], r) ** 2 for k in keys)) for r in rows]))
    return magnitude_rejections(checks, max_ratio)


def screen_message(
    up: dict,
    info: RoundInfo,
    d: int | None,
    round_: int,
    tamper=None,
    label: str = "the method",
    max_ratio: float | None = None,
    fields: dict | None = None,
    own_clients: bool = True,
):
    """Reject unusable client parts of a stacked message (logged, naming the client); with
    ``max_ratio`` also replies whose preconditioner trace or model norm is an outlier.
    ``fields``: the algorithm's message declaration (name -> 'model' | 'psd' | 'data').  ``own_clients``
    (the simulators): every client runs our code, so all of them non-finite is divergence; with clients
    that are not ours (Flower) it is only a round without usable replies.

    Returns (message, info) restricted to the usable clients with renormalised weights, and the
    rejected client ids; the message is re-stacked only when something was rejected."""
    if tamper is not None:  # fault injection for tests: tamper(round, up) -> up
        up = tamper(round_, up)
    fields = fields or {"theta": "model", "P": "psd"}
    psd_keys = tuple(k for k, role in fields.items() if role == "psd")
    rejected, rows, reasons = [], [], []
    if all_usable(up, len(info.sel), d, psd_keys):  # every part usable, seen a whole stack at a time
        rows = list(range(len(info.sel)))
    for k, client in enumerate(info.sel if not rows else ()):
        problem = client_problem(up, k, d, psd_keys)
        if problem is None:
            rows.append(k)
        else:
            rejected.append(int(client))
            reasons.append(problem)
    if max_ratio and len(rows) > 1:
        outliers = _magnitude_outliers(up, fields, rows, max_ratio)
        for pos in sorted(outliers):
            rejected.append(int(info.sel[rows[pos]]))
            reasons.append(outliers[pos])
        rows = [k for pos, k in enumerate(rows) if pos not in outliers]
    if not rejected:
        return up, info, rejected
    if own_clients and not rows and all("NaN or Inf" in r for r in reasons):
        # in the simulator every client runs our own code: all of them blowing up is divergence
        raise Diverged(
            f"{label} diverged at round {round_}: every client returned non-finite values (learning rate too large)"
        )
    for client, problem in zip(rejected, reasons, strict=False):
        server_log.warning("round %d: client %d rejected: %s", round_, client, problem)
    if not rows:
        return None, info, rejected
    w = (
        info.weights[namespace(info.weights).asarray(rows)]
        if namespace(info.weights).__name__ != "torch"
        else info.weights[rows]
    )
    return keep(up, rows), RoundInfo(sel=info.sel[rows], weights=normalised(w), n_clients=info.n_clients), rejected


@dataclass
class Driver:
    """The round loop of every front-end.

    algorithm  the method (fedconvex.algorithms.base protocol)
    problem    what ``receive`` / ``server_update`` see (the front-end's problem or server view)
    transport  runs the clients (``InProcess(problem)`` here)
    weights    ``weights(sel) -> array``: the un-normalised mixing weights of the clients ``sel``
    evaluate   ``evaluate(state) -> dict``: the metric columns of a history row
    n_clients, participants, d     sampling; ``d`` bounds preconditioner feature indices (None: no index check)
    screen, max_ratio, tamper      screening (on by default), the magnitude guard, fault injection for tests
    synchronize                    called before a round's clock stops (GPU work)
    finite     ``finite(state) -> bool``: the divergence check
    """

    algorithm: Any
    problem: Any
    transport: Callable
    weights: Callable
    evaluate: Callable
    n_clients: int
    participants: int | None = None
    d: int | None = None
    screen: bool = True
    max_ratio: float | None = None
    tamper: Callable | None = None
    synchronize: Callable | None = None
    finite: Callable | None = None
    label: str = ""
    own_clients: bool = True  # False (Flower): all replies non-finite skips the round instead of Diverged

    def __post_init__(self):
        problem = max_ratio_problem(self.max_ratio)
        if problem:
            raise ValueError(f"max_ratio {self.max_ratio!r}: {problem}")

    def first_row(self, state) -> dict:
        return {"round": 0, **self.evaluate(state), "bytes_up": 0, "bytes_down": 0, "seconds": 0.0, "rejected": 0}

    def round(self, state, t: int, rng):
        """One round: (new state, row fields of the round: bytes, seconds, rejected, extras)."""
        alg, n = self.algorithm, self.n_clients
        start = time.perf_counter()
        sel = sample_clients(rng, n, self.participants)
        down = alg.broadcast(state)
        cstate = gather(state.clients, sel, n)
        before = _snapshot(state.clients, sel) if alg.server_tracked_state else None
        got = self.transport(alg, down, cstate, sel, rng, t)
        state = replace(state, clients=scatter(state.clients, sel, got.cstate, n))
        rejected = [c for c, _ in got.rejected]
        sent, up = got.up, got.up
        if up is not None and len(got.sel):
            info = RoundInfo(sel=got.sel, weights=normalised(self.weights(got.sel)), n_clients=n)
            if hasattr(alg, "receive"):  # decode compressed payloads before screening (fedconvex.codecs)
                up, state = alg.receive(self.problem, state, up, info)
            if self.screen or self.tamper is not None:
                up, info, more = screen_message(
                    up,
                    info,
                    self.d,
                    t,
                    self.tamper,
                    label=self.label,
                    max_ratio=self.max_ratio,
                    fields=alg.message_fields,
                    own_clients=self.own_clients,
                )
                rejected += more
        else:
            up = None
        used = {int(i) for i in info.sel} if up is not None else set()
        unused = [int(c) for c in sel if int(c) not in used]
        if unused and got.cstate is not None and alg.server_tracked_state:
            # a client whose reply the server did not use keeps the state the server tracks (SCAFFOLD's c_i,
            # FedNL's H_i): the server's sums take only the replies it used, and the two must stay in step
            # -- as with a client that commits that state only when the server acknowledges its reply
            state = replace(state, clients=_restore(state.clients, before, unused, alg.server_tracked_state))
        if hasattr(self.transport, "acknowledge"):  # clients that keep their own state (Flower nodes) are told
            self.transport.acknowledge(used, unused)
        if up is not None:
            state = alg.server_update(self.problem, state, up, info)
        else:  # nobody usable: the round is skipped, the model and the server's state kept (an optimizer's
            # step count included: a skipped round is no step)
            server_log.warning("round %d: no usable client reply, round skipped, model unchanged", t)
        if self.synchronize is not None:
            self.synchronize()
        seconds = time.perf_counter() - start
        if self.finite is not None and not self.finite(state):
            raise Diverged(f"{self.label} diverged at round {t}: parameters are not finite")
        sent_bytes = got.wire_bytes if got.wire_bytes is not None else message_bytes(sent) if sent is not None else 0
        up_bytes = sent_bytes // len(got.sel) if len(got.sel) else 0
        return state, {
            "bytes_up": up_bytes,
            "bytes_down": message_bytes(down),
            "seconds": seconds,
            "rejected": len(rejected),
            **got.extra,
        }

    def run(self, state, rounds: int, rng, history: list | None = None, on_round=None, stop=None, checkpoint=None):
        """Rounds ``len(history)`` .. ``rounds``; returns (state, history).  Byte and second columns are
        cumulative; ``checkpoint(state, history, rng)`` after every round, then ``on_round(row, history)``;
        ``stop(row) -> bool`` ends the run early.  ``history=[]`` starts at round 1 without a round-0 row
        (the DNN front-end's history has none: evaluating the initial model costs a test pass)."""
        history = history if history is not None else [self.first_row(state)]
        start = {"round": 0, "bytes_up": 0, "bytes_down": 0, "seconds": 0.0}
        for t in range((history[-1] if history else start)["round"] + 1, rounds + 1):
            state, acc = self.round(state, t, rng)
            prev = history[-1] if history else start
            row = {
                "round": t,
                **self.evaluate(state),
                "bytes_up": prev["bytes_up"] + acc.pop("bytes_up"),
                "bytes_down": prev["bytes_down"] + acc.pop("bytes_down"),
                "seconds": prev["seconds"] + acc.pop("seconds"),
                **acc,
            }
            history.append(row)
            if checkpoint is not None:
                checkpoint(state, history, rng)
            if on_round is not None:
                on_round(row, history)
            if stop is not None and stop(row):
                break
        return state, history
