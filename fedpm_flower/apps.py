"""Flower ServerApp / ClientApp for FedPM, LocalNewton and FedAvg (flwr 1.42 Message API).

``server_app`` / ``client_app`` read their configuration from the Flower run config
(deployment: ``flwr run --run-config``); ``make_server_app(cfg)`` / ``make_client_app(cfg)``
bind one for the simulation engine.  The ServerApp writes the final parameters and a per-round
history as JSON to ``cfg.out``.
"""
from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from . import logreg
from .config import FlowerRunConfig


def _server(cfg):
    if cfg.problem == "cnn":
        from .cnn import CnnServer

        return CnnServer(cfg)
    return logreg.Server(cfg)

log = logging.getLogger("fedpm.server")


def _arrays(d: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in d.items()})


def _numpy(record: ArrayRecord) -> dict:
    return {k: record[k].numpy() for k in record.keys()}


def _wait_for_nodes(grid: Grid, n: int, timeout: float) -> list:
    """The SuperNodes to train on: all n, or after ``timeout`` those that did connect."""
    start = time.time()
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= n:
            return sorted(nodes)[:n]
        if time.time() - start > timeout:
            if not nodes:
                raise TimeoutError(f"no SuperNode connected within {timeout:.0f}s")
            log.warning("only %d of %d SuperNodes connected within %.0fs; training with them", len(nodes), n, timeout)
            return sorted(nodes)
        time.sleep(0.5)


def serve(grid: Grid, cfg: FlowerRunConfig) -> dict:
    server = _server(cfg)
    nodes = _wait_for_nodes(grid, cfg.clients, cfg.timeout)
    history, start = [], time.perf_counter()
    bytes_up = bytes_down = 0
    owner: dict = {}   # partition id -> the node that first claimed it: a node is held to its claim
    for t in range(1, cfg.rounds + 1):
        down = server.broadcast()
        msgs = [Message(content=RecordDict({"arrays": _arrays(down), "config": ConfigRecord({"round": t})}),
                        dst_node_id=node, message_type="train") for node in nodes]
        replies, dropped, spoofed = {}, 0, 0
        received = list(grid.send_and_receive(msgs, timeout=cfg.timeout))
        claims: dict = {}
        for reply in received:
            src = reply.metadata.src_node_id
            if reply.has_error():
                dropped += 1
                log.warning("round %d: node %s failed: %s", t, src, reply.error.reason)
                continue
            try:
                p = reply.content["metrics"]["partition-id"]
                arrays = _numpy(reply.content["arrays"])
            except Exception as exc:  # a reply without the records a client of ours sends
                spoofed += 1
                log.warning("round %d: node %s rejected: malformed reply (%s)", t, src, exc)
                continue
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < cfg.clients:
                spoofed += 1
                log.warning("round %d: node %s rejected: partition id %r is not an integer in 0..%d",
                            t, src, p, cfg.clients - 1)
                continue
            mine = [q for q, node in owner.items() if node == src]
            why = (f"claims partition {p}, which belongs to node {owner[p]}" if owner.get(p, src) != src else
                   f"claims partition {p} but earlier claimed {mine[0]}" if mine and mine[0] != p else
                   f"partition {p} already replied this round" if p in claims else None)
            if why:
                spoofed += 1
                log.warning("round %d: node %s rejected: %s", t, src, why)
                continue
            owner[p] = claims[p] = src
            replies[p] = arrays
            bytes_up += sum(a.nbytes for a in arrays.values())
        dropped += len(msgs) - len(received)
        if len(msgs) > len(received):
            log.warning("round %d: %d of %d clients did not reply (dropped)", t, len(msgs) - len(received), len(msgs))
        bytes_down += sum(a.nbytes for a in down.values()) * len(msgs)
        used = server.step(replies, t)
        used["rejected"] += spoofed
        history.append({"round": t, **used, "dropped": dropped, "seconds": time.perf_counter() - start,
                        "bytes_up_per_client": bytes_up / max(1, t * cfg.clients),
                        "bytes_down_per_client": bytes_down / max(1, t * cfg.clients)})
    result = {"theta": server.theta.tolist(), "history": history, "config": cfg.to_run_config()}
    if cfg.out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        tmp = cfg.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh)
        os.replace(tmp, cfg.out)
    return result


def train(msg: Message, context: Context, cfg: FlowerRunConfig) -> Message:
    partition = int(context.node_config["partition-id"])
    round_ = int(msg.content["config"]["round"])
    if cfg.problem == "cnn":
        from . import cnn

        # the node's FOOF matrices persist between rounds in its Context state
        state = _numpy(context.state["foof_state"]) if "foof_state" in context.state else {}
        arrays, _ = cnn.client_train(cfg, partition, _numpy(msg.content["arrays"]), round_, state)
        context.state["foof_state"] = _arrays(state)
        metrics = MetricRecord({"partition-id": partition})
    else:
        theta = msg.content["arrays"]["theta"].numpy()
        arrays = logreg.client_train(cfg, partition, theta, round_)
        metrics = MetricRecord({"partition-id": partition,
                                "num-examples": int(logreg.local_problem(cfg, partition).n_samples)})
    return Message(content=RecordDict({"arrays": _arrays(arrays), "metrics": metrics}), reply_to=msg)


def make_server_app(cfg: FlowerRunConfig | None = None) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_cfg = cfg or FlowerRunConfig.from_mapping(context.run_config)
        try:
            serve(grid, run_cfg)
        except Exception as exc:  # tell the launcher why, instead of leaving it waiting
            if run_cfg.out:
                with open(run_cfg.out, "w") as fh:
                    json.dump({"error": f"{type(exc).__name__}: {exc}"}, fh)
            raise

    return app


def make_client_app(cfg: FlowerRunConfig | None = None) -> ClientApp:
    app = ClientApp()

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        return train(msg, context, cfg or FlowerRunConfig.from_mapping(context.run_config))

    return app


server_app = make_server_app()
client_app = make_client_app()
