"""fedpm_dnn.FOOF as a torch.optim optimizer: steps against a plain solve, param groups, momentum, statistics
from hooks against explicit ones, running averages and inverse cadence, state_dict round trips, block coverage
(subclasses, padding='same', frozen parameters, MultiheadAttention), buffers, bf16 autocast."""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedpm_dnn import FOOF  # noqa: E402

torch.set_num_threads(1)


class MLP(nn.Module):
    def __init__(self, d_in=5, hidden=7, classes=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def data(n=32, d=5, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def second_moment(a, bias=True):
    """E[a a^T] of rows a, augmented with a constant 1 when the block has a bias: the plain reference."""
    a = a.reshape(-1, a.shape[-1]).double()
    if bias:
        a = torch.cat([a, torch.ones(len(a), 1, dtype=torch.float64)], 1)
    return a.T @ a / len(a)


def layer_inputs(model, x, names):
    """The inputs each named layer receives in one forward pass of ``x``."""
    seen, handles = {}, []
    for name in names:
        m = model.get_submodule(name)
        handles.append(m.register_forward_pre_hook(lambda mod, inp, name=name: seen.__setitem__(name, inp[0].detach())))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


def plain_direction(layer, A, damping):
    """(A + damping I)^{-1} G_Theta for a Linear ``layer``'s gradient, by torch.linalg.solve (float64):
    (weight direction, bias direction or None)."""
    G = layer.weight.grad.double()
    has_bias = layer.bias is not None and layer.bias.requires_grad
    if has_bias:
        G = torch.cat([G, layer.bias.grad.double()[:, None]], 1)
    D = torch.linalg.solve(A + damping * torch.eye(len(A), dtype=torch.float64), G.T).T
    return (D[:, :-1], D[:, -1]) if has_bias else (D, None)


def test_a_step_is_the_plain_solve_per_block_with_its_group_lr_and_sgd_elsewhere():
    torch.manual_seed(0)
    model = MLP()
    x, y = data()
    groups = [
        {"params": [model.fc1.weight, model.fc1.bias], "lr": 0.05},
        {"params": [model.fc2.weight, model.fc2.bias, model.norm.weight, model.norm.bias]},
    ]
    opt = FOOF(groups, lr=0.2, damping=0.3, model=model)
    A = opt.update_statistics([(x, y)])
    inputs = layer_inputs(model, x, ["fc1", "fc2"])
    for name in ("fc1", "fc2"):
        torch.testing.assert_close(A[name], second_moment(inputs[name]), rtol=1e-6, atol=1e-6)  # float32 Grams
    before = copy.deepcopy(model)
    F.cross_entropy(model(x), y).backward()
    expect = {}
    for name, lr in (("fc1", 0.05), ("fc2", 0.2)):
        layer = getattr(model, name)
        dw, db = plain_direction(layer, A[name], 0.3)
        expect[f"{name}.weight"] = getattr(before, name).weight.double() - lr * dw
        expect[f"{name}.bias"] = getattr(before, name).bias.double() - lr * db
    for k in ("norm.weight", "norm.bias"):
        expect[k] = dict(before.named_parameters())[k].double() - 0.2 * dict(model.named_parameters())[k].grad.double()
    opt.step()
    for k, v in model.named_parameters():
        torch.testing.assert_close(v.double(), expect[k], rtol=1e-5, atol=1e-6, msg=k)


def test_parameters_with_model_and_the_model_itself_give_the_same_steps():
    torch.manual_seed(1)
    a = MLP()
    b = copy.deepcopy(a)
    x, y = data(seed=1)
    opts = [
        FOOF(a, lr=0.1, damping=0.1, momentum=0.9),
        FOOF(b.parameters(), lr=0.1, damping=0.1, momentum=0.9, model=b),
    ]
    for model, opt in zip((a, b), opts, strict=True):
        opt.update_statistics([x])
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_momentum_and_weight_decay_follow_torch_sgd_on_the_preconditioned_direction():
    """With A fixed, FOOF with momentum is torch.optim.SGD(momentum) on the gradient preconditioned by hand."""
    torch.manual_seed(2)
    model = nn.Linear(4, 3)
    twin = copy.deepcopy(model)
    x, y = data(d=4, seed=2)
    opt = FOOF(model, lr=0.1, damping=0.2, momentum=0.8, weight_decay=0.01)
    A = opt.update_statistics([x])[""]  # a root Linear: the block named ""
    sgd = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.8)
    for _ in range(4):
        opt.zero_grad()
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(twin(x), y).backward()
        with torch.no_grad():
            twin.weight.grad.add_(twin.weight, alpha=0.01)
            twin.bias.grad.add_(twin.bias, alpha=0.01)
            dw, db = plain_direction(twin, A, 0.2)
            twin.weight.grad.copy_(dw)
            twin.bias.grad.copy_(db)
        opt.step()
        sgd.step()
    torch.testing.assert_close(model.weight, twin.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bias, twin.bias, rtol=1e-5, atol=1e-6)


def test_hooked_statistics_equal_explicit_ones_and_the_steps_match():
    """stats_every=1 with no running average: each step uses A of its own training batch, exactly what
    update_statistics on that batch at the same parameters gives."""
    torch.manual_seed(3)
    a = MLP()
    b = copy.deepcopy(a)
    hooked = FOOF(a, lr=0.1, damping=0.1, stats_every=1, stats_decay=0.0)
    explicit = FOOF(b, lr=0.1, damping=0.1)
    for seed in range(3):
        x, y = data(seed=10 + seed)
        explicit.update_statistics([x])
        for model, opt in ((a, hooked), (b, explicit)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        for k, M in explicit.matrices().items():
            torch.testing.assert_close(hooked.matrices()[k], M, rtol=1e-12, atol=1e-12)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_running_average_every_other_step_and_inverses_every_third():
    torch.manual_seed(4)
    model = MLP()
    opt = FOOF(model, lr=0.05, damping=0.1, stats_every=2, inverse_every=3, stats_decay=0.5)
    batches = [data(seed=20 + i) for i in range(6)]
    expect, inverted = None, []
    for step, (x, y) in enumerate(batches):
        if step % 2 == 0:  # the batches the hooks take: steps 0, 2, 4
            A = second_moment(layer_inputs(model, x, ["fc2"])["fc2"])
            expect = A if expect is None else 0.5 * expect + 0.5 * A
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            model(x)  # an extra forward without gradients (evaluation): the hooks ignore it
        opt.step()
        torch.testing.assert_close(opt.matrices()["fc2"], expect, rtol=1e-6, atol=1e-7)  # float32 Gram products
        inverted.append(opt.state_dict()["foof"]["inverted"]["fc2"])
    # inverses formed at the first step and again at steps 3 (index 3): unchanged in between
    assert torch.equal(inverted[0], inverted[1]) and torch.equal(inverted[1], inverted[2])
    assert not torch.equal(inverted[2], inverted[3]) and torch.equal(inverted[3], inverted[4])


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("hooked", [False, True])
def test_state_dict_round_trip_resumes_identically(hooked):
    torch.manual_seed(5)
    kw = dict(lr=0.05, damping=0.1, momentum=0.9, weight_decay=1e-3)
    if hooked:
        kw.update(stats_every=2, inverse_every=3)
    batches = [data(seed=30 + i) for i in range(8)]
    model = MLP()
    opt = FOOF(model, **kw)
    if not hooked:
        opt.update_statistics([x for x, _ in batches[:2]])
    _train(model, opt, batches[:3])
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(opt.state_dict())
    _train(model, opt, batches[3:])
    again = MLP()
    again.load_state_dict(saved_model)
    opt2 = FOOF(again, **kw)
    opt2.load_state_dict(saved)
    _train(again, opt2, batches[3:])
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q)
    for k, M in opt.matrices().items():
        assert torch.equal(M, opt2.matrices()[k])


def test_subclasses_of_linear_are_blocks_and_multihead_attention_out_proj_is_listed_with_its_reason():
    class Scaled(nn.Linear):  # a subclass that keeps Linear's forward
        pass

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = Scaled(4, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            h = self.inp(x)
            return self.head(self.attn(h, h, h)[0].mean(1))

    torch.manual_seed(6)
    with pytest.warns(UserWarning, match="NonDynamicallyQuantizableLinear.*attn.out_proj") as record:
        opt = FOOF(Net(), lr=0.1)
    assert len([w for w in record if "FOOF leaves" in str(w.message)]) == 1  # one warning per skipped type
    rows = {layer.name: layer for layer in opt.blocks()}
    assert rows["inp"].preconditioned and rows["inp"].kind == "Scaled" and rows["inp"].side == 5
    assert not rows["attn.out_proj"].preconditioned and "MultiheadAttention" in rows["attn.out_proj"].why
    assert not rows["attn"].preconditioned  # in_proj_weight: a plain parameter of the attention module
    x = torch.randn(6, 5, 4)
    A = opt.update_statistics([x])
    assert sorted(A) == ["head", "inp"]


def test_padding_same_is_the_explicit_padding_block_and_an_even_kernel_is_refused_clearly():
    torch.manual_seed(7)
    same = nn.Sequential(nn.Conv2d(2, 3, 3, padding="same"), nn.Flatten(), nn.Linear(3 * 36, 2))
    explicit = copy.deepcopy(same)
    explicit[0] = nn.Conv2d(2, 3, 3, padding=1)
    explicit[0].load_state_dict(same[0].state_dict())
    x = torch.randn(4, 2, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # covered: no warning
        a = FOOF(same, lr=0.1).update_statistics([x])
    b = FOOF(explicit, lr=0.1).update_statistics([x])
    torch.testing.assert_close(a["0"], b["0"], rtol=1e-6, atol=1e-6)
    even = nn.Sequential(nn.Conv2d(2, 3, 2, padding="same"), nn.Flatten(), nn.Linear(3 * 36, 2))
    with pytest.warns(UserWarning, match="padding='same' with an even kernel"):
        opt = FOOF(even, lr=0.1)
    assert [layer.name for layer in opt.blocks() if layer.preconditioned] == ["2"]


def test_frozen_weights_are_no_blocks_and_a_frozen_bias_leaves_the_block_without_its_row():
    torch.manual_seed(8)
    model = MLP()
    model.fc1.weight.requires_grad_(False)
    model.fc1.bias.requires_grad_(False)
    model.fc2.bias.requires_grad_(False)
    x, y = data(seed=8)
    opt = FOOF(model, lr=0.2, damping=0.1)
    assert sorted(opt.update_statistics([x])) == ["fc2"] and opt.matrices()["fc2"].shape == (7, 7)
    bias, weight = model.fc2.bias.detach().clone(), model.fc2.weight.detach().clone()
    F.cross_entropy(model(x), y).backward()
    A = second_moment(layer_inputs(model, x, ["fc2"])["fc2"], bias=False)
    dw, _ = plain_direction(model.fc2, A, 0.1)
    opt.step()
    assert torch.equal(model.fc2.bias, bias)
    torch.testing.assert_close(model.fc2.weight.double(), weight.double() - 0.2 * dw, rtol=1e-5, atol=1e-6)


def test_statistics_passes_leave_batchnorm_running_statistics_untouched():
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = data(seed=9)
    opt = FOOF(model, lr=0.1, damping=0.1)
    opt.update_statistics([x, x + 1.0])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    F.cross_entropy(model(x), y).backward()  # a training pass does move them
    assert int(model[1].num_batches_tracked) == 1


def test_bf16_autocast_training_keeps_the_statistics_in_float32_or_better():
    """Under autocast the second layer's input is bfloat16; its A is that input's second moment accumulated in
    float64, and training steps."""
    torch.manual_seed(10)
    model = MLP()
    x, y = data(seed=10)
    opt = FOOF(model, lr=0.1, damping=0.1, stats_every=1, stats_decay=0.0)
    captured = {}
    h = model.fc2.register_forward_pre_hook(lambda m, inp: captured.__setitem__("a", inp[0].detach()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    h.remove()
    assert captured["a"].dtype == torch.bfloat16
    loss.backward()
    opt.step()
    A = opt.matrices()["fc2"]
    assert A.dtype == torch.float64
    torch.testing.assert_close(A, second_moment(captured["a"].float()), rtol=1e-6, atol=1e-8)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_the_centralised_benchmark_runs_on_generated_data(tmp_path):
    """benchmarks/foof_centralised.py end to end at a tiny size: its JSON (table, curves, provenance) and figure."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "foof_centralised.py"
    spec = importlib.util.spec_from_file_location("foof_centralised", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    argv = ["--synthetic", "--train-subset", "48", "--test-subset", "16", "--epochs", "1", "--batch-size", "16"]
    argv += ["--seeds", "0", "1"]
    argv += ["--configs", "sgd", "foof-epoch", "foof-5-20", "--eval-every", "1", "--out", str(out)]
    assert bench.main(argv + ["--figure", str(tmp_path / "fig")]) == 0
    result = json.loads(out.read_text())
    assert not result["partial"] and {"command", "device", "date", "commit"} <= set(result)
    assert set(result["table"]["rows"]) == {"sgd", "foof-epoch", "foof-5-20"} and len(result["runs"]) == 6
    rows = result["table"]["rows"]
    assert result["table"]["equal_seconds_budget"] == min(r["train_seconds_mean"] for r in rows.values())
    for r in result["runs"]:
        assert [p["epoch"] for p in r["curve"]] == [0.0, 1 / 3, 2 / 3, 1.0] and r["finite"]
    assert (tmp_path / "fig.png").stat().st_size > 0 and (tmp_path / "fig.pdf").stat().st_size > 0
    assert not list(tmp_path.glob("*.tmp"))
    assert bench.main(["--replot", "--out", str(out), "--figure", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0
