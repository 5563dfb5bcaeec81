"""Hostile inputs to the library API: ``fedpm_dnn.FOOF``, ``fedpm_dnn.mix`` and ``fedpm_dnn.federated``.
Each bad input gives one clear TypeError/ValueError in the library's words, or the documented behaviour."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from fedpm_dnn import FOOF, federated, mix  # noqa: E402
from fedpm_dnn import foof as _foof  # noqa: E402

torch.set_num_threads(1)


def one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text and "--" not in text, text  # library words: no command-line flags
    return text


class Net(nn.Module):
    def __init__(self, aux=False, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6) if bn else nn.Identity()
        self.fc2 = nn.Linear(6, 3)
        if aux:
            self.aux = nn.Linear(6, 2)  # an auxiliary head forward() never calls

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def batches(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


# --- FOOF ---------------------------------------------------------------------------------------------------------


def test_foof_of_bare_parameters_names_the_model_argument():
    model = Net()
    with pytest.raises(TypeError) as exc:
        FOOF(model.parameters(), lr=0.1)
    assert "model=model" in one_line(exc)
    FOOF(model.parameters(), lr=0.1, model=model)  # the documented form


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"lr": float("nan")}, "lr must be a finite number > 0"),
        ({"lr": "0.1"}, "lr must be a number"),
        ({"lr": 0.1, "damping": None}, "damping must be a number"),
        ({"lr": 0.1, "damping": -1.0}, "damping must be a finite number >= 0"),
        ({"lr": 0.1, "momentum": 1.0}, "momentum must be a finite number in \\[0, 1\\)"),
        ({"lr": 0.1, "stats_every": 0}, "stats_every must be a positive integer"),
        ({"lr": 0.1, "stats_every": None, "inverse_every": 5}, "inverse_every needs stats_every"),
        ({"lr": 0.1, "stats_every": "every"}, "stats_every must be a positive integer, .auto. or None"),
        ({"lr": 0.1, "stats_every": 1, "stats_decay": 1.0}, "stats_decay must be"),
        ({"lr": 0.1, "clip_stage": "after"}, "clip_stage must be"),
    ],
)
def test_foof_refuses_bad_settings_in_one_line(kw, match):
    with pytest.raises((TypeError, ValueError), match=match) as exc:
        FOOF(Net(), **kw)
    one_line(exc)


def test_foof_on_a_linear_with_a_frozen_bias_steps_without_a_shape_error():
    torch.manual_seed(0)
    model = Net()
    model.fc2.bias.requires_grad_(False)
    x, y = batches()
    opt = FOOF(model, lr=0.1, damping=0.1)
    assert opt.update_statistics([x])["fc2"].shape == (6, 6)  # no bias row: the bias is not trained
    bias = model.fc2.bias.detach().clone()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert torch.equal(model.fc2.bias, bias)


def test_update_statistics_with_an_unused_layer_warns_once_and_steps_it_plainly():
    torch.manual_seed(1)
    model = Net(aux=True)
    x, y = batches()
    opt = FOOF(model, lr=0.1, damping=0.1)
    with pytest.warns(UserWarning, match="'aux' received no input"):
        A = opt.update_statistics([x])
    assert sorted(A) == ["fc1", "fc2"]
    assert not {layer.name: layer for layer in opt.blocks()}["aux"].preconditioned
    loss = F.cross_entropy(model(x), y) + model.aux(torch.relu(model.fc1(x))).pow(2).mean()
    w = model.aux.weight.detach().clone()
    loss.backward()
    g = model.aux.weight.grad.clone()
    opt.step()
    torch.testing.assert_close(model.aux.weight.detach(), w - 0.1 * g)


def test_update_statistics_of_an_empty_iterable_is_a_clear_error():
    opt = FOOF(Net(), lr=0.1)
    with pytest.raises(ValueError, match="saw no batch") as exc:
        opt.update_statistics([])
    one_line(exc)
    with pytest.raises(ValueError, match="saw no batch"):
        _foof.compute_foof(Net(), _foof.foof_blocks(Net()), iter(()))


def test_compute_foof_names_a_layer_the_forward_pass_never_reaches():
    model = Net(aux=True)
    with pytest.raises(ValueError, match="'aux' received no input") as exc:
        _foof.compute_foof(model, _foof.foof_blocks(model), [batches()[0]])
    one_line(exc)


def test_diverged_statistics_and_a_singular_undamped_matrix_speak_the_library_words():
    with pytest.raises(ArithmeticError, match="lower the learning rate") as exc:
        _foof.factorize({"fc": torch.full((3, 3), float("nan"))}, 1.0)
    one_line(exc)
    with pytest.raises(ArithmeticError, match="raise the damping") as exc:
        _foof.damped_inverses({"fc": torch.zeros(3, 3, dtype=torch.float64)}, 0.0)
    one_line(exc)


def test_load_state_dict_of_another_optimizer_or_model_is_refused():
    model = Net()
    opt = FOOF(model, lr=0.1)
    with pytest.raises(ValueError, match="no 'foof' entry"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
    other = FOOF(Net(aux=True), lr=0.1)
    with pytest.raises(ValueError, match="names blocks"):
        opt.load_state_dict(other.state_dict())


# --- mix ----------------------------------------------------------------------------------------------------------


def _clients(n=2, model=None, damping=0.1):
    torch.manual_seed(2)
    model = model or Net()
    states, mats = [], []
    for i in range(n):
        m = copy.deepcopy(model)
        opt = FOOF(m, lr=0.1, damping=damping)
        x, y = batches(seed=i)
        opt.update_statistics([x])
        F.cross_entropy(m(x), y).backward()
        opt.step()
        states.append(m.state_dict())
        mats.append(opt.update_statistics([x]))
    return states, mats


@pytest.mark.parametrize(
    "damping, err", [(None, TypeError), ("0.1", TypeError), (-0.1, ValueError), (float("nan"), ValueError)]
)
def test_mix_refuses_a_bad_damping_in_one_line(damping, err):
    states, mats = _clients()
    with pytest.raises(err, match="damping") as exc:
        mix(states, mats, damping=damping)
    one_line(exc)


def test_mix_at_damping_zero_gives_identical_clients_back_even_with_singular_matrices():
    """A dead input unit makes every A singular: identical clients still come back unchanged."""
    torch.manual_seed(3)
    model = Net()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    mats = []
    for seed in range(3):
        x = batches(seed=seed)[0]
        x[:, 1] = 0.0  # input feature 1 never fires: fc1's A has a zero row and column
        mats.append(FOOF(copy.deepcopy(model), lr=0.1, damping=0.1).update_statistics([x]))
    mixed = mix([state] * 3, mats, damping=0.0)
    for k in state:
        torch.testing.assert_close(mixed[k], state[k], rtol=1e-5, atol=1e-6, msg=k)


def test_mix_of_tied_weights_returns_one_tensor_for_both_names():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight  # tied

        def forward(self, t):
            return self.head(self.emb(t).mean(1))

    torch.manual_seed(4)
    states, mats = [], []
    for seed in range(2):
        m = Tied()
        with torch.no_grad():
            m.emb.weight.add_(0.1 * seed)
        t = torch.randint(0, 5, (8, 3), generator=torch.Generator().manual_seed(seed))
        mats.append(FOOF(m, lr=0.1, damping=0.1).update_statistics([t]))
        states.append(m.state_dict())
    mixed = mix(states, mats, damping=0.1)
    assert mixed["emb.weight"] is mixed["head.weight"]
    model = Tied()
    model.load_state_dict(mixed)
    assert torch.equal(model.emb.weight, mixed["head.weight"])


def test_mix_takes_the_same_entries_in_another_order():
    states, mats = _clients()
    shuffled = dict(reversed(list(states[1].items())))
    got = mix([states[0], shuffled], mats, damping=0.1)
    expect = mix(states, mats, damping=0.1)
    assert list(got) == list(states[0])
    for k in expect:
        assert torch.equal(got[k], expect[k])


def test_mix_names_the_entries_that_differ_and_a_device_mismatch_as_such():
    states, mats = _clients()
    fewer = {k: v for k, v in states[1].items() if k != "fc2.bias"}
    with pytest.raises(ValueError, match=r"lacks entries \['fc2.bias'\]") as exc:
        mix([states[0], fewer], mats)
    one_line(exc)
    elsewhere = dict(states[1], **{"fc1.weight": states[1]["fc1.weight"].to("meta")})
    with pytest.raises(ValueError, match="'fc1.weight' is on meta, client 0's on cpu") as exc:
        mix([states[0], elsewhere], mats)
    one_line(exc)
    with pytest.raises(TypeError, match="client 1's state must be a dict"):
        mix([states[0], [1, 2]], mats)


def test_mix_averages_batchnorm_buffers_and_rounds_the_batch_count_keeping_its_dtype():
    """One rule for buffers (``fedconvex.mixing.simple_mix``'s): floats are the weighted mean, integers the weighted
    mean rounded to the nearest integer in their own dtype (a state dict must load back into the same tensors)."""
    torch.manual_seed(5)
    model = Net(bn=True)
    states, mats = _clients(model=model)
    states[0]["bn.num_batches_tracked"] = torch.tensor(3)
    states[1]["bn.num_batches_tracked"] = torch.tensor(10)
    mixed = mix(states, mats, weights=[1, 3], damping=0.1)
    assert mixed["bn.num_batches_tracked"].dtype == torch.int64 and int(mixed["bn.num_batches_tracked"]) == 8
    expect = 0.25 * states[0]["bn.running_mean"] + 0.75 * states[1]["bn.running_mean"]
    torch.testing.assert_close(mixed["bn.running_mean"], expect)


# --- federated ----------------------------------------------------------------------------------------------------


def loaders(n=3, per=16, batch=8, generator=False):
    out = []
    for i in range(n):
        x, y = batches(per, seed=20 + i)
        g = torch.Generator().manual_seed(100 + i) if generator else None
        out.append(DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=g))
    return out


KW = dict(method="fedpm", lr=0.1, damping=0.1, local_epochs=1)


def test_federated_refuses_a_generator_as_a_client():
    gen = ((x, y) for x, y in loaders(1)[0])
    with pytest.raises(TypeError, match="client 1 is a one-shot iterator") as exc:
        federated(Net, [loaders(1)[0], gen], rounds=1, **KW)
    one_line(exc)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"participants": 5}, "participants must be an integer from 1 to the 3 clients"),
        ({"participants": 0}, "participants must be"),
        ({"seed": -1}, "seed must be an integer"),
        ({"seed": "0"}, "seed must be an integer"),
        ({"engine": "parallel"}, "engine must be one of 'sequential', 'vectorized', got 'parallel'"),
        ({"resume": True}, "resume=True needs checkpoint=PATH"),
        ({"rounds": 0}, "rounds must be a positive integer"),
        ({"evaluate": 3}, "evaluate must be a function"),
    ],
)
def test_federated_refuses_bad_arguments_naming_them(kw, match):
    args = {"rounds": 1, **KW, **kw}
    with pytest.raises((TypeError, ValueError), match=match) as exc:
        federated(Net, loaders(), **args)
    one_line(exc)


def test_federated_resume_without_the_checkpoint_file_is_refused(tmp_path):
    missing = tmp_path / "none.pt"
    with pytest.raises(ValueError, match="there is no checkpoint file") as exc:
        federated(Net, loaders(), rounds=1, checkpoint=str(missing), resume=True, **KW)
    one_line(exc)
    assert not missing.exists()


def test_federated_refuses_an_evaluate_metric_named_as_a_history_column():
    with pytest.raises(ValueError, match=r"\['round'\]") as exc:
        federated(Net, loaders(), rounds=1, evaluate=lambda m: {"round": 99, "acc": 0.5}, **KW)
    one_line(exc)


def _strip(history):
    return [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in history]


def test_federated_resumes_identically_with_seeded_loader_generators(tmp_path):
    full = federated(Net, loaders(generator=True), rounds=3, **KW)
    ck = str(tmp_path / "ck.pt")
    federated(Net, loaders(generator=True), rounds=1, checkpoint=ck, **KW)
    resumed = federated(Net, loaders(generator=True), rounds=3, checkpoint=ck, resume=True, **KW)
    assert _strip(resumed.history) == _strip(full.history)
    for a, b in zip(resumed.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_federated_averages_batchnorm_buffers_over_the_participants_and_resumes_them(tmp_path):
    """Clients of 2 and 4 batches, one epoch a round: the global batch count is round(mean(start + batches)) --
    3 after round 1 and 6 after round 2 -- not the sequential sum; FOOF's statistics passes count nothing."""
    two = [loaders(1, per=16)[0], loaders(1, per=32)[0]]
    run = federated(lambda: Net(bn=True), two, rounds=2, **KW)
    assert int(run.model.bn.num_batches_tracked) == 6
    ck = str(tmp_path / "ck.pt")
    federated(lambda: Net(bn=True), two, rounds=1, checkpoint=ck, **KW)
    resumed = federated(lambda: Net(bn=True), two, rounds=2, checkpoint=ck, resume=True, **KW)
    for (k, a), b in zip(run.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert np.isfinite(run.history[-1]["train_loss"])


def test_federated_checkpoint_refusals_name_keywords_not_command_line_flags(tmp_path):
    ck = str(tmp_path / "ck.pt")
    federated(Net, loaders(), rounds=2, checkpoint=ck, **KW)
    with pytest.raises(ValueError, match="already holds 2 rounds") as exc:
        federated(Net, loaders(), rounds=1, checkpoint=ck, resume=True, **KW)
    one_line(exc)
    with pytest.raises(ValueError, match="different configuration.*lr.*pass resume=False") as exc:
        federated(Net, loaders(), rounds=3, checkpoint=ck, resume=True, **dict(KW, lr=0.2))
    one_line(exc)


@pytest.mark.parametrize("hooked", [False, True])
def test_an_unused_layer_found_in_training_survives_a_checkpoint_round_trip(hooked):
    torch.manual_seed(6)
    model = Net(aux=True)
    kw = {"stats_every": 1} if hooked else {}
    opt = FOOF(model, lr=0.1, damping=0.1, momentum=0.5, **kw)
    x, y = batches(seed=6)
    with pytest.warns(UserWarning, match="'aux' received no input"):
        if not hooked:
            opt.update_statistics([x])
        F.cross_entropy(model(x), y).backward()
        opt.step()
    again = copy.deepcopy(model)
    opt2 = FOOF(again, lr=0.1, damping=0.1, momentum=0.5, **kw)
    opt2.load_state_dict(opt.state_dict())
    for m, o in ((model, opt), (again, opt2)):
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q)
