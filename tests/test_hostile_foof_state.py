"""Hostile arguments and saved states to ``fedpm_dnn.FOOF``, and numbers no float32 can hold: one clear
ValueError/TypeError naming the argument or entry, or a correct result -- beside a healthy counterpart each."""

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedpm_dnn import FOOF  # noqa: E402
from fedpm_dnn.algorithms import make_method  # noqa: E402
from fedpm_dnn.engine.lr_schedule import LrSchedule, parse_milestones  # noqa: E402

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def one_step(model, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def ready(model=None, **kw):
    model = model or Net()
    opt = FOOF(model, lr=0.1, **kw)
    x, y = data()
    opt.update_statistics([x])
    return model, opt, x, y


# --- another model's parameters; groups added later ---------------------------------------------------------------
def test_foof_refuses_the_parameters_of_another_model():
    a, b = Net(), Net()
    with pytest.raises(ValueError, match="not parameters of the model"):
        FOOF(a.parameters(), lr=0.1, model=b)
    with pytest.raises(ValueError, match="1 of the 2 parameters"):
        FOOF([b.fc1.weight, a.fc1.weight], lr=0.1, model=b)
    FOOF(b.parameters(), lr=0.1, model=b)  # healthy: the model's own (a generator is read once)


def test_a_group_added_later_is_preconditioned_like_one_given_at_first():
    torch.manual_seed(0)
    one, two = Net(), Net()
    two.load_state_dict(one.state_dict())
    x, y = data()
    whole = FOOF(one.parameters(), lr=0.1, model=one)
    late = FOOF(two.fc1.parameters(), lr=0.1, model=two)
    assert [r.preconditioned for r in late.blocks() if r.name == "fc2"] == [False]
    late.add_param_group({"params": list(two.fc2.parameters())})
    rows = {r.name: r for r in late.blocks()}
    assert rows["fc2"].preconditioned and rows["fc2"].side == 7, rows["fc2"]
    for opt, model in ((whole, one), (late, two)):
        opt.update_statistics([x])
        one_step(model, opt, x, y)
    for p, q in zip(one.parameters(), two.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_group_added_after_the_statistics_must_get_its_own_before_a_step():
    model = Net()
    opt = FOOF(model.fc1.parameters(), lr=0.1, model=model)
    x, y = data()
    opt.update_statistics([x])
    opt.add_param_group({"params": list(model.fc2.parameters())})
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="no matrices for block\\(s\\) 'fc2'"):
        opt.step()
    opt.update_statistics([x])
    opt.step()  # healthy: with its statistics


@pytest.mark.parametrize(
    "group, exc, match",
    [
        ({"lr": -0.1}, ValueError, "a param group's lr must be a finite number > 0"),
        ({"lr": float("inf")}, ValueError, "a param group's lr must be a finite number"),
        ({"lr": 1e300}, ValueError, "a param group's lr must be at most 3.40282e\\+38"),
        ({"momentum": 1.0}, ValueError, "a param group's momentum must be a finite number in"),
        ({"weight_decay": "0"}, TypeError, "a param group's weight_decay must be a number"),
    ],
)
def test_an_added_groups_numbers_are_checked_as_the_defaults_are(group, exc, match):
    model = Net()
    opt = FOOF(model.fc1.parameters(), lr=0.1, model=model)
    with pytest.raises(exc, match=match):
        opt.add_param_group({"params": list(model.fc2.parameters()), **group})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="not parameters of the model"):
        opt.add_param_group({"params": list(Net().fc2.parameters())})
    opt.add_param_group({"params": list(model.fc2.parameters()), "lr": 0.01})  # healthy
    assert opt.param_groups[1]["lr"] == 0.01


# --- saved states and matrices ------------------------------------------------------------------------------------
def _saved(**change):
    _, opt, _, _ = ready()
    state = opt.state_dict()
    for key, value in change.items():
        if value is KeyError:
            del state["foof"][key]
        else:
            state["foof"][key] = value
    return state


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({"blocks": []}, ValueError, "names blocks \\[\\]"),
        ({"blocks": "fc1"}, ValueError, "'blocks' must be a list"),
        ({"damping": "1.0"}, TypeError, "damping must be a number"),
        ({"damping": float("nan")}, ValueError, "damping must be a finite number"),
        ({"damping": -1.0}, ValueError, "damping must be a finite number >= 0"),
        ({"steps": -1}, ValueError, "steps must be an integer >= 0"),
        ({"steps": 2.5}, ValueError, "steps must be an integer"),
        ({"steps": True}, TypeError, "steps must be an integer"),
        ({"damping": KeyError}, ValueError, "has no 'damping' entry"),
        ({"steps": KeyError}, ValueError, "has no 'steps' entry"),
        ({"matrices": KeyError}, ValueError, "has no 'matrices' entry"),
        ({"inverted": KeyError}, ValueError, "has no 'inverted' entry"),
        ({"blocks": KeyError}, ValueError, "has no 'blocks' entry"),
    ],
)
def test_a_damaged_saved_state_is_refused_naming_its_entry(change, exc, match):
    model, opt, _, _ = ready()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(exc, match=match):
        opt.load_state_dict(_saved(**change))
    after = opt.state_dict()  # nothing of the refused state was taken
    assert after["foof"]["blocks"] == before["foof"]["blocks"] and after["foof"]["steps"] == before["foof"]["steps"]


def test_a_saved_state_without_param_groups_or_with_a_bad_group_lr_is_refused():
    _, opt, _, _ = ready()
    state = _saved()
    del state["param_groups"]
    with pytest.raises(ValueError, match="no 'param_groups' entry"):
        opt.load_state_dict(state)
    state = _saved()
    state["param_groups"][0]["lr"] = 1e300
    with pytest.raises(ValueError, match="saved param group's lr must be at most"):
        opt.load_state_dict(state)
    opt.load_state_dict(_saved())  # healthy


def _bad_matrices(opt, kind):
    A = {k: v.clone() for k, v in opt.matrices().items()}
    d = A["fc1"].shape[0]
    if kind == "negative-definite":
        A["fc1"] = -5 * torch.eye(d, dtype=torch.float64)
    elif kind == "non-symmetric":
        A["fc1"][0, 1] += 1.0
    elif kind == "nan":
        A["fc1"][0, 0] = float("nan")
    elif kind == "complex":
        A["fc1"] = A["fc1"].to(torch.complex128)
    elif kind == "bool":
        A["fc1"] = torch.ones(d, d, dtype=torch.bool)
    return A


@pytest.mark.parametrize("kind", ["negative-definite", "non-symmetric", "nan", "complex", "bool"])
def test_set_matrices_and_load_state_dict_refuse_matrices_no_second_moment_is(kind):
    model, opt, x, y = ready()
    bad = _bad_matrices(opt, kind)
    with pytest.raises(ValueError, match="FOOF matrix 'fc1'"):
        opt.set_matrices(bad)
    for key in ("matrices", "inverted"):
        with pytest.raises(ValueError, match="FOOF matrix 'fc1'"):
            opt.load_state_dict(_saved(**{key: bad}))


def test_set_matrices_takes_a_clients_kept_float32_statistics():
    """Healthy: matrices built in float32 (symmetric to round-off, PSD to float32's tolerance) are taken."""
    model, opt, x, y = ready()
    kept = {k: v.float().double() for k, v in opt.matrices().items()}
    opt.set_matrices(kept)
    opt.set_matrices({k: torch.zeros_like(v) for k, v in kept.items()})  # zero statistics: damping alone
    one_step(model, opt, x, y)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_empty_batch_is_reported_as_such_not_as_divergence():
    model = Net()
    opt = FOOF(model, lr=0.1)
    with pytest.raises(ValueError, match="no rows .*empty batch"):
        opt.update_statistics([torch.empty(0, 4)])
    hooked = FOOF(Net(), lr=0.1, stats_every=1)
    hooked.model(torch.empty(0, 4)).sum().backward()
    with pytest.raises(ValueError, match="empty batch"):
        hooked.step()


# --- numbers no float32 holds -------------------------------------------------------------------------------------
@pytest.mark.parametrize("lr", [1e300, 3.5e38, 1e-50, 10**400])
def test_a_rate_no_float32_holds_is_refused_by_every_entry_point(lr):
    with pytest.raises(ValueError, match="lr must be"):
        FOOF(Net(), lr=lr)
    with pytest.raises(ValueError, match="fedpm: lr must be"):
        make_method("fedpm", lr=lr)
    with pytest.raises(ValueError, match="lr must be"):
        LrSchedule(milestones=((2, 1.0),)).check_rate(lr)  # lr first, then lr x every factor


def test_milestone_factors_that_leave_float32_are_refused():
    with pytest.raises(ValueError, match="factor must be at most"):
        LrSchedule(milestones=((2, 1e39),))
    with pytest.raises(ValueError, match="factor must be at most"):
        parse_milestones("50:1e39")
    with pytest.raises(ValueError, match="at its largest .* must be at most"):
        LrSchedule(milestones=((2, 1e20), (3, 1e20))).check_rate(1.0)
    with pytest.raises(ValueError, match="at its smallest .* rounds to 0 in float32"):
        LrSchedule(milestones=((2, 1e-30), (3, 1e-30))).check_rate(1e-3)
    LrSchedule(milestones=((2, 1e-10), (3, 10.0))).check_rate(1e20)  # healthy: in float32's range throughout


def test_large_but_representable_numbers_are_taken():
    assert make_method("fedpm", lr=1e30).lr == 1e30
    FOOF(Net(), lr=1e30, damping=1e30, weight_decay=1e-30)
    assert make_method("fedavg", lr=1e-40, weight_decay=0.0).lr == 1e-40  # subnormal in float32, not 0


def _dnn(tmp_path, *extra):
    from tests.fake_cifar import cifar_pickle
    from validation import dnn

    data = tmp_path / "data"
    if not data.exists():
        cifar_pickle(str(data / "cifar-10-batches-py"), n=30)
    argv = ["--dataset", "cifar10", "--data-dir", str(data), "--method", "fedpm", "--clients", "2"]
    argv += ["--local-epochs", "1", "--train-subset", "20", "--test-subset", "10", "--foof-samples", "64"]
    return dnn.main(argv + ["--quiet", "--threads", "1", "--out", str(tmp_path / "out"), *extra])


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--lr", "1e300", "--rounds", "1"], "fedpm: lr must be at most 3.40282e+38"),
        (["--lr", "1e30", "--lr-milestones", "50:1e10", "--rounds", "2"], "at its largest"),
        (["--lr", "1e30", "--rounds", "1"], "diverged at round 1"),
    ],
)
def test_validation_dnn_with_a_huge_rate_ends_in_one_line(tmp_path, capsys, extra, match):
    with pytest.raises(SystemExit) as exc:
        _dnn(tmp_path, *extra)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and match in err and "Traceback" not in err, err
