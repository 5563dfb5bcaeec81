"""The Flower strategy ``fedpm_flower.strategy.FedPM``, the client helper ``fedpm_fit`` and the example app
examples/flower-fedpm (the paper's SimpleCNN on FEMNIST writers) in-process and under ``flwr run``."""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flwr = pytest.importorskip("flwr")

from federations import federation  # noqa: E402
from flower_loopback import AppGrid  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME  # noqa: E402

from fedpm_dnn import FOOF, mix  # noqa: E402
from fedpm_flower.client import fedpm_fit  # noqa: E402
from fedpm_flower.strategy import FedPM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "flower-fedpm")


def leaf_femnist(root, writers=6, per_writer=14, seed=0):
    """Small generated LEAF FEMNIST files: train/ and test/ JSON, ``writers`` users, digits-like random images."""
    g = np.random.default_rng(seed)
    for split, n in (("train", per_writer), ("test", 4)):
        os.makedirs(os.path.join(root, split))
        users = [f"f{i:04d}" for i in range(writers)]
        data = {
            "users": users,
            "num_samples": [n] * writers,
            "user_data": {
                u: {"x": g.random((n, 784)).round(3).tolist(), "y": g.integers(0, 62, n).tolist()} for u in users
            },
        }
        with open(os.path.join(root, split, "all_data_0.json"), "w") as fh:
            json.dump(data, fh)
    return root


def example_modules():
    if EXAMPLE not in sys.path:
        sys.path.insert(0, EXAMPLE)
    from fedpmexample import client_app, server_app, task

    return client_app, server_app, task


def example_config(data_dir, **overrides):
    import tomllib

    with open(os.path.join(EXAMPLE, "pyproject.toml"), "rb") as fh:
        cfg = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    return {**cfg, "data-dir": str(data_dir), **overrides}


def in_process(data_dir, nodes=3, rounds=2, **overrides):
    """The example's ServerApp logic with its ClientApp in this process (one Context per node)."""
    client_app, server_app, task = example_modules()
    cfg = example_config(data_dir, **overrides)
    grid = AppGrid(
        {"train": client_app.train},
        [{"partition-id": i, "num-partitions": nodes} for i in range(nodes)],
        run_config=cfg,
    )
    torch.manual_seed(int(cfg["seed"]))
    model = task.make_net(str(data_dir))
    strategy = server_app.make_strategy(cfg)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=rounds,
        train_config=server_app.train_config(cfg),
    )
    return result, strategy, grid


def test_the_example_trains_through_the_strategy_and_keeps_the_matrices_per_node(tmp_path):
    data = leaf_femnist(str(tmp_path / "leaf"))
    result, strategy, grid = in_process(data, rounds=2, lr=0.05)
    losses = [float(result.train_metrics_clientapp[r]["train_loss"]) for r in (1, 2)]
    assert all(np.isfinite(losses)) and losses[1] < losses[0]
    assert strategy.rejected == {1: [], 2: []}
    for ctx in grid.contexts.values():  # the end-of-round matrices, for the next round's steps
        kept = ctx.state["fedpm.foof"].to_torch_state_dict()
        assert sorted(kept) == ["conv1", "conv2", "fc1", "fc2", "fc3"]
        assert kept["conv1"].shape == (26, 26) and kept["fc1"].shape == (257, 257)  # 1x5x5 + 1, 16x4x4 + 1


def _clients(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(20, 5, generator=g) + i, torch.randint(0, 3, (20,), generator=g)) for i in range(n)]


def _net():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _handler(data, loss_fn=torch.nn.functional.cross_entropy):
    def train(msg, context):
        model = _net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = data[context.node_config["partition-id"]]
        return Message(fedpm_fit(model, [(x, y)], msg.content["config"], context.state, loss_fn), reply_to=msg)

    return train


def _one_round(data, tamper=None, first_node=100, **strategy_kw):
    nodes = [{"partition-id": i} for i in range(len(data))]
    grid = AppGrid({"train": _handler(data)}, nodes, tamper=tamper, first_node=first_node)
    strategy = FedPM(damping=0.1, fraction_evaluate=0.0, **strategy_kw)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_net().state_dict()),
        num_rounds=1,
        train_config=ConfigRecord({"lr": 0.1, "local-epochs": 2}),
    )
    return result.arrays.to_torch_state_dict(), strategy, result.train_metrics_clientapp[1]


@pytest.mark.parametrize("first_node", [100, 2**63 + 1])  # node ids are unsigned 64-bit: these straddle 2**63
def test_the_strategy_mixes_as_fedpm_dnn_mix_does(first_node):
    data = _clients()
    got, strategy, metrics = _one_round(data, first_node=first_node - len(data), weighting="samples")
    assert strategy.rejected == {1: []} and metrics["rejected"] == 0
    states, mats, losses = [], [], []
    for x, y in data:  # the same clients, by hand: FOOF steps, then mix
        model = _net()
        opt = FOOF(model, lr=0.1, damping=0.1)
        opt.update_statistics([x])
        for _ in range(2):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        states.append(model.state_dict())
        mats.append({k: v.float() for k, v in opt.update_statistics([x]).items()})
    expect = mix(states, mats, weights=[20, 20, 20], damping=0.1)
    assert metrics["train_loss"] == pytest.approx(np.mean(losses))  # every node's reply counted
    assert list(got) == list(expect)
    for k in expect:
        torch.testing.assert_close(got[k], expect[k], rtol=1e-6, atol=1e-6)


def test_identical_clients_give_back_their_model():
    x, y = _clients(1)[0]
    data = [(x, y)] * 3
    got, _, _ = _one_round(data)
    model = _net()
    ref = fedpm_fit(model, [(x, y)], {"lr": 0.1, "local-epochs": 2, "damping": 0.1})
    for k, v in ref["arrays"].to_torch_state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def _screened(edit):
    data = _clients()
    seen = {}

    def tamper(dst, reply):
        if dst != 101:
            return reply
        c = reply.content
        arrays, foof = edit(c["arrays"].to_torch_state_dict(), c["foof"].to_torch_state_dict())
        content = RecordDict({"arrays": ArrayRecord(arrays), "foof": ArrayRecord(foof), "metrics": c["metrics"]})
        reply.content = content
        seen["done"] = True
        return reply

    got, strategy, _ = _one_round(data, tamper=tamper)
    assert seen
    honest, _, _ = _one_round(data[::2])  # the round without node 101's client
    return got, honest, strategy.rejected[1]


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda a, f: ({**a, "3.weight": a["3.weight"] * float("nan")}, f), "NaN or Inf"),
        (lambda a, f: (a, {**f, "0": -f["0"]}), "positive semidefinite"),
        (lambda a, f: ({**a, "1.weight": torch.ones(9)}, f), "shape"),
        (lambda a, f: (a, {**f, "2": torch.eye(4)}), "names no layer"),
    ],
)
def test_bad_replies_are_screened_out_and_the_others_mixed(edit, reason, caplog):
    got, honest, rejected = _screened(edit)
    assert [n for n, _ in rejected] == [101], rejected
    assert reason in rejected[0][1] or "client 101 rejected: " in caplog.text and reason in caplog.text
    for k in honest:
        torch.testing.assert_close(got[k], honest[k], rtol=1e-5, atol=1e-6)


def _flwr_run(app, data_dir, out, rounds, nodes, home):
    """``flwr run`` of ``app`` in simulation on a SuperLink of our own (free port, own FLWR_HOME); waits for ``out``."""
    from fedpm_flower.deploy import executable, free_port

    port = free_port()
    os.makedirs(home)
    with open(os.path.join(home, "config.toml"), "w") as fh:
        fh.write(f'[superlink]\ndefault = "sim"\n\n[superlink.sim]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {
        **os.environ,
        "FLWR_HOME": home,
        "FLWR_TELEMETRY_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join([ROOT, app, os.environ.get("PYTHONPATH", "")]),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    link = subprocess.Popen(
        [executable("flower-superlink"), "--insecure", "--simulation", "--host", "127.0.0.1", "--port", str(port)]
        + ["--database", FLWR_IN_MEMORY_DB_NAME, "--disable-runtime-dependency-installation"],
        env=env,
        cwd=home,
        stdout=open(os.path.join(home, "superlink.log"), "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        run_config = f"num-server-rounds={rounds} data-dir={json.dumps(data_dir)} out-file={json.dumps(out)}"
        cmd = [executable("flwr"), "run", app, "sim", "--run-config", run_config]
        cmd += ["--federation-config", f"num-supernodes={nodes}"]
        deadline = time.time() + 60
        while True:  # the SuperLink needs a moment before it accepts the run
            sub = subprocess.run(cmd, env=env, cwd=home, capture_output=True, text=True, timeout=120)
            if sub.returncode == 0 or time.time() > deadline:
                break
            time.sleep(1)
        assert sub.returncode == 0, sub.stdout + sub.stderr
        deadline = time.time() + 400
        while not os.path.exists(out) and time.time() < deadline and link.poll() is None:
            time.sleep(1)
        time.sleep(0.5)
        if not os.path.exists(out):  # the run's own log (its ServerApp's and ClientApps' output) says why
            run_id = re.search(r"\brun (\d+)", sub.stdout + sub.stderr)
            shown = "(no run id in flwr run's output)"
            if run_id:
                cmd = [executable("flwr"), "log", run_id.group(1), "sim", "--show"]
                got = subprocess.run(cmd, env=env, cwd=home, capture_output=True, text=True, timeout=120)
                text = got.stdout + got.stderr
                # the cause comes first (an exception in a ClientApp or a Ray worker), Flower's wrap-up last
                causes = [line for line in text.splitlines() if re.search(r"Error|Exception|Killed|memory", line)]
                shown = "\n".join(causes[:15]) + "\n...\n" + text[-2500:]
            with open(os.path.join(home, "superlink.log"), errors="replace") as fh:
                pytest.fail(f"no final model; the run's log:\n{shown}\nthe SuperLink's:\n{fh.read()[-1000:]}")
        return torch.load(out, weights_only=True)
    finally:
        os.killpg(link.pid, 15)
        link.wait(timeout=30)


@pytest.mark.slow
def test_flwr_run_of_the_example_gives_the_in_process_model(tmp_path):
    data = leaf_femnist(str(tmp_path / "leaf"))
    with federation():
        flwr_model = _flwr_run(EXAMPLE, data, str(tmp_path / "final.pt"), 2, 3, str(tmp_path / "flwr-home"))
    result, _, _ = in_process(data, nodes=3, rounds=2)
    ours = result.arrays.to_torch_state_dict()
    assert list(flwr_model) == list(ours)
    for k in ours:
        torch.testing.assert_close(flwr_model[k], ours[k], rtol=1e-5, atol=1e-6)


def test_the_example_server_app_on_cifar_writes_its_history_and_the_readme_names_what_it_runs(tmp_path):
    """The example's default path at a tiny size: CIFAR-10 files (generated), its ServerApp's own main on a grid
    that hands messages to its ClientApp, a subset of the training and test images, the history file after every
    round; and the README's command uses a throw-away FLWR_HOME, streams the log and names only run-config keys
    the app has."""
    import csv

    from fake_cifar import cifar_pickle
    from flwr.app import Context, RecordDict

    client_app, server_app, task = example_modules()
    data = str(tmp_path / "data")
    cifar_pickle(os.path.join(data, "cifar-10-batches-py"), n=40)
    history = tmp_path / "history.csv"
    cfg = example_config(data, **{"train-images": 90, "test-images": 25, "history-file": str(history)})
    cfg["num-server-rounds"] = 2
    nodes = [{"partition-id": i, "num-partitions": 3} for i in range(3)]
    grid = AppGrid({"train": client_app.train}, nodes, run_config=cfg)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    with open(history) as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["round"]) for r in rows] == [0, 1, 2]
    assert all(float(r["test_accuracy"]) in {k / 25 for k in range(26)} for r in rows)  # 25 test images
    x, _, _ = task._train_set(data, 90)
    assert x.shape == (90, 3, 32, 32)
    assert sorted(grid.contexts[100].state["fedpm.foof"].to_torch_state_dict()) == [
        "conv1",
        "conv2",
        "fc1",
        "fc2",
        "fc3",
    ]
    with open(os.path.join(EXAMPLE, "README.md")) as fh:
        readme = fh.read()
    command = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    assert 'export FLWR_HOME="$(mktemp -d)"' in command and "$HOME/.flwr" not in command
    assert "flwr run . --stream" in command
    keys = re.findall(r"(\w[\w-]*)=", re.search(r'--run-config "([^"]*)"', command).group(1))
    assert keys and set(keys) <= set(example_config(data))
