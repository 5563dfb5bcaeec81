"""Several runs of our apps in ONE Flower simulation: Ray and the simulation engine start once (tens of seconds
each time) instead of once per run.  The ServerApp serves the runs one after another (fedpm_flower.apps.serve,
unchanged); every message it sends carries its run's index, and each node keeps every run's state in Flower's
own Context.state under that run's prefix, so the runs share nothing but the engine."""

import json
import os

from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from fedpm_flower import apps
from fedpm_flower.config import FlowerRunConfig, progress_file

RUN = "multirun-index"  # the message config key naming the run a message belongs to


class RunGrid:
    """The grid as one run sees it: its messages tagged with its index."""

    def __init__(self, grid, index: int):
        self.grid, self.index = grid, index

    def send_and_receive(self, messages, timeout=None):
        for m in messages:
            m.content["config"][RUN] = self.index
        return self.grid.send_and_receive(messages, timeout=timeout)

    def __getattr__(self, name):
        return getattr(self.grid, name)


def server_app(cfgs: list, out: str) -> ServerApp:
    """Serves ``cfgs`` in turn and writes {index: result or {"error": ...}} to ``out`` once all are done."""
    app = ServerApp()

    @app.main()
    def main(grid, context):
        grid = apps.Heartbeat(grid, progress_file(out))  # the launcher's watch for a stuck simulation
        results = {}
        for k, cfg in enumerate(cfgs):
            try:
                results[k] = apps.serve(RunGrid(grid, k), cfg)
            except Exception as exc:  # the other runs go on; the tests of this one see why it failed
                results[k] = {"error": f"{type(exc).__name__}: {exc}"}
        with open(out + ".tmp", "w") as fh:
            json.dump(results, fh)
        os.replace(out + ".tmp", out)

    return app


def client_app(cfgs: list) -> ClientApp:
    app = ClientApp()

    def handle(handler, msg, context):
        k = int(msg.content["config"][RUN])
        prefix = f"run-{k}/"
        state = RecordDict({key[len(prefix) :]: v for key, v in context.state.items() if key.startswith(prefix)})
        mine = Context(context.run_id, context.node_id, context.node_config, state, context.run_config)
        reply = handler(msg, mine, cfgs[k])
        for key, value in state.items():  # back into the Context Flower keeps for this node
            context.state[prefix + key] = value
        return reply

    @app.train()
    def _train(msg, context):
        return handle(apps.train, msg, context)

    @app.query()
    def _query(msg, context):
        return handle(apps.query, msg, context)

    return app


def simulate_runs(cfgs: dict, folder: str, timeout: float = 300.0) -> dict:
    """{name: result} of every run of ``cfgs`` ({name: FlowerRunConfig}, all with the same client count) in one
    simulation, through validation.flower.simulate (its own process, stopped with everything below it)."""
    import pytest

    from validation.flower import simulate

    names, runs = list(cfgs), list(cfgs.values())
    assert len({c.clients for c in runs}) == 1, "one simulation has one set of nodes"
    out = os.path.join(str(folder), "runs.json")
    driver = FlowerRunConfig(clients=runs[0].clients, rounds=sum(c.rounds for c in runs), timeout=timeout, out=out)
    with pytest.MonkeyPatch.context() as mp:  # the simulation's child builds these apps
        mp.setattr(apps, "make_server_app", lambda cfg: server_app(runs, out))
        mp.setattr(apps, "make_client_app", lambda cfg: client_app(runs))
        simulate(driver)
    with open(out) as fh:
        results = json.load(fh)
    return {name: results[str(k)] for k, name in enumerate(names)}
