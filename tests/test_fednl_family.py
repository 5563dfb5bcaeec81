"""The FedNL family (issue 12): compressors' defining properties and bit counts, the partial
eigensolver, FedNL-LS's monotone line search, FedNL-PP's reductions, FedNS's sketches, and the
fast paths (one-product Hessians, certified screening) against their plain definitions."""

import numpy as np
import pytest
from naive import NaiveLogReg, random_data

from fedconvex.algorithms import make_algorithm
from fedconvex.algorithms.compressors import make_compressor, top_abs_eigh
from fedconvex.blocks import ActiveBlocks
from fedconvex.messages import client_problem
from fedconvex.problem import FederatedLogReg
from fedconvex.run import run


def sym(rng, n, d):
    A = rng.normal(size=(n, d, d))
    return A + A.transpose(0, 2, 1)


def dense(H):
    """A client-state stack of Hessian estimates as (N, d, d) (block states have ``dense``)."""
    return H.dense() if hasattr(H, "dense") else H


def upper(M):
    return M[np.triu_indices(M.shape[0])]


def problem(rng, n=4, d=6, lam=1e-2, **kw):
    X, y, parts = random_data(rng, n, d, **kw)
    return FederatedLogReg(X, y, parts, lam=lam), NaiveLogReg(X, y, parts, lam)


# ------------------------------------------------------------------ partial eigensolver
@pytest.mark.parametrize("n,r", [(40, 1), (40, 3), (25, 2), (6, 2)])
def test_partial_eigensolver_equals_full_eigh_top_r(rng, n, r):
    for shift in (-5.0, 0.0, 5.0):  # the dominant end is the bottom, either, the top
        M = sym(rng, 1, n)[0] + shift * np.eye(n)
        lam, V = np.linalg.eigh(M)
        pick = np.argsort(-np.abs(lam))[:r]
        got_lam, got_V = top_abs_eigh(M, r)
        np.testing.assert_allclose(got_lam, lam[pick], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose((got_V * got_lam) @ got_V.T, (V[:, pick] * lam[pick]) @ V[:, pick].T, atol=1e-9)
        np.testing.assert_allclose(got_V.T @ got_V, np.eye(r), atol=1e-10)


@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("n", [30, 40, 150])
def test_partial_eigensolver_pairs_are_lapack_index_range_pairs(rng, r, n):
    """One tridiagonal reduction serves both ends: each pair returned is what LAPACK's index-range solver
    dsyevr returns for that end -- bit for bit for n <= 32, where dsytrd reduces unblocked whatever its
    workspace, and to round-off above, where our smaller block size rounds differently -- and the pairs kept
    are the r of largest |eigenvalue| among both ends (the top end first on equal magnitudes), also when T
    splits into blocks.  (Eigenvalue gaps here are >= 1e-9 relative, far above round-off, so the pairs
    picked are the same ones.)"""
    from scipy.linalg.lapack import dsyevr

    h = n // 3
    cases = [sym(rng, 1, n)[0] + shift * np.eye(n) for shift in (-6.0, -1.0, 0.0, 1.0, 6.0)]
    split = np.zeros((n, n))  # block diagonal: dsytrd's T splits, dstebz orders by block
    split[:h, :h], split[h:, h:] = sym(rng, 1, h)[0] + 4 * np.eye(h), sym(rng, 1, n - h)[0] - 4 * np.eye(n - h)
    low_rank = rng.normal(size=(n, 2))
    mixed = np.zeros((n, n))  # the largest eigenvalues alternate between the two blocks
    mixed[:h, :h] = np.diag(np.arange(float(h))) * 3.5 + 1e-3 * sym(rng, 1, h)[0]
    mixed[h:, h:] = (
        np.diag(np.arange(float(n - h))) * (3.5 * (h - 1) - 1.0) / (n - h - 1) + 1e-3 * sym(rng, 1, n - h)[0]
    )
    cases += [split, mixed, low_rank @ np.diag([3.0, -3.0 - 1e-6]) @ low_rank.T, np.zeros((n, n))]
    for M in cases:
        ends = {}
        for top in (True, False):
            il, iu = (n - r + 1, n) if top else (1, r)
            w, Z, m = dsyevr(np.asfortranarray(M), compute_v=1, range="I", il=il, iu=iu, lower=1)[:3]
            ends[top] = (w[:m], Z[:, :m])
        lam = np.concatenate([ends[True][0], ends[False][0]])
        V = np.concatenate([ends[True][1], ends[False][1]], axis=1)
        pick = np.argsort(-np.abs(lam), kind="stable")[:r]
        got_lam, got_V = top_abs_eigh(M, r)
        if n <= 32:
            assert np.array_equal(got_lam, lam[pick]) and np.array_equal(got_V, V[:, pick])
        else:  # the same pairs to round-off: values, the rank-r part they make (vectors of a repeated or zero
            # eigenvalue are not unique), residuals and orthonormality
            scale = max(np.abs(M).max(), 1e-300)
            np.testing.assert_allclose(got_lam, lam[pick], rtol=0, atol=1e-12 * scale)
            np.testing.assert_allclose(
                (got_V * got_lam) @ got_V.T, (V[:, pick] * lam[pick]) @ V[:, pick].T, rtol=0, atol=1e-10 * scale
            )
            assert np.abs(M @ got_V - got_V * got_lam).max() <= 1e-11 * scale
            np.testing.assert_allclose(got_V.T @ got_V, np.eye(r), atol=1e-12)


def test_rank_r_on_a_support_equals_rank_r_on_the_whole_matrix(rng):
    d, r = 30, 2
    M = np.zeros((3, d, d))
    support = (np.arange(0, 30, 2), np.arange(5, 25), np.arange(d))
    for c, a in enumerate(support):
        M[c][np.ix_(a, a)] = sym(rng, 1, len(a))[0]
    comp = make_compressor("rankr", rank=r)
    dense = comp.decode(np, comp.encode(np, M, rng), d)
    np.testing.assert_allclose(comp.decode(np, comp.encode(np, M, rng, support=support), d), dense, atol=1e-10)
    # a wrong support is detected (mass outside it) and the whole matrix is used
    wrong = (np.arange(3), np.arange(3), np.arange(3))
    np.testing.assert_allclose(comp.decode(np, comp.encode(np, M, rng, support=wrong), d), dense, atol=1e-10)
    out = comp.decode(np, comp.encode(np, M, rng), d)
    assert np.array_equal(out, out.transpose(0, 2, 1))  # exactly symmetric


# --------------------------------------------------------------------------- compressors
def test_contractive_compressors_keep_topk_guarantee(rng):
    d, k = 12, 10
    n = d * (d + 1) // 2
    M = sym(rng, 5, d)
    for name in ("topk", "toplek"):
        comp = make_compressor(name, k=k)
        msg = comp.encode(np, M, rng)
        C = comp.decode(np, msg, d)
        counts = [len(v) for v in msg["values"]]
        for c in range(5):
            u, cu = upper(M[c]), upper(C[c])
            assert np.sum((u - cu) ** 2) <= (1 - k / n) * np.sum(u**2) + 1e-12
            assert np.count_nonzero(cu) == counts[c] <= k
        assert comp.bits(msg, d).tolist() == [96 * c for c in counts]
        if name == "toplek":  # fewer entries than TopK whenever fewer suffice, never more
            assert all(1 <= c <= k for c in counts)
    # energy concentrated in two entries: TopLEK sends only what the guarantee needs
    M2 = 1e-3 * sym(rng, 1, d)
    M2[0, 0, 1] = M2[0, 1, 0] = 5.0
    M2[0, 3, 3] = 4.0
    assert len(make_compressor("toplek", k=70).encode(np, M2, rng)["values"][0]) == 2  # of 78


class _Start:
    """An rng whose RandSeqK start is fixed."""

    def __init__(self, start):
        self.start = start

    def integers(self, low, high, size):
        return np.full(size, self.start)


def test_randseqk_is_exactly_unbiased_over_every_start(rng):
    d, k = 5, 4
    n = d * (d + 1) // 2
    M = sym(rng, 1, d)
    comp = make_compressor("randseqk", k=k)
    # the start is uniform over the n upper entries: the average over all of them is the expectation
    mean = sum(comp.decode(np, comp.encode(np, M, _Start(s)), d)[0] for s in range(n)) / n
    np.testing.assert_allclose(mean, M[0], rtol=1e-12, atol=1e-12)
    msg = comp.encode(np, M, rng)
    assert np.count_nonzero(upper(comp.decode(np, msg, d)[0])) == k
    assert comp.bits(msg, d).tolist() == [64 * k + 32]


def test_randk_and_natural_are_unbiased_and_natural_has_omega_one_eighth(rng):
    d = 4
    M = sym(rng, 1, d)
    nat, rk = make_compressor("natural"), make_compressor("randk", k=3)
    nat_draws = np.array([nat.decode(np, nat.encode(np, M, rng), d)[0] for _ in range(3000)])
    rk_draws = np.array([rk.decode(np, rk.encode(np, M, rng), d)[0] for _ in range(3000)])
    scale = np.abs(M).max()
    np.testing.assert_allclose(nat_draws.mean(0), M[0], atol=0.03 * scale)
    np.testing.assert_allclose(rk_draws.mean(0), M[0], atol=0.25 * scale)
    # every draw is a signed power of two next to the entry, and the variance is at most ||x||^2 / 8
    U = upper(M[0])
    one = upper(nat_draws[0])
    assert np.all(np.sign(one) == np.sign(U)) and np.all(np.abs(one) / np.abs(U) <= 2)
    assert np.all(np.abs(one) / np.abs(U) >= 0.5)
    assert np.all(np.log2(np.abs(one)) == np.round(np.log2(np.abs(one))))
    var = np.mean([np.sum((upper(D) - U) ** 2) for D in nat_draws])
    assert var <= np.sum(U**2) / 8 * 1.05
    msg = nat.encode(np, M, rng)
    assert nat.bits(msg, d).tolist() == [12 * d * (d + 1) // 2]
    assert msg["code"].dtype == np.int16


def test_natural_decoding_table_is_the_definition_and_its_server_sum_is_the_entry_sum(rng):
    """Natural's codes decode by table look-up to sign(c) 2^(|c| - 1075) for every int16 code (the
    definition, in Python's own float arithmetic), and the server's sum of Natural messages equals, to the
    last bit, the sum that adds each client's non-zero entries w_i value_i in client order (bincount)."""
    import math

    from fedconvex.algorithms import fednl_blocks
    from fedconvex.algorithms.compressors import natural_values

    codes = np.arange(-32768, 32768, dtype=np.int64)
    got = natural_values(codes.astype(np.int16))

    def value(c):  # |c| - 1075 > 1023 overflows to inf; -32768 is its own absolute value in int16
        e = (c if c == -32768 else abs(c)) - 1075
        return math.copysign(math.inf if e > 1023 else math.ldexp(1.0, e), c) if c else 0.0

    want = np.array([value(int(c)) for c in codes])
    assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))
    d = 9
    n = d * (d + 1) // 2
    nat = make_compressor("natural")
    code = nat.encode(np, sym(rng, 6, d) * np.exp(rng.normal(size=(6, 1, 1)) * 3), rng)["code"]
    code[rng.random(code.shape) < 0.3] = 0  # entries off a client's block
    assert nat.bits({"code": code}, d).tolist() == [12 * n] * 6
    w = rng.random(6)
    at = np.flatnonzero(code)
    c, u = np.divmod(at, n)
    rows, cols = np.triu_indices(d)
    ref = np.zeros((d, d))
    np.add.at(ref, (rows[u], cols[u]), w[c] * natural_values(code.reshape(-1)[at]))  # client order, from 0
    ref = np.triu(ref) + np.triu(ref, 1).T
    assert np.array_equal(fednl_blocks.server_sum(nat, {"code": code}, w, d), ref)


def test_bits_formulas(rng):
    d = 7
    M = sym(rng, 2, d)
    assert make_compressor("identity").bits({"S": M}, d).tolist() == [64 * 28] * 2
    rank = make_compressor("rankr", rank=2)
    assert rank.bits(rank.encode(np, M, rng), d).tolist() == [64 * 2 * 8] * 2
    top = make_compressor("topk", k=5)
    assert top.bits(top.encode(np, M, rng), d).tolist() == [96 * 5] * 2


# ------------------------------------------------------------------------ FedNL-LS / -PP
def test_fednl_ls_is_monotone_from_far_away_and_converges(rng):
    pb, ref = problem(rng, n=4, d=6, lam=1e-2, sizes=[15, 20, 10, 25])
    theta0 = 8.0 * np.ones(pb.d)  # far from the optimum
    for kw in ({}, dict(compressor="rankr", rank=1)):
        # f_star = 0 makes the history's f_gap the objective itself
        state, hist = run(pb, make_algorithm("fednl-ls", **kw), theta0, 30, f_star=0.0)
        f = [h["f_gap"] for h in hist]
        assert all(b <= a for a, b in zip(f, f[1:], strict=False))
        assert f[-1] < f[0] and hist[-1]["grad_norm"] < 1e-8
        assert state.server["ls_trials"] >= 30


def test_fednl_ls_takes_the_unit_step_near_the_optimum_like_fednl(rng):
    pb, ref = problem(rng)
    theta0 = rng.normal(size=pb.d) * 0.05
    ls, _ = run(pb, make_algorithm("fednl-ls"), theta0, 4)
    plain, _ = run(pb, make_algorithm("fednl", option="project"), theta0, 4)
    np.testing.assert_allclose(ls.theta, plain.theta, rtol=1e-12)


def test_fednl_pp_with_every_client_identity_alpha_one_is_newton(rng):
    pb, ref = problem(rng)
    theta = rng.normal(size=pb.d) * 0.3
    state, _ = run(pb, make_algorithm("fednl-pp"), theta, 3)
    for _ in range(3):
        theta = ref.newton_step(theta)
    np.testing.assert_allclose(state.theta, theta, rtol=1e-9)


@pytest.mark.parametrize("participants", [None, 2])
def test_fednl_pp_server_sums_are_the_client_states_and_absent_clients_keep_theirs(rng, participants):
    pb, ref = problem(rng, n=5)
    theta0 = rng.normal(size=pb.d) * 0.3
    alg = make_algorithm("fednl-pp", compressor="rankr", rank=1)
    before = run(pb, alg, theta0, 3, participants=participants, seed=4)[0]
    after = run(pb, alg, theta0, 4, participants=participants, seed=4)[0]
    w = pb.client_weights
    for st in (before, after):
        np.testing.assert_allclose(st.server["H"], np.tensordot(w, dense(st.clients["H"]), 1), atol=1e-12)
        np.testing.assert_allclose(st.server["g"], w @ st.clients["g"], atol=1e-12)
        assert st.server["l"] == pytest.approx(float(w @ st.clients["l"]), abs=1e-12)
    changed = [i for i in range(5) if not np.array_equal(dense(before.clients["H"])[i], dense(after.clients["H"])[i])]
    assert len(changed) <= (participants or 5)
    # the model is (H + l I)^{-1} g of the server's sums
    H, l, g = after.server["H"], after.server["l"], after.server["g"]
    np.testing.assert_allclose(after.theta, np.linalg.solve(H + l * np.eye(pb.d), g), rtol=1e-10)


# ------------------------------------------------------------------------------- FedNS
def test_fedns_gaussian_draws_are_the_per_client_draws(rng):
    pb, ref = problem(rng, n=3, d=5, sizes=[30, 40, 20], density=0.6)
    theta = rng.normal(size=pb.d)
    alg = make_algorithm("fedns", sketch_size=4)
    up, _ = alg.client_update(pb, {"theta": theta}, {}, np.arange(3), np.random.default_rng(7))
    draw = np.random.default_rng(7)
    for c in range(3):
        St = draw.standard_normal((int(pb.counts[c]), 4)) / 2.0
        rows = np.arange(pb.row_offsets[c], pb.row_offsets[c + 1])
        m = pb.y_host[rows] * (pb.X[rows] @ theta)
        s = 1 / (1 + np.exp(-m)) * (1 - 1 / (1 + np.exp(-m))) / len(rows)
        Ac = pb.X[rows][:, pb.active_host[c]].toarray() * np.sqrt(s)[:, None]
        np.testing.assert_allclose(up["SAt"][c], Ac.T @ St, rtol=1e-10, atol=1e-13)


def test_fedns_gaussian_draws_ahead_in_a_thread_with_the_numbers_and_generator_state_of_one_draw(rng):
    """The Gaussian sketches are drawn by a helper thread while the client computes: the message is, to the
    last bit, the one made from ``sketches``' single draw, and the generator ends in the same state."""
    pb, _ = problem(rng, n=4, d=6, sizes=[30, 3, 25, 40], density=0.6)  # client 1: k >= M, sent exactly
    theta = rng.normal(size=pb.d)
    alg = make_algorithm("fedns", sketch_size=5)
    sel = np.arange(4)
    a, b = np.random.default_rng(21), np.random.default_rng(21)
    up, _ = alg.client_update(pb, {"theta": theta}, {}, sel, a)
    G = b.standard_normal((30 + 25 + 40, 5))  # one draw for the three sketched clients
    sk, scale = [G[:30], None, G[30:55], G[55:]], 1 / np.sqrt(5)
    ref = pb.sketched_roots(np.tile(theta, (4, 1)), sk, sel, scale=scale)
    for x, y in zip(up["SAt"], ref, strict=False):
        assert np.array_equal(x, y)
    assert a.random() == b.random()


def test_srht_sketch_is_the_subsampled_hadamard_transform_and_its_product_is_exact(rng):
    """The SRHT sketch kept as its random choices is sqrt(P/k) (R H D)^T / sqrt(P) on the first M rows, with
    the random choices drawn as one pick of k of P rows, then M signs; the product through the transform's
    Kronecker structure (fedns.SRHTSketch.rows_product) equals the product with that dense S^T to round-off
    (the sums are grouped differently) and to A^T S^T formed from the definition."""
    from fedconvex.algorithms.fedns import SRHTSketch

    pb, _ = problem(rng, n=3, d=7, sizes=[30, 45, 12], density=0.5)
    theta = rng.normal(size=pb.d)
    alg = make_algorithm("fedns", sketch_size=5, sketch="srht")
    sk, scale = alg.sketches(pb, np.arange(3), 5, np.random.default_rng(11))
    draw = np.random.default_rng(11)
    dense_sk = []
    for c, St in enumerate(sk):
        m = int(pb.counts[c])
        if m <= 5:
            assert St is None
            dense_sk.append(None)
            continue
        P = 1 << (m - 1).bit_length()
        pick, D = draw.choice(P, 5, replace=False), draw.choice((-1.0, 1.0), m)
        H = np.array([[(-1.0) ** bin(i & j).count("1") for j in range(P)] for i in range(P)])  # Sylvester order
        ref = (np.sqrt(P / 5) * (H[pick][:, :m] * D[None, :]) / np.sqrt(P)).T  # first M columns of R H, times D
        assert isinstance(St, SRHTSketch) and St.shape == (m, 5)
        np.testing.assert_allclose(St.dense(), ref, rtol=1e-15)
        dense_sk.append(St.dense())
    thetas = np.tile(theta, (3, 1))
    fast = pb.sketched_roots(thetas, sk, np.arange(3), scale=scale)
    slow = pb.sketched_roots(thetas, dense_sk, np.arange(3), scale=scale)
    root = np.sqrt(pb._curvature(thetas, pb._rows(None)))
    for c, (a, b, St) in enumerate(zip(fast, slow, dense_sk, strict=False)):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-16)
        A = pb.X[pb.row_offsets[c] : pb.row_offsets[c + 1]][:, pb.active_host[c]].toarray()
        A = A * root[pb.row_offsets[c] : pb.row_offsets[c + 1], None]
        np.testing.assert_allclose(a, A.T if St is None else A.T @ St, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("m,k", [(2, 1), (3, 2), (5, 3), (17, 4), (40, 9), (100, 30), (350, 300), (600, 50)])
def test_srht_fast_transform_product_is_the_dense_sketch_product(rng, m, k):
    """rows_product's Kronecker-factored transform (P = P1 P2, also P1 = 1 and odd log2 P, rows padded) is
    (diag(w) A)^T S^T with the dense S^T of the same random choices, to round-off."""
    from fedconvex.algorithms.fedns import SRHTSketch

    P = 1 << (m - 1).bit_length()
    St = SRHTSketch(rng.choice(P, k, replace=False), rng.choice((-1.0, 1.0), m), P, 1.0 / np.sqrt(k))
    A = rng.normal(size=(m, 7)) * (rng.random((m, 7)) < 0.3)
    w = rng.uniform(0.1, 2.0, m)
    got = St.rows_product(A, w)
    ref = (A * w[:, None]).T @ St.dense()
    assert got.shape == (7, k)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-13 * np.abs(ref).max())


def test_countsketch_is_one_signed_bucket_per_row_and_its_product_is_exact(rng):
    """The CountSketch kept as its random choices (per client k buckets, then M signs) is the M x k matrix
    with the row's sign in its bucket; the product through bincount equals, to the last bit, the product
    with that matrix as a SciPy sparse matrix and as a dense one, and A^T S^T to round-off."""
    pb, _ = problem(rng, n=3, d=7, sizes=[30, 45, 12], density=0.5)
    theta = rng.normal(size=pb.d)
    alg = make_algorithm("fedns", sketch_size=6, sketch="countsketch")
    sk, scale = alg.sketches(pb, np.arange(3), 6, np.random.default_rng(11))
    draw = np.random.default_rng(11)
    sparse_sk, dense_sk = [], []
    for c, St in enumerate(sk):
        m = int(pb.counts[c])
        if m <= 6:
            assert St is None
            sparse_sk.append(None)
            dense_sk.append(None)
            continue
        bucket, sign = draw.integers(0, 6, m), draw.choice((-1.0, 1.0), m)
        ref = np.zeros((m, 6))
        ref[np.arange(m), bucket] = sign
        assert St.shape == (m, 6) and np.array_equal(St.dense(), ref)
        sparse_sk.append(St.sparse())
        dense_sk.append(ref)
    thetas = np.tile(theta, (3, 1))
    fast = pb.sketched_roots(thetas, sk, np.arange(3), scale=scale)
    for other in (sparse_sk, dense_sk):
        for a, b in zip(fast, pb.sketched_roots(thetas, other, np.arange(3), scale=scale), strict=False):
            assert np.array_equal(a, b)
    root = np.sqrt(pb._curvature(thetas, pb._rows(None)))
    for c, (R, St) in enumerate(zip(fast, dense_sk, strict=False)):
        A = pb.X[pb.row_offsets[c] : pb.row_offsets[c + 1]][:, pb.active_host[c]].toarray()
        A = A * root[pb.row_offsets[c] : pb.row_offsets[c + 1], None]
        np.testing.assert_allclose(R, A.T if St is None else A.T @ St, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("sketch", ["srht", "countsketch"])
def test_fedns_cheap_sketches_are_unbiased(rng, sketch):
    X, y, parts = random_data(rng, 2, 4, sizes=[40, 40], density=0.8)
    pb, ref = FederatedLogReg(X, y, parts, lam=1e-2), NaiveLogReg(X, y, parts, 1e-2)
    theta = rng.normal(size=4)
    alg = make_algorithm("fedns", sketch_size=8, sketch=sketch)
    Hs = []
    for seed in range(400):
        up, _ = alg.client_update(pb, {"theta": theta}, {}, np.arange(2), np.random.default_rng(seed))
        Hs.append(
            ActiveBlocks(tuple(R @ R.T for R in up["SAt"]), up["active"], 4, pb.lam).weighted_sum(np.full(2, 0.5))
        )
    H = ref.H(theta)
    assert np.linalg.norm(Hs[0] - H) > 1e-3 * np.linalg.norm(H)
    assert np.linalg.norm(np.mean(Hs, 0) - H) < 0.06 * np.linalg.norm(H)
    with pytest.raises(ValueError, match="sketch"):
        make_algorithm("fedns", sketch="fourier")


# ------------------------------------------------------------------------ fast paths
def test_one_product_hessians_equal_the_per_client_products(rng):
    pb, ref = problem(rng, n=5, d=9, sizes=[4, 9, 1, 12, 6], density=0.4)
    T = rng.normal(size=(5, 9))
    assert pb._plan is not None
    H = pb.hessians(T)
    for c in range(5):
        np.testing.assert_allclose(H.dense()[c], ref.H_i(c, T[c]), rtol=1e-12, atol=1e-15)
        assert np.array_equal(H.blocks[c], H.blocks[c].T)
    with pytest.raises(ValueError):
        H.blocks[0][0, 0] = 1.0  # the certified numbers cannot be changed in place
    sub = pb.hessians(T[[3, 0]], np.array([3, 0]))
    np.testing.assert_allclose(sub.dense(), H.dense()[[3, 0]], rtol=1e-13)
    w = rng.random(5)
    loop = ActiveBlocks(tuple(np.array(b) for b in H.blocks), H.active, H.d, H.shift)  # the plain path
    np.testing.assert_allclose(H.weighted_sum(w), loop.weighted_sum(w), rtol=1e-13)
    np.testing.assert_allclose(H.plus_dense(np.ones((5, 9, 9))), loop.plus_dense(np.ones((5, 9, 9))), rtol=1e-13)
    sub_loop = ActiveBlocks(tuple(np.array(b) for b in sub.blocks), sub.active, sub.d, sub.shift)
    np.testing.assert_allclose(sub.weighted_sum(w[:2]), sub_loop.weighted_sum(w[:2]), rtol=1e-13)
    np.testing.assert_allclose(H.weighted_sum(np.full(5, 0.2)), loop.weighted_sum(np.full(5, 0.2)), rtol=1e-13)
    G = rng.normal(size=(5, 9))
    np.testing.assert_allclose(H.solve(G), loop.solve(G), rtol=1e-12)


def test_screening_trusts_only_its_own_factorisation(rng):
    pb, _ = problem(rng)
    T = rng.normal(size=(pb.n_clients, pb.d))
    H = pb.hessians(T)
    up = {"P": H}
    assert H.certificate.get("pd_shift") is None
    H.solve(pb.gradients(T))  # the client step factorises B_c + lam I
    assert H.certificate["pd_shift"] == pb.lam
    assert all(client_problem(up, k, pb.d) is None for k in range(pb.n_clients))
    # the same numbers without the certificate are factorised by the server: same verdict
    plain = ActiveBlocks(tuple(np.array(b) for b in H.blocks), H.active, H.d, H.shift)
    assert all(client_problem({"P": plain}, k, pb.d) is None for k in range(pb.n_clients))
    bad = ActiveBlocks(tuple(-np.array(b) - np.eye(len(b)) for b in H.blocks), H.active, H.d, H.shift)
    assert client_problem({"P": bad}, 1, pb.d).endswith("is not positive semidefinite")


# ------------------------------------------------------------- FedNL on the active blocks
def _dense_path_problem(X, y, parts, lam):
    """The same problem without the packed Hessian plan: FedNL then keeps dense (N, d, d) estimates and
    runs the compressors on whole matrices (the path CuPy / torch take), our straightforward reference."""

    class Dense(FederatedLogReg):
        PLAN_MAX_PAIRS = -1

    pb = Dense(X, y, parts, lam=lam)
    assert pb._plan is None
    return pb


@pytest.mark.parametrize(
    "name,kw",
    [
        ("fednl", {}),
        ("fednl", dict(option="shift", compressor="rankr", rank=2)),
        ("fednl", dict(compressor="topk", k=20, option="project")),
        ("fednl", dict(compressor="toplek", k=20)),
        ("fednl", dict(compressor="randk", k=15, alpha=0.2, option="shift")),
        ("fednl", dict(compressor="randseqk", k=15, alpha=0.2, option="shift")),
        ("fednl", dict(compressor="natural", alpha=8 / 9)),
        ("fednl-ls", dict(compressor="rankr", rank=1)),
        ("fednl-pp", dict(compressor="topk", k=20)),
        ("fednl-pp", dict(compressor="natural", alpha=8 / 9)),
    ],
)
@pytest.mark.parametrize("participants", [None, 3])
def test_block_path_equals_the_dense_path(rng, name, kw, participants):
    X, y, parts = random_data(rng, 6, 12, sizes=[9, 14, 5, 11, 8, 13], density=0.25)
    blocks, dense = FederatedLogReg(X, y, parts, lam=1e-2), _dense_path_problem(X, y, parts, 1e-2)
    theta0 = rng.normal(size=12) * 0.3
    alg = make_algorithm(name, **kw)
    a, ha = run(blocks, alg, theta0, 4, participants=participants, seed=5)
    b, hb = run(dense, alg, theta0, 4, participants=participants, seed=5)
    assert isinstance(b.clients["H"], np.ndarray) and hasattr(a.clients["H"], "dense")
    np.testing.assert_allclose(a.theta, b.theta, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(dense_of(a.clients["H"]), b.clients["H"], rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(a.server["H"], b.server["H"], rtol=1e-10, atol=1e-13)
    # the messages are the dense path's (same entries, same draws), so the same bytes cross the wire; the
    # identity compressor sends the difference on the client's active block (as FedPM its Hessian).  In round 1
    # the difference is zero: exactly on the blocks, round-off on the dense path's diagonal, where TopLEK
    # then keeps a round-off-dependent count; from round 2 on it sends the same counts.
    first = 2 if kw.get("compressor") == "toplek" else 1
    if kw.get("compressor", "identity") != "identity":
        assert np.array_equal(
            np.diff([r["bytes_up"] for r in ha])[first - 1 :], np.diff([r["bytes_up"] for r in hb])[first - 1 :]
        )


def dense_of(H):
    return H.dense() if hasattr(H, "dense") else H


def test_block_compressors_send_the_dense_messages_of_the_same_matrices(rng):
    from fedconvex.algorithms import fednl_blocks

    X, y, parts = random_data(rng, 5, 14, sizes=[12, 9, 4, 15, 10], density=0.3, binary=True)
    pb = FederatedLogReg(X, y, parts, lam=1e-2)
    T = rng.normal(size=(5, 14))
    H0, H1 = pb.hessians(T * 0), pb.hessians(T)
    diff = H1.packed - H0.packed
    D = fednl_blocks.BlockState(diff, H1.layout, H1.active, 14, 0.0).dense()  # the same numbers, dense
    for name, kw in [
        ("topk", dict(k=30)),
        ("toplek", dict(k=30)),
        ("topk", dict(k=200)),
        ("randk", dict(k=25)),
        ("randseqk", dict(k=25)),
        ("natural", {}),
        ("rankr", dict(rank=2)),
    ]:
        comp = make_compressor(name, **kw)
        # Natural draws for the entries of the support, so it gets the active features, as FedNL passes them;
        # Rank-R solves on the whole matrix here, an independent check of the block path's sub-block solves
        support = H1.active if name == "natural" else None
        ref = comp.encode(np, D, np.random.default_rng(3), support=support)
        msg, S = fednl_blocks.encode(comp, diff, H1.layout, H1.active, 14, np.random.default_rng(3))
        assert set(msg) == set(ref)
        for key in ref:
            for r, m in zip(ref[key], msg[key], strict=False):  # binary data: many exact ties, broken alike
                np.testing.assert_allclose(
                    np.abs(m) if key == "eigvecs" else m, np.abs(r) if key == "eigvecs" else r, rtol=1e-12, atol=1e-15
                )
        Sd = comp.decode(np, ref, 14)
        np.testing.assert_allclose(
            fednl_blocks.BlockState(S, H1.layout, H1.active, 14, 0.0).dense(), Sd, rtol=1e-12, atol=1e-15
        )
        w = rng.random(5)
        np.testing.assert_allclose(
            fednl_blocks.server_sum(comp, msg, w, 14), np.tensordot(w, Sd, 1), rtol=1e-12, atol=1e-15
        )


def test_the_block_path_refuses_active_features_out_of_order(rng):
    """Its blocks' upper entries are numbered in row-major order, which is global upper-index order (TopK's
    tie rule) only for increasing features."""
    from fedconvex.algorithms import fednl_blocks
    from fedconvex.blocks import Layout

    active = [np.array([1, 3]), np.array([5, 2])]
    layout = Layout([2, 2], [(a[:, None] * 7 + a[None, :]).reshape(-1) for a in active], 7)
    with pytest.raises(ValueError, match="client 1's active features"):
        fednl_blocks.encode(
            make_compressor("topk", k=2), rng.normal(size=8), layout, active, 7, np.random.default_rng(0)
        )


def _paper_fednl_pp(ref, x0, rounds, compress, alpha):
    """Safaryan et al. 2022, Algorithm 3 with every client taking part, written from the paper:
    init H_i^0 = grad^2 f_i(x^0), l_i^0 = ||H_i^0 - grad^2 f_i(x^0)||_F, g_i^0 = (H_i^0 + l_i^0 I) x^0 - grad f_i(x^0);
    x^{k+1} = (H^k + l^k I)^{-1} g^k with H, l, g the averages; then every client sets w_i = x^{k+1},
    H_i += alpha C(grad^2 f_i(w_i) - H_i), l_i = ||H_i - grad^2 f_i(w_i)||_F, g_i = (H_i + l_i I) w_i - grad f_i(w_i)."""
    n, d = len(ref.Xs), ref.d
    H = [ref.H_i(i, x0) for i in range(n)]
    l = [0.0] * n
    g = [H[i] @ x0 - ref.g_i(i, x0) for i in range(n)]
    xs = []
    for _ in range(rounds):
        x = np.linalg.solve(sum(H) / n + sum(l) / n * np.eye(d), sum(g) / n)
        xs.append(x)
        for i in range(n):
            Hi = ref.H_i(i, x)
            H[i] = H[i] + alpha * compress(Hi - H[i])
            l[i] = np.linalg.norm(H[i] - Hi)
            g[i] = (H[i] + l[i] * np.eye(d)) @ x - ref.g_i(i, x)
    return xs


def _top_k_dense(M, k):
    """Keep the k upper entries of largest magnitude (and their mirrors)."""
    iu, ju = np.triu_indices(M.shape[0])
    u = M[iu, ju]
    keep = np.argsort(-np.abs(u), kind="stable")[:k]
    out = np.zeros_like(M)
    out[iu[keep], ju[keep]] = u[keep]
    out[ju[keep], iu[keep]] = u[keep]
    return out


def _rank_one_dense(M):
    lam, V = np.linalg.eigh(M)
    j = int(np.argmax(np.abs(lam)))
    return lam[j] * np.outer(V[:, j], V[:, j])


@pytest.mark.parametrize(
    "comp,kw,alpha",
    [(_rank_one_dense, dict(compressor="rankr", rank=1), 1.0), (_top_k_dense, dict(compressor="topk", k=12), 0.5)],
)
def test_fednl_pp_with_every_client_is_the_papers_algorithm_3(rng, comp, kw, alpha):
    pb, ref = problem(rng, n=4, d=7, lam=1e-2, sizes=[12, 9, 15, 10])
    x0 = rng.normal(size=pb.d) * 0.4
    compress = (lambda M: comp(M, 12)) if comp is _top_k_dense else comp
    paper = _paper_fednl_pp(ref, x0, 6, compress, alpha)
    # our round t ends with the paper's x^t: its first round re-reads x^0 (C(0) = 0 changes nothing) and
    # steps with the initial sums, as the paper's server does before any client works
    for t in range(1, 7):
        state, _ = run(pb, make_algorithm("fednl-pp", alpha=alpha, **kw), x0, t)
        np.testing.assert_allclose(state.theta, paper[t - 1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("sketch", ["srht", "countsketch", "gaussian"])
def test_fedns_server_sum_is_the_scatter_add_loop_and_screening_sees_each_client(rng, sketch):
    """The server's sum over the packed layout is, to the last bit, ActiveBlocks.weighted_sum's per-client loop
    over the Grams, and sum_i w_i E_i R_i R_i^T E_i^T + lam I to round-off; the stack-at-once screening of the
    per-client arrays accepts a clean message and leaves a non-finite client's part to the per-client test."""
    from fedconvex.algorithms.fedns import _gram, _weighted_gram_sum
    from fedconvex.messages import all_usable

    pb, _ = problem(rng, n=5, d=8, sizes=[30, 45, 12, 25, 40], density=0.5)
    theta = rng.normal(size=pb.d)
    alg = make_algorithm("fedns", sketch_size=6, sketch=sketch)
    sel = np.arange(5)
    up, _ = alg.client_update(pb, {"theta": np.asarray(theta)}, {}, sel, np.random.default_rng(3))
    w = rng.uniform(0.1, 1.0, 5)
    assert pb._plan is not None  # the packed path is the one taken
    fast = _weighted_gram_sum(pb, up["SAt"], up["active"], sel, w)
    loop = ActiveBlocks(tuple(_gram(R) for R in up["SAt"]), up["active"], pb.d, pb.lam).weighted_sum(w)
    assert np.array_equal(fast, loop)
    ref = pb.lam * w.sum() * np.eye(pb.d)
    for c, (R, a) in enumerate(zip(up["SAt"], up["active"], strict=False)):
        ref[np.ix_(a, a)] += w[c] * (R @ R.T)
    np.testing.assert_allclose(fast, ref, rtol=1e-12, atol=1e-15)
    assert all_usable(up, 5, pb.d) and all(client_problem(up, k, pb.d) is None for k in range(5))
    bad = {**up, "SAt": tuple(R.copy() for R in up["SAt"])}
    bad["SAt"][2][0, 0] = np.nan
    assert not all_usable(bad, 5, pb.d)
    assert [k for k in range(5) if client_problem(bad, k, pb.d)] == [2]


@pytest.mark.parametrize("sel", [None, [3, 0, 4]])
def test_hessian_differences_are_the_hessians_minus_the_blocks(rng, sel):
    """FedNL's differences gathered straight into one array are hessians(...).packed - packed to the last bit,
    the blocks of grad^2 f_c - (B_c + lam I) in the Hessians' layout; without a Hessian plan there are none."""
    pb, ref = problem(rng, n=5, d=9, sizes=[4, 9, 1, 12, 6], density=0.4)
    idx = np.arange(5) if sel is None else np.asarray(sel)
    thetas = rng.normal(size=(len(idx), pb.d))
    hess = pb.hessians(thetas, sel)
    B = rng.normal(size=hess.packed.shape)
    D = pb.hessian_differences(thetas, sel, B)
    assert np.array_equal(D.packed, hess.packed - B) and D.shift == 0.0
    assert D.layout.total == hess.layout.total and all(
        np.array_equal(a, b) for a, b in zip(D.active, hess.active, strict=False)
    )
    for k, c in enumerate(idx):
        a = pb.active_host[c]
        Bk = B[hess.layout.offsets[k] : hess.layout.offsets[k + 1]].reshape(len(a), len(a))
        full = ref.H_i(c, thetas[k])  # the plain definition, lam I included
        np.testing.assert_allclose(D.blocks[k], full[np.ix_(a, a)] - pb.lam * np.eye(len(a)) - Bk, atol=1e-12)
    pb.set_hessian_plan(None)
    assert pb.hessian_differences(thetas, sel, B) is None


@pytest.mark.parametrize("alpha,r", [(1.0, 1), (0.5, 2)])
def test_rank_r_block_encode_forms_the_new_estimate_of_add_scaled(rng, alpha, r):
    """Rank-R's block path given the estimates forms H + alpha S itself: the same message and, bit for bit,
    the estimate fednl._add_scaled makes from the decoded update S."""
    from fedconvex.algorithms import fednl_blocks
    from fedconvex.algorithms.fednl import _add_scaled

    pb, _ = problem(rng, n=5, d=12, sizes=[30, 45, 12, 25, 40], density=0.5)
    thetas = rng.normal(size=(5, pb.d))
    hess = pb.hessians(thetas)
    diff = np.empty_like(hess.packed)  # per client an exactly symmetric block
    for c, (a, b) in enumerate(zip(hess.layout.offsets[:-1], hess.layout.offsets[1:], strict=False)):
        n = len(pb.active_host[c])
        X = rng.normal(size=(n, n))
        diff[a:b] = (X + X.T).reshape(-1)
    base = np.array(hess.packed)
    comp = make_compressor("rankr", rank=r)
    msg, S = fednl_blocks.encode(comp, diff, hess.layout, hess.active, pb.d, None)
    msg2, H_new = fednl_blocks.encode(comp, diff, hess.layout, hess.active, pb.d, None, base=base, alpha=alpha)
    assert all(np.array_equal(msg[k], msg2[k]) for k in msg)
    assert np.array_equal(H_new, _add_scaled(base, alpha, S))
    for c, B in enumerate(hess.layout.views(S)):  # S is the rank-r truncation of each block
        D = hess.layout.views(diff)[c]
        lam, V = np.linalg.eigh(D)
        pick = np.argsort(-np.abs(lam))[:r]
        np.testing.assert_allclose(B, (V[:, pick] * lam[pick]) @ V[:, pick].T, atol=1e-10)


def test_fedns_gram_is_the_same_for_either_memory_layout(rng):
    """The server's Gram takes a column-major R (SRHT's messages) through syrk 'N' and a row-major one through
    'T' on R^T, without copies; both give the same numbers, so a message's layout (Flower's records make every
    array row-major) does not change the server's H.  Also exactly symmetric and R R^T to round-off."""
    from fedconvex.algorithms.fedns import _gram

    for a, k in [(1, 7), (5, 6), (37, 11), (136, 300), (198, 300), (64, 513)]:
        R = rng.normal(size=(a, k))
        C, F = _gram(np.ascontiguousarray(R)), _gram(np.asfortranarray(R))
        assert np.array_equal(C, F) and np.array_equal(C, C.T)
        np.testing.assert_allclose(C, R @ R.T, rtol=1e-12, atol=1e-12 * k)


def test_natural_uniforms_buffer_draws_what_rng_random_draws():
    """The kept buffer changes where the numbers live, not which numbers or the generator's state."""
    from fedconvex.algorithms.fednl_blocks import _uniforms

    a, b = np.random.default_rng(11), np.random.default_rng(11)
    for shape in [(3, 10), (3, 10), (2, 7)]:
        got = _uniforms(a, shape).copy()
        assert np.array_equal(got, b.random(shape))
    assert a.bit_generator.state == b.bit_generator.state


@pytest.mark.parametrize("k", [0, -3, 2.5, True])
def test_fedns_rejects_a_sketch_size_that_is_not_a_positive_integer(k):
    with pytest.raises(ValueError, match="sketch_size"):
        make_algorithm("fedns", sketch_size=k)


def test_fedns_gram_of_an_empty_sketch_writes_zeros_into_the_callers_buffer():
    """The server's packed sum hands _gram a view of an uninitialised buffer: every path must fill it."""
    from fedconvex.algorithms.fedns import _gram

    buf = np.full(9, np.nan)
    got = _gram(np.zeros((3, 0)), out=buf.reshape(3, 3), scale=2.0)
    assert np.array_equal(buf, np.zeros(9)) and np.shares_memory(got, buf)
    R = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(_gram(R, out=np.empty((3, 3)), scale=0.5), 0.5 * (R @ R.T))
