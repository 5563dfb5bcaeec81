"""Flower simulation with a client slower than --timeout: the round goes on without it (reported as dropped, in
result.json and its warnings), every round ends, and the command ends in a bounded time, well before the slow
client would have answered."""

import json
import time

import pytest

pytest.importorskip("flwr")

SLEEP = 150.0  # the slow client's extra seconds: far beyond --timeout and beyond the whole run's bound
TIMEOUT = 30.0  # the healthy client answers well within it even on a loaded machine (tests run two at a time)


def _slow_client_app(cfg, slow_partition: int, seconds: float):
    """Our ClientApp, except that the node of ``slow_partition`` trains ``seconds`` longer (built in the simulation's
    forked process and shipped to Ray's workers by value: no module of the tests needs to be importable there)."""
    from flwr.clientapp import ClientApp

    from fedpm_flower import apps

    app = ClientApp()

    @app.train()
    def _train(msg, context):
        if int(context.node_config["partition-id"]) == slow_partition:
            time.sleep(seconds)
        return apps.train(msg, context, cfg)

    @app.query()
    def _query(msg, context):
        return apps.query(msg, context, cfg)

    return app


@pytest.mark.slow
def test_a_client_slower_than_the_timeout_is_left_out_and_the_run_ends_in_bounded_time(tmp_path, monkeypatch):
    from fedpm_flower import apps
    from validation import flower

    monkeypatch.setattr(apps, "make_client_app", lambda cfg: _slow_client_app(cfg, 1, SLEEP))
    monkeypatch.setattr(flower, "RESULT_GRACE", 2.0)  # the slow worker still sleeps once the result is written
    out = tmp_path / "out"
    argv = ["--method", "fedavg", "--dataset", "a9a", "--clients", "2", "--rounds", "1"]
    argv += ["--timeout", str(TIMEOUT), "--quiet"]
    start = time.monotonic()
    assert flower.main(argv + ["--mode", "simulation", "--out", str(out)]) == 0
    wall = time.monotonic() - start
    result = json.loads((out / "result.json").read_text())
    rounds = [h for h in result["history"] if h["round"] >= 1]
    assert [(h["asked"], h["used"], h["dropped"]) for h in rounds] == [(2, 1, 1)]
    assert any("did not reply" in w or "dropped" in w for w in result["server_warnings"]), result["server_warnings"]
    assert wall < SLEEP, wall  # bounded by --timeout per wait, not by the slow client


@pytest.mark.parametrize("timeout", [1.0, 300.0])
def test_the_setup_wait_allows_a_node_to_start_and_stays_below_the_watchdog(timeout):
    """A node's first answer includes starting its ClientApp (a Ray worker: tens of seconds on a busy machine, which
    once dropped every healthy node of a simulation run with --timeout 20): the setup's wait is longer than
    --timeout, yet shorter than the launchers' watchdog, which would otherwise call a healthy start stuck; every
    later wait is --timeout itself."""
    from flower_loopback import LoopbackGrid

    from fedpm_flower.apps import serve
    from fedpm_flower.config import FlowerRunConfig
    from fedpm_flower.deploy import IDLE_GRACE

    class Timed(LoopbackGrid):
        waits = []

        def send_and_receive(self, messages, timeout=None):
            self.waits.append(timeout)
            return super().send_and_receive(messages, timeout=timeout)

    cfg = FlowerRunConfig(method="fedavg", dataset="a9a", clients=2, rounds=2, timeout=timeout)
    grid = Timed(cfg)
    assert [h["used"] for h in serve(grid, cfg)["history"][1:]] == [2, 2]
    setup, *rounds = grid.waits
    assert timeout + 20.0 <= setup < 2 * timeout + IDLE_GRACE
    assert rounds and set(rounds) == {timeout}
