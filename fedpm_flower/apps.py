"""Flower ServerApp / ClientApp (flwr 1.42 Message API): every registered fedconvex method on logistic
regression and every registered fedpm_dnn method on the CNN, both through the round driver
(fedconvex.driver; transports: fedpm_flower.transport, fedpm_flower.cnn).

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
from fedconvex.files import replaced_atomically

from . import logreg, wire
from .config import FlowerRunConfig, progress_file
from .transport import FlowerTransport, fine_polling, numpy, records

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


class Heartbeat:
    """The grid, touching ``path`` each time a wait for the SuperNodes ends: the launcher's --timeout then
    bounds one wait (a round's replies, an oracle question), not the whole run (fedpm_flower.deploy).  After
    each round ``path`` holds the number of rounds done (``on_round``): the launcher's progress bar reads it
    (fedpm_flower.config.rounds_done), as the ServerApp may run in another process than the command's."""

    def __init__(self, grid, path: str):
        self.grid, self.path = grid, path
        self.beat()

    def beat(self) -> None:
        with open(self.path, "a"):
            os.utime(self.path)

    def on_round(self, row, history) -> None:
        """The round driver's hook: the count replaces the file in one rename (a reader sees a whole number)."""
        with replaced_atomically(self.path) as tmp, open(tmp, "w") as fh:
            fh.write(f"{row['round']}\n")

    def get_node_ids(self):
        self.beat()
        return self.grid.get_node_ids()

    def send_and_receive(self, messages, timeout=None):
        replies = self.grid.send_and_receive(messages, timeout=timeout)
        self.beat()
        return replies

    def __getattr__(self, name):
        return getattr(self.grid, name)


class _Collect(logging.Handler):
    """Keeps the server's warnings (rejected replies with their reasons, dropped nodes) for the result file:
    in a deployment the ServerApp is a process of the SuperLink's, and its log is not the launcher's."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def serve(grid: Grid, cfg: FlowerRunConfig) -> dict:
    on_round = None
    grid = fine_polling(grid)
    if cfg.out:
        grid = Heartbeat(grid, progress_file(cfg.out))
        on_round = grid.on_round
    collect = _Collect()
    log.addHandler(collect)
    try:
        result = _serve(grid, cfg, on_round)
    finally:
        log.removeHandler(collect)
    result["server_warnings"] = collect.lines
    if cfg.out:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        with replaced_atomically(cfg.out, cfg.out + ".tmp") as tmp, open(tmp, "w") as fh:
            json.dump(result, fh)
    return result


def _serve(grid: Grid, cfg: FlowerRunConfig, on_round=None) -> dict:
    if cfg.problem == "cnn":
        state, history = _serve_cnn(grid, cfg, on_round)
        from .cnn import flat_theta, test_accuracy

        result = {"theta": flat_theta(state.theta).tolist(), "history": history}
        if cfg.data_dir:  # a prepared data set: the final model's accuracy on the server's test set
            result["test_acc"] = test_accuracy(cfg, state.theta)
    else:
        state, history = _serve_logreg(grid, cfg, on_round)
        result = {"theta": np.asarray(state.theta).tolist(), "history": history}
    result["config"] = cfg.to_run_config()
    return result


def _drive(cfg, alg, view, transport, state, weights, finite, d=None, on_round=None):
    """The round driver over the SuperNodes (own_clients=False: a round whose replies are all unusable is
    skipped, not divergence); each history row also says how many replies the server used.  ``on_round(row,
    history)`` after each round (Heartbeat.on_round)."""
    driver = Driver(
        alg,
        view,
        transport,
        weights=weights,
        evaluate=lambda s: {},
        n_clients=cfg.clients,
        participants=cfg.participants or None,
        d=d,
        max_ratio=cfg.max_ratio or None,
        label=f"{alg.label} (lr={alg.lr:g})",
        finite=finite,
        own_clients=False,
    )
    state, history = driver.run(state, cfg.rounds, np.random.default_rng(cfg.seed), on_round=on_round)
    for row in history[1:]:
        row["used"] = row["asked"] - row["dropped"] - row["rejected"]
    return state, history


def _serve_logreg(grid: Grid, cfg: FlowerRunConfig, on_round=None):
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
    return _drive(
        cfg,
        alg,
        view,
        transport,
        state,
        weights=lambda sel: view.client_weights[np.asarray(sel)],
        finite=lambda s: bool(np.all(np.isfinite(s.theta))),
        d=d,
        on_round=on_round,
    )


def _serve_cnn(grid: Grid, cfg: FlowerRunConfig, on_round=None):
    """Any registered fedpm_dnn method through the round driver: each client's state on its node, the
    server's state here -- with the client state entries the server's own steps write (FedPM's delta codec:
    its acknowledgements), which each client gets with its next 'train' (fedpm_flower.cnn.held_entries)."""
    from . import cnn

    alg = cnn.algorithm(cfg)
    view, start = cnn.server_task(cfg)
    nodes = _wait_for_nodes(grid, cfg.clients, cfg.timeout, every=True)
    transport = cnn.CnnTransport(grid, cfg, view.blocks, cnn.client_sizes(cfg))
    transport.setup(cfg.clients, nodes)
    state = alg.init(view, start)
    # the transport brings no client state back (Delivery.cstate None): state.clients holds only what the
    # server's steps write there
    # weighting='samples': the split's sample counts (or, where the server does not know them, the nodes')
    return _drive(
        cfg,
        alg,
        view,
        transport,
        state,
        weights=lambda sel: alg.client_weights(transport.sizes, sel),
        finite=cnn.finite,
        on_round=on_round,
    )


def _train_cnn(msg: Message, context: Context, cfg: FlowerRunConfig, partition: int) -> Message:
    """The node's client of the CNN: its state (FOOF matrices, SCAFFOLD's control, ...) persists in the
    node's Context state between rounds."""
    from . import cnn

    cs = cnn.nest(numpy(context.state["cnn-state"])) if "cnn-state" in context.state else {}
    tracked = cnn.algorithm(cfg).server_tracked_state
    if tracked and int(msg.content["config"].get("last-used", 1)) == 0 and "cnn-prev" in context.state:
        # the server did not use this node's last reply: the state it tracks (SCAFFOLD's control) goes back to
        # what it was before that round, as the in-process driver does
        prev = cnn.nest(numpy(context.state["cnn-prev"]))
        for k in tracked:
            if k in prev:
                cs[k] = prev[k]
            else:  # created by the unused round (a first participation): not yet the client's
                cs.pop(k, None)
    if tracked:
        context.state["cnn-prev"] = records(cnn.flat({k: cs[k] for k in tracked if k in cs}))
    arrays, held = cnn.read_held(numpy(msg.content["arrays"]), msg.content["config"])
    cs.update(held)  # the entries the server keeps for this client (its acknowledgement): its say
    reply, loss, samples = cnn.client_train(
        cfg,
        partition,
        cnn.nest(arrays),
        int(msg.content["config"]["round"]),
        cs,
        folder=context.node_config.get("data-dir") or None,
    )
    context.state["cnn-state"] = records(cnn.flat({k: v for k, v in cs.items() if k not in held}))
    return Message(
        content=RecordDict(
            {
                "arrays": records(cnn.flat(reply)),
                "metrics": MetricRecord({"client": partition, "samples": samples, "loss": float(loss)}),
            }
        ),
        reply_to=msg,
    )


def train(msg: Message, context: Context, cfg: FlowerRunConfig) -> Message:
    partition = int(context.node_config["partition-id"])
    round_ = int(msg.content["config"]["round"])
    asked = int(msg.content["config"]["client"])
    if asked != partition:
        raise ValueError(f"asked to train client {asked}, but this node holds client {partition}")
    if cfg.problem == "cnn":
        return _train_cnn(msg, context, cfg, partition)
    arrays = numpy(msg.content["arrays"])
    down = {k: v for k, v in arrays.items() if not k.startswith("state/")}
    cstate = _load_state(context)
    tracked = logreg.algorithm(cfg).server_tracked_state
    if tracked and int(msg.content["config"].get("last-used", 1)) == 0 and "cstate-prev-kinds" in context.state:
        # the server did not use this node's last reply: the state it tracks (SCAFFOLD's c_i, FedNL's H_i)
        # goes back to what it was before that round, as the in-process driver does
        prev = _load_state(context, "cstate-prev")
        cstate.update({k: prev[k] for k in tracked if k in prev})
    if "state-kinds" in msg.content["config"]:  # the entries the server keeps for this client (its say)
        held = {k[len("state/") :]: v for k, v in arrays.items() if k.startswith("state/")}
        cstate.update(wire.state_from_row(held, json.loads(msg.content["config"]["state-kinds"])))
    if tracked:
        _save_state(context, cstate, "cstate-prev")  # to roll back to if this reply is not used
    up, cstate = logreg.client_reply(cfg, partition, down, cstate, round_)
    _save_state(context, cstate)
    block_dtype = None if cfg.precond_dtype == "float64" else cfg.precond_dtype
    return Message(
        content=RecordDict(
            {"arrays": records(wire.flatten(up, 0, block_dtype)), "metrics": MetricRecord({"client": partition})}
        ),
        reply_to=msg,
    )


def query(msg: Message, context: Context, cfg: FlowerRunConfig) -> Message:
    """'hello' (setup: this node's client id; its client state initialised at the given model) or a
    problem oracle at the given model (fedpm_flower.logreg.ORACLES)."""
    partition = int(context.node_config["partition-id"])
    op = str(msg.content["config"]["op"])
    arrays = {}
    if op == "hello" and cfg.problem == "cnn":
        pass  # the CNN's client state starts empty (fedpm_dnn: created at the first participation)
    elif op == "hello":
        theta = msg.content["arrays"]["theta"].numpy()
        _save_state(context, logreg.init_client_state(cfg, partition, theta))
    else:
        if int(msg.content["config"]["client"]) != partition:
            raise ValueError("asked about a client this node does not hold")
        theta = msg.content["arrays"]["theta"].numpy()
        arrays = wire.flatten(logreg.client_oracle(cfg, partition, op, theta))
    return Message(
        content=RecordDict({"arrays": records(arrays), "metrics": MetricRecord({"client": partition})}), reply_to=msg
    )


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
