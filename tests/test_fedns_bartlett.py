"""FedNS's Gaussian sketch drawn through its Gram (gaussian_draw='bartlett'): the factor, the Wishart draw, and
the server's sketched Hessian distributed as with S_i drawn entry by entry ('dense')."""

import numpy as np
import pytest
import scipy.sparse as sp
from naive import NaiveLogReg, random_data
from scipy import stats

from fedconvex.algorithms import make_algorithm
from fedconvex.algorithms.wishart import bartlett_factor, pivoted_root, sketched_root
from fedconvex.problem import FederatedLogReg


def psd_root(B):
    C, order, r = pivoted_root(B)
    U = np.triu(C[:r])
    assert np.array_equal(np.sort(order), np.arange(B.shape[0]))
    R = np.empty_like(U)
    R[:, order] = U
    return R


def psd(rng, n, rank):
    G = rng.normal(size=(rank, n))
    return G.T @ G


@pytest.mark.parametrize("n,rank", [(7, 7), (7, 3), (12, 1), (5, 0), (0, 0)])
def test_psd_root_factors_rank_deficient_matrices(rng, n, rank):
    B = psd(rng, n, rank)
    R = psd_root(B)
    assert R.shape == (rank, n)
    assert np.allclose(R.T @ R, B, rtol=0, atol=1e-12 * max(np.abs(B).max(initial=0), 1.0))


def test_psd_root_of_a_matrix_with_repeated_columns(rng):
    """Binary features that always occur together (w8a has them): the client's Hessian is singular."""
    A = rng.normal(size=(20, 4))
    A = np.hstack([A, A[:, :2]])  # columns 4, 5 repeat columns 0, 1
    R = psd_root(A.T @ A)
    assert R.shape[0] == 4
    np.testing.assert_allclose(R.T @ R, A.T @ A, atol=1e-12 * np.abs(A.T @ A).max())


@pytest.mark.parametrize("r,k", [(1, 3), (4, 4), (5, 9)])
def test_bartlett_factor_draws_a_wishart_matrix(r, k):
    """Every diagonal entry of W ~ Wishart_r(k, I) is chi^2_k (also the last, built from k-r+1 degrees of
    freedom and r-1 squared normals), every off-diagonal entry has mean 0 and variance k."""
    rng = np.random.default_rng(3)
    W = np.array([T @ T.T for T in (bartlett_factor(rng, r, k) for _ in range(4000))])
    for j in (0, r - 1):
        assert stats.kstest(W[:, j, j], stats.chi2(k).cdf).pvalue > 1e-3
    if r > 1:
        off = W[:, r - 1, 0]
        assert abs(off.mean()) < 4 * np.sqrt(k / 4000)
        assert abs(off.var() / k - 1) < 0.1
    T = bartlett_factor(np.random.default_rng(0), r, k)
    assert np.array_equal(T, np.tril(T)) and (np.diag(T) > 0).all()


def test_bartlett_factor_refuses_more_dimensions_than_degrees_of_freedom():
    with pytest.raises(ValueError, match="r <= k"):
        bartlett_factor(np.random.default_rng(0), 4, 3)


@pytest.mark.parametrize("n,rank,k", [(8, 3, 5), (8, 3, 3), (10, 6, 6), (8, 3, 2), (9, 5, 12)])
def test_sketched_root_is_r_transpose_times_the_factor_in_the_features_order(rng, n, rank, k):
    """The message is R^T T / sqrt(k) (R^T G^T / sqrt(k) when k < r), R = the pivoted factor with its columns put
    back in B's order -- checked row by row with several non-pivot features (n - r >= 2), whose rows come from
    the rectangle of the factor."""
    B = psd(rng, n, rank)
    R = psd_root(B)
    a, b = np.random.default_rng(4), np.random.default_rng(4)
    M = sketched_root(B, k, a)
    if rank <= k:
        expected = R.T @ bartlett_factor(b, rank, k) / np.sqrt(k)
    else:
        expected = R.T @ b.standard_normal((k, rank)).T / np.sqrt(k)
    np.testing.assert_allclose(M, expected, rtol=0, atol=1e-13 * np.abs(expected).max())
    assert a.random() == b.random()


def test_a_non_finite_hessian_gives_a_non_finite_message():
    """As the dense draw's S A would: the server's screening then rejects the reply (pivoting would drop a NaN)."""
    B = np.eye(3)
    B[1, 1] = np.nan
    assert not np.isfinite(sketched_root(B, 5, np.random.default_rng(0))).all()


@pytest.mark.parametrize("k", [10, 2])  # k >= rank: Bartlett; k < rank: G drawn directly
def test_sketched_root_quadratic_forms_are_scaled_chi_squares(rng, k):
    """For S (k x M) with N(0, 1/k) entries, k v^T (SA)^T (SA) v / ||A v||^2 ~ chi^2_k for every v."""
    A = rng.normal(size=(30, 6)) * (rng.random((30, 6)) < 0.7)
    A = np.hstack([A, A[:, :1]])  # rank 6 of 7 columns
    B = A.T @ A
    v = rng.normal(size=7)
    draw = np.random.default_rng(11)
    q = []
    for _ in range(3000):
        M = sketched_root(B, k, draw)
        assert M.shape[0] == 7 and M.shape[1] <= k
        q.append(k * np.sum((M.T @ v) ** 2) / (v @ B @ v))
    assert stats.kstest(q, stats.chi2(k).cdf).pvalue > 1e-3


def small_problem(rng):
    X, y, parts = random_data(rng, 2, 5, sizes=[40, 25], density=0.7)
    X = sp.hstack([X, X[:, :1]]).tocsr()  # a repeated feature: singular client Hessians
    return FederatedLogReg(X, y, parts, lam=1e-2), NaiveLogReg(X, y, parts, 1e-2)


def server_hessians(alg, pb, theta, seeds):
    out = []
    for s in seeds:
        up, _ = alg.client_update(pb, {"theta": theta}, {}, np.arange(pb.n_clients), np.random.default_rng(s))
        out.append([(R, a) for R, a in zip(up["SAt"], up["active"], strict=False)])
    return out


@pytest.mark.parametrize("k", [4, 6])  # k < and = the clients' active features
def test_bartlett_and_dense_draws_give_the_same_distribution_of_the_sketched_hessian(rng, k):
    """Two-sample tests on bilinear forms u^T (S_c A_c)^T (S_c A_c) w of both clients' messages: one
    distribution, whichever way the sketch is drawn; and both unbiased for the exact loss Hessian."""
    pb, ref = small_problem(rng)
    theta = rng.normal(size=pb.d) * 0.5
    forms = [rng.normal(size=(2, pb.d)) for _ in range(2)]
    samples = {}
    for draw in ("bartlett", "dense"):
        alg = make_algorithm("fedns", sketch_size=k, gaussian_draw=draw)
        vals, mean = [], [np.zeros((len(a), len(a))) for a in pb.active]
        for msgs in server_hessians(alg, pb, theta, range(2500)):
            row = []
            for c, (R, a) in enumerate(msgs):
                G = R @ R.T
                mean[c] += G / 2500
                row += [u[a] @ G @ w[a] for u, w in forms]
            vals.append(row)
        samples[draw] = np.array(vals)
        for c, a in enumerate(pb.active):
            rows = pb.X[pb.row_offsets[c] : pb.row_offsets[c + 1]]
            m = pb.y_host[pb.row_offsets[c] : pb.row_offsets[c + 1]] * (rows @ theta)
            s = 1 / (1 + np.exp(-m)) * (1 - 1 / (1 + np.exp(-m))) / rows.shape[0]
            A = rows[:, a].toarray() * np.sqrt(s)[:, None]
            H = A.T @ A
            assert np.abs(mean[c] - H).max() < 0.1 * np.abs(H).max()  # E[S^T S] = I
    for j in range(samples["dense"].shape[1]):
        assert stats.ks_2samp(samples["bartlett"][:, j], samples["dense"][:, j]).pvalue > 1e-3


def test_the_round_draws_client_by_client_in_order_with_the_clients_hessians(rng):
    """The participants' messages are ``sketched_root`` of each one's exact loss Hessian, drawn one after the
    other from the round's generator (given in another order than the clients' own)."""
    from fedconvex.algorithms.wishart import wishart_roots

    pb, _ = small_problem(rng)
    theta = np.tile(rng.normal(size=pb.d), (2, 1))
    sel = np.array([1, 0])
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    got = wishart_roots(pb, theta, sel, pb.d, a)
    for M, B in zip(got, pb.hessians(theta, sel).blocks, strict=False):
        assert np.array_equal(M, sketched_root(B, pb.d, b))
    assert a.random() == b.random()


def test_bartlett_messages_are_never_wider_than_the_sketch_and_exact_when_k_reaches_the_samples(rng):
    pb, _ = small_problem(rng)
    theta = rng.normal(size=pb.d)
    up, _ = make_algorithm("fedns", sketch_size=3, gaussian_draw="bartlett").client_update(
        pb, {"theta": theta}, {}, np.arange(2), np.random.default_rng(0)
    )
    assert all(R.shape[1] <= 3 for R in up["SAt"])
    # k >= M for client 1 (25 samples): it sends A_1^T itself, as the dense draw and the identity do
    for draw in ("bartlett", "dense"):
        up, _ = make_algorithm("fedns", sketch_size=30, gaussian_draw=draw).client_update(
            pb, {"theta": theta}, {}, np.arange(2), np.random.default_rng(0)
        )
        ident, _ = make_algorithm("fedns", sketch="identity").client_update(
            pb, {"theta": theta}, {}, np.arange(2), np.random.default_rng(0)
        )
        assert np.array_equal(up["SAt"][1], ident["SAt"][1])


@pytest.mark.parametrize("draw", ["bartlett", "dense"])
def test_fedns_with_either_draw_converges_to_the_optimum(rng, draw):
    """Sketched Newton steps (k < M on every client) drive the gradient to round-off from theta = 0."""
    from fedconvex.reference import solve_optimum
    from fedconvex.run import run

    X, y, parts = random_data(rng, 8, 6, sizes=[60] * 8, density=0.7)
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    theta_star, f_star, _ = solve_optimum(pb)
    _, hist = run(
        pb,
        make_algorithm("fedns", lr=1.0, sketch_size=30, gaussian_draw=draw),
        np.zeros(pb.d),
        40,
        seed=0,
        theta_star=theta_star,
        f_star=f_star,
    )
    assert hist[-1]["grad_norm"] < 1e-10 * hist[0]["grad_norm"]


def test_the_default_draw_is_the_dense_one_of_test_1(rng):
    pb, _ = small_problem(rng)
    theta = rng.normal(size=pb.d)
    a, _ = make_algorithm("fedns", sketch_size=4).client_update(
        pb, {"theta": theta}, {}, np.arange(2), np.random.default_rng(2)
    )
    b, _ = make_algorithm("fedns", sketch_size=4, gaussian_draw="dense").client_update(
        pb, {"theta": theta}, {}, np.arange(2), np.random.default_rng(2)
    )
    assert all(np.array_equal(x, y) for x, y in zip(a["SAt"], b["SAt"], strict=False))


def test_gaussian_draw_is_validated():
    with pytest.raises(ValueError, match="gaussian_draw must be one of dense, bartlett"):
        make_algorithm("fedns", gaussian_draw="wishart")
