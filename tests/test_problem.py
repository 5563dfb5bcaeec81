"""The logistic-regression oracles against finite differences and a dense naive reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import NaiveLogReg, random_data

from fedconvex.blocks import ActiveBlocks, NotPositiveDefinite
from fedconvex.problem import FederatedLogReg


def make(rng, n_clients=4, d=6, lam=1e-2, weighting="uniform", **kw):
    X, y, parts = random_data(rng, n_clients, d, **kw)
    return FederatedLogReg(X, y, parts, lam=lam, weighting=weighting), NaiveLogReg(X, y, parts, lam, weighting)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    weighting=st.sampled_from(["uniform", "samples"]),
    lam=st.sampled_from([0.0, 1e-3, 0.3]),
)
def test_oracles_match_the_naive_reference(seed, weighting, lam):
    rng = np.random.default_rng(seed)
    pb, ref = make(rng, n_clients=int(rng.integers(1, 6)), d=int(rng.integers(1, 9)), lam=lam, weighting=weighting)
    T = rng.normal(size=(pb.n_clients, pb.d))
    vals, grads = pb.values_and_gradients(T)
    H = pb.hessians(T).dense()
    V = rng.normal(size=T.shape)
    hv = pb.hvps(T, V)
    for i in range(pb.n_clients):
        assert vals[i] == pytest.approx(ref.f_i(i, T[i]), rel=1e-12, abs=1e-14)
        np.testing.assert_allclose(grads[i], ref.g_i(i, T[i]), rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(H[i], ref.H_i(i, T[i]), rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(hv[i], ref.H_i(i, T[i]) @ V[i], rtol=1e-10, atol=1e-14)
    assert np.array_equal(pb.values(T), vals)  # the values-only path: the same numbers
    th = T[0]
    assert pb.value(th) == pytest.approx(ref.f(th), rel=1e-12)
    assert pb.value(th) == pb.value_and_gradient(th)[0]
    np.testing.assert_allclose(pb.gradient(th), ref.g(th), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(pb.hessian(th), ref.H(th), rtol=1e-10, atol=1e-14)


def test_gradient_and_hessian_match_finite_differences(rng):
    pb, _ = make(rng, n_clients=3, d=5, lam=1e-2)
    T = rng.normal(size=(3, 5))
    g = pb.gradients(T)
    H = pb.hessians(T).dense()
    eps = 1e-6
    for j in range(5):
        e = np.zeros(5)
        e[j] = eps
        E = np.repeat(e[None], 3, 0)
        fd_g = (pb.values(T + E) - pb.values(T - E)) / (2 * eps)
        fd_H = (pb.gradients(T + E) - pb.gradients(T - E)) / (2 * eps)
        np.testing.assert_allclose(g[:, j], fd_g, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(H[:, :, j], fd_H, rtol=1e-6, atol=1e-9)


def test_subsets_of_clients_agree_with_the_full_set(rng):
    pb, _ = make(rng, n_clients=6, d=5)
    T = rng.normal(size=(6, 5))
    sel = np.array([4, 1, 5])
    v, g = pb.values_and_gradients(T)
    vs, gs = pb.values_and_gradients(T[sel], sel)
    np.testing.assert_allclose(vs, v[sel], rtol=1e-13)
    np.testing.assert_allclose(gs, g[sel], rtol=1e-13)
    np.testing.assert_allclose(pb.hessians(T[sel], sel).dense(), pb.hessians(T).dense()[sel], rtol=1e-13)
    with pytest.raises(ValueError, match="shape"):
        pb.gradients(T, sel)


def test_hessian_blocks_are_exactly_symmetric(rng):
    pb, _ = make(rng, n_clients=3, d=7, density=0.5)
    for B in pb.hessians(rng.normal(size=(3, 7))).blocks:
        assert np.array_equal(B, B.T)


def test_active_blocks_solve_apply_and_null_space(rng):
    d = 6
    active = (np.array([0, 2, 5]), np.array([], dtype=np.int64), np.arange(6))
    blocks = tuple(np.eye(len(a)) + (lambda A: A @ A.T)(rng.normal(size=(len(a), len(a)))) for a in active)
    G = rng.normal(size=(3, d))
    for shift in (0.4, 0.0):
        stack = ActiveBlocks(blocks, active, d, shift)
        D = stack.dense()
        if shift:
            np.testing.assert_allclose(stack.solve(G), np.linalg.solve(D, G[:, :, None])[:, :, 0], rtol=1e-10)
        else:  # singular off the active features: the minimum-norm solution (pseudo-inverse)
            np.testing.assert_allclose(
                stack.solve(G), np.einsum("nij,nj->ni", np.linalg.pinv(D), G), rtol=1e-8, atol=1e-12
            )
        np.testing.assert_allclose(stack.apply(G), np.einsum("nij,nj->ni", D, G), rtol=1e-12)
    bad = ActiveBlocks((-np.eye(2),), (np.array([0, 1]),), 3, 0.0)
    with pytest.raises(NotPositiveDefinite, match="client 0"):
        bad.solve(np.ones((1, 3)))


def test_empty_client_and_bad_arguments(rng):
    X, y, parts = random_data(rng, 2, 3)
    with pytest.raises(ValueError, match="at least one sample"):
        FederatedLogReg(X, y, [parts[0], np.array([], dtype=int)])
    with pytest.raises(ValueError, match="lam"):
        FederatedLogReg(X, y, parts, lam=-1)
    with pytest.raises(ValueError, match="weighting"):
        FederatedLogReg(X, y, parts, weighting="size")


def test_hessian_plan_product_written_into_its_buffer_is_the_sparse_product():
    """``_matvec_into`` (the one-product Hessians' Q s, written into a buffer one longer) gives SciPy's
    ``Q @ s`` to the last bit, then the 0 entry, for 32- and 64-bit index arrays."""
    import scipy.sparse as sp

    from fedconvex.problem import _matvec_into

    r = np.random.default_rng(5)
    Q = sp.random(300, 80, density=0.1, random_state=r, format="csr") * 1e3
    x = r.normal(size=80) * np.exp(r.normal(size=80) * 4)
    for idx in (np.int32, np.int64):
        Qi = sp.csr_matrix((Q.data, Q.indices.astype(idx), Q.indptr.astype(idx)), shape=Q.shape)
        got = _matvec_into(Qi, x)
        assert got.shape == (301,) and got[-1] == 0.0 and np.array_equal(got[:-1], Qi @ x)


def test_global_hessian_product_keeps_its_pattern_and_gives_scipys_numbers(rng):
    """``_xtsx`` (X^T diag(s) X with the sparse product's symbolic pass made once) is, to the last bit, the
    expression it replaces, on call after call with new weights (zeros and wide magnitudes included), and the
    global Hessian built on it is still the naive one."""
    X, y, parts = random_data(rng, 5, 9, density=0.3)
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    for _ in range(4):
        s = rng.random(pb.X.shape[0]) * np.exp(rng.normal(size=pb.X.shape[0]) * 5)
        s[rng.random(s.size) < 0.2] = 0.0
        ref = (pb.X.T @ pb.X.multiply(s[:, None]).tocsr()).toarray()
        got = pb._xtsx(s)
        assert got.dtype == ref.dtype and np.array_equal(got, ref)
    theta = rng.normal(size=pb.d)
    np.testing.assert_allclose(pb.hessian(theta), NaiveLogReg(X, y, parts, 1e-2).H(theta), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ malformed inputs, refused at the boundary
def _small(rng):
    X, y, parts = random_data(rng, 3, 4, sizes=[4, 5, 3])
    return X, y, parts


@pytest.mark.parametrize(
    "lam,exc,fragment",
    [
        (float("inf"), ValueError, "lam must be a finite number >= 0, got inf"),
        (float("nan"), ValueError, "lam must be a finite number >= 0, got nan"),
        (-1e-3, ValueError, "lam must be a finite number >= 0, got -0.001"),
        ("x", TypeError, "lam must be a real number, got 'x'"),
        (None, TypeError, "lam must be a real number, got None"),
        (True, TypeError, "lam must be a real number, got True"),
    ],
    ids=["inf", "nan", "negative", "text", "none", "bool"],
)
def test_bad_lam_is_one_clear_error(rng, lam, exc, fragment):
    X, y, parts = _small(rng)
    with pytest.raises(exc) as info:
        FederatedLogReg(X, y, parts, lam=lam)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_labels_must_be_exactly_plus_minus_one(rng):
    """0/1 labels would give another (wrong) problem: log(1 + exp(0)) for every 0 label, whatever theta."""
    X, y, parts = _small(rng)
    with pytest.raises(ValueError) as info:
        FederatedLogReg(X, (y + 1) / 2, parts)
    msg = str(info.value)
    assert "y must hold labels -1 and +1" in msg and "got 0" in msg and "2 * y - 1" in msg
    for bad in (y * 2, np.where(y > 0, 1.0, 0.5), (y > 0)):  # +-2, a fraction, booleans
        with pytest.raises(ValueError, match="y must hold labels -1 and \\+1"):
            FederatedLogReg(X, bad, parts)
    # +-1 of any numeric dtype are the same problem
    a = FederatedLogReg(X, y.astype(np.int8), parts, lam=0.1)
    b = FederatedLogReg(X, y, parts, lam=0.1)
    theta = rng.normal(size=4)
    assert a.value(theta) == b.value(theta)


@pytest.mark.parametrize(
    "case,fragment",
    [
        ("y-short", "y has 11 labels but X has 12 rows"),
        ("y-2d", "y must be a 1-D array of labels, got shape (12, 1)"),
        ("y-text", "y must be numeric"),
        ("y-nan", "y holds NaN or Inf"),
        ("X-nan", "X holds NaN or Inf"),
        ("X-inf", "X holds NaN or Inf"),
        ("X-text", "X must be a 2-D numeric array or SciPy sparse matrix"),
        ("X-no-columns", "X has no columns"),
    ],
)
def test_malformed_data_is_one_clear_error(rng, case, fragment):
    X, y, parts = _small(rng)
    if case == "y-short":
        y = y[:-1]
    elif case == "y-2d":
        y = y[:, None]
    elif case == "y-text":
        y = np.array(["a"] * len(y))
    elif case == "y-nan":
        y = y.copy()
        y[3] = np.nan
    elif case in ("X-nan", "X-inf"):
        X = X.toarray()
        X[2, 1] = np.nan if case == "X-nan" else np.inf
    elif case == "X-text":
        X = np.array([["a"] * 4] * 12)
    elif case == "X-no-columns":
        X = np.zeros((12, 0))
    with pytest.raises((ValueError, TypeError)) as info:
        FederatedLogReg(X, y, parts)
    assert fragment in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "parts,exc,fragment",
    [
        ([[0, 1, 2], [3, -1]], ValueError, "client 1 has row index -1; row indices must be in 0..11"),
        ([[0, 1, 2], [3, 12]], ValueError, "client 1 has row index 12; row indices must be in 0..11"),
        ([[0, 1, 2], [3.0, 4.0]], TypeError, "client 1's row indices must be integers, got float64"),
        ([[0, 1, 2], [True, False]], TypeError, "client 1's row indices must be integers, got bool"),
        ([[0, 1], 2], ValueError, "client 1's rows must be a 1-D array of row indices, got a scalar"),
        ([[[0, 1], [2, 3]]], ValueError, "client 0's rows must be a 1-D array of row indices, got shape (2, 2)"),
        (None, TypeError, "parts must be a sequence of row-index arrays (one per client), got NoneType"),
        ([], ValueError, "a federated problem needs at least one client"),
    ],
    ids=["negative", "out-of-range", "float", "bool", "scalar", "2d", "none", "empty"],
)
def test_bad_client_partition_is_one_clear_error(rng, parts, exc, fragment):
    X, y, _ = _small(rng)
    with pytest.raises(exc) as info:
        FederatedLogReg(X, y, parts)
    assert fragment in str(info.value), str(info.value)


def test_a_row_twice_in_a_client_is_that_row_copied(rng):
    """A resampled client (a row listed twice) is the problem whose data holds that row twice."""
    X, y, parts = _small(rng)
    X = np.asarray(X.todense()) if hasattr(X, "todense") else np.asarray(X)
    twice = FederatedLogReg(X, y, [parts[0], np.r_[parts[1], parts[1][:2]], parts[2]], lam=0.1)
    Xc, yc = np.vstack([X, X[parts[1][:2]]]), np.r_[y, y[parts[1][:2]]]
    copied = FederatedLogReg(Xc, yc, [parts[0], np.r_[parts[1], len(y), len(y) + 1], parts[2]], lam=0.1)
    theta = rng.normal(size=X.shape[1])
    np.testing.assert_allclose(twice.value(theta), copied.value(theta), rtol=1e-14)
    np.testing.assert_allclose(twice.gradient(theta), copied.gradient(theta), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(twice.hessian(theta), copied.hessian(theta), rtol=1e-13, atol=1e-15)
    assert twice.counts[1] == len(parts[1]) + 2


def test_a_row_may_belong_to_several_clients_and_index_arrays_of_any_integer_type_work(rng):
    X, y, parts = _small(rng)
    a = FederatedLogReg(X, y, [parts[0], parts[0], list(parts[1])], lam=0.1)
    b = FederatedLogReg(X, y, [parts[0].astype(np.uint16), parts[0].astype(np.int32), range(4, 9)], lam=0.1)
    theta = rng.normal(size=4)
    assert a.n_clients == 3 and a.value(theta) == b.value(theta)


def test_zero_dimensional_arrays_are_the_numbers_they_hold(rng):
    """lam (and a method's hyper-parameters) given as 0-d arrays, as array code often has them, act as floats."""
    from fedconvex.algorithms import make_algorithm

    X, y, parts = _small(rng)
    theta = rng.normal(size=4)
    plain = FederatedLogReg(X, y, parts, lam=1e-3)
    assert FederatedLogReg(X, y, parts, lam=np.array(1e-3)).value(theta) == plain.value(theta)
    alg = make_algorithm("fedpm", lr=np.array(0.5))
    assert type(alg.lr) is float and alg.lr == 0.5
    with pytest.raises(ValueError, match="must be > 0"):
        make_algorithm("fedpm", lr=np.array(-0.5))
    with pytest.raises(TypeError, match="lam must be a real number"):
        FederatedLogReg(X, y, parts, lam=np.array("x"))
    torch = pytest.importorskip("torch")
    assert FederatedLogReg(X, y, parts, lam=torch.tensor(1e-3, dtype=torch.float64)).value(theta) == plain.value(theta)
