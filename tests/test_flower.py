"""FedPM on Flower: same global model as the in-process run, in simulation and in a real local
deployment; bad or missing replies are tolerated."""
import logging
import os
import subprocess
import time

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from fedpm_flower.config import FlowerRunConfig  # noqa: E402
from fedpm_flower.logreg import Server, client_train  # noqa: E402
from validation.flower import in_process, run_flower  # noqa: E402

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"


def live_flower_processes():
    out = subprocess.run(["pgrep", "-f", "flower-superlink|flower-supernode|flwr-serverapp|flwr-clientapp"],
                         capture_output=True, text=True).stdout.split()
    alive = []
    for pid in out:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(int(pid))
        except OSError:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedpm", "localnewton"])
def test_simulation_gives_the_in_process_model(tmp_path, method):
    cfg = FlowerRunConfig(method=method, dataset="a9a", clients=3, rounds=2, out=str(tmp_path / f"{method}.json"))
    result = run_flower(cfg, "simulation", 300)
    np.testing.assert_allclose(np.asarray(result["theta"]), in_process(cfg), rtol=1e-10, atol=1e-12)
    assert [h["used"] for h in result["history"]] == [3, 3]


@pytest.mark.slow
def test_deployment_gives_the_in_process_model_and_stops_everything(tmp_path):
    before = set(live_flower_processes())
    cfg = FlowerRunConfig(method="fedpm", dataset="a9a", clients=3, rounds=2, out=str(tmp_path / "r.json"))
    result = run_flower(cfg, "deployment", 300)
    np.testing.assert_allclose(np.asarray(result["theta"]), in_process(cfg), rtol=1e-10, atol=1e-12)
    assert result["history"][-1]["bytes_up_per_client"] > 123 * 8      # parameters + preconditioner block
    time.sleep(1)
    assert set(live_flower_processes()) <= before


@pytest.mark.slow
def test_a_supernode_dropping_out_is_tolerated(tmp_path):
    from fedpm_flower.deploy import LocalFederation

    cfg = FlowerRunConfig(method="fedpm", dataset="a9a", clients=3, rounds=2, timeout=20, out=str(tmp_path / "r.json"))
    with LocalFederation(3) as fed:
        result = fed.run(cfg, timeout=240, on_submitted=lambda f: f.kill_node(2))
    history = result["history"]
    # whether the killed node had registered (then it is counted as dropped) or not, every round
    # completes with the two that remain
    assert len(history) == 2 and all(h["used"] == 2 for h in history)
    assert np.all(np.isfinite(result["theta"]))


def _replies(cfg, theta):
    return {p: client_train(cfg, p, theta, 1) for p in range(cfg.clients)}


def test_server_rejects_bad_replies_and_renormalises(caplog):
    cfg = FlowerRunConfig(method="fedpm", dataset="a9a", clients=3, rounds=1)
    server = Server(cfg)
    good = _replies(cfg, server.theta)
    reference = Server(cfg)
    reference.step({0: good[0], 1: good[1]}, 1)                    # what two clients give
    bad = dict(good)
    bad[2] = {**good[2], "P_block": -good[2]["P_block"]}
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        used = server.step(bad, 1)
    assert used == {"used": 2, "rejected": 1}
    assert "client 2 rejected: preconditioner is not positive semidefinite" in caplog.text
    np.testing.assert_allclose(server.theta, reference.theta, rtol=1e-12)


@pytest.mark.parametrize("corrupt,reason", [
    (lambda r: {**r, "theta": r["theta"][:-1]}, "theta has shape (122,), expected (123,)"),
    (lambda r: {**r, "theta": np.full_like(r["theta"], np.nan)}, "theta contains NaN or Inf"),
    (lambda r: {**r, "P_active": r["P_active"] + 1000}, "feature indices"),
    (lambda r: {k: v for k, v in r.items() if k != "P_block"}, "missing the preconditioner"),
])
def test_each_kind_of_bad_reply(caplog, corrupt, reason):
    cfg = FlowerRunConfig(method="fedpm", dataset="a9a", clients=2, rounds=1)
    server = Server(cfg)
    replies = _replies(cfg, server.theta)
    replies[1] = corrupt(replies[1])
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        assert server.step(replies, 1)["rejected"] == 1
    assert f"client 1 rejected: {reason}" in caplog.text or reason in caplog.text


def test_no_usable_reply_keeps_the_model(caplog):
    cfg = FlowerRunConfig(method="fedpm", dataset="a9a", clients=2, rounds=1)
    server = Server(cfg)
    theta = server.theta.copy()
    replies = {p: {**r, "theta": r["theta"] * np.nan} for p, r in _replies(cfg, theta).items()}
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        assert server.step(replies, 1) == {"used": 0, "rejected": 2}
    np.testing.assert_array_equal(server.theta, theta)
    assert "round skipped, model unchanged" in caplog.text
    assert server.step({}, 2) == {"used": 0, "rejected": 0}         # every client dropped out


def test_float16_preconditioners_halve_the_upload():
    base = FlowerRunConfig(method="fedpm", dataset="a9a", clients=2, rounds=1)
    theta = np.zeros(123)
    b64 = client_train(base, 0, theta, 1)["P_block"].nbytes
    b16 = client_train(FlowerRunConfig(**{**base.to_run_config(), "precond_dtype": "float16"}), 0, theta, 1)["P_block"]
    assert b16.dtype == np.float16 and b16.nbytes * 4 == b64


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedpm", "localnewton"])
def test_cnn_simulation_gives_the_in_process_model(tmp_path, method):
    from fedpm_flower.cnn import in_process as cnn_in_process

    cfg = FlowerRunConfig(problem="cnn", method=method, clients=3, rounds=2, lr=0.1, out=str(tmp_path / "r.json"))
    result = run_flower(cfg, "simulation", 300)
    np.testing.assert_allclose(np.asarray(result["theta"]), cnn_in_process(cfg), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_cnn_deployment_gives_the_in_process_model(tmp_path):
    from fedpm_flower.cnn import in_process as cnn_in_process

    cfg = FlowerRunConfig(problem="cnn", method="fedpm", clients=3, rounds=2, lr=0.1, out=str(tmp_path / "r.json"))
    result = run_flower(cfg, "deployment", 300)
    np.testing.assert_allclose(np.asarray(result["theta"]), cnn_in_process(cfg), rtol=1e-5, atol=1e-6)
    assert result["history"][-1]["bytes_up_per_client"] > result["history"][-1]["bytes_down_per_client"]


def test_cnn_server_rejects_a_bad_preconditioner(caplog):
    from fedpm_flower.cnn import CnnServer, client_train

    cfg = FlowerRunConfig(problem="cnn", method="fedpm", clients=2, rounds=1, lr=0.1)
    server = CnnServer(cfg)
    replies = {p: client_train(cfg, p, server.broadcast(), 1, {})[0] for p in range(2)}
    replies[1]["foof/fc3"] = -replies[1]["foof/fc3"]
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        assert server.step(replies, 1) == {"used": 1, "rejected": 1}
    assert "client 1 rejected: preconditioner foof[fc3] is not positive semidefinite" in caplog.text


# ---------------------------------------------------------------- preconditioner codecs (issue 13)
@pytest.mark.slow
def test_sym_codec_simulation_gives_the_uncompressed_model(tmp_path):
    cfg = FlowerRunConfig(method="fedpm", dataset="a9a", clients=3, rounds=2, precond_codec="sym", timeout=600,
                          out=str(tmp_path / "sym.json"))
    result = run_flower(cfg, "simulation", 600)
    np.testing.assert_allclose(np.asarray(result["theta"]), in_process(cfg), rtol=1e-10, atol=1e-12)
    assert [h["used"] for h in result["history"]] == [3, 3]


@pytest.mark.slow
def test_cnn_sym_codec_simulation_gives_the_in_process_model(tmp_path):
    from fedpm_flower.cnn import in_process as cnn_in_process

    cfg = FlowerRunConfig(problem="cnn", method="fedpm", clients=3, rounds=2, lr=0.1, precond_codec="sym",
                          timeout=600, out=str(tmp_path / "r.json"))
    result = run_flower(cfg, "simulation", 600)
    np.testing.assert_allclose(np.asarray(result["theta"]), cnn_in_process(cfg), rtol=1e-5, atol=1e-6)


def test_codec_payloads_are_decoded_and_malformed_ones_rejected(caplog):
    cfg = FlowerRunConfig(method="fedpm", dataset="a9a", clients=3, rounds=1, precond_codec="sym")
    server = Server(cfg)
    replies = {p: client_train(cfg, p, server.theta, 1) for p in range(3)}
    n = len(replies[0]["P_active"])
    assert replies[0]["P_code/upper"].shape == (n * (n + 1) // 2,) and "P_block" not in replies[0]
    replies[2]["P_code/upper"] = replies[2]["P_code/upper"][:-1]
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        assert server.step(replies, 1) == {"used": 2, "rejected": 1}
    assert "client 2 rejected: undecodable preconditioner payload" in caplog.text


def test_delta_codecs_are_refused_on_flower():
    from fedpm_flower.logreg import algorithm

    with pytest.raises(ValueError, match="stateless"):
        algorithm(FlowerRunConfig(method="fedpm", precond_codec="delta:topk:0.1"))
