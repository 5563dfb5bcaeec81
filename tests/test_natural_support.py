"""Natural draws its uniforms on the supports: one per upper entry (i <= j, both in the matrix's support),
matrix after matrix, in upper-index order; the dense path (Natural.encode with supports) and FedNL's block
path (fednl_blocks.encode on the active blocks) draw and send the same; a matrix with mass outside its
support draws for every entry instead; the distribution is still unbiased rounding to powers of two."""

import math

import numpy as np
import pytest

from fedconvex.algorithms import fednl_blocks
from fedconvex.algorithms.compressors import Natural
from fedconvex.blocks import Layout

D = 9
SUPPORTS = [
    np.array([], dtype=np.int64),
    np.array([4]),
    np.array([0, 2, 5, 8]),
    np.arange(D),
    np.array([1, 3, 4, 6, 7]),
]


def upper_count(a):
    return len(a) * (len(a) + 1) // 2


def random_blocks(rng, supports, d=D):
    """Symmetric blocks on ``supports`` (entries of very different magnitudes, a few exact zeros and
    exact powers of two) packed as FedNL keeps them, and the same matrices as a dense (P, d, d) stack."""
    blocks = []
    for a in supports:
        A = rng.normal(size=(len(a), len(a))) * np.exp(3 * rng.normal(size=(len(a), len(a))))
        A = np.triu(A) + np.triu(A, 1).T
        if len(a) > 2:
            A[0, 1] = A[1, 0] = 0.0
            A[2, 2] = -0.25
        blocks.append(A)
    layout = Layout([len(a) for a in supports], [(a[:, None] * d + a[None, :]).reshape(-1) for a in supports], d)
    packed = np.concatenate([B.reshape(-1) for B in blocks])
    M = np.zeros((len(supports), d, d))
    for c, (a, B) in enumerate(zip(supports, blocks, strict=False)):
        M[c][np.ix_(a, a)] = B
    return packed, layout, M


def natural_by_definition(M, entries, uniforms):
    """The values Natural sends, written from its definition: matrix after matrix, its listed (i, j) get the
    next uniform u; |t| in [2^a, 2^(a+1)) becomes 2^(a+1) if u < |t| / 2^a - 1, else 2^a, sign kept; every other
    upper entry is 0.  Returns (P, d, d) symmetric matrices."""
    P, d = M.shape[0], M.shape[1]
    out = np.zeros((P, d, d))
    u = iter(uniforms)
    for c in range(P):
        for i, j in entries[c]:
            t, draw = M[c, i, j], next(u)
            if t == 0.0:
                continue
            a = math.frexp(abs(t))[1] - 1  # 2^a <= |t| < 2^(a+1)
            up = draw < abs(t) / 2.0**a - 1.0
            out[c, i, j] = out[c, j, i] = math.copysign(2.0 ** (a + up), t)
    assert next(u, None) is None  # every uniform used
    return out


def support_pairs(a):
    a = sorted(set(int(x) for x in a))
    return [(i, j) for i in a for j in a if i <= j]  # row-major upper triangle: upper-index order


def test_the_dense_path_draws_one_uniform_per_upper_entry_of_each_support_in_upper_index_order(rng):
    packed, layout, M = random_blocks(rng, SUPPORTS)
    nat = Natural()
    count = sum(upper_count(a) for a in SUPPORTS)
    got, ref = np.random.default_rng(7), np.random.default_rng(7)
    msg = nat.encode(np, M, got, support=SUPPORTS)
    uniforms = ref.random(count)
    assert got.bit_generator.state == ref.bit_generator.state  # exactly `count` uniforms drawn
    want = natural_by_definition(M, [support_pairs(a) for a in SUPPORTS], uniforms)
    assert np.array_equal(nat.decode(np, msg, D), want)
    # the message format is unchanged: every upper entry has an int16 code, 12 bits each
    assert msg["code"].shape == (len(SUPPORTS), D * (D + 1) // 2) and msg["code"].dtype == np.int16
    assert nat.bits(msg, D).tolist() == [12 * D * (D + 1) // 2] * len(SUPPORTS)
    # entries off the support get code 0
    rows, cols = np.triu_indices(D)
    for c, a in enumerate(SUPPORTS):
        off = ~(np.isin(rows, a) & np.isin(cols, a))
        assert not msg["code"][c, off].any()


def test_without_a_support_every_upper_entry_gets_a_uniform_as_before(rng):
    _, _, M = random_blocks(rng, SUPPORTS)
    got, ref = np.random.default_rng(3), np.random.default_rng(3)
    msg = Natural().encode(np, M, got)
    uniforms = ref.random((len(M), D * (D + 1) // 2))
    assert got.bit_generator.state == ref.bit_generator.state
    every = [support_pairs(range(D))] * len(M)
    assert np.array_equal(Natural().decode(np, msg, D), natural_by_definition(M, every, uniforms.reshape(-1)))


def test_a_support_is_a_set_of_features(rng):
    """Order and repeats in a support do not matter: the entries are drawn in upper-index order."""
    _, _, M = random_blocks(rng, [np.array([2, 5, 6])])
    a = Natural().encode(np, M, np.random.default_rng(1), support=[np.array([6, 2, 5, 2])])
    b = Natural().encode(np, M, np.random.default_rng(1), support=[np.array([2, 5, 6])])
    assert np.array_equal(a["code"], b["code"])


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [3, 0, 4, 2, 1], [2], [1, 1, 0]])
def test_the_block_path_sends_the_dense_paths_messages_and_leaves_the_same_generator_state(rng, order):
    """Supports of every size (empty, one feature, some, all d), any client order (partial participation)."""
    supports = [SUPPORTS[c] for c in order]
    packed, layout, M = random_blocks(rng, supports)
    nat = Natural()
    dense_rng, block_rng, ref = (np.random.default_rng(11) for _ in range(3))
    for _ in range(2):  # the block path's kept buffer is reused
        want = nat.encode(np, M, dense_rng, support=supports)
        msg, S = fednl_blocks.encode(nat, packed, layout, supports, D, block_rng)
        assert np.array_equal(msg["code"], want["code"])
        assert block_rng.bit_generator.state == dense_rng.bit_generator.state
        ref.random(sum(upper_count(a) for a in supports))
        assert block_rng.bit_generator.state == ref.bit_generator.state
        # the update the client adds is the decoded message, on its block
        decoded = nat.decode(np, want, D)
        for c, (a, B) in enumerate(zip(supports, layout.views(S), strict=False)):
            assert np.array_equal(B, decoded[c][np.ix_(a, a)])


def test_mass_outside_the_support_draws_for_every_entry_and_is_not_dropped(rng):
    """The chosen behaviour: a matrix with a non-zero entry outside its support gets one uniform per upper
    entry of the whole matrix (as without a support); the other matrices keep their support's draws."""
    supports = [np.array([0, 2, 5, 8]), np.array([1, 3]), np.array([4, 6, 7])]
    _, _, M = random_blocks(rng, supports)
    M[1, 0, 7] = M[1, 7, 0] = 3.0  # client 1's support is {1, 3}: entry (0, 7) is outside
    got, ref = np.random.default_rng(5), np.random.default_rng(5)
    msg = Natural().encode(np, M, got, support=supports)
    entries = [support_pairs(supports[0]), support_pairs(range(D)), support_pairs(supports[2])]
    uniforms = ref.random(sum(len(e) for e in entries))
    assert got.bit_generator.state == ref.bit_generator.state
    decoded = Natural().decode(np, msg, D)
    assert np.array_equal(decoded, natural_by_definition(M, entries, uniforms))
    assert decoded[1, 0, 7] in (2.0, 4.0)  # 3 is rounded to a power of two, not dropped


def test_natural_on_a_support_is_unbiased(rng):
    """The mean of many encodes is the matrix: per entry within 5 standard errors of the two-point
    distribution (2^a w.p. 1 - p, 2^(a+1) w.p. p; variance (2^(a+1) - |t|)(|t| - 2^a)); off the support exactly 0."""
    supports = [np.array([0, 2, 3, 5]), np.array([1, 4])]
    _, _, M = random_blocks(rng, supports, d=6)
    nat, draws = Natural(), 4000
    gen = np.random.default_rng(2)
    total = np.zeros_like(M)
    for _ in range(draws):
        total += nat.decode(np, nat.encode(np, M, gen, support=supports), 6)
    mean = total / draws
    t = np.abs(M)
    low = np.where(t > 0, 2.0 ** (np.frexp(t)[1] - 1.0), 0.0)
    sd = np.sqrt((2 * low - t) * (t - low) / draws)
    assert np.all(np.abs(mean - M) <= 5 * sd + 1e-12 * t)
    assert (sd > 0).sum() >= 10  # most entries are really random


def test_natural_rejects_supports_that_do_not_fit_the_matrices(rng):
    _, _, M = random_blocks(rng, SUPPORTS[:2])
    with pytest.raises(ValueError, match="2 matrices"):
        Natural().encode(np, M, np.random.default_rng(0), support=SUPPORTS[:1])
    with pytest.raises(ValueError, match="outside 0..8"):
        Natural().encode(np, M, np.random.default_rng(0), support=[np.array([1]), np.array([3, 9])])

    with pytest.raises(ValueError, match="boolean mask"):
        Natural().encode(np, M, np.random.default_rng(0), support=[np.arange(9) < 4, np.arange(9) < 2])
