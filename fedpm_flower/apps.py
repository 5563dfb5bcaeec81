"""Flower ServerApp / ClientApp (flwr 1.42 Message API): every registered fedconvex method on logistic
regression through the round driver (fedconvex.driver, transport: fedpm_flower.transport), and the FOOF
CNN (fedpm_flower.cnn).

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
from dataclasses import replace

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedconvex.driver import Driver

from . import logreg, wire
from .config import FlowerRunConfig
from .transport import FlowerTransport, numpy, records


log = logging.getLogger("fedpm.server")


def _wait_for_nodes(grid: Grid, n: int, timeout: float, every: bool = False) -> list:
    """The SuperNodes to train on: n of them (``every``: all that are connected once n are), or after
    ``timeout`` those that did connect."""
    start = time.time()
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= n:
            return sorted(nodes) if every else sorted(nodes)[:n]
        if time.time() - start > timeout:
            if not nodes:
                raise TimeoutError(f"no SuperNode connected within {timeout:.0f}s")
            log.warning("only %d of %d SuperNodes connected within %.0fs; training with them", len(nodes), n, timeout)
            return sorted(nodes)
        time.sleep(0.5)


def serve(grid: Grid, cfg: FlowerRunConfig) -> dict:
    if cfg.problem == "cnn":
        result = _serve_cnn(grid, cfg)
    else:
        state, history = _serve_logreg(grid, cfg)
        result = {"theta": np.asarray(state.theta).tolist(), "history": history}
    result["config"] = cfg.to_run_config()
    if cfg.out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        tmp = cfg.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh)
        os.replace(tmp, cfg.out)
    return result


def _serve_logreg(grid: Grid, cfg: FlowerRunConfig):
    """Any registered method through the round driver: clients on the SuperNodes, state here."""
    alg = logreg.algorithm(cfg)
    d, counts = logreg.server_problem(cfg)
    # every connected node is asked which client it holds: one claiming a taken or unknown id is refused
    nodes = _wait_for_nodes(grid, cfg.clients, cfg.timeout, every=True)
    transport = FlowerTransport(grid, cfg, logreg.templates(alg, d, cfg.lam), d, cfg.lam, alg.message_fields)
    start = logreg.theta0(d)
    transport.setup(cfg.clients, nodes, start)
    view = logreg.ServerView(d, cfg.lam, logreg.client_weights(cfg, counts), transport.ask)
    # per-client state lives on the nodes (their Context.state); the server keeps only the entries its own
    # steps write (logreg.templates: 'server_keys') and sends each client its row with the next 'train'
    state = alg.init(view, start)
    state = replace(state, clients={k: state.clients[k] for k in transport.templates["server_keys"]})
    driver = Driver(alg, view, transport, weights=lambda sel: view.client_weights[np.asarray(sel)],
                    evaluate=lambda s: {}, n_clients=cfg.clients, participants=cfg.participants or None, d=d,
                    max_ratio=cfg.max_ratio or None, label=f"{alg.label} (lr={alg.lr:g})",
                    finite=lambda s: bool(np.all(np.isfinite(s.theta))), own_clients=False)
    state, history = driver.run(state, cfg.rounds, np.random.default_rng(cfg.seed))
    for row in history[1:]:
        row["used"] = row["asked"] - row["dropped"] - row["rejected"]
    return state, history


def _serve_cnn(grid: Grid, cfg: FlowerRunConfig) -> dict:
    from .cnn import CnnServer

    server = CnnServer(cfg)
    nodes = _wait_for_nodes(grid, cfg.clients, cfg.timeout)
    history, start = [], time.perf_counter()
    bytes_up = bytes_down = 0
    owner: dict = {}   # partition id -> the node that first claimed it: a node is held to its claim
    for t in range(1, cfg.rounds + 1):
        down = server.broadcast()
        msgs = [Message(content=RecordDict({"arrays": records(down), "config": ConfigRecord({"round": t})}),
                        dst_node_id=node, message_type="train") for node in nodes]
        replies, dropped, spoofed, round_up = {}, 0, 0, 0
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
                arrays = numpy(reply.content["arrays"])
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
            round_up += sum(a.nbytes for a in arrays.values())
        dropped += len(msgs) - len(received)
        if len(msgs) > len(received):
            log.warning("round %d: %d of %d clients did not reply (dropped)", t, len(msgs) - len(received), len(msgs))
        bytes_down += sum(a.nbytes for a in down.values())
        used = server.step(replies, t)
        used["rejected"] += spoofed
        # cumulative bytes per client that replied (round by round), as the round driver counts them
        bytes_up += round_up / max(1, len(replies))
        history.append({"round": t, **used, "dropped": dropped, "seconds": time.perf_counter() - start,
                        "bytes_up": bytes_up, "bytes_down": bytes_down})
    result = {"theta": server.theta.tolist(), "history": history}
    if cfg.data_dir:    # a prepared data set: the final model's accuracy on the server's test set
        result["test_acc"] = server.test_accuracy()
    return result


def train(msg: Message, context: Context, cfg: FlowerRunConfig) -> Message:
    partition = int(context.node_config["partition-id"])
    round_ = int(msg.content["config"]["round"])
    if cfg.problem == "cnn":
        from . import cnn

        # the node's FOOF matrices persist between rounds in its Context state
        state = numpy(context.state["foof_state"]) if "foof_state" in context.state else {}
        arrays, _ = cnn.client_train(cfg, partition, numpy(msg.content["arrays"]), round_, state,
                                     folder=context.node_config.get("data-dir") or None)
        context.state["foof_state"] = records(state)
        return Message(content=RecordDict({"arrays": records(arrays),
                                           "metrics": MetricRecord({"partition-id": partition})}), reply_to=msg)
    asked = int(msg.content["config"]["client"])
    if asked != partition:
        raise ValueError(f"asked to train client {asked}, but this node holds client {partition}")
    arrays = numpy(msg.content["arrays"])
    down = {k: v for k, v in arrays.items() if not k.startswith("state/")}
    cstate = _load_state(context)
    tracked = logreg.algorithm(cfg).server_tracked_state
    if tracked and int(msg.content["config"].get("last-used", 1)) == 0 and "cstate-prev-kinds" in context.state:
        # the server did not use this node's last reply: the state it tracks (SCAFFOLD's c_i, FedNL's H_i)
        # goes back to what it was before that round, as the in-process driver does
        prev = _load_state(context, "cstate-prev")
        cstate.update({k: prev[k] for k in tracked if k in prev})
    if "state-kinds" in msg.content["config"]:   # the entries the server keeps for this client (its say)
        held = {k[len("state/"):]: v for k, v in arrays.items() if k.startswith("state/")}
        cstate.update(wire.state_from_row(held, json.loads(msg.content["config"]["state-kinds"])))
    if tracked:
        _save_state(context, cstate, "cstate-prev")      # to roll back to if this reply is not used
    up, cstate = logreg.client_reply(cfg, partition, down, cstate, round_)
    _save_state(context, cstate)
    block_dtype = None if cfg.precond_dtype == "float64" else cfg.precond_dtype
    return Message(content=RecordDict({"arrays": records(wire.flatten(up, 0, block_dtype)),
                                       "metrics": MetricRecord({"client": partition})}), reply_to=msg)


def query(msg: Message, context: Context, cfg: FlowerRunConfig) -> Message:
    """'hello' (setup: this node's client id; its client state initialised at the given model) or a
    problem oracle at the given model (fedpm_flower.logreg.ORACLES)."""
    partition = int(context.node_config["partition-id"])
    op = str(msg.content["config"]["op"])
    theta = msg.content["arrays"]["theta"].numpy()
    arrays = {}
    if op == "hello":
        _save_state(context, logreg.init_client_state(cfg, partition, theta))
    else:
        if int(msg.content["config"]["client"]) != partition:
            raise ValueError("asked about a client this node does not hold")
        arrays = wire.flatten(logreg.client_oracle(cfg, partition, op, theta))
    return Message(content=RecordDict({"arrays": records(arrays), "metrics": MetricRecord({"client": partition})}),
                   reply_to=msg)


def _load_state(context: Context, key: str = "cstate") -> dict:
    if key + "-kinds" not in context.state:
        raise RuntimeError("no client state: the server's setup ('hello') has not reached this node")
    kinds = dict(context.state[key + "-kinds"])
    return wire.state_from_row(numpy(context.state[key]), kinds)


def _save_state(context: Context, cstate: dict, key: str = "cstate") -> None:
    arrays, kinds = wire.state_row(cstate)
    context.state[key] = records(arrays)
    context.state[key + "-kinds"] = ConfigRecord(kinds)


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

    @app.query()
    def _query(msg: Message, context: Context) -> Message:
        return query(msg, context, cfg or FlowerRunConfig.from_mapping(context.run_config))

    return app


server_app = make_server_app()
client_app = make_client_app()
