"""Properties of the preconditioned-mixing kernel, on several array libraries."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedconvex.backend import to_numpy
from fedconvex.blocks import ActiveBlocks
from fedconvex.mixing import precond_mix, simple_mix

try:
    import torch
except ImportError:  # the [dnn] extra is optional for fedconvex
    torch = None
try:
    import array_api_strict
except ImportError:
    array_api_strict = None


def spd_stack(rng, n, d, rank=None):
    A = rng.normal(size=(n, d, rank or d))
    return A @ A.transpose(0, 2, 1) + 0.1 * np.eye(d)


problems = st.tuples(st.integers(1, 6), st.integers(1, 7), st.integers(0, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(problems, st.sampled_from([0.0, 0.5]))
def test_identical_parameters_are_returned(prob, damping):
    n, d, seed = prob
    rng = np.random.default_rng(seed)
    x = rng.normal(size=d)
    P = spd_stack(rng, n, d)
    out = precond_mix(P, np.repeat(x[None], n, 0), rng.random(n) + 0.1, damping=damping)
    np.testing.assert_allclose(out, x, rtol=1e-9, atol=1e-10)


@settings(max_examples=60, deadline=None)
@given(problems)
def test_identical_preconditioners_give_the_weighted_mean(prob):
    n, d, seed = prob
    rng = np.random.default_rng(seed)
    P1 = spd_stack(rng, 1, d)
    X, w = rng.normal(size=(n, d, 2)), rng.random(n) + 0.1
    out = precond_mix(np.repeat(P1, n, 0), X, w, damping=0.3)
    np.testing.assert_allclose(out, simple_mix(X, w), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(simple_mix(X, w), np.tensordot(w / w.sum(), X, 1), rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(problems)
def test_permutation_invariance(prob):
    n, d, seed = prob
    rng = np.random.default_rng(seed)
    P, X, w = spd_stack(rng, n, d), rng.normal(size=(n, d)), rng.random(n) + 0.1
    perm = rng.permutation(n)
    np.testing.assert_allclose(precond_mix(P[perm], X[perm], w[perm]), precond_mix(P, X, w), rtol=1e-9, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(problems, st.integers(1, 5))
def test_columns_mix_independently(prob, k):
    n, d, seed = prob
    rng = np.random.default_rng(seed)
    P, X = spd_stack(rng, n, d), rng.normal(size=(n, d, k))
    full = precond_mix(P, X, damping=0.2)
    for j in range(k):
        np.testing.assert_allclose(full[:, j], precond_mix(P, X[:, :, j], damping=0.2), rtol=1e-10, atol=1e-12)


def test_matches_the_closed_form(rng):
    n, d = 5, 4
    P, X, w = spd_stack(rng, n, d, rank=2), rng.normal(size=(n, d)), rng.random(n)
    lam = 0.7
    w_n = w / w.sum()
    A = sum(wi * (Pi + lam * np.eye(d)) for wi, Pi in zip(w_n, P, strict=False))
    b = sum(wi * (Pi + lam * np.eye(d)) @ xi for wi, Pi, xi in zip(w_n, P, X, strict=False))
    np.testing.assert_allclose(precond_mix(P, X, w, damping=lam), np.linalg.solve(A, b), rtol=1e-10)


def test_structured_stack_equals_dense(rng):
    d, n = 8, 4
    active = [np.sort(rng.choice(d, k, replace=False)) for k in (3, 8, 1, 5)]
    blocks = [spd_stack(rng, 1, len(a), rank=1)[0] for a in active]
    stack = ActiveBlocks(tuple(blocks), tuple(active), d, shift=0.05)
    X = rng.normal(size=(n, d))
    np.testing.assert_allclose(
        precond_mix(stack, X, damping=0.3), precond_mix(stack.dense(), X, damping=0.3), rtol=1e-11
    )


@pytest.mark.parametrize(
    "bad",
    [
        dict(P=np.zeros((2, 3, 4)), X=np.zeros((2, 3))),
        dict(P=np.eye(3)[None].repeat(2, 0), X=np.zeros((3, 3))),
        dict(P=np.eye(3)[None].repeat(2, 0), X=np.zeros((2, 4))),
        dict(P=np.eye(3)[None].repeat(2, 0), X=np.zeros((2, 3)), damping=-1.0),
        dict(P=np.eye(3)[None].repeat(2, 0), X=np.zeros((2, 3)), weights=[1.0]),
        dict(P=np.eye(3)[None].repeat(2, 0), X=np.zeros((2, 3)), weights=[0.0, 0.0]),
    ],
)
def test_bad_inputs_raise(bad):
    with pytest.raises(ValueError):
        precond_mix(**bad)


BACKENDS = [
    pytest.param("torch", marks=pytest.mark.skipif(torch is None, reason="torch not installed")),
    pytest.param(
        "array_api_strict", marks=pytest.mark.skipif(array_api_strict is None, reason="array-api-strict not installed")
    ),
]


def to_backend(name, a):
    return torch.asarray(a) if name == "torch" else array_api_strict.asarray(a)


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(problems, st.sampled_from([0.0, 1e-2]))
def test_same_result_on_other_array_libraries(name, prob, damping):
    n, d, seed = prob
    rng = np.random.default_rng(seed)
    P, X, w = spd_stack(rng, n, d), rng.normal(size=(n, d, 3)), rng.random(n) + 0.1
    ref = precond_mix(P, X, w, damping=damping)
    out = precond_mix(to_backend(name, P), to_backend(name, X), to_backend(name, w), damping=damping)
    assert type(out).__module__.split(".")[0] == name.split(".")[0]
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(
        np.asarray(precond_mix(to_backend(name, P), to_backend(name, X[:, :, 0]))),
        precond_mix(P, X[:, :, 0]),
        rtol=1e-10,
        atol=1e-12,
    )
    np.testing.assert_allclose(
        np.asarray(simple_mix(to_backend(name, X), to_backend(name, w))), simple_mix(X, w), rtol=1e-12
    )


def test_mixing_arrays_of_two_libraries_is_an_error():
    if torch is None:
        pytest.skip("torch not installed")
    with pytest.raises(TypeError, match="different libraries"):
        precond_mix(torch.eye(2)[None], np.zeros((1, 2)))


@settings(max_examples=40, deadline=None)
@given(problems, st.sampled_from([0.3, 2.0]))
def test_default_weights_are_uniform_one_over_n(prob, damping):
    # paper eq. fedpm_multi: w_i = 1/N; the damping's scale relative to sum_i w_i P_i depends on it
    n, d, seed = prob
    rng = np.random.default_rng(seed)
    P, X = spd_stack(rng, n, d, rank=1), rng.normal(size=(n, d))
    A = sum(Pi + damping * np.eye(d) for Pi in P) / n
    b = sum((Pi + damping * np.eye(d)) @ xi for Pi, xi in zip(P, X, strict=False)) / n
    np.testing.assert_allclose(precond_mix(P, X, damping=damping), np.linalg.solve(A, b), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(
        precond_mix(P, X, damping=damping), precond_mix(P, X, np.ones(n), damping=damping), rtol=1e-10, atol=1e-12
    )


# ------------------------------------------------------------------ malformed inputs, refused at the call
@pytest.mark.parametrize(
    "args,kw,exc,fragment",
    [
        (([], [], []), {}, TypeError, "P must be an (N, d, d) array stack or a structured stack, got list"),
        ((np.eye(2)[None], [[1.0, 2.0]]), {}, TypeError, "X must be an (N, d) or (N, d, k) array, got list"),
        ((np.eye(2)[None], np.float64(1.0)), {}, ValueError, "X has shape (), expected (N, 2) or (N, 2, k)"),
        (
            (np.zeros((0, 3, 3)), np.zeros((0, 3))),
            {},
            ValueError,
            "precond_mix needs at least one client (P and X hold 0)",
        ),
        (
            (np.eye(2)[None], np.ones((1, 2))),
            {"damping": float("nan")},
            ValueError,
            "damping must be a finite number >= 0, got nan",
        ),
        (
            (np.eye(2)[None], np.ones((1, 2))),
            {"damping": float("inf")},
            ValueError,
            "damping must be a finite number >= 0, got inf",
        ),
        (
            (np.eye(2)[None], np.ones((1, 2))),
            {"damping": -1.0},
            ValueError,
            "damping must be a finite number >= 0, got -1.0",
        ),
        ((np.eye(2)[None], np.ones((1, 2)), [np.inf]), {}, ValueError, "weights must sum to a finite positive number"),
    ],
    ids=["lists", "x-list", "x-scalar", "empty", "damping-nan", "damping-inf", "damping-neg", "weights-inf"],
)
def test_precond_mix_refuses_malformed_input(args, kw, exc, fragment):
    with pytest.raises(exc) as info:
        precond_mix(*args, **kw)
    assert fragment in str(info.value), str(info.value)


def test_simple_mix_refuses_malformed_input():
    with pytest.raises(TypeError, match=r"X must be an \(N, \.\.\.\) array stack, got list"):
        simple_mix([])
    with pytest.raises(ValueError, match=r"simple_mix needs at least one client \(X holds 0\)"):
        simple_mix(np.zeros((0, 3)))
    with pytest.raises(ValueError, match="got a 0-d array"):
        simple_mix(np.float64(1.0))


# ------------------------------------------------------------------ the solve: Cholesky, and its fallback
try:
    import cupy

    cupy.cuda.runtime.getDeviceCount()
except Exception:  # not installed, or no usable GPU
    cupy = None
SOLVE_LIBS = [
    "numpy",
    pytest.param("torch", marks=pytest.mark.skipif(torch is None, reason="torch not installed")),
    pytest.param("cupy", marks=pytest.mark.skipif(cupy is None, reason="needs CuPy and a GPU")),
]


def _lib(name, a):
    return {"torch": lambda: torch.asarray(a), "cupy": lambda: cupy.asarray(a)}.get(name, lambda: a)()


def _reference(P, X, w, damping):
    """The damped, symmetrised system precond_mix solves, and np.linalg.solve's (LU) answer to it."""
    d = P.shape[1]
    A = np.einsum("n,nij->ij", w, P) + damping * np.eye(d)
    A = 0.5 * (A + A.T)
    b = np.einsum("n,nij,njk->ik", w, P + damping * np.eye(d), X)
    return A, np.linalg.solve(A, b)


@pytest.mark.parametrize("name", SOLVE_LIBS)
@pytest.mark.parametrize("cond", [1e1, 1e5, 1e10])
@pytest.mark.parametrize("damping", [0.0, 1e-4])
def test_cholesky_solve_agrees_with_lu_within_the_conditioning_bound(name, cond, damping, monkeypatch):
    """Both solves are backward stable: LU's answer is within about 4 d cond(A) eps ||theta|| of the exact one
    (Frobenius norm); precond_mix solves for theta - X_0 (module code), so its error is within 4 d cond(A) eps
    (||theta|| + ||X_0||) plus the rounding of the final addition.  The bound used is the sum of the two."""
    rng = np.random.default_rng(int(np.log10(cond)))
    n, d, k = 3, 40, 5
    Q = np.linalg.qr(rng.normal(size=(d, d)))[0]
    base = Q @ np.diag(np.geomspace(1.0, 1.0 / cond, d)) @ Q.T  # shared spectrum: Pbar's conditioning is ~cond
    P = np.stack([base + 1e-3 / cond * (lambda B: B @ B.T)(rng.normal(size=(d, d))) for _ in range(n)])
    X, w = rng.normal(size=(n, d, k)), rng.random(n) + 0.1
    w = w / w.sum()
    A, ref = _reference(P, X, w, damping)
    kappa = np.linalg.cond(A)

    def no_lu(*a, **kw):
        raise AssertionError("the LU fallback ran on a positive definite system")

    monkeypatch.setattr({"torch": torch, "cupy": cupy}.get(name, np).linalg, "solve", no_lu)
    out = to_numpy(precond_mix(_lib(name, P), _lib(name, X), _lib(name, w), damping=damping))
    scale = 2 * np.linalg.norm(ref) + np.linalg.norm(X[0])
    err = np.linalg.norm(out - ref)
    assert err <= (4 * d * kappa + 1) * np.finfo(np.float64).eps * scale, (err, kappa)


@pytest.mark.parametrize("name", SOLVE_LIBS)
def test_identical_clients_and_a_single_client_are_returned_exactly(name):
    rng = np.random.default_rng(3)
    P, x = spd_stack(rng, 3, 5), rng.normal(size=(5, 2))
    for stack, X in ((P, np.stack([x] * 3)), (P[:1], x[None])):
        out = precond_mix(_lib(name, stack), _lib(name, X), damping=0.1)
        np.testing.assert_array_equal(to_numpy(out), x)


@pytest.mark.parametrize("name", SOLVE_LIBS)
def test_indefinite_stack_falls_back_to_the_lu_solve(name):
    # symmetric but indefinite (no Cholesky factor) and nonsingular: the general solve's answer
    rng = np.random.default_rng(1)
    d = 6
    Q = np.linalg.qr(rng.normal(size=(d, d)))[0]
    P = np.stack([Q @ np.diag([3.0, 2.0, 1.0, 0.5, -0.2, -1.0]) @ Q.T] * 2)
    X, w = rng.normal(size=(2, d, 3)), np.array([0.5, 0.5])
    A, ref = _reference(P, X, w, 0.0)
    assert np.linalg.eigvalsh(A).min() < 0
    out = to_numpy(precond_mix(_lib(name, P), _lib(name, X), _lib(name, w)))
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", SOLVE_LIBS)
def test_singular_undamped_stack_gets_the_minimum_norm_mix(name):
    """Undamped PSD preconditioners that all vanish on the same directions (a feature no client uses) leave Pbar
    exactly singular: Cholesky and LU both fail, and the mix is the minimum-norm solution of the consistent system,
    zero on the unused directions."""
    rng = np.random.default_rng(2)
    n, d, unused = 3, 7, [2, 5]
    B = rng.normal(size=(n, d, d))
    B[:, unused, :] = 0.0
    P = B @ B.transpose(0, 2, 1)  # rows and columns of the unused features exactly zero
    X, w = rng.normal(size=(n, d, 2)), np.array([0.2, 0.3, 0.5])
    A = np.einsum("n,nij->ij", w, P)
    b = np.einsum("n,nij,njk->ik", w, P, X)
    assert np.linalg.matrix_rank(A) == d - len(unused)
    out = to_numpy(precond_mix(_lib(name, P), _lib(name, X), _lib(name, w)))
    np.testing.assert_allclose(out, np.linalg.lstsq(A, b, rcond=None)[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out[unused], 0.0, atol=1e-12)
    np.testing.assert_allclose(A @ out, b, rtol=1e-9, atol=1e-12)
