"""Every registered fedconvex method on Flower: the same global model as the in-process run (each client
drawing from its own random stream, ``client_streams``), on a loopback grid (fast, every method), in
Flower's simulation engine and in a real local deployment; bad, spoofed or missing replies are
rejected with a reason and the round completes with the others."""

import json
import logging
import os
import subprocess

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flower_loopback import LoopbackGrid  # noqa: E402

from fedconvex.algorithms import REGISTRY  # noqa: E402
from fedpm_flower import logreg, wire  # noqa: E402
from fedpm_flower.apps import serve  # noqa: E402
from fedpm_flower.config import FlowerRunConfig, RoundsWatch, rounds_done  # noqa: E402
from validation.flower import in_process  # noqa: E402

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
METHODS = sorted(REGISTRY)


def config(method="fedpm", **kw):
    lr = REGISTRY[method].__dataclass_fields__["lr"].default
    return FlowerRunConfig(**{"method": method, "dataset": "a9a", "clients": 3, "rounds": 2, "lr": lr, **kw})


def loopback(cfg, **kw):
    return serve(LoopbackGrid(cfg, **kw), cfg)


def live_flower_processes(mark: str):
    """The live Flower processes whose environment holds ``mark`` (NAME=VALUE): a run started with it in the
    environment passes it to every process it starts, and Flower runs of other programs on this machine have none."""
    out = subprocess.run(
        ["pgrep", "-f", "flower-superlink|flower-supernode|flwr-serverapp|flwr-clientapp"],
        capture_output=True,
        text=True,
    ).stdout.split()
    alive = []
    for pid in out:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                zombie = fh.read().rsplit(")", 1)[1].split()[0] == "Z"
            with open(f"/proc/{pid}/environ", "rb") as fh:
                marked = mark.encode() in fh.read().split(b"\0")
            if marked and not zombie:
                alive.append(int(pid))
        except OSError:
            pass
    return alive


# ------------------------------------------------------------------- equivalence, every method
VARIANTS = [  # random client draws, client state, sampling and sample weights through the wire
    dict(method="fednl", params='{"compressor": "randk", "k": 40}'),
    dict(method="fednl-pp", params='{"compressor": "natural"}', participants=2, clients=4),
    dict(method="fedns", params='{"sketch": "countsketch", "sketch_size": 60}', weighting="samples"),
    dict(method="fedpm", precond_codec="delta:topk:0.1", participants=2, clients=4, rounds=3),
    dict(method="fedpm", precond_codec="sym"),
    dict(method="scaffold", lr=1.0, participants=2, clients=5, weighting="samples", rounds=3),
    dict(method="fedadam", lr=1.0, participants=3, clients=5, rounds=3),
]


@pytest.mark.parametrize(
    "kw",
    [dict(method=m) for m in METHODS] + VARIANTS,
    ids=METHODS + [f"{v['method']}-{i}" for i, v in enumerate(VARIANTS)],
)
def test_every_method_on_flower_gives_the_in_process_model(kw):
    assert_equivalent(config(**kw), in_process, rtol=1e-10, atol=1e-12)


def assert_equivalent(cfg, reference, rtol, atol):
    """The Flower run (loopback grid) ends at the in-process model, every sampled client used every round."""
    result = loopback(cfg)
    np.testing.assert_allclose(np.asarray(result["theta"]), reference(cfg), rtol=rtol, atol=atol)
    expected = min(cfg.participants or cfg.clients, cfg.clients)
    assert [h["used"] for h in result["history"][1:]] == [expected] * cfg.rounds
    assert result["history"][-1]["rejected"] == 0


def test_bytes_are_counted_per_client_that_replied():
    full = loopback(config("scaffold"))["history"]
    dropped = loopback(config("scaffold"), tamper=lambda node, r: None if node == 102 else r)["history"]
    # SCAFFOLD sends dtheta and dc (2 x 123 float64) per client and round, however many replied
    assert full[-1]["bytes_up"] == dropped[-1]["bytes_up"] == 2 * 2 * 123 * 8
    assert [h["dropped"] for h in dropped[1:]] == [1, 1] and [h["used"] for h in dropped[1:]] == [2, 2]


def test_per_client_state_lives_on_the_nodes():
    from fedpm_flower.apps import _load_state

    cfg = config("scaffold", lr=1.0)
    grid = LoopbackGrid(cfg)
    serve(grid, cfg)
    c = [_load_state(grid.contexts[100 + i])["c"] for i in range(3)]
    assert all(x.shape == (1, 123) for x in c) and not np.allclose(c[0], c[1])  # each node its own c_i


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """Every method's run, and the CNN's stateful SCAFFOLD, in one Flower simulation (tests/flower_multirun.py):
    {name: (config, result)}."""
    from flower_multirun import simulate_runs

    cfgs = {**{m: config(m) for m in METHODS}, "cnn-scaffold": cnn_config("scaffold")}
    results = simulate_runs(cfgs, tmp_path_factory.mktemp("simulation"))
    return {name: (cfgs[name], results[name]) for name in cfgs}


def simulated_run(simulated, name):
    cfg, result = simulated[name]
    if "error" in result:
        raise RuntimeError(f"the ServerApp failed: {result['error']}")
    return cfg, result


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_simulation_gives_the_in_process_model(simulated, method):
    cfg, result = simulated_run(simulated, method)
    np.testing.assert_allclose(np.asarray(result["theta"]), in_process(cfg), rtol=1e-10, atol=1e-12)
    assert [h["used"] for h in result["history"][1:]] == [3, 3]


@pytest.mark.slow
def test_deployment_gives_the_in_process_model_and_stops_everything(deployment_runs):
    """A real secure deployment (the one shared by the deployment tests, tests/flower_deployment.py; its FedNL
    run): the in-process model, and no Flower process or private folder is left once the federation stops."""
    from flower_deployment import result_of

    result, cfg = result_of(deployment_runs, "fednl"), deployment_runs["configs"]["fednl"]
    np.testing.assert_allclose(np.asarray(result["theta"]), in_process(cfg), rtol=1e-10, atol=1e-12)
    assert not deployment_runs["procs_left"] and not deployment_runs["private_left"]


@pytest.mark.slow
def test_a_deployments_bar_counts_every_round_while_the_federation_runs(deployment_runs):
    """The launcher learns of each round from the ServerApp (a process of the SuperLink's) through its progress
    file: the bar of the shared deployment's FedNL run ends at every round, each count reported once and in
    order while the SuperLink and the 3 SuperNodes are alive."""
    from flower_deployment import result_of

    result, cfg = result_of(deployment_runs, "fednl"), deployment_runs["configs"]["fednl"]
    seen = deployment_runs["rounds_seen"]
    assert [done for done, _ in seen] == list(range(1, cfg.rounds + 1)) == [h["round"] for h in result["history"][1:]]
    assert min(alive for _, alive in seen) >= 4
    bar = [ln for ln in deployment_runs["bar"].replace("\r", "\n").splitlines() if ln.startswith("fednl rounds")]
    assert bar and f"{cfg.rounds}/{cfg.rounds}" in bar[-1], deployment_runs["bar"]


def test_the_server_writes_its_count_of_rounds_done_after_each_round(tmp_path):
    """What the launcher's bar reads in either mode (the ServerApp is another process): round t's replies
    arrive while the file says t - 1, and at the end it says every round; the launcher's watch reports each
    count once, as it grows."""
    out = str(tmp_path / "r.json")
    cfg = config("fedpm", rounds=3, out=out)
    seen, reported = [], []
    watch = RoundsWatch(out, reported.append)

    def note(node, reply):
        if reply.metadata.message_type == "train":
            seen.append(rounds_done(out))
            watch()
        return reply

    assert rounds_done(out) == 0  # no file yet
    result = loopback(cfg, tamper=note)
    watch()
    assert seen == [0] * 3 + [1] * 3 + [2] * 3 and reported == [1, 2, 3]
    assert rounds_done(out) == 3 == result["history"][-1]["round"]
    with open(out + ".progress.tmp", "w") as fh:
        fh.write("")  # created by the first heartbeat, before any round
    assert rounds_done(out) == 0


@pytest.mark.slow
def test_a_supernode_dropping_out_is_tolerated(deployment_runs):
    """A run submitted while SuperNode 2 is dead (tests/flower_deployment.py)."""
    from flower_deployment import result_of

    result, cfg = result_of(deployment_runs, "dead"), deployment_runs["configs"]["dead"]
    history = result["history"][1:]
    # whether the killed node is still registered (then it is counted as dropped) or not, every round
    # completes with the two that remain
    used = [h["used"] for h in history]
    assert len(used) == cfg.rounds and all(u == 2 for u in used), (used, result.get("server_warnings"))
    assert np.all(np.isfinite(result["theta"]))


# ------------------------------------------------------------------------- hostile replies
def corrupt_arrays(node, fn):
    """A tamper hook: node ``node``'s (None: every node's) 'train' replies get arrays ``fn(arrays)``."""
    from fedpm_flower.transport import numpy, records

    def tamper(dst, reply):
        if node not in (None, dst) or reply.has_error() or reply.metadata.message_type != "train":
            return reply
        reply.content["arrays"] = records(fn(numpy(reply.content["arrays"])))
        return reply

    return tamper


@pytest.mark.parametrize("method,field", [("scaffold", "dtheta"), ("fednl", "grad")])
def test_a_node_whose_reply_was_rejected_rolls_back_the_state_the_server_tracks(method, field):
    """Round 2 rejects node 102's reply: the node is told with its next message and restores its c_i / H_i,
    so the run equals the in-process run with the same rejection (server and clients stay in step)."""
    from fedconvex.run import run
    from fedpm_flower.apps import _load_state

    cfg = config(method, rounds=4, **({"lr": 1.0} if method == "scaffold" else {}))
    tamper = in_round(2, corrupt_arrays(102, lambda a: {**a, field: a[field] * np.nan}))

    grid = LoopbackGrid(cfg, tamper=tamper)
    result = serve(grid, cfg)
    assert [h["rejected"] for h in result["history"][1:]] == [0, 1, 0, 0]

    def nan_client_2(t, up):
        if t != 2:
            return up
        bad = np.array(up[field], copy=True)
        bad[2] = np.nan
        return {**up, field: bad}

    problem, alg = _in_process_parts(cfg)
    state, _ = run(
        problem, alg, np.zeros(problem.d), cfg.rounds, tamper=nan_client_2, client_streams=True, seed=cfg.seed
    )
    np.testing.assert_allclose(np.asarray(result["theta"]), state.theta, rtol=1e-10, atol=1e-12)
    key = alg.server_tracked_state[0]
    node_state = _load_state(grid.contexts[102])[key]
    mine = state.clients[key][[2]]
    np.testing.assert_allclose(
        np.asarray(getattr(node_state, "packed", node_state)),
        np.asarray(getattr(mine, "packed", mine)),
        rtol=1e-10,
        atol=1e-12,
    )


def _in_process_parts(cfg):
    from fedconvex.data import load_dataset
    from fedconvex.problem import FederatedLogReg
    from fedpm_flower.logreg import algorithm, split

    ds = load_dataset(cfg.dataset)
    return FederatedLogReg(ds.X, ds.y, split(cfg, ds.n), lam=cfg.lam, weighting=cfg.weighting), algorithm(cfg)


def in_round(k, tamper):
    """``tamper`` applied only to each node's k-th 'train' reply."""
    seen = {}

    def hook(node, reply):
        if reply.has_error() or reply.metadata.message_type != "train":
            return reply
        seen[node] = seen.get(node, 0) + 1
        return tamper(node, reply) if seen[node] == k else reply

    return hook


def test_a_rejected_reply_is_as_if_its_client_had_dropped_out(caplog):
    cfg = config("fedpm", rounds=1)
    two = loopback(cfg, tamper=lambda node, r: None if node == 102 else r)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        bad = loopback(cfg, tamper=corrupt_arrays(102, lambda a: {**a, "P/block": -a["P/block"]}))
    assert bad["history"][1]["used"] == 2 and bad["history"][1]["rejected"] == 1
    assert "client 2 rejected: preconditioner P is not positive semidefinite" in caplog.text
    np.testing.assert_allclose(bad["theta"], two["theta"], rtol=1e-12)


@pytest.mark.parametrize(
    "fn,reason",
    [
        (lambda a: {**a, "theta": a["theta"][:-1]}, "theta has shape (122,), expected (123,)"),
        (lambda a: {**a, "theta": np.full_like(a["theta"], np.nan)}, "theta contains NaN or Inf"),
        (lambda a: {**a, "P/active": a["P/active"] + 1000}, "P: feature indices outside 0..122"),
        (lambda a: {k: v for k, v in a.items() if k != "P/block"}, "missing 'P/block'"),
        (lambda a: {**a, "extra": a["theta"]}, "unexpected entry 'extra'"),
        (lambda a: {**a, "P/block": a["P/block"].astype(np.complex64)}, "P: block has dtype complex64"),
        (lambda a: {**a, "P/active": a["P/active"].astype(np.float64)}, "P: feature indices has dtype float64"),
        (lambda a: {**a, "theta": a["theta"].astype(np.complex128)}, "theta has dtype complex128"),
    ],
    ids=["shape", "nan", "indices", "missing", "extra", "complex-block", "float-indices", "complex-theta"],
)
def test_each_kind_of_bad_reply(caplog, fn, reason):
    cfg = config("fedpm", clients=2, rounds=1)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = loopback(cfg, tamper=corrupt_arrays(101, fn))
    assert result["history"][1]["rejected"] == 1 and result["history"][1]["used"] == 1
    assert f"client 1 rejected: {reason}" in caplog.text


def test_no_usable_reply_keeps_the_model(caplog):
    cfg = config("fedpm", clients=2, rounds=1)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = loopback(cfg, tamper=corrupt_arrays(None, lambda a: {**a, "theta": a["theta"] * np.nan}))
    assert result["history"][1]["used"] == 0 and result["history"][1]["rejected"] == 2
    np.testing.assert_array_equal(result["theta"], np.zeros(123))
    assert "round skipped, model unchanged" in caplog.text
    everyone_gone = loopback(cfg, tamper=lambda node, r: r if r.metadata.message_type == "query" else None)
    assert everyone_gone["history"][1]["dropped"] == 2 and np.all(np.asarray(everyone_gone["theta"]) == 0)


def test_spoofed_client_ids_are_rejected(caplog):
    cfg = config("fedavg", lr=10.0, rounds=1)

    def spoof(node, reply):
        if node == 102 and reply.metadata.message_type == "train":
            reply.content["metrics"]["client"] = 0
        return reply

    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = loopback(cfg, tamper=spoof)
        twice = loopback(cfg, nodes=[0, 1, 1])  # two nodes claim client 1
    assert result["history"][1]["rejected"] == 1 and "claims client id 0 but node 102 holds client 2" in caplog.text
    assert "setup: node 102 rejected: client id 1 is held by node 101" in caplog.text
    assert twice["history"][1]["used"] == 2 and twice["history"][1]["dropped"] == 1


def test_float16_preconditioners_quarter_the_block():
    cfg = config("fedpm")
    up, _ = logreg.client_reply(cfg, 0, {"theta": np.zeros(123)}, {}, 1)
    b64, b16 = wire.flatten(up)["P/block"], wire.flatten(up, 0, "float16")["P/block"]
    assert b16.dtype == np.float16 and b16.nbytes * 4 == b64.nbytes


def test_codec_payloads_are_decoded_and_malformed_ones_rejected(caplog):
    cfg = config("fedpm", rounds=1, precond_codec="sym")
    up, _ = logreg.client_reply(cfg, 0, {"theta": np.zeros(123)}, {}, 1)
    flat = wire.flatten(up)
    n = len(flat["P/active"])
    assert flat["P/code/upper"].shape == (n * (n + 1) // 2,) and "P/block" not in flat
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = loopback(cfg, tamper=corrupt_arrays(102, lambda a: {**a, "P/code/upper": a["P/code/upper"][:-1]}))
    assert result["history"][1]["used"] == 2 and "client 2 rejected: undecodable preconditioner payload" in caplog.text


@pytest.mark.parametrize(
    "method,fn,reason",
    [
        ("fednl", lambda a: {**a, "blocks": a["blocks"][:-1]}, "blocks has shape"),
        ("fednl", lambda a: {**a, "active": a["active"] + 500}, "active outside 0..122"),
        ("fedns", lambda a: {**a, "SAt": a["SAt"][:-1]}, "SAt has shape"),
    ],
    ids=["fednl-block", "fednl-active", "fedns-rows"],
)
def test_entries_sized_by_the_active_features_must_match_them(caplog, method, fn, reason):
    cfg = config(method, rounds=1)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = loopback(cfg, tamper=corrupt_arrays(101, fn))
    assert result["history"][1]["used"] == 2 and f"client 1 rejected: {reason}" in caplog.text


def test_out_of_range_compressor_indices_are_rejected_before_decoding(caplog):
    cfg = config("fednl", rounds=1, params='{"compressor": "topk", "k": 30}')
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = loopback(cfg, tamper=corrupt_arrays(101, lambda a: {**a, "index": a["index"] + 10**6}))
    assert result["history"][1]["used"] == 2 and "client 1 rejected: index outside 0..7625" in caplog.text


# ------------------------------------------------------------------------------------ the CNN
from fedpm_dnn.algorithms import METHODS as DNN_METHODS  # noqa: E402

CNN_VARIANTS = [  # sampling, sample weights, stateful clients, float16 and encoded preconditioners on the wire
    dict(method="scaffold", participants=2, clients=4, rounds=3, weighting="samples"),
    dict(method="fedadam", participants=2, clients=4, rounds=3),
    dict(method="fedpm", precond_dtype="float16"),
    dict(method="fedpm", precond_codec="sym"),
    # the delta codecs: estimates on the nodes, acknowledgements kept by the server and sent with each message
    dict(method="fedpm", precond_codec="delta:topk:0.5", participants=2, clients=4, rounds=3),
    dict(method="fedpm", precond_codec="delta:identity", participants=2, clients=4, rounds=3),
]


def cnn_config(method="fedpm", **kw):
    return FlowerRunConfig(**{"problem": "cnn", "method": method, "clients": 3, "rounds": 2, "lr": 0.1, **kw})


@pytest.mark.parametrize(
    "kw",
    [dict(method=m) for m in DNN_METHODS] + CNN_VARIANTS,
    ids=list(DNN_METHODS) + [f"{v['method']}-{i}" for i, v in enumerate(CNN_VARIANTS)],
)
def test_cnn_every_method_on_flower_gives_the_in_process_model(kw):
    from fedpm_flower.cnn import in_process as cnn_in_process

    assert_equivalent(cnn_config(**kw), cnn_in_process, rtol=1e-5, atol=1e-6)


def test_cnn_client_state_lives_on_the_nodes_and_bytes_count_per_client_that_replied():
    from fedpm_flower import cnn
    from fedpm_flower.transport import numpy

    cfg = cnn_config("scaffold")
    grid = LoopbackGrid(cfg)
    full = serve(grid, cfg)["history"]
    controls = [cnn.nest(numpy(grid.contexts[100 + i].state["cnn-state"]))["control"] for i in range(3)]
    assert all(set(c) == set(controls[0]) for c in controls)  # each node its own control c_i
    assert not all(bool((controls[0][k] == controls[1][k]).all()) for k in controls[0])
    dropped = loopback(cfg, tamper=lambda node, r: None if node == 102 else r)["history"]
    assert [h["dropped"] for h in dropped[1:]] == [1, 1] and [h["used"] for h in dropped[1:]] == [2, 2]
    n_params = sum(c.numel() for c in controls[0].values())
    # SCAFFOLD sends the parameters and the control change (float32) per client, however many replied
    assert full[-1]["bytes_up"] == dropped[-1]["bytes_up"] == 2 * 2 * n_params * 4


def _nan_params_of_client_2_in_round_2(t, client, reply):
    """The in-process counterpart of node 102's corrupted second reply (fedpm_dnn's tamper hook)."""
    import torch

    if t == 2 and client == 2:
        reply = {**reply, "params": {k: v * torch.nan for k, v in reply["params"].items()}}
    return reply


def test_cnn_a_node_whose_reply_was_rejected_rolls_back_its_control():
    """Round 2 rejects node 102's reply: it restores its SCAFFOLD control when told, so the run equals the
    in-process run with the same rejection."""
    from fedpm_flower.cnn import in_process as cnn_in_process

    cfg = cnn_config("scaffold", rounds=4)
    tamper = in_round(
        2, corrupt_arrays(102, lambda a: {k: v * np.nan if k.startswith("params/") else v for k, v in a.items()})
    )

    result = serve(LoopbackGrid(cfg, tamper=tamper), cfg)
    assert [h["rejected"] for h in result["history"][1:]] == [0, 1, 0, 0]

    np.testing.assert_allclose(
        np.asarray(result["theta"]),
        cnn_in_process(cfg, tamper=_nan_params_of_client_2_in_round_2),
        rtol=1e-5,
        atol=1e-6,
    )


def test_cnn_delta_codec_a_rejected_reply_resyncs_as_in_process():
    """FedPM with a delta codec: round 2 rejects node 102's reply (screening, after decoding).  The server
    does not take its pending estimate and tells the node so with its next message (the acknowledgement it
    keeps for it), so the run equals the in-process run with the same rejection."""
    from fedpm_flower import cnn
    from fedpm_flower.cnn import in_process as cnn_in_process
    from fedpm_flower.transport import numpy

    cfg = cnn_config("fedpm", precond_codec="delta:topk:0.5", rounds=4)
    tamper = in_round(
        2, corrupt_arrays(102, lambda a: {k: v * np.nan if k.startswith("params/") else v for k, v in a.items()})
    )

    grid = LoopbackGrid(cfg, tamper=tamper)
    result = serve(grid, cfg)
    assert [h["rejected"] for h in result["history"][1:]] == [0, 1, 0, 0]
    kept = cnn.nest(numpy(grid.contexts[102].state["cnn-state"]))
    assert "foof_hat" in kept and "foof_ack" not in kept  # estimates on the node, acknowledgements not

    np.testing.assert_allclose(
        np.asarray(result["theta"]),
        cnn_in_process(cfg, tamper=_nan_params_of_client_2_in_round_2),
        rtol=1e-5,
        atol=1e-6,
    )


def _last(a):  # the reply's last parameter entry
    return sorted(k for k in a if k.startswith("params/"))[-1]


@pytest.mark.parametrize(
    "method,fn,reason",
    [
        ("fedpm", lambda a: {**a, "foof/fc3": -a["foof/fc3"]}, "preconditioner foof[fc3] is not positive semidefinite"),
        ("fedavg", lambda a: {**a, _last(a): a[_last(a)][:-1]}, "has shape"),
        ("fedavg", lambda a: {**a, _last(a): a[_last(a)] * np.nan}, "NaN or Inf"),
        ("fedavg", lambda a: {k: v for k, v in a.items() if k != _last(a)}, "params has entries"),
        ("fedavg", lambda a: {**a, "extra": a[_last(a)]}, "unexpected entries ['extra']"),
        ("fedavg", lambda a: {**a, _last(a): a[_last(a)].astype(np.complex64)}, "complex"),
        ("fedavg", lambda a: {**a, _last(a): a[_last(a)].astype(np.float64)}, "has dtype float64, expected float32"),
        ("scaffold", lambda a: {k: v for k, v in a.items() if not k.startswith("dcontrol/")}, "missing 'dcontrol'"),
    ],
    ids=["not-psd", "shape", "nan", "missing", "extra", "complex", "dtype", "missing-field"],
)
def test_cnn_each_kind_of_bad_reply(caplog, method, fn, reason):
    cfg = cnn_config(method, clients=2, rounds=1)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = loopback(cfg, tamper=corrupt_arrays(101, fn))
    assert result["history"][1]["rejected"] == 1 and result["history"][1]["used"] == 1
    assert any("client 1 rejected: " in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_cnn_malformed_metrics_and_spoofed_ids_are_rejected(caplog):
    cfg = cnn_config("fedavg", rounds=1)

    def lie(node, reply):
        if reply.metadata.message_type == "train" and node == 101:
            reply.content["metrics"]["samples"] = -5  # would flip its mixing weight's sign
        if reply.metadata.message_type == "train" and node == 102:
            reply.content["metrics"]["client"] = 0
        return reply

    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = loopback(cfg, tamper=lie)
    assert result["history"][1]["rejected"] == 2 and result["history"][1]["used"] == 1
    assert "client 1 rejected: sample count -5" in caplog.text
    assert "claims client id 0 but node 102 holds client 2" in caplog.text

    def inflate(node, reply):  # the server knows the synthetic split: a node claiming more data is refused
        if reply.metadata.message_type == "train" and node == 101:
            reply.content["metrics"]["samples"] = 10**6
        return reply

    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = loopback(cnn_config("fedavg", rounds=1, weighting="samples"), tamper=inflate)
    assert (
        result["history"][1]["rejected"] == 1
        and "client 1 rejected: reports 1000000 samples, its partition has 48" in caplog.text
    )


@pytest.mark.slow
def test_cnn_simulation_gives_the_in_process_model(simulated):
    """Flower's simulation engine (one process per node run, Context.state kept by Flower): a stateful method."""
    from fedpm_flower.cnn import in_process as cnn_in_process

    cfg, result = simulated_run(simulated, "cnn-scaffold")
    np.testing.assert_allclose(np.asarray(result["theta"]), cnn_in_process(cfg), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_cnn_deployment_gives_the_in_process_model(deployment_runs):
    from flower_deployment import result_of

    from fedpm_flower.cnn import in_process as cnn_in_process

    result, cfg = result_of(deployment_runs, "cnn"), deployment_runs["configs"]["cnn"]
    np.testing.assert_allclose(np.asarray(result["theta"]), cnn_in_process(cfg), rtol=1e-5, atol=1e-6)
    assert result["history"][-1]["bytes_up"] > result["history"][-1]["bytes_down"]


# ------------------------------------------------------------------ CIFAR: one folder per client
def fake_cifar(root, n=40, seed=0):
    from fake_cifar import cifar_pickle

    cifar_pickle(root, n, seed, balanced=True)


def test_prepare_writes_each_clients_partition_and_a_node_reads_only_its_folder(tmp_path, capsys):
    import torch

    from fedpm_dnn.data import effective_classes, load_image_dataset
    from fedpm_dnn.data.partition import make_partition
    from fedpm_flower import cnn, prepared
    from validation import flower

    fake_cifar(str(tmp_path / "data"))
    out = tmp_path / "parts"
    assert flower.main(["prepare", "--data-dir", str(tmp_path / "data"), "--clients", "3", "--out", str(out)]) == 0
    data, _ = load_image_dataset("cifar10", str(tmp_path / "data"))
    parts = make_partition("relaysum", data.y_train, 3, 0.1, seed=0)  # validation.dnn's split
    for i, part in enumerate(parts):
        x, y, meta = prepared.load(prepared.client_folder(str(out), i), "train.npz")
        np.testing.assert_array_equal(x, data.x_train[part])
        np.testing.assert_array_equal(y, data.y_train[part])
    assert sorted(os.listdir(out)) == ["client-0", "client-1", "client-2", "meta.json", "server"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["effective_classes_per_client"] == pytest.approx(effective_classes(meta["class_counts"]).mean())
    cfg = FlowerRunConfig(problem="cnn", method="fedpm", clients=3, rounds=1, lr=0.1, data_dir="")
    # a node is handed its folder in its node config: that folder is its data, whatever its partition id
    mine = cnn.client_data(cfg, 0, prepared.client_folder(str(out), 2))
    assert torch.equal(mine.y, torch.as_tensor(data.y_train[parts[2]]))
    assert cnn._shape_of(cfg, prepared.client_folder(str(out), 2)) == (10, 3, 32)
    with pytest.raises(SystemExit):  # never over an existing data set
        flower.main(["prepare", "--data-dir", str(tmp_path / "data"), "--clients", "3", "--out", str(out)])


def test_cnn_on_prepared_data_trains_each_node_on_its_own_folder(tmp_path):
    """The CIFAR path on a loopback grid: nodes read their prepared folders, the server reports the final
    model's test accuracy; each node's reported sample count is its folder's."""
    from validation import flower

    fake_cifar(str(tmp_path / "data"))
    out = str(tmp_path / "parts")
    assert flower.main(["prepare", "--data-dir", str(tmp_path / "data"), "--clients", "3", "--out", out]) == 0
    cfg = cnn_config("fedavg", rounds=1, data_dir=out, weighting="samples")
    grid = LoopbackGrid(cfg)
    result = serve(grid, cfg)
    assert result["history"][1]["used"] == 3 and 0.0 <= result["test_acc"] <= 1.0
    assert len(result["theta"]) > 0 and np.all(np.isfinite(result["theta"]))


@pytest.mark.slow
def test_the_check_command_passes_and_writes_the_one_history_format(flower_check_runs):
    """README's command `python -m validation.flower --problem logreg --dataset a9a --method fedpm ... --mode simulation
    --check` exits 0, and history.csv holds the very rows of result.json's history (fedconvex.history)."""
    import json

    from fedconvex.history import read_run

    code, out, _, stdout = flower_check_runs["fedpm"]
    assert code == 0
    # the result's path as the user typed it (relative), as the other commands print theirs
    assert f"wrote {out.name}/result.json and history.csv beside it" in stdout, stdout
    result = json.loads((out / "result.json").read_text())
    assert result["max_abs_diff_vs_in_process"] <= 1e-9
    rows = read_run(out / "history.csv")
    assert [r["round"] for r in rows] == [h["round"] for h in result["history"]]
    assert [r["bytes_up"] for r in rows] == [h["bytes_up"] for h in result["history"]]


def test_check_refuses_fedns_bartlett_before_starting_anything(tmp_path, capsys):
    """The Bartlett draw is exact in distribution but not round-off-stable: a --check run would fail after the
    whole Flower run; it is refused up front, in one line, with nothing written."""
    from validation.flower import main

    out = tmp_path / "r"
    with pytest.raises(SystemExit):
        main(
            [
                "--problem",
                "logreg",
                "--method",
                "fedns",
                "--params",
                '{"gaussian_draw": "bartlett"}',
                "--clients",
                "3",
                "--rounds",
                "1",
                "--check",
                "--out",
                str(out),
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not round-off-stable" in err[0] and "'dense'" in err[0]
    assert not out.exists()
