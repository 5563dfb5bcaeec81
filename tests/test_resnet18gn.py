"""ResNet18-GN: the reference ResNets' initialisation, the GroupNorm group count as a flag, and a one-round
training check through ``python -m validation.dnn`` on generated CIFAR-format images a model can learn."""

import csv
import json
import math
import os

import pytest

torch = pytest.importorskip("torch")

from fake_cifar import cifar_pickle  # noqa: E402

from fedpm_dnn.models import make_model  # noqa: E402
from validation import dnn  # noqa: E402


def test_convolutions_start_as_kaiming_fan_out_and_groupnorm_as_the_identity():
    torch.manual_seed(0)
    model = make_model("resnet18gn", 10)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 20  # stem + 16 in the blocks + 3 shortcuts
    for m in convs:
        fan_out = m.out_channels * m.kernel_size[0] * m.kernel_size[1]
        std = math.sqrt(2.0 / fan_out)  # ReLU gain sqrt(2) over sqrt(fan_out)
        w = m.weight.detach().double()
        # the sample std of >= 1,728 normal draws is within 10 % of the true one (>= 6 standard errors)
        assert abs(w.std().item() / std - 1) < 0.1 and abs(w.mean().item()) < 0.2 * std, m
    for m in model.modules():
        if isinstance(m, torch.nn.GroupNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight)) and torch.equal(m.bias, torch.zeros_like(m.bias))


@pytest.mark.parametrize("groups", [1, 2, 32])
def test_the_group_count_reaches_every_groupnorm(groups):
    model = make_model("resnet18gn", 10, groups=groups)
    assert {m.num_groups for m in model.modules() if isinstance(m, torch.nn.GroupNorm)} == {groups}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "cnn", "--gn-groups", "4"], "--gn-groups applies to --model resnet18gn"),
        (["--model", "resnet18gn", "--gn-groups", "3"], "--gn-groups 3: must divide 64"),
    ],
)
def test_a_bad_group_count_is_refused_before_any_data_is_read(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        dnn.main(["--data-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py"
    cifar_pickle(str(root), n=400, seed=3, learnable=True)  # 2,000 training images, 400 test images
    return root


# ResNet-18's FOOF blocks reach 4,608 inputs (3x3x512): a FedPM round costs about a minute of CPU in the float64
# factorisations of its participant and of the server's mixing, so one participant of twenty (100 images: two local
# steps, each preconditioned through every block) takes one round.
# FedPM's run passes the model through everything FedAvg's would (its local steps are FedAvg's with the
# preconditioned direction); that each round starts from the last one's mixed model is the round driver's, whatever
# the model (tests/test_dnn_training.py: learning over rounds, a resumed run's identical history)
@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedpm"])
def test_resnet18gn_trains_on_cifar_format_images(images, tmp_path, method):
    was = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        out = tmp_path / method
        argv = ["--data-dir", str(images.parent), "--model", "resnet18gn", "--method", method, "--device", "cpu"]
        argv += ["--clients", "20", "--participants", "1", "--local-epochs", "1", "--rounds", "1", "--alpha", "100"]
        argv += ["--lr", "0.05", "--clip", "1", "--batch-size", "50", "--test-subset", "100", "--foof-samples", "64"]
        argv += ["--augment", "none", "--out", str(out), "--quiet"]
        assert dnn.main(argv) == 0
    finally:
        torch.set_num_threads(was)
    with open(out / "history.csv") as fh:
        rows = list(csv.DictReader(fh))
    (row,) = rows
    assert math.isfinite(float(row["train_loss"])) and 0 <= float(row["test_acc"]) <= 1
    # the participant's FOOF matrices went up beside its model: more bytes up than the model coming down
    assert int(row["bytes_up"]) > int(row["bytes_down"]) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gn_groups"] == 2 and summary["train_samples"] == 2000 and summary["rounds_done"] == 1
