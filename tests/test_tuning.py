"""Speed-ups of Test 1 that must not change a single number: the run's reuse of the last oracle point."""
import numpy as np
import pytest

import fedconvex.run as fr
from fedconvex.algorithms import applicable, make_algorithm
from fedconvex.data import sequential_split
from fedconvex.problem import FederatedLogReg
from fedconvex.reference import initial_point, solve_optimum


@pytest.fixture(scope="module")
def small(a9a):
    pb = FederatedLogReg(a9a.X[:1200], a9a.y[:1200], sequential_split(1200, 6, 200), lam=1e-3)
    theta_star, f_star, _ = solve_optimum(pb)
    return pb, theta_star, f_star, initial_point(pb, theta_star, "paper", seed=0)


def _history(small, method, lr, rounds=8, **kw):
    pb, theta_star, f_star, theta0 = small
    alg = make_algorithm(method, **applicable(method, {"local_steps": 1, "lr": lr}))
    _, hist = fr.run(pb, alg, theta0, rounds, seed=0, theta_star=theta_star, f_star=f_star, **kw)
    return [{k: v for k, v in row.items() if k != "seconds"} for row in hist]


@pytest.mark.parametrize("method,lr", [("fedavg", 1.0), ("scaffold", 1.0), ("fedadam", 10.0), ("fedns", 1.0),
                                       ("fednl", 1.0), ("fedpm", 1.0), ("localnewton", 0.5)])
def test_reusing_the_last_point_changes_no_number(small, monkeypatch, method, lr):
    reused = _history(small, method, lr)
    monkeypatch.setattr(fr, "reusing_last_point", lambda problem: problem)
    assert _history(small, method, lr) == reused          # bit for bit, every column but wall time


def test_the_clients_first_gradients_come_from_the_previous_rounds_metrics(small, monkeypatch):
    calls = []
    real = FederatedLogReg.values_and_gradients

    def counting(self, thetas, sel=None):
        calls.append(len(thetas))
        return real(self, thetas, sel)

    monkeypatch.setattr(FederatedLogReg, "values_and_gradients", counting)
    _history(small, "fedavg", 1.0, rounds=5)
    assert len(calls) == 6            # metrics of rounds 0..5; the five rounds' client gradients were answered
    calls.clear()
    _history(small, "fedavg", 1.0, rounds=5, participants=3)
    assert len(calls) == 11           # a sample of the clients asks another question: computed


def test_the_view_leaves_the_problem_alone(small):
    pb = small[0]
    view = fr.reusing_last_point(pb)
    assert isinstance(view, FederatedLogReg) and view is not pb and "_last" not in vars(pb)
    thetas = np.zeros((pb.n_clients, pb.d))
    v1, g1 = view.values_and_gradients(thetas)
    g1 += 1.0                         # a caller that writes into its answer does not change the next one
    v2, g2 = view.values_and_gradients(thetas, np.arange(pb.n_clients))
    np.testing.assert_array_equal(g2, pb.values_and_gradients(thetas)[1])
    other = object()
    assert fr.reusing_last_point(other) is other    # only the logistic problem, whose oracles are pure
