"""fedpm_dnn.cost: the upload it predicts is the bytes of the simulator's actual replies (FedAvg, FedPM, FedPM
through the lowrank and delta codecs), its forward products are what torch's FLOP counter counts, and its FOOF
work per step is the hand count of a tiny model."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from fedpm_dnn import cost, federated  # noqa: E402
from fedpm_dnn.foof.run_cost import matrix_bytes  # noqa: E402

torch.set_num_threads(1)


def net():
    # conv: 2 channels x 3x3 = 18 inputs (+1 bias), 3 outputs at 3 x 3 positions; Linear 27 (+1) -> 4
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.LayerNorm(27), nn.Linear(27, 4))


def loaders(n=2, samples=10, batch=4):
    g = torch.Generator().manual_seed(0)
    sets = [
        TensorDataset(torch.randn(samples, 2, 5, 5, generator=g), torch.randint(0, 4, (samples,), generator=g))
        for _ in range(n)
    ]
    return [DataLoader(s, batch_size=batch) for s in sets]


def uploads(method, **kw):
    """Each round's bytes a client sent, from the simulator's history (its count of the replies' tensors)."""
    history = federated(net, loaders(), method=method, rounds=2, lr=0.1, local_epochs=1, **kw).history
    total = [row["bytes_up"] for row in history]
    return [total[0], total[1] - total[0]]


def test_the_predicted_upload_is_the_bytes_of_the_actual_replies():
    c = cost(net(), torch.zeros(2, 5, 5), batch=4, samples=10)
    assert uploads("fedavg") == [c.fedavg_bytes] * 2
    assert uploads("fedpm") == [c.fedpm_bytes] * 2
    assert c.fedpm_bytes > c.fedavg_bytes and c.codecs  # the matrices outweigh this model: codecs are weighed
    low = cost(net(), torch.zeros(2, 5, 5), batch=4, samples=10, codec="lowrank:2")
    assert uploads("fedpm", precond_codec="lowrank:2") == [low.fedpm_bytes] * 2
    assert low.fedpm_bytes == dict((s, b) for s, b, _ in c.codecs).get("lowrank:2", low.fedpm_bytes)
    # delta: the first upload is the full upper triangle, the later ones the compressed change
    delta = cost(net(), torch.zeros(2, 5, 5), batch=4, samples=10, codec="delta:rankr:1")
    first = c.fedavg_bytes + sum(matrix_bytes(d, "delta:rankr:1", first=True) for d in (19, 28))
    assert uploads("fedpm", precond_codec="delta:rankr:1") == [first, delta.fedpm_bytes]


def test_the_forward_products_are_what_torch_counts():
    model = net()
    c = cost(model, torch.zeros(2, 5, 5), batch=4, samples=10)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 2, 5, 5))
    assert sum(b["forward_flop"] for b in c.blocks) == counter.get_total_flops()


def test_the_work_per_step_is_the_hand_count():
    c = cost(net(), torch.zeros(2, 5, 5), batch=4, samples=10, epochs=1)
    conv, lin = 2 * 9 * 18 * 3, 2 * 27 * 4  # forward: 2 L d_in rows per sample
    assert [b["forward_flop"] for b in c.blocks] == [conv, lin]
    assert [b["d"] for b in c.blocks] == [19, 28]
    assert c.steps_per_round == 3  # 10 samples in batches of 4
    assert c.sgd_flop_per_step == 3 * 4 * (conv + lin)
    apply = 2 * 3 * 19**2 + 2 * 4 * 28**2  # the inverses' products, every step
    stats = 10 * (conv + lin + 2 * 9 * 18**2 + 2 * 27**2)  # a forward pass and the Grams over the 10 samples
    inverses = 2 * (2 * 19**3 // 3) + 2 * (2 * 28**3 // 3)  # Cholesky and inverse of each (d, d), once a round
    assert c.foof_flop_per_step == round((3 * apply + stats + inverses) / 3)
    twice = cost(net(), torch.zeros(2, 5, 5), batch=4, samples=10, refreshes=2)  # refresh_every: passes a round
    assert twice.foof_flop_per_step == round((3 * apply + 2 * (stats + inverses)) / 3)
    assert c.work_ratio == pytest.approx((c.sgd_flop_per_step + c.foof_flop_per_step) / c.sgd_flop_per_step)


def test_the_report_leaves_the_model_and_the_generators_as_they_were():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Dropout(0.5), nn.Flatten(), nn.Linear(27, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    example = torch.randn(2, 5, 5)
    state = torch.get_rng_state()
    text = str(cost(model, example))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "19 x 19" in text and "28 x 28" in text


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"batch": 0}, "batch must be a positive integer"),
        ({"samples": 2.5}, "samples must be a positive integer"),
        ({"codec": "zip"}, "unknown precond codec 'zip'"),
        ({"example": [1, 2]}, "example must be one input tensor"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kw, match):
    args = {"example": torch.zeros(2, 5, 5), **kw}
    with pytest.raises((TypeError, ValueError), match=match) as exc:
        cost(net(), args.pop("example"), **args)
    assert "\n" not in str(exc.value)


def test_federated_says_the_cost_first_and_its_result_is_unchanged(capsys, monkeypatch):
    import sys

    fed = sys.modules["fedpm_dnn.federated"]  # the module (the package's name 'federated' is the function)

    def run():
        run = federated(net, loaders(), method="fedpm", rounds=2, lr=0.1, local_epochs=1)
        kept = ("round", "bytes_up", "bytes_down", "rejected", "train_loss")  # not the times and memory
        return [{k: row[k] for k in kept} for row in run.history], [p.detach().clone() for p in run.model.parameters()]

    with_line, params = run()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    c = cost(net(), torch.zeros(2, 5, 5), batch=4, samples=10)
    assert line == c.line() and line.startswith("FedPM cost: upload")
    monkeypatch.setattr(fed, "method_line", lambda *a, **k: None)
    without, again = run()
    assert without == with_line  # the report draws nothing from the generators the run uses
    assert all(torch.equal(p, q) for p, q in zip(params, again, strict=True))
    assert capsys.readouterr().err == ""


def test_validation_dnn_prints_the_cost_of_its_fedpm_run(tmp_path):
    import csv
    import os
    import subprocess
    import sys

    from fake_cifar import cifar_pickle

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "validation.dnn", "--dataset", "cifar10", "--data-dir", str(tmp_path / "data")]
    cmd += ["--method", "fedpm", "--clients", "3", "--local-epochs", "1", "--rounds", "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}, cwd=root)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("FedPM cost: upload"))
    with open(out / "history.csv") as fh:
        sent = int(next(csv.DictReader(fh))["bytes_up"])  # round 1: what a client sent, counted from its reply
    assert f"upload {sent / 1e6:.2f} MB a client a round" in line


def test_the_predicted_upload_is_the_bytes_of_a_flower_reply():
    """fedpm_fit's reply (the Flower client): the model's arrays and the float32 matrices, byte for byte."""
    pytest.importorskip("flwr")
    from fedpm_flower.client import fedpm_fit

    c = cost(net(), torch.zeros(2, 5, 5), batch=4, samples=10)
    reply = fedpm_fit(net(), loaders(n=1)[0], {"lr": 0.1})
    sent = {key: reply[key].to_torch_state_dict() for key in ("arrays", "foof")}
    size = {key: sum(t.numel() * t.element_size() for t in arrays.values()) for key, arrays in sent.items()}
    assert size["arrays"] == c.fedavg_bytes and size["arrays"] + size["foof"] == c.fedpm_bytes


def test_the_guides_report_is_what_cost_prints():
    """docs/use-in-your-code.md shows cost's report for SimpleCNN: it is this code's output, so it cannot drift."""
    import os
    import re

    from fedpm_dnn.models import SimpleCNN

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "use-in-your-code.md")) as fh:
        shown = re.search(r"print\(cost\(SimpleCNN\(\).*?```\n\n```\n(.*?)```", fh.read(), re.S).group(1)
    assert shown.rstrip("\n") == str(cost(SimpleCNN(), torch.zeros(3, 32, 32), batch=64, samples=500))
