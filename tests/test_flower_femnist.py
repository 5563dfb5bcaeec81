"""FEMNIST on Flower: LEAF's writers as clients.  ``prepare --dataset femnist`` gives each writer a folder of its
own; nodes that hold only their own writer's folder, 10 sampled per round, give FedPM's in-process model
(fedpm_dnn's simulator on the same LEAF files through validation.dnn) to round-off."""

import gzip
import json
import os
import shutil

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
torch = pytest.importorskip("torch")

from flower_loopback import LoopbackGrid  # noqa: E402

from fedpm_dnn.data import load_femnist  # noqa: E402
from fedpm_flower import cnn, prepared  # noqa: E402
from fedpm_flower.apps import serve  # noqa: E402
from fedpm_flower.config import FlowerRunConfig  # noqa: E402
from validation import dnn, flower  # noqa: E402

WRITERS = 12
MANY = 300  # the scale of the FEMNIST sample: 300 writers, 10 sampled a round


def leaf(root, seed=0, writers=WRITERS):
    """``writers`` writers of unequal sizes (4..15 images), 62 classes, LEAF JSON gzip-compressed as the shared
    copy."""
    g = np.random.default_rng(seed)
    for split, scale in (("train", 1), ("test", 0.3)):
        os.makedirs(os.path.join(root, split))
        users = [f"f{i:04d}_{i % 7:02d}" for i in range(writers)]
        sizes = [max(1, int((4 + i % 12) * scale)) for i in range(writers)]
        data = {
            "users": users,
            "num_samples": sizes,
            "user_data": {
                u: {"x": g.random((n, 784)).round(4).tolist(), "y": g.integers(0, 62, n).tolist()}
                for u, n in zip(users, sizes, strict=True)
            },
        }
        with gzip.open(
            os.path.join(root, split, f"all_data_0_niid_05_keep_0_{split}_9.json.gz"), "wt", compresslevel=1
        ) as fh:
            json.dump(data, fh)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("femnist")
    leaf(str(root / "leaf"))
    assert (
        flower.main(["prepare", "--dataset", "femnist", "--data-dir", str(root / "leaf"), "--out", str(root / "p")])
        == 0
    )
    return root


@pytest.fixture(scope="module")
def many_parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("femnist-300")
    leaf(str(root / "leaf"), seed=1, writers=MANY)
    argv = ["prepare", "--dataset", "femnist", "--data-dir", str(root / "leaf"), "--out", str(root / "p")]
    assert flower.main(argv) == 0
    return root


def test_prepare_gives_each_writer_its_own_folder(parts):
    data, writers, _ = load_femnist(str(parts / "leaf"))
    assert sorted(os.listdir(parts / "p")) == sorted([f"client-{i}" for i in range(WRITERS)] + ["meta.json", "server"])
    for i, rows in enumerate(writers):
        x, y, meta = prepared.load(prepared.client_folder(str(parts / "p"), i), "train.npz")
        np.testing.assert_array_equal(x, data.x_train[rows])
        np.testing.assert_array_equal(y, data.y_train[rows])
        assert meta["num_classes"] == 62 and (meta["channels"], meta["image_size"]) == (1, 28)
    xt, yt, meta = prepared.load(prepared.server_folder(str(parts / "p")), "test.npz")
    np.testing.assert_array_equal(xt, data.x_test)
    assert meta["split"] == "natural (writers)" and meta["client_sizes"] == [len(r) for r in writers]


@pytest.mark.parametrize(
    "extra,message", [(["--alpha", "0.5"], "--alpha does not apply"), (["--clients", "13"], "exceeds the 12 writers")]
)
def test_prepare_femnist_refuses_what_does_not_apply(parts, tmp_path, capsys, extra, message):
    argv = ["prepare", "--dataset", "femnist", "--data-dir", str(parts / "leaf"), "--out", str(tmp_path / "o"), *extra]
    with pytest.raises(SystemExit) as exc:
        flower.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


def _isolated(parts, tmp_path):
    """The server's folder without any client's data, and each node's folder holding only its writer's."""
    server = tmp_path / "server-side"
    server.mkdir()
    shutil.copytree(parts / "p" / "server", server / "server")
    shutil.copy(parts / "p" / "meta.json", server / "meta.json")
    nodes = []
    for i in range(WRITERS):
        shutil.copytree(prepared.client_folder(str(parts / "p"), i), tmp_path / f"node-{i}")
        nodes.append(str(tmp_path / f"node-{i}"))
    return str(server), nodes


@pytest.fixture
def one_thread():
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


def test_fedpm_on_flower_with_writers_as_clients_is_the_in_process_run(parts, tmp_path, one_thread):
    server, nodes = _isolated(parts, tmp_path)
    cfg = FlowerRunConfig(
        problem="cnn", method="fedpm", clients=WRITERS, participants=10, rounds=2, lr=0.1, data_dir=server
    )
    grid = LoopbackGrid(cfg)
    for ctx, folder in zip(grid.contexts.values(), nodes, strict=True):
        ctx.node_config["data-dir"] = folder  # as a deployed SuperNode: its own writer's folder, nothing else
    cnn._CACHE.clear()
    result = serve(grid, cfg)
    theta = np.asarray(result["theta"])
    assert [h["used"] for h in result["history"][1:]] == [10, 10] and result["history"][-1]["rejected"] == 0

    # the in-process simulator on the very LEAF files, through validation.dnn (its defaults, the same lr and
    # local epochs, 10 of the 12 writers per round)
    args = dnn.parse_args(
        ["--dataset", "femnist", "--data-dir", str(parts / "leaf"), "--method", "fedpm", "--lr", "0.1"]
        + ["--local-epochs", "1", "--participants", "10", "--rounds", "2", "--device", "cpu"]
        + ["--out", str(tmp_path / "dnn")]
    )
    exp, _ = dnn.build(args)
    from fedpm_dnn.engine.simulation import run_experiment

    ck = str(tmp_path / "ck.pt")
    run_experiment(exp, checkpoint=ck)
    ref = cnn.flat_theta(torch.load(ck, weights_only=True)["server"]["params"])
    np.testing.assert_allclose(theta, ref, rtol=1e-5, atol=1e-6)
    # and the --check reference of validation.flower on the prepared folders is that run too
    cnn._CACHE.clear()
    check = cnn.in_process(FlowerRunConfig(**{**cfg.to_run_config(), "data_dir": str(parts / "p")}))
    np.testing.assert_allclose(check, ref, rtol=1e-5, atol=1e-6)
    assert np.abs(theta - cnn.flat_theta(dict(cnn.new_model(0, 62, 1, 28)[0].named_parameters()))).max() > 1e-3


@pytest.mark.slow
def test_fedpm_on_flowers_simulation_engine_with_300_writers_as_clients(many_parts, tmp_path, one_thread):
    """Flower's simulation engine with 300 virtual clients, 10 sampled a round (one ClientApp per writer, reading
    its writer's folder): the in-process model."""
    cfg = FlowerRunConfig(
        problem="cnn",
        method="fedpm",
        clients=MANY,
        participants=10,
        rounds=2,
        lr=0.1,
        data_dir=str(many_parts / "p"),
        out=str(tmp_path / "r.json"),
    )
    result = flower.run_flower(cfg, "simulation", 300)
    cnn._CACHE.clear()
    np.testing.assert_allclose(np.asarray(result["theta"]), cnn.in_process(cfg), rtol=1e-5, atol=1e-6)
    assert [h["used"] for h in result["history"][1:]] == [10, 10]
