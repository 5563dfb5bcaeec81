"""The paper's claims and the reductions between methods (docs/architecture.md)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import NaiveLogReg, random_data

from fedconvex.algorithms import REGISTRY, applicable, make_algorithm
from fedconvex.algorithms.compressors import make_compressor
from fedconvex.problem import FederatedLogReg
from fedconvex.reference import solve_optimum
from fedconvex.run import Diverged, run


def rel(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def one_round(pb, name, theta, rounds=1, **params):
    state, hist = run(pb, make_algorithm(name, **params), theta, rounds)
    return state.theta


# ----------------------------------------------------------------- FedPM == Newton
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    weighting=st.sampled_from(["uniform", "samples"]),
    lam=st.sampled_from([1e-3, 1e-1]),
    lr=st.sampled_from([1.0, 0.5, 0.3]),
)
def test_fedpm_one_local_step_is_one_global_newton_step(seed, weighting, lam, lr):
    rng = np.random.default_rng(seed)
    n, d = int(rng.integers(1, 7)), int(rng.integers(1, 9))
    X, y, parts = random_data(rng, n, d)  # unequal client sizes, unused features
    pb = FederatedLogReg(X, y, parts, lam=lam, weighting=weighting)
    ref = NaiveLogReg(X, y, parts, lam, weighting)
    theta = rng.normal(size=d)
    out = one_round(pb, "fedpm", theta, lr=lr, local_steps=1)
    assert rel(out, ref.newton_step(theta, lr)) < 1e-10


def test_fedpm_tracks_newton_over_rounds_on_a9a(a9a_paper):
    pb, theta_star, f_star, theta0 = a9a_paper
    ref = NaiveLogReg(
        pb.X, pb.y_host, [np.arange(pb.row_offsets[c], pb.row_offsets[c + 1]) for c in range(pb.n_clients)], pb.lam
    )
    state, _ = run(pb, make_algorithm("fedpm", lr=1.0), theta0, 3)
    theta = theta0
    for _ in range(3):
        theta = ref.newton_step(theta)
    assert rel(state.theta, theta) < 1e-10


def test_localnewton_differs_from_newton_on_heterogeneous_clients(rng):
    X, y, parts = random_data(rng, 4, 5)
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    theta = rng.normal(size=5)
    ref = NaiveLogReg(X, y, parts, 1e-2)
    assert rel(one_round(pb, "localnewton", theta), ref.newton_step(theta)) > 1e-3


# ------------------------------------------------------------------- reductions
def hetero_problem(rng, n=5, d=6):
    X, y, parts = random_data(rng, n, d)
    return FederatedLogReg(X, y, parts, lam=1e-2), NaiveLogReg(X, y, parts, 1e-2)


@pytest.mark.parametrize("participants", [None, 3])
def test_fedavgm_without_momentum_is_fedavg(rng, participants):
    pb, _ = hetero_problem(rng)
    theta = rng.normal(size=pb.d)
    a, ha = run(
        pb, make_algorithm("fedavgm", lr=0.3, momentum=0.0, local_steps=3), theta, 4, participants=participants, seed=1
    )
    b, hb = run(pb, make_algorithm("fedavg", lr=0.3, local_steps=3), theta, 4, participants=participants, seed=1)
    np.testing.assert_allclose(a.theta, b.theta, rtol=1e-13)


def test_fedprox_without_proximal_term_is_fedavg(rng):
    pb, _ = hetero_problem(rng)
    theta = rng.normal(size=pb.d)
    a = one_round(pb, "fedprox", theta, rounds=3, lr=0.2, mu=0.0, local_steps=4)
    b = one_round(pb, "fedavg", theta, rounds=3, lr=0.2, local_steps=4)
    np.testing.assert_allclose(a, b, rtol=1e-13)
    c = one_round(pb, "fedprox", theta, rounds=3, lr=0.2, mu=1.0, local_steps=4)
    assert rel(c, b) > 1e-4  # and the proximal term does act


def test_fedavg_one_step_and_scaffold_are_gradient_descent(rng):
    pb, ref = hetero_problem(rng)
    theta = rng.normal(size=pb.d)
    gd = theta
    for _ in range(3):
        gd = gd - 0.5 * ref.g(gd)
    assert rel(one_round(pb, "scaffold", theta, rounds=3, lr=0.5, local_steps=1), gd) < 1e-12
    assert rel(one_round(pb, "fedavg", theta, rounds=3, lr=0.5, local_steps=1), gd) < 1e-12
    assert rel(one_round(pb, "gd", theta, rounds=3, lr=0.5), gd) < 1e-12


def test_scaffold_local_steps_follow_the_control_variate_rule(rng):
    """Two rounds of SCAFFOLD option II written out by hand for K = 2."""
    pb, ref = hetero_problem(rng, n=3, d=4)
    theta0, lr, K = rng.normal(size=4), 0.3, 2
    theta, c, ci = theta0.copy(), np.zeros(4), np.zeros((3, 4))
    for _ in range(2):
        new_thetas, new_ci = [], []
        for i in range(3):
            th = theta.copy()
            for _ in range(K):
                th = th - lr * (ref.g_i(i, th) - ci[i] + c)
            new_ci.append(ci[i] - c + (theta - th) / (K * lr))
            new_thetas.append(th)
        dc = np.array(new_ci) - ci
        theta = theta + np.mean(np.array(new_thetas) - theta, axis=0)
        c, ci = c + dc.mean(0), np.array(new_ci)
    state, _ = run(pb, make_algorithm("scaffold", lr=lr, local_steps=K), theta0, 2)
    assert rel(state.theta, theta) < 1e-12
    np.testing.assert_allclose(state.server["c"], c, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(state.clients["c"], ci, rtol=1e-12, atol=1e-15)


def test_scaffold_partial_participation_updates_only_participants(rng):
    pb, _ = hetero_problem(rng, n=6)
    state, _ = run(
        pb, make_algorithm("scaffold", lr=0.2, local_steps=2), rng.normal(size=pb.d), 1, participants=2, seed=4
    )
    touched = np.flatnonzero(np.abs(state.clients["c"]).sum(1) > 0)
    assert len(touched) == 2


def test_fednl_identity_alpha_one_is_newton_with_a_stale_hessian(rng):
    pb, ref = hetero_problem(rng)
    theta0 = rng.normal(size=pb.d) * 0.3
    xs = [theta0, ref.newton_step(theta0, 0.8)]  # round 1: H^0 = grad^2 f(x^0)
    for _ in range(3):  # then H^k = grad^2 f(x^{k-1})
        xs.append(ref.newton_step(xs[-1], 0.8, H=ref.H(xs[-2])))
    state, _ = run(pb, make_algorithm("fednl", lr=0.8), theta0, 4)
    assert rel(state.theta, xs[-1]) < 1e-10
    # projection onto {H >= lam I} leaves these positive definite estimates unchanged
    proj, _ = run(pb, make_algorithm("fednl", lr=0.8, option="project"), theta0, 4)
    assert rel(proj.theta, xs[-1]) < 1e-9


def test_fednl_shift_option_adds_the_mean_estimate_error(rng):
    pb, ref = hetero_problem(rng, n=3, d=4)
    theta0 = rng.normal(size=4) * 0.3
    x1 = ref.newton_step(theta0)  # l^0 = 0 since H_i^0 = grad^2 f_i(x^0)
    l1 = np.mean([np.linalg.norm(ref.H_i(i, theta0) - ref.H_i(i, x1)) for i in range(3)])
    x2 = ref.newton_step(x1, H=ref.H(theta0) + l1 * np.eye(4))
    state, _ = run(pb, make_algorithm("fednl", option="shift"), theta0, 2)
    assert rel(state.theta, x2) < 1e-10


@pytest.mark.parametrize("name,kw", [("topk", dict(k=7)), ("rankr", dict(rank=2)), ("randk", dict(k=5))])
def test_fednl_with_compressors_still_converges(a9a_paper, name, kw):
    pb, theta_star, f_star, theta0 = a9a_paper
    alpha = 5 / (123 * 124 / 2) if name == "randk" else 1.0  # unbiased compressors need alpha = 1/(omega+1)
    # heavily compressed estimates can lose definiteness; FedNL's Option 2 shift keeps steps safe
    state, hist = run(
        pb,
        make_algorithm("fednl", compressor=name, alpha=alpha, option="shift", **kw),
        theta0,
        12,
        theta_star=theta_star,
        f_star=f_star,
    )
    assert hist[-1]["dist"] < 0.2 * hist[0]["dist"]
    assert hist[-1]["bytes_up"] < 12 * (123 * 123 * 8)  # compressed: far less than dense Hessians


def test_compressors(rng):
    d = 6
    A = rng.normal(size=(3, d, d))
    M = A + A.transpose(0, 2, 1)
    top = make_compressor("topk", k=4)
    dec = top.decode(np, top.encode(np, M, rng), d)
    assert np.array_equal(dec, dec.transpose(0, 2, 1))
    for i in range(3):
        upper = np.abs(M[i][np.triu_indices(d)])
        kept = np.abs(dec[i][np.triu_indices(d)])
        assert np.count_nonzero(kept) == 4 and kept.max() == upper.max()
        assert np.sort(kept[kept > 0]).tolist() == np.sort(upper)[-4:].tolist()
    rank = make_compressor("rankr", rank=2)
    V = np.linalg.qr(rng.normal(size=(d, d)))[0][:, :2]
    low = (V * np.array([3.0, -2.0])) @ V.T
    np.testing.assert_allclose(rank.decode(np, rank.encode(np, low[None], rng), d)[0], low, atol=1e-12)
    rand = make_compressor("randk", k=5)
    mean = np.mean([rand.decode(np, rand.encode(np, M[:1], rng), d)[0] for _ in range(4000)], axis=0)
    np.testing.assert_allclose(mean, M[0], atol=0.35 * np.abs(M[0]).max())  # unbiased
    ident = make_compressor("identity")
    assert ident.decode(np, ident.encode(np, M, rng), d) is M
    with pytest.raises(ValueError):
        make_compressor("topk")
    with pytest.raises(ValueError):
        make_compressor("svd")


def test_localnewton_on_identical_clients_is_newton(rng):
    X, y, parts = random_data(rng, 1, 5, sizes=[9])
    same = [parts[0]] * 4
    pb = FederatedLogReg(X, y, same, lam=1e-2)
    ref = NaiveLogReg(X, y, same, 1e-2)
    theta = rng.normal(size=5)
    assert rel(one_round(pb, "localnewton", theta, lr=0.7), ref.newton_step(theta, 0.7)) < 1e-12


@pytest.mark.parametrize("kw", [dict(sketch_size=50), dict(sketch="identity")])
def test_fedns_with_an_exact_sketch_is_newton(rng, kw):
    pb, ref = hetero_problem(rng)  # clients have < 12 rows, so k = 50 >= M
    theta = rng.normal(size=pb.d)
    assert rel(one_round(pb, "fedns", theta, lr=0.9, **kw), ref.newton_step(theta, 0.9)) < 1e-10


def test_fedns_gaussian_sketch_is_unbiased_but_inexact(rng):
    X, y, parts = random_data(rng, 2, 4, sizes=[60, 60], density=0.8)
    pb, ref = FederatedLogReg(X, y, parts, lam=1e-2), NaiveLogReg(X, y, parts, 1e-2)
    theta = rng.normal(size=4)
    alg = make_algorithm("fedns", sketch_size=8)
    down = alg.broadcast(alg.init(pb, theta))
    Hs = []
    for seed in range(300):
        up, _ = alg.client_update(pb, down, {}, np.arange(2), np.random.default_rng(seed))
        from fedconvex.blocks import ActiveBlocks

        Hs.append(
            ActiveBlocks(tuple(R @ R.T for R in up["SAt"]), up["active"], 4, pb.lam).weighted_sum(np.full(2, 0.5))
        )
    H = ref.H(theta)
    assert rel(Hs[0], H) > 1e-3  # one sketch is not exact
    assert rel(np.mean(Hs, axis=0), H) < 0.05  # but E[S^T S] = I


def test_fedadam_server_step_matches_adam(rng):
    pb, ref = hetero_problem(rng)
    theta0 = rng.normal(size=pb.d)
    lr, slr, b1, b2, tau = 0.1, 0.03, 0.9, 0.99, 1e-3
    theta, m, v = theta0.copy(), 0 * theta0, 0 * theta0
    for t in (1, 2, 3):
        delta = lr * ref.g(theta)  # K = 1: Delta = theta - mean theta_i = lr g
        m = b1 * m + (1 - b1) * (-delta)
        v = b2 * v + (1 - b2) * delta**2
        theta = theta + slr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + tau)
    assert rel(one_round(pb, "fedadam", theta0, rounds=3, lr=lr, server_lr=slr), theta) < 1e-12


def test_newton_reference_and_optimum(a9a_paper):
    pb, theta_star, f_star, theta0 = a9a_paper
    assert np.linalg.norm(pb.gradient(theta_star)) < 1e-12
    # README sanity figure: about 0.85 accuracy of the a9a model on its own training rows
    acc = np.mean(np.sign(pb.X @ theta_star) == pb.y_host)
    assert 0.83 < acc < 0.87


# ------------------------------------------------------------------ superlinear
def contraction(hist):
    return [hist[t + 1]["dist"] / hist[t]["dist"] for t in range(len(hist) - 1) if hist[t + 1]["dist"] > 1e-12]


@pytest.mark.parametrize("name", ["fedpm", "fednl"])
def test_superlinear_convergence_on_a9a(a9a_paper, name):
    pb, theta_star, f_star, theta0 = a9a_paper
    _, hist = run(
        pb,
        make_algorithm(name, **applicable(name, {"lr": 1.0, "local_steps": 1})),
        theta0,
        10,
        theta_star=theta_star,
        f_star=f_star,
    )
    assert min(r["dist"] for r in hist) < 1e-10
    ratios = contraction(hist)
    tail = ratios[-3:]
    assert all(b < a for a, b in zip(tail, tail[1:], strict=False)), ratios  # contraction ratios shrink ...
    assert tail[-1] < 0.01  # ... towards 0


def test_fedavg_is_not_superlinear_on_a9a(a9a_paper):
    pb, theta_star, f_star, theta0 = a9a_paper
    for lr in REGISTRY["fedavg"].search_space["lr"]:
        try:
            _, hist = run(pb, make_algorithm("fedavg", lr=lr), theta0, 10, theta_star=theta_star, f_star=f_star)
        except Diverged:
            continue
        assert min(r["dist"] for r in hist) > 1e-6


# ---------------------------------------------------------------- the run loop
def test_same_seed_same_history(rng):
    pb, _ = hetero_problem(rng, n=6)
    theta = rng.normal(size=pb.d)
    for name, kw in [("fedns", dict(sketch_size=3)), ("fedpm", {}), ("fednl", dict(compressor="randk", k=3))]:
        h = [run(pb, make_algorithm(name, **kw), theta, 3, participants=4, seed=7)[1] for _ in range(2)]
        strip = [[{k: v for k, v in r.items() if k != "seconds"} for r in hh] for hh in h]
        assert strip[0] == strip[1]
    a = run(pb, make_algorithm("fedpm"), theta, 3, participants=4, seed=7)[1]
    b = run(pb, make_algorithm("fedpm"), theta, 3, participants=4, seed=8)[1]
    assert [r["grad_norm"] for r in a] != [r["grad_norm"] for r in b]  # the seed drives the sampling


def test_bytes_are_counted_from_the_messages(rng):
    pb, _ = hetero_problem(rng, n=4, d=6)
    theta = rng.normal(size=6)
    _, h = run(pb, make_algorithm("fedavg"), theta, 2)
    assert h[2]["bytes_up"] == 2 * 6 * 8 and h[2]["bytes_down"] == 2 * 6 * 8
    _, h = run(pb, make_algorithm("scaffold"), theta, 1)
    assert h[1]["bytes_up"] == 2 * 6 * 8 and h[1]["bytes_down"] == 2 * 6 * 8
    _, h = run(pb, make_algorithm("fedpm"), theta, 1)
    blocks = sum(len(a) ** 2 * 8 + len(a) * 8 for a in pb.active_host)
    assert h[1]["bytes_up"] == 6 * 8 + blocks // 4
    _, h = run(pb, make_algorithm("fednl"), theta, 1)  # identity: its difference on the active block, like FedPM
    assert h[1]["bytes_up"] == 6 * 8 + blocks // 4
    _, h = run(pb, make_algorithm("newton"), theta, 1)
    assert h[1]["bytes_up"] == 0


def test_history_rows(rng):
    pb, _ = hetero_problem(rng)
    theta_star, f_star, _ = solve_optimum(pb)
    _, hist = run(pb, make_algorithm("fedpm"), theta_star + 0.1, 3, theta_star=theta_star, f_star=f_star)
    assert [r["round"] for r in hist] == [0, 1, 2, 3]
    assert hist[0]["dist"] == pytest.approx(0.1 * np.sqrt(pb.d))
    assert all(r["seconds"] >= 0 for r in hist) and hist[-1]["seconds"] >= hist[1]["seconds"]


def test_divergence_is_reported(rng):
    pb, _ = hetero_problem(rng)
    with pytest.raises(Diverged, match=r"FedAvg/PSGD .*diverged at round"):
        run(pb, make_algorithm("fedavg", lr=1e200), rng.normal(size=pb.d) * 10, 20)


def test_sampling_and_registry_errors(rng):
    pb, _ = hetero_problem(rng)
    with pytest.raises(ValueError, match="participants"):
        run(pb, make_algorithm("fedavg"), np.zeros(pb.d), 1, participants=0)
    with pytest.raises(ValueError, match="unknown method"):
        make_algorithm("fedsgd")
    with pytest.raises(ValueError, match="option"):
        make_algorithm("fednl", option="clip")


def test_fedns_paper_sketch_converges_linearly_on_a9a(a9a_paper):
    """k = d Gaussian sketch (paper Test 1): fast, but the ratios settle instead of going to 0."""
    pb, theta_star, f_star, theta0 = a9a_paper
    _, hist = run(pb, make_algorithm("fedns", lr=1.0), theta0, 8, seed=0, theta_star=theta_star, f_star=f_star)
    ratios = contraction(hist)
    assert hist[-1]["dist"] < 1e-6
    assert min(ratios[-4:]) > 0.01  # linear: bounded away from zero, unlike FedPM / FedNL


def test_make_algorithm_rejects_a_hyper_parameter_the_method_does_not_have():
    from fedconvex.algorithms import applicable, make_algorithm

    with pytest.raises(ValueError, match="fedpm has no hyper-parameter 'lrr'"):
        make_algorithm("fedpm", lrr=1.0)
    with pytest.raises(ValueError, match="local_steps"):
        make_algorithm("fednl", local_steps=2)  # FedNL takes no local steps
    # shared command-line settings are passed on only where they apply
    assert applicable("fednl", {"local_steps": 2, "lr": 0.5}) == {"lr": 0.5}
    assert make_algorithm("fedpm", **applicable("fedpm", {"local_steps": 2})).local_steps == 2


# ------------------------------------------------- first-order baselines written out by hand
def test_fedprox_local_steps_follow_the_proximal_gradient_rule(rng):
    """K local steps on f_i(x) + mu/2 ||x - theta||^2, then the mean (FedProx, Li et al. 2020)."""
    pb, ref = hetero_problem(rng, n=4, d=5)
    theta, lr, mu, K = rng.normal(size=5), 0.2, 0.7, 3
    theta0 = theta.copy()
    for _ in range(2):
        local = []
        for i in range(4):
            x = theta.copy()
            for _ in range(K):
                x = x - lr * (ref.g_i(i, x) + mu * (x - theta))
            local.append(x)
        theta = np.mean(local, axis=0)
    assert rel(one_round(pb, "fedprox", theta0, rounds=2, lr=lr, mu=mu, local_steps=K), theta) < 1e-12


def test_fedavgm_server_step_is_heavy_ball_on_the_pseudo_gradient(rng):
    """v <- beta v + Delta, theta <- theta - server_lr v, Delta = theta - mean_i theta_i (Hsu et al. 2019)."""
    pb, ref = hetero_problem(rng, n=4, d=5)
    theta0, lr, beta, slr, K = rng.normal(size=5), 0.3, 0.7, 0.8, 2
    theta, v = theta0.copy(), np.zeros(5)
    for _ in range(3):
        local = []
        for i in range(4):
            x = theta.copy()
            for _ in range(K):
                x = x - lr * ref.g_i(i, x)
            local.append(x)
        v = beta * v + (theta - np.mean(local, axis=0))
        theta = theta - slr * v
    out = one_round(pb, "fedavgm", theta0, rounds=3, lr=lr, momentum=beta, server_lr=slr, local_steps=K)
    assert rel(out, theta) < 1e-12


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_scaffold_server_control_is_the_mean_of_the_client_controls(rng, weighting):
    """SCAFFOLD's invariant c = (1/N) sum_i c_i, which c <- c + (|S|/N) mean_{i in S} dc_i keeps under partial
    participation and whatever the mixing weights of the parameters."""
    X, y, parts = random_data(rng, 6, 5)
    pb = FederatedLogReg(X, y, parts, lam=1e-2, weighting=weighting)
    state, _ = run(pb, make_algorithm("scaffold", lr=0.3, local_steps=3), rng.normal(size=5), 4, participants=3, seed=2)
    assert np.abs(state.clients["c"]).sum() > 0
    np.testing.assert_allclose(state.server["c"], state.clients["c"].mean(0), rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------- run's arguments, checked at the boundary
@pytest.mark.parametrize(
    "rounds,exc,fragment",
    [
        (-1, ValueError, "rounds must be an integer >= 0, got -1"),
        (2.5, TypeError, "rounds must be an integer, got 2.5"),
        (True, TypeError, "rounds must be an integer, got True"),
        ("3", TypeError, "rounds must be an integer, got '3'"),
    ],
    ids=["negative", "float", "bool", "text"],
)
def test_run_refuses_a_bad_round_count(rng, rounds, exc, fragment):
    X, y, parts = random_data(rng, 3, 4)
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    with pytest.raises(exc) as info:
        run(pb, make_algorithm("fedpm", lr=1.0), np.zeros(4), rounds)
    assert fragment in str(info.value)


def test_run_with_zero_rounds_is_the_initial_point_and_its_metrics(rng):
    X, y, parts = random_data(rng, 3, 4)
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    theta0 = rng.normal(size=4)
    state, hist = run(pb, make_algorithm("fedpm", lr=1.0), theta0, 0)
    assert [r["round"] for r in hist] == [0]
    np.testing.assert_array_equal(state.theta, theta0)
    assert hist[0]["grad_norm"] == np.linalg.norm(pb.gradient(theta0))


@pytest.mark.parametrize(
    "theta0,exc,fragment",
    [
        (np.zeros(5), ValueError, "theta0 must have shape (4,) (the problem's 4 features), got (5,)"),
        (np.zeros((1, 4)), ValueError, "theta0 must have shape (4,) (the problem's 4 features), got (1, 4)"),
        (np.array([0.0, np.nan, 0.0, 0.0]), ValueError, "theta0 holds NaN or Inf"),
        ([0.0] * 4, TypeError, "theta0 must be an array of shape (4,), got list"),
    ],
    ids=["long", "2d", "nan", "list"],
)
def test_run_refuses_a_bad_starting_point(rng, theta0, exc, fragment):
    X, y, parts = random_data(rng, 3, 4)
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    with pytest.raises(exc) as info:
        run(pb, make_algorithm("fedpm", lr=1.0), theta0, 2)
    assert fragment in str(info.value)
