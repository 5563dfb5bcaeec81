"""The conformance table: every registered convex method, with what it promises.

Each row states a method's expectations; the checks below hold every method to its row, and a method
registered without a row fails (adding a method = one file, one registry line, one row here).
  superlinear   from near the optimum, the contraction ratios ||theta_{t+1}-theta*|| / ||theta_t-theta*|| fall
  newton_at_k1  with full participation and K = 1 every round is a global Newton step theta - P^{-1} g
                (two rounds are checked: FedNL's first step uses the fresh Hessian, its later ones a learned one)
  stateful      keeps per-client state between rounds (State.clients)
Every method must be deterministic for a given seed and must not mutate its inputs.
"""

import copy

import numpy as np
import pytest
from naive import NaiveLogReg, random_data

from fedconvex.algorithms import REGISTRY, applicable, make_algorithm
from fedconvex.algorithms.base import RoundInfo
from fedconvex.problem import FederatedLogReg
from fedconvex.reference import solve_optimum
from fedconvex.run import run

ROWS = {  # method: (superlinear, newton_at_k1, stateful)
    "fedavg": (False, False, False),
    "psgd": (False, False, False),
    "fedavgm": (False, False, False),
    "fedprox": (False, False, False),
    "scaffold": (False, False, True),
    "fedadam": (False, False, False),
    "gd": (False, False, False),
    "fednl": (True, False, True),
    "fednl-ls": (True, False, True),
    "fednl-pp": (True, True, True),
    "fedns": (False, False, False),
    "localnewton": (False, False, False),
    "fedpm": (True, True, False),
    "newton": (True, True, False),
}
SAFE = {
    "fedavg": 0.5,
    "psgd": 0.5,
    "fedavgm": 0.3,
    "fedprox": 0.5,
    "scaffold": 0.5,
    "fedadam": 0.5,
    "gd": 0.5,
    "fedns": 0.5,
}


def test_every_registered_method_has_a_row():
    assert set(REGISTRY) == set(ROWS)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(11)
    X, y, parts = random_data(rng, 5, 6, sizes=[9, 14, 6, 11, 8])
    pb = FederatedLogReg(X, y, parts, lam=0.05)
    theta_star, f_star, _ = solve_optimum(pb)
    return pb, X, y, parts, theta_star, f_star


def _array(v):
    """A per-client state as one array (FedNL keeps its estimates as packed blocks)."""
    return np.asarray(v.packed) if hasattr(v, "packed") else np.asarray(v)


def _rows(v):
    """Per-client rows of a stacked client state, comparable with array_equal."""
    if hasattr(v, "packed"):
        return [np.asarray(v[[i]].packed) for i in range(len(v))]
    return list(np.asarray(v))


def _dense_rows(v):
    return np.asarray(v.blocks().dense()) if hasattr(v, "blocks") else np.asarray(v)


def _dense(v):
    return np.asarray(v.dense()) if hasattr(v, "dense") else np.asarray(v)


def _alg(name):
    return make_algorithm(name, **applicable(name, {"lr": SAFE.get(name, 1.0), "local_steps": 1}))


@pytest.mark.parametrize("name", sorted(ROWS))
def test_deterministic_and_inputs_not_mutated(problem, name):
    pb, X, y, parts, theta_star, f_star = problem
    theta0 = theta_star + 0.3
    keep = theta0.copy()
    runs = [
        run(pb, _alg(name), theta0, 3, participants=4, seed=5, theta_star=theta_star, f_star=f_star) for _ in range(2)
    ]
    strip = [[{k: v for k, v in r.items() if k != "seconds"} for r in h] for _, h in runs]
    assert strip[0] == strip[1]
    np.testing.assert_array_equal(runs[0][0].theta, runs[1][0].theta)
    np.testing.assert_array_equal(theta0, keep)  # the start point is the caller's
    # one round by hand, every client taking part (the driver then hands over the state's own arrays):
    # neither the state, nor the broadcast, nor the client state, nor the server state changes in place
    alg = _alg(name)
    state = alg.init(pb, theta0)
    sel = np.arange(pb.n_clients)
    down = alg.broadcast(state)
    down_copy, state_copy = copy.deepcopy(down), copy.deepcopy(state)
    cstate = dict(state.clients)
    up, _ = alg.client_update(pb, down, cstate, sel, np.random.default_rng(0))
    for k in down:
        np.testing.assert_array_equal(down[k], down_copy[k])
    for k in cstate:
        np.testing.assert_array_equal(_array(cstate[k]), _array(state_copy.clients[k]))
    info = RoundInfo(sel=sel, weights=np.full(len(sel), 1 / len(sel)), n_clients=pb.n_clients)
    if hasattr(alg, "receive"):
        up, state = alg.receive(pb, state, up, info)
        state_copy = copy.deepcopy(state)
    alg.server_update(pb, state, up, info)
    np.testing.assert_array_equal(state.theta, state_copy.theta)
    for k in state.clients:
        np.testing.assert_array_equal(_array(state.clients[k]), _array(state_copy.clients[k]))
    for k, v in state.server.items():
        np.testing.assert_array_equal(_array(v), _array(state_copy.server[k]))


@pytest.mark.parametrize("name", sorted(ROWS))
def test_stateful_methods_keep_client_state(problem, name):
    """A stateful method's per-client state changes from round to round for the participants only."""
    pb, *_, theta_star, f_star = problem
    alg = _alg(name)
    state0 = alg.init(pb, theta_star + 0.3)
    assert bool(state0.clients) == ROWS[name][2]
    if not ROWS[name][2]:
        return
    state2, _ = run(pb, alg, theta_star + 0.3, 2, participants=3, seed=2)
    from fedconvex.driver import sample_clients

    draw = np.random.default_rng(2)  # the driver's draws (these methods take no other random numbers)
    first, second = (set(sample_clients(draw, pb.n_clients, 3).tolist()) for _ in range(2))
    changed = set()
    for k in state0.clients:
        a, b = _rows(state0.clients[k]), _rows(state2.clients[k])
        changed |= {i for i in range(pb.n_clients) if not np.array_equal(a[i], b[i])}
    # round 2's participants updated theirs (FedNL's round-1 update is zero: H_i^0 is the Hessian at
    # theta^0 already; a part such as FedNL-PP's l_i may stay 0 throughout); nobody else's changed
    assert second <= changed <= first | second, (changed, first, second)


@pytest.mark.parametrize("name,field", [("scaffold", "dtheta"), ("fednl", "grad"), ("fednl-pp", "dg")])
def test_a_rejected_client_keeps_its_state_in_step_with_the_server(problem, name, field):
    """The server aggregates only the replies it used, so a client whose reply was rejected must keep its
    old state: afterwards the server's state is still the weighted sum of the clients' (SCAFFOLD:
    c = mean c_i; FedNL: H = sum_i w_i H_i)."""
    pb, *_, theta_star, f_star = problem

    def tamper(t, up):
        if t == 2:
            up = dict(up)
            bad = np.array(up[field], copy=True)
            bad[1] = np.nan
            up[field] = bad
        return up

    state, hist = run(pb, _alg(name), theta_star + 0.3, 4, tamper=tamper)
    assert [r["rejected"] for r in hist] == [0, 0, 1, 0, 0]
    w = np.asarray(pb.client_weights)
    if name == "scaffold":
        np.testing.assert_allclose(state.server["c"], state.clients["c"].mean(0), atol=1e-14)
    else:
        H_clients = np.einsum("i,ijk->jk", w, _dense_rows(state.clients["H"]))
        np.testing.assert_allclose(_dense(state.server["H"]), H_clients, atol=1e-12)


@pytest.mark.parametrize(
    "name,field",
    [("scaffold", "dtheta"), ("fednl", "grad"), ("fedns", "grad"), ("fednl-pp", "dg"), ("fedavg", "theta")],
)
def test_the_magnitude_guard_checks_a_declared_update(problem, name, field):
    """A field declared 'model' or 'update': with max_ratio one client's enormous value is rejected, not applied."""
    pb, *_, theta_star, f_star = problem

    def tamper(t, up):
        if t == 2:
            up = dict(up)
            big = np.array(up[field], copy=True)
            big[1] = big[1] * 1e6 + 1e3
            up[field] = big
        return up

    state, hist = run(pb, _alg(name), theta_star + 0.3, 3, tamper=tamper, max_ratio=100.0)
    assert hist[2]["rejected"] == 1 and np.linalg.norm(state.theta) < 10


@pytest.mark.parametrize("name", sorted(ROWS))
def test_newton_at_k1(problem, name):
    pb, X, y, parts, theta_star, _ = problem
    theta0 = theta_star + 0.3
    ref = NaiveLogReg(X, y, parts, 0.05)
    newton = theta0
    for _ in range(2):
        newton = newton - np.linalg.solve(ref.H(newton), ref.g(newton))
    alg = make_algorithm(name, **applicable(name, {"lr": 1.0, "local_steps": 1}))
    theta2 = run(pb, alg, theta0, 2)[0].theta
    assert np.allclose(theta2, newton, rtol=1e-10, atol=1e-12) == ROWS[name][1]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_superlinear_where_promised(problem, name):
    pb, *_, theta_star, f_star = problem
    theta0 = theta_star + 0.05
    try:
        _, h = run(
            pb,
            make_algorithm(name, **applicable(name, {"lr": 1.0, "local_steps": 1})),
            theta0,
            8,
            theta_star=theta_star,
            f_star=f_star,
        )
        d = [r["dist"] for r in h]
        ratios = [d[t + 1] / d[t] for t in range(len(d) - 1) if d[t + 1] > 1e-13]
        superlinear = min(d) < 1e-12 and ratios[-1] < 0.01 and ratios[-1] < ratios[0]
    except ArithmeticError:
        superlinear = False
    assert superlinear == ROWS[name][0], [r["dist"] for r in h]
