"""The server optimizers' forms (fedconvex.server_opt) against hand-written recursions, and the convex and DNN
FedAvgM / FedAdam running the same server step."""

import itertools

import numpy as np
import pytest

from fedconvex.algorithms import make_algorithm
from fedconvex.algorithms.base import RoundInfo, State
from fedconvex.server_opt import Adam, Momentum

ROUNDS = 6
FORMS = list(itertools.product(("heavy-ball", "ema"), (False, True)))


def deltas(rng, d=7):
    return [rng.normal(size=d) for _ in range(ROUNDS)]


def run_opt(opt, theta, ds):
    state = opt.init(theta)
    for t, delta in enumerate(ds, start=1):
        theta, state = opt.step(theta, delta, state, t)
    return theta


def reference_momentum(theta, ds, lr, b, form, bias_correction):
    v = np.zeros_like(theta)
    for t, d in enumerate(ds, start=1):
        if form == "heavy-ball":
            v = b * v + d
        else:
            v = b * v + (1 - b) * d
        step = v / (1 - b**t) if bias_correction else v
        theta = theta - lr * step
    return theta


@pytest.mark.parametrize("form,bias_correction", FORMS)
def test_momentum_forms_follow_their_recursions(rng, form, bias_correction):
    theta0, ds = rng.normal(size=7), deltas(rng)
    out = run_opt(Momentum(0.8, 0.7, form, bias_correction), theta0, ds)
    np.testing.assert_allclose(out, reference_momentum(theta0, ds, 0.8, 0.7, form, bias_correction), rtol=1e-13)


def test_the_forms_differ_as_their_definitions_say(rng):
    """ema is heavy-ball scaled by (1 - beta); with bias correction the first step is the pseudo-gradient itself."""
    theta0, ds = rng.normal(size=7), deltas(rng)
    heavy = run_opt(Momentum(1.0, 0.9, "heavy-ball"), theta0, ds) - theta0
    ema = run_opt(Momentum(1.0, 0.9, "ema"), theta0, ds) - theta0
    np.testing.assert_allclose(ema, 0.1 * heavy, rtol=1e-12)
    first = run_opt(Momentum(0.5, 0.99, "ema", True), theta0, ds[:1])
    np.testing.assert_allclose(first, theta0 - 0.5 * ds[0], rtol=1e-13)


def test_an_unknown_momentum_form_is_refused():
    with pytest.raises(ValueError, match="momentum form 'nesterov': choose from heavy-ball, ema"):
        make_algorithm("fedavgm", momentum_form="nesterov")


@pytest.mark.parametrize("bias_correction", [False, True])
def test_adam_follows_its_recursion(rng, bias_correction):
    """Reddi et al.'s Algorithm 2 (FedAdam) without bias correction; Kingma & Ba's corrected step with it."""
    theta0, ds = rng.normal(size=7), deltas(rng)
    lr, b1, b2, tau = 0.03, 0.9, 0.99, 1e-3
    theta, m, v = theta0.copy(), np.zeros(7), np.zeros(7)
    for t, d in enumerate(ds, start=1):
        m = b1 * m + (1 - b1) * (-d)
        v = b2 * v + (1 - b2) * d**2
        m_hat, v_hat = (m / (1 - b1**t), v / (1 - b2**t)) if bias_correction else (m, v)
        # Kingma & Ba's efficient form puts tau next to sqrt(v) before the correction: tau' = tau sqrt(1 - b2^t)
        eps = tau / np.sqrt(1 - b2**t) if bias_correction else tau
        theta = theta + lr * m_hat / (np.sqrt(v_hat) + eps)
    out = run_opt(Adam(lr, b1, b2, tau, bias_correction), theta0, ds)
    np.testing.assert_allclose(out, theta, rtol=1e-12)


# ----------------------------------------------------------------- the two packages, one server step
CASES = [("fedavgm", dict(momentum=0.9, server_lr=0.7, momentum_form=f, bias_correction=b)) for f, b in FORMS] + [
    ("fedadam", dict(server_lr=0.03, bias_correction=b)) for b in (False, True)
]


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in CASES])
def test_convex_and_dnn_methods_take_the_same_server_steps(rng, name, params):
    torch = pytest.importorskip("torch")
    from fedpm_dnn.algorithms import make_method

    shapes = {"w": (2, 3), "b": (3,)}
    theta0 = rng.normal(size=9)
    replies = [rng.normal(size=(2, 9)) for _ in range(ROUNDS)]  # two clients' models each round
    info = RoundInfo(sel=np.arange(2), weights=np.full(2, 0.5), n_clients=2)

    convex = make_algorithm(name, **params)
    cstate = State(theta=theta0, server=convex.server_optimizer().init(theta0))
    dnn = make_method(name, **params)
    split = lambda v: {"w": v[..., :6].reshape(*v.shape[:-1], 2, 3), "b": v[..., 6:]}  # noqa: E731
    params0 = {k: torch.as_tensor(a, dtype=torch.float64) for k, a in split(theta0).items()}
    dstate = State(theta=params0, server=dnn.init_server(params0))
    assert {k: v.shape for k, v in dstate.theta.items()} == shapes
    for stack in replies:
        cstate = convex.server_update(None, cstate, {"theta": stack}, info)
        up = {"params": {k: torch.as_tensor(a, dtype=torch.float64) for k, a in split(stack).items()}}
        dstate = dnn.server_update(None, dstate, up, info)
    assert cstate.round == dstate.round == ROUNDS
    dnn_theta = np.concatenate([dstate.theta["w"].numpy().ravel(), dstate.theta["b"].numpy()])
    np.testing.assert_allclose(dnn_theta, cstate.theta, rtol=1e-12, atol=1e-14)
    assert np.abs(cstate.theta - theta0).max() > 1e-3  # the server moved
