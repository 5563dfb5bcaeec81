"""fedpm_dnn.FOOF with its defaults in a plain training loop (stats_every='auto'): statistics from the training
passes at the centralised benchmark's cadence, and the explicit once-a-round mode unchanged once matrices are given."""

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedpm_dnn import FOOF  # noqa: E402
from fedpm_dnn.foof.optimizer import DEFAULT_INVERSE_EVERY, DEFAULT_STATS_DECAY, DEFAULT_STATS_EVERY  # noqa: E402

torch.set_num_threads(1)


def batches(n, seed=0, d=6, classes=3, size=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, d, generator=g), torch.randint(0, classes, (size,), generator=g)) for _ in range(n)]


def second_moment(x):
    a = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    return a.T @ a / len(a)


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_the_defaults_step_from_the_first_batch_with_its_statistics():
    """FOOF(model, lr) then zero_grad/backward/step: the first step is preconditioned by A of the first training
    batch (what update_statistics on that batch at the same parameters gives), with no call beforehand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    twin = copy.deepcopy(model)
    opt = FOOF(model, lr=0.1)
    ref = FOOF(twin, lr=0.1, stats_every=None)
    (x, y), *_ = batches(1)
    ref.update_statistics([x])
    train(model, opt, [(x, y)])
    train(twin, ref, [(x, y)])
    for k, M in ref.matrices().items():
        torch.testing.assert_close(opt.matrices()[k], M, rtol=1e-12, atol=1e-12)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_the_default_cadence_is_the_running_average_of_every_fifth_batch_inverted_every_twentieth():
    """A one-layer model (its input is the data, so A depends on the data alone): the inverses in use after step
    s were formed at the last multiple of 20 from the running average of the batches of steps 0, 5, 10, ..."""
    assert (DEFAULT_STATS_EVERY, DEFAULT_INVERSE_EVERY) == (5, 20)  # benchmarks/foof_centralised.py's foof-5-20
    torch.manual_seed(1)
    model = nn.Linear(6, 3)
    opt = FOOF(model, lr=0.05)
    data = batches(45, seed=1)
    running, formed = None, {}
    for step, (x, y) in enumerate(data):
        if step % DEFAULT_STATS_EVERY == 0:
            A = second_moment(x)
            running = A if running is None else DEFAULT_STATS_DECAY * running + (1 - DEFAULT_STATS_DECAY) * A
        if step % DEFAULT_INVERSE_EVERY == 0:
            formed = running
        train(model, opt, [(x, y)])
        inverted = opt.state_dict()["foof"]["inverted"][""]
        torch.testing.assert_close(inverted, formed, rtol=1e-6, atol=1e-7)  # float32 Gram products
        torch.testing.assert_close(opt.matrices()[""], running, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("given", ["update_statistics", "set_matrices"])
def test_matrices_given_explicitly_make_the_defaults_the_once_a_round_mode_bit_for_bit(given):
    """The FedPM client's pattern (matrices from update_statistics or kept ones, then steps, then statistics
    again) gives bit-identical parameters and matrices with the defaults and with stats_every=None."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))
    twin = copy.deepcopy(model)
    data = batches(12, seed=2)
    kept = FOOF(copy.deepcopy(model), lr=0.1, stats_every=None).update_statistics([x for x, _ in data[:3]])
    out = []
    for net, kw in ((model, {}), (twin, {"stats_every": None})):
        opt = FOOF(net, lr=0.1, damping=0.1, momentum=0.9, clip=1.0, **kw)
        if given == "update_statistics":
            opt.update_statistics([x for x, _ in data])
        else:
            opt.set_matrices(kept)
        train(net, opt, data)
        out.append(opt.update_statistics([x for x, _ in data]))
        assert opt.stats_every is None and not opt._handles  # no hooks left on the model
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    for k in out[0]:
        assert torch.equal(out[0][k], out[1][k])


def test_a_state_of_the_defaults_resumes_identically_in_either_mode():
    torch.manual_seed(3)
    data = batches(30, seed=3)
    for explicit in (False, True):
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = FOOF(model, lr=0.05, momentum=0.9)
        if explicit:
            opt.update_statistics([x for x, _ in data[:2]])
        train(model, opt, data[:13])
        resumed_model = copy.deepcopy(model)
        resumed = FOOF(resumed_model, lr=0.05, momentum=0.9)
        resumed.load_state_dict(opt.state_dict())
        assert (resumed.stats_every is None) == explicit
        train(model, opt, data[13:])
        train(resumed_model, resumed, data[13:])
        for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
            assert torch.equal(p, q)


def test_a_step_without_a_training_pass_says_how_to_get_matrices():
    model = nn.Linear(4, 2)
    opt = FOOF(model, lr=0.1)
    model.eval()  # evaluation mode: the hooks take no statistics
    F.mse_loss(model(torch.randn(5, 4)), torch.zeros(5, 2)).backward()
    with pytest.raises(RuntimeError, match="FOOF has no matrices yet: call update_statistics"):
        opt.step()
