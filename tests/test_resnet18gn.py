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


# the whole command on ResNet18-GN at its full width, one FedAvg round of one participant of twenty (100 images, two
# local steps).  FedPM on this model is covered where its cost is spent, without the command around it: its FOOF
# blocks at every width up to 4,608 inputs against the solves (tests/test_foof_apply.py; a FedPM round costs about a
# minute of CPU in those factorisations) and a FedPM round of the narrower ResNet18-GN there, whose mixed model
# agrees with the solves' within the propagated bound.  That each round starts from the last one's mixed model is the
# round driver's, whatever the model (tests/test_dnn_training.py: learning over rounds, a resumed run's history)
@pytest.mark.slow
def test_resnet18gn_trains_on_cifar_format_images(images, tmp_path):
    was = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        out = tmp_path / "fedavg"
        argv = ["--data-dir", str(images.parent), "--model", "resnet18gn", "--method", "fedavg", "--device", "cpu"]
        argv += ["--clients", "20", "--participants", "1", "--local-epochs", "1", "--rounds", "1", "--alpha", "100"]
        argv += ["--lr", "0.05", "--clip", "1", "--batch-size", "50", "--test-subset", "100"]
        argv += ["--augment", "none", "--out", str(out), "--quiet"]
        assert dnn.main(argv) == 0
    finally:
        torch.set_num_threads(was)
    with open(out / "history.csv") as fh:
        rows = list(csv.DictReader(fh))
    (row,) = rows
    assert math.isfinite(float(row["train_loss"])) and 0 <= float(row["test_acc"]) <= 1
    # the whole model down to the participant and back, in float32: ResNet-18's 11.2 M parameters each way
    params = sum(p.numel() for p in make_model("resnet18gn", 10).parameters())
    assert int(row["bytes_up"]) == int(row["bytes_down"]) == 4 * params
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gn_groups"] == 2 and summary["train_samples"] == 2000 and summary["rounds_done"] == 1
