"""The round driver's Flower transport: the broadcast goes to the SuperNodes holding the sampled clients,
their replies come back through ``fedpm_flower.wire``.

Which node holds which client is settled once, at setup (``setup``): every node answers a 'hello' with
the partition id of its node config, and a node is held to that claim for the whole run.  A reply is
accepted only from the node that was asked, claiming the client it was asked for, once; then its
structure is checked against the server's template.  Everything rejected here goes to
``Delivery.rejected`` with its reason (and is logged); content screening is the driver's.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedconvex.driver import Delivery
from fedconvex.messages import client_problem, concat

from . import wire

log = logging.getLogger("fedpm.server")
# a node's first answer (the setup's 'hello') includes starting its ClientApp -- a Ray worker in a simulation, which
# takes tens of seconds on a busy machine -- so that one wait gets this much beyond --timeout; it stays below the
# launchers' watchdog (2 x --timeout + deploy.IDLE_GRACE), so a node that never answers is still found stuck
START_GRACE = 30.0


# a wait for replies looks first after POLL_FIRST seconds, then at intervals growing by half up to POLL_LAST
POLL_FIRST, POLL_LAST = 0.05, 1.0


class FinePolling:
    """A Flower grid whose ``send_and_receive`` looks for replies from every 50 ms at first to once a second, where
    flwr 1.42's deployment grid looks every 3 s: a logistic-regression round is done at the nodes in well under a
    second, so a fixed 3 s look would set the pace of a deployment (up to 3 s lost per wait, a few per round).  The
    wait ends when every message has its reply or at ``timeout``, whichever is first; the rest is the grid's."""

    def __init__(self, grid):
        self.grid = grid

    def send_and_receive(self, messages, timeout=None):
        pending = set(self.grid.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies, pause = [], POLL_FIRST
        while pending:
            got = list(self.grid.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            left = None if end is None else end - time.monotonic()
            if not pending or (left is not None and left <= 0):
                break
            time.sleep(pause if left is None else min(pause, left))
            pause = min(1.5 * pause, POLL_LAST)
        return replies

    def __getattr__(self, name):
        return getattr(self.grid, name)


def fine_polling(grid):
    """``grid`` with FinePolling if it is a Flower grid (a test's stand-in keeps its own ``send_and_receive``)."""
    return FinePolling(grid) if isinstance(grid, Grid) else grid


def records(arrays: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def numpy(record: ArrayRecord) -> dict:
    return {k: record[k].numpy() for k in record.keys()}


class FlowerTransport:
    def __init__(self, grid, cfg, templates: dict, d: int, shift: float, roles: dict):
        self.grid, self.cfg = grid, cfg
        self.templates, self.d, self.shift, self.roles = templates, d, shift, roles
        self.node_of: dict = {}  # client id -> the node that holds it
        self.verdict: dict = {}  # client id -> 1/0: was its last reply used (told with its next message)
        self.metrics: dict = {}  # client id -> the metrics of its last accepted reply

    # ------------------------------------------------------------------------------- exchanges
    def _exchange(self, kind: str, per_client: dict, round_: int, config: dict | None = None, extra=None):
        """Send ``per_client[c]`` (arrays) to the node of each client c (with ``extra[c]``: more config).
        Returns ({client: arrays}, [(client, reason)] rejected, number dropped)."""
        msgs, asked = [], {}
        for c, arrays in per_client.items():
            node = self.node_of.get(int(c))
            if node is None:
                continue  # no node holds it (never connected): dropped
            content = RecordDict(
                {
                    "arrays": records(arrays),
                    "config": ConfigRecord(
                        {"round": round_, "client": int(c), **(config or {}), **(extra or {}).get(int(c), {})}
                    ),
                }
            )
            msgs.append(Message(content=content, dst_node_id=node, message_type=kind))
            asked[node] = int(c)
        replies = list(self.grid.send_and_receive(msgs, timeout=self.cfg.timeout)) if msgs else []
        got, rejected, seen = {}, [], set()
        for reply in replies:
            src = reply.metadata.src_node_id
            c = asked.get(src)
            if c is None or src in seen:
                log.warning(
                    "round %d: node %s rejected: %s",
                    round_,
                    src,
                    "it was not asked" if c is None else "a second reply this round",
                )
                continue
            seen.add(src)
            if reply.has_error():
                log.warning("round %d: client %d (node %s) failed: %s", round_, c, src, reply.error.reason)
                continue  # counted as dropped
            try:
                claim = reply.content["metrics"]["client"]
                arrays = numpy(reply.content["arrays"])
            except Exception as exc:  # a reply without the records our ClientApp sends
                rejected.append((c, f"malformed reply ({type(exc).__name__}: {exc})"))
                continue
            if isinstance(claim, bool) or claim != c:
                rejected.append((c, f"claims client id {claim!r} but node {src} holds client {c}"))
                continue
            got[c] = arrays
            self.metrics[c] = dict(reply.content["metrics"])
        for c, reason in rejected:
            log.warning("round %d: client %d rejected: %s", round_, c, reason)
        return got, rejected, len(per_client) - len(got) - len(rejected)

    def setup(self, n_clients: int, nodes: list, theta=None) -> None:
        """Learn which node holds which client; every node initialises its client state (at ``theta``, where
        the problem's client state starts from the model)."""
        self.node_of = {}
        hello = records({} if theta is None else {"theta": theta})
        msgs = [
            Message(
                content=RecordDict({"arrays": hello, "config": ConfigRecord({"op": "hello"})}),
                dst_node_id=node,
                message_type="query",
            )
            for node in nodes
        ]
        for reply in self.grid.send_and_receive(msgs, timeout=self.cfg.timeout + START_GRACE):
            src = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("setup: node %s failed: %s", src, reply.error.reason)
                continue
            try:
                c = reply.content["metrics"]["client"]
            except Exception:
                c = None
            if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < n_clients:
                log.warning("setup: node %s rejected: client id %r is not an integer in 0..%d", src, c, n_clients - 1)
            elif c in self.node_of:
                log.warning("setup: node %s rejected: client id %d is held by node %s", src, c, self.node_of[c])
            elif src not in self.node_of.values():
                self.node_of[c] = src
        missing = sorted(set(range(n_clients)) - set(self.node_of))
        if missing:
            log.warning("setup: no node holds client(s) %s; they count as dropped", missing)

    # ----------------------------------------------------------------------------- the transport
    def __call__(self, algorithm, down, cstate, sel, rng, round_):
        per_client, extra = {}, {}
        for k, c in enumerate(sel):  # the server-held rows of each client's state go with its message
            arrays, kinds = wire.state_row({key: v[[k]] for key, v in cstate.items()}) if cstate else ({}, {})
            per_client[int(c)] = {**down, **{"state/" + key: a for key, a in arrays.items()}}
            if kinds:
                extra[int(c)] = {"state-kinds": json.dumps(kinds)}
            if int(c) in self.verdict:
                extra.setdefault(int(c), {})["last-used"] = self.verdict[int(c)]
        got, rejected, dropped = self._exchange("train", per_client, round_, extra=extra)
        parts, ok = [], []
        for c in sorted(got):
            msg, problem = wire.unflatten(got[c], self.templates["train"], self.d, self.shift, self.roles)
            if problem:
                log.warning("round %d: client %d rejected: %s", round_, c, problem)
                rejected.append((c, problem))
            else:
                parts.append(msg)
                ok.append(c)
        if dropped:
            log.warning("round %d: %d of %d clients did not reply (dropped)", round_, dropped, len(sel))
        up = concat(parts) if parts else None
        # bytes as they travelled (FedPM's blocks may travel in float16; the server mixes in float64)
        sent = sum(a.nbytes for c in ok for a in got[c].values())
        return Delivery(
            up=up,
            cstate=None,
            sel=np.asarray(ok, dtype=np.int64),
            rejected=rejected,
            extra={"asked": len(sel), "dropped": dropped},
            wire_bytes=sent,
        )

    def acknowledge(self, used, unused) -> None:
        """The driver's verdict on this round's replies: each client learns it with its next message and
        keeps (used) or rolls back (unused, dropped) the state the server tracks (fedpm_flower.apps.train)."""
        self.verdict.update({int(c): 1 for c in used})
        self.verdict.update({int(c): 0 for c in unused})

    def ask(self, oracle: str, thetas, sel) -> object:
        """The clients' answers to a problem oracle (stacked); every asked client must answer."""
        got, rejected, _ = self._exchange(
            "query", {int(c): {"theta": thetas[k]} for k, c in enumerate(sel)}, -1, {"op": oracle}
        )
        parts = []
        for c in (int(c) for c in sel):
            msg, problem = (
                (None, "no reply")
                if c not in got
                else wire.unflatten(got[c], self.templates[oracle], self.d, self.shift)
            )
            problem = problem or client_problem(msg, 0, self.d)  # finite; Hessian blocks PSD
            if problem:
                raise RuntimeError(f"client {c} did not answer the server's {oracle} query: {problem}")
            parts.append(msg)
        return concat(parts)["value"]
