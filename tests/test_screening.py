"""Server robustness: unusable client replies are rejected, logged, and the round goes on."""

import logging

import numpy as np
import pytest
from naive import random_data

from fedconvex.algorithms import make_algorithm
from fedconvex.blocks import ActiveBlocks
from fedconvex.mixing import precond_mix
from fedconvex.problem import FederatedLogReg
from fedconvex.run import run
from fedconvex.screening import psd_problem, reply_problem, screen


def problem(rng, n=5, d=6):
    X, y, parts = random_data(rng, n, d)
    return FederatedLogReg(X, y, parts, lam=1e-2)


def corrupt_theta(client, value):
    def tamper(round_, up):
        up = dict(up)
        up["theta"] = up["theta"].copy()
        up["theta"][client, 0] = value
        return up

    return tamper


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_reply_is_dropped_and_the_rest_reweighted(rng, caplog, value):
    pb = problem(rng)
    theta = rng.normal(size=pb.d)
    alg = make_algorithm("fedpm")
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        state, hist = run(pb, alg, theta, 1, tamper=corrupt_theta(2, value))
    assert "round 1: client 2 rejected: theta contains NaN or Inf" in caplog.text
    assert hist[1]["rejected"] == 1
    # the same server step on the four remaining clients, weights renormalised
    down = alg.broadcast(alg.init(pb, theta))
    up, _ = alg.client_update(pb, down, {}, np.arange(5), np.random.default_rng(0))
    keep = [0, 1, 3, 4]
    expect = precond_mix(up["P"].take(keep), up["theta"][keep], np.full(4, 0.25))
    np.testing.assert_allclose(state.theta, expect, rtol=1e-12)


def test_a_preconditioner_that_is_not_psd_is_rejected(rng, caplog):
    pb = problem(rng)

    def tamper(round_, up):
        P = up["P"]
        blocks = list(P.blocks)
        blocks[1] = -blocks[1] - np.eye(blocks[1].shape[0])
        return {**up, "P": ActiveBlocks(tuple(blocks), P.active, P.d, P.shift, P.flat)}

    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        _, hist = run(pb, make_algorithm("fedpm"), rng.normal(size=pb.d), 2, tamper=tamper)
    assert "client 1 rejected: preconditioner P is not positive semidefinite" in caplog.text
    assert [h["rejected"] for h in hist] == [0, 1, 1]


def test_when_nobody_is_usable_the_round_is_skipped_and_the_model_kept(rng, caplog):
    pb = problem(rng)
    theta = rng.normal(size=pb.d)

    def tamper(round_, up):
        P = up["P"]
        return {
            **up,
            "P": ActiveBlocks(tuple(-b - np.eye(b.shape[0]) for b in P.blocks), P.active, P.d, P.shift, P.flat),
        }

    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        state, hist = run(pb, make_algorithm("fedpm"), theta, 2, tamper=tamper)
    np.testing.assert_array_equal(state.theta, theta)
    assert "round skipped, model unchanged" in caplog.text and hist[-1]["rejected"] == 5


def test_psd_and_reply_checks():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(5, 5))
    P = A @ A.T
    assert psd_problem(P) is None and psd_problem(np.zeros((0, 0))) is None
    lowest = np.linalg.eigvalsh(P)[0]
    assert psd_problem(P - (lowest + 1.0) * np.eye(5)) == "is not positive semidefinite"  # eigenvalue -1
    assert psd_problem(P - lowest * np.eye(5)) is None  # singular PSD: fine
    assert psd_problem(A) == "is not symmetric"
    assert psd_problem(-P) == "is not positive semidefinite"
    assert psd_problem(P + 1e-12 * rng.normal(size=(5, 5))) is None  # asymmetry within tolerance
    bad = P.copy()
    bad[2, 3] = np.nan
    assert psd_problem(bad) == "contains NaN or Inf"
    assert psd_problem(np.ones((2, 3))).startswith("is not a square matrix")
    shapes = {"params": {"w": (2, 2), "b": (2,)}, "foof": {"fc": (3, 3)}}
    good = {"params": {"w": np.ones((2, 2)), "b": np.ones(2)}, "foof": {"fc": np.eye(3)}}
    assert reply_problem(good, shapes, {"foof"}) is None
    assert (
        reply_problem({**good, "params": {"w": np.ones((2, 3)), "b": np.ones(2)}}, shapes)
        == "params[w] has shape (2, 3), expected (2, 2)"
    )
    assert reply_problem({"params": good["params"]}, shapes) == "missing 'foof'"
    assert (
        reply_problem({**good, "foof": {"fc": -np.eye(3)}}, shapes, {"foof"})
        == "preconditioner foof[fc] is not positive semidefinite"
    )
    kept, rejected = screen([good, {"params": good["params"]}], [7, 9], shapes, {"foof"})
    assert kept == [0] and rejected == [(9, "missing 'foof'")]


def test_tolerance_follows_the_matrix_precision():
    rng = np.random.default_rng(1)
    A = rng.normal(size=(40, 3))
    P = A @ A.T * 100.0  # rank 3: 37 zero eigenvalues
    assert psd_problem(P) is None
    assert psd_problem(P.astype(np.float32)) is None  # float32 rounding is not a reason to reject
    assert psd_problem(-P.astype(np.float32)) == "is not positive semidefinite"


def test_the_convex_loop_magnitude_guard_rejects_an_enormous_valid_preconditioner(caplog):
    """P = 1e12 (B + lam I) is symmetric PD, so only the guard can stop one client setting the model."""
    from dataclasses import replace

    rng = np.random.default_rng(3)
    X, y, parts = random_data(rng, 5, 6, sizes=[30, 25, 40, 35, 30])
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    theta0 = rng.normal(size=6)

    def inflate(round_, up):
        P = up["P"]
        blocks = (P.blocks[0] * 1e12,) + tuple(P.blocks[1:])
        return {
            **up,
            "P": replace(P, blocks=blocks, packed=None, layout=None, certificate={}),
            "theta": np.vstack([up["theta"][:1] + 50.0, up["theta"][1:]]),
        }

    alg = make_algorithm("fedpm", lr=1.0)
    honest, _ = run(pb, alg, theta0, 1, max_ratio=100.0)
    captured, hist_open = run(pb, alg, theta0, 1, tamper=inflate)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        guarded, hist = run(pb, alg, theta0, 1, tamper=inflate, max_ratio=100.0)
    assert hist_open[-1]["rejected"] == 0 and hist[-1]["rejected"] == 1
    assert "client 0 rejected: preconditioner trace" in caplog.text and "x the round's median" in caplog.text
    # unguarded, client 0 dictates the model; guarded, the other four mix as without it
    assert np.linalg.norm(captured.theta - honest.theta) > 10
    assert np.linalg.norm(guarded.theta - honest.theta) < np.linalg.norm(captured.theta - honest.theta) / 10


def test_whole_stack_check_accepts_exactly_what_every_per_client_check_accepts(rng):
    """``all_usable`` (the screening's fast path) says True for a clean certified FedPM message, and False as
    soon as any one client's part would be rejected by ``client_problem`` (then screening looks per client)."""
    from dataclasses import replace

    from fedconvex.messages import all_usable, client_problem

    X, y, parts = random_data(rng, 4, 6)
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    alg = make_algorithm("fedpm")
    up, _ = alg.client_update(pb, {"theta": rng.normal(size=6)}, {}, np.arange(4), rng)
    psd = ("P",)

    def per_client(msg):
        return all(client_problem(msg, k, 6, psd) is None for k in range(4))

    assert all_usable(up, 4, 6, psd) and per_client(up)
    bad_theta = dict(up, theta=up["theta"].copy())
    bad_theta["theta"][2, 1] = np.nan
    P = up["P"]
    bad_index = dict(up, P=replace(P, active=P.active[:3] + (P.active[3] + 6,)))
    flipped = P.packed.copy()
    flipped[:] *= -1  # negative definite, uncertified: factorised per client
    uncertified = dict(up, P=ActiveBlocks(P.layout.views(flipped), P.active, P.d, P.shift, P.flat, flipped, P.layout))
    for msg in (bad_theta, bad_index, uncertified):
        assert not per_client(msg) and not all_usable(msg, 4, 6, psd)
    honest = dict(up, P=ActiveBlocks(P.blocks, P.active, P.d, P.shift, P.flat, P.packed, P.layout))  # no certificate
    assert per_client(honest) and not all_usable(honest, 4, 6, psd)  # undecided cheaply: the per-client path decides


@pytest.mark.parametrize("library", ["numpy", "torch", "generic"])
def test_psd_check_with_a_shift_is_the_check_of_the_shifted_matrix(library, monkeypatch):
    """A stack stored as block + shift I (ActiveBlocks: B + lam I) is judged as the matrix B + shift I,
    on each of psd_problem's three paths (NumPy, torch, and the generic one CuPy takes)."""
    import types

    from fedconvex import screening

    conv = lambda a: a  # noqa: E731
    if library == "torch":
        conv = pytest.importorskip("torch").asarray
    elif library == "generic":  # a NumPy stand-in that is not ``np``: the branch CuPy runs

        class Forward(types.ModuleType):
            def __getattr__(self, name):
                return getattr(np, name)

        fwd = Forward("generic_numpy")
        monkeypatch.setattr(screening, "namespace", lambda *a: fwd)
    rng = np.random.default_rng(5)
    A = rng.normal(size=(6, 6))
    B = A @ A.T
    B = B - (np.linalg.eigvalsh(B)[0] + 0.5) * np.eye(6)  # lowest eigenvalue -0.5
    for shift in (0.0, 0.2, 0.8, 3.0):
        expect = psd_problem(conv(B + shift * np.eye(6)))
        assert psd_problem(conv(B), shift=shift) == expect, shift
        assert (expect is None) == (shift > 0.5)


def test_magnitude_guard_with_two_replies_uses_the_smaller_as_reference():
    """The guard compares with the lower median: with two replies (or half of them inflated) the honest
    magnitude is the reference, so the enormous reply is rejected, whichever position it has."""
    from fedconvex.screening import magnitude_outliers

    for vals, bad in (([1.0, 1e6], [1]), ([1e6, 1.0], [0]), ([2.0, 1e6, 1e7, 1.0], [1, 2]), ([3.0, 1.0, 1e9], [2])):
        assert magnitude_outliers(vals, 100.0) == bad
    assert magnitude_outliers([1.0, 50.0], 100.0) == [] and magnitude_outliers([1e9], 100.0) == []


def test_magnitudes_are_the_trace_and_the_euclidean_norm(rng):
    from fedconvex.screening import magnitudes

    A = rng.normal(size=(4, 4))
    P = {"a": A @ A.T, "b": np.diag([1.0, 2.0])}
    theta, extra = rng.normal(size=5), rng.normal(size=(2, 3))
    trace, norm = magnitudes({"P": P, "theta": theta, "x": extra}, ("P",))
    assert trace == pytest.approx(np.trace(P["a"]) + 3.0, rel=1e-12)
    assert norm == pytest.approx(np.sqrt(np.sum(theta**2) + np.sum(extra**2)), rel=1e-12)
