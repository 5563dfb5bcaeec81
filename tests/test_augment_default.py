"""The augmentation each data set trains with by default: crop-flip on CIFAR, none on FEMNIST (handwriting is
not mirror-symmetric).  ``--augment auto`` is the concrete choice it stands for, in the run, its checkpoint's
fingerprint, its summary, the sweep's comparison and the Flower clients of a prepared folder."""

import gzip
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")


from fedpm_dnn.data.augment import default_augment  # noqa: E402
from validation import dnn, experiments, flower, sweep  # noqa: E402


def leaf(root, writers=4):
    """A small LEAF FEMNIST folder (train and test, gzip JSON as the shared copy)."""
    g = np.random.default_rng(0)
    for split, n in (("train", 6), ("test", 3)):
        os.makedirs(os.path.join(root, split))
        users = [f"f{i:04d}_00" for i in range(writers)]
        data = {
            "users": users,
            "num_samples": [n] * writers,
            "user_data": {
                u: {"x": g.random((n, 784)).round(3).tolist(), "y": g.integers(0, 62, n).tolist()} for u in users
            },
        }
        with gzip.open(
            os.path.join(root, split, f"all_data_0_niid_05_keep_0_{split}_9.json.gz"), "wt", compresslevel=1
        ) as fh:
            json.dump(data, fh)
    return root


@pytest.fixture(scope="module")
def femnist_dir(tmp_path_factory):
    return leaf(str(tmp_path_factory.mktemp("leaf") / "femnist"))


def femnist_argv(data, out, *extra):
    return [
        *("--dataset", "femnist", "--data-dir", data, "--method", "fedavg", "--local-epochs", "1"),
        *("--batch-size", "4", "--rounds", "1", "--quiet", "--device", "cpu", "--threads", "1", "--out", str(out)),
        *extra,
    ]


def cifar_argv(data, out, *extra):
    return [
        *("--data-dir", data, "--method", "fedavg", "--clients", "3", "--local-epochs", "1", "--batch-size", "8"),
        *("--rounds", "1", "--quiet", "--device", "cpu", "--threads", "1", "--out", str(out)),
        *extra,
    ]


def history(out):
    return (out / "history.csv").read_text().splitlines()


def trained(out):
    """The history without its wall-clock columns."""
    rows = [r.split(",") for r in history(out)]
    keep = [i for i, name in enumerate(rows[0]) if "seconds" not in name and "memory" not in name]
    return [[r[i] for i in keep] for r in rows]


def test_each_data_set_has_its_default():
    assert default_augment("femnist") == "none"
    assert default_augment("cifar10") == default_augment("cifar100") == "crop-flip"


@pytest.mark.parametrize("dataset", ["femnist", "cifar10"])
def test_the_default_trains_as_the_concrete_choice_and_differs_from_the_other(
    dataset, femnist_dir, cifar_dir, tmp_path
):
    argv, data = (femnist_argv, femnist_dir) if dataset == "femnist" else (cifar_argv, cifar_dir)
    same, other = ("none", "crop-flip") if dataset == "femnist" else ("crop-flip", "none")
    runs = {}
    for name, extra in (("auto", ()), ("same", ("--augment", same)), ("other", ("--augment", other))):
        assert dnn.main(argv(data, tmp_path / name, *extra)) == 0
        runs[name] = trained(tmp_path / name)
    assert runs["auto"] == runs["same"]
    assert runs["auto"] != runs["other"]  # the test can tell the two augmentations apart
    assert json.loads((tmp_path / "auto" / "summary.json").read_text())["augment"] == same


def test_a_checkpoint_with_the_concrete_name_resumes_under_auto_and_another_is_refused(
    femnist_dir, cifar_dir, tmp_path, capsys
):
    # CIFAR runs checkpointed as "crop-flip" (the name every earlier version recorded) resume under the default
    out = tmp_path / "cifar"
    assert dnn.main(cifar_argv(cifar_dir, out, "--augment", "crop-flip")) == 0
    assert dnn.main(cifar_argv(cifar_dir, out, "--resume", "--rounds", "2")) == 0
    assert json.loads((out / "summary.json").read_text())["rounds_done"] == 2
    # a FEMNIST run made with crop-flip is not the default's run
    out = tmp_path / "femnist"
    assert dnn.main(femnist_argv(femnist_dir, out, "--augment", "crop-flip")) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        dnn.main(femnist_argv(femnist_dir, out, "--resume", "--rounds", "2"))
    assert exc.value.code == 2
    assert "--augment: checkpoint has 'crop-flip', this run 'none'" in capsys.readouterr().err


def test_the_sweep_calls_a_run_made_under_another_default_stale(femnist_dir, tmp_path):
    run = next(r for r in experiments.plan("femnist") if r.name == "femnist-fedavg-s0")
    assert "--augment" not in run.argv
    out = tmp_path / run.name
    args = [a for a in run.argv if a != "--quiet"]
    assert dnn.main([*args, "--rounds", "1", "--data-dir", femnist_dir, "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert sweep.status(run, str(out)).state == sweep.PARTIAL  # one round of 100, under this version's default
    # the same folder as an earlier version wrote it: the same command, trained with crop-flip
    summary["augment"] = "crop-flip"
    (out / "summary.json").write_text(json.dumps(summary))
    st = sweep.status(run, str(out))
    assert st.state == sweep.STALE and "--augment is 'crop-flip', the profile's 'none'" in st.why


def test_flower_clients_of_a_prepared_folder_train_with_their_data_sets_default(femnist_dir, cifar_dir, tmp_path):
    from fedpm_flower import cnn
    from fedpm_flower.config import FlowerRunConfig

    assert (
        flower.main(["prepare", "--dataset", "femnist", "--data-dir", femnist_dir, "--out", str(tmp_path / "f")]) == 0
    )
    argv = ["prepare", "--dataset", "cifar10", "--data-dir", cifar_dir, "--clients", "2", "--out", str(tmp_path / "c")]
    assert flower.main(argv) == 0
    cnn._CACHE.clear()
    for folder, expected in (("f", False), ("c", True)):
        cfg = FlowerRunConfig(problem="cnn", method="fedavg", clients=2, data_dir=str(tmp_path / folder))
        assert cnn.client_data(cfg, 0).augment is expected
    cnn._CACHE.clear()
