"""FOOF blocks and FedPM-FOOF mixing against naive references."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedconvex.algorithms.base import RoundInfo  # noqa: E402
from fedpm_dnn import foof  # noqa: E402
from fedpm_dnn.algorithms import make_method  # noqa: E402
from fedpm_dnn.algorithms.base import stack_replies  # noqa: E402


def aggregate(alg, params, replies, weights, blocks):
    """The method's server step from the initial state at ``params`` over ``replies``: the new parameters."""
    from types import SimpleNamespace

    task = SimpleNamespace(blocks=blocks, n_clients=len(replies))
    info = RoundInfo(sel=np.arange(len(replies)), weights=np.asarray(weights, dtype=np.float64), n_clients=len(replies))
    return alg.server_update(task, alg.init(task, params), stack_replies(replies), info).theta


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_foof_matrix_is_the_mean_outer_product(bias):
    torch.manual_seed(0)
    lin = nn.Linear(5, 3, bias=bias)
    x = torch.randn(11, 5)
    A = foof.compute_foof(lin, foof.foof_blocks(nn.Sequential(lin)) | {"": foof.LinearBlock(lin)}, [x[:4], x[4:]])
    a = torch.cat([x, torch.ones(11, 1)], 1) if bias else x
    naive = sum(torch.outer(r, r) for r in a) / 11
    torch.testing.assert_close(A[""], naive)


@pytest.mark.parametrize("stride,padding,dilation,bias", [(1, 0, 1, True), (2, 1, 1, True), (1, 2, 2, False)])
def test_conv_foof_matrix_sums_every_patch(stride, padding, dilation, bias):
    torch.manual_seed(1)
    conv = nn.Conv2d(2, 4, 3, stride=stride, padding=padding, dilation=dilation, bias=bias)
    x = torch.randn(3, 2, 7, 6)
    blocks = {"c": foof.Conv2dBlock(conv)}
    A = foof.compute_foof(conv, blocks, [x])["c"]
    xp = F.pad(x, (padding,) * 4)
    patches = []
    H, W = xp.shape[2], xp.shape[3]
    span = dilation * 2
    for b in range(3):
        for i in range(0, H - span, stride):
            for j in range(0, W - span, stride):
                p = xp[b, :, i : i + span + 1 : dilation, j : j + span + 1 : dilation].reshape(-1)  # (C, kh, kw) order
                patches.append(torch.cat([p, torch.ones(1)]) if bias else p)
    P = torch.stack(patches)
    torch.testing.assert_close(A, P.T @ P / len(P))
    # Theta layout matches the patch layout: Theta^T a reproduces the convolution output
    theta = foof.get_theta(blocks["c"], conv.weight, conv.bias)
    out = conv(x).permute(0, 2, 3, 1).reshape(-1, 4)
    torch.testing.assert_close(P @ theta, out)


def test_theta_round_trip():
    conv = nn.Conv2d(3, 5, 2)
    block = foof.Conv2dBlock(conv)
    w, b = foof.split_theta(block, foof.get_theta(block, conv.weight, conv.bias))
    assert torch.equal(w, conv.weight) and torch.equal(b, conv.bias)


def test_identity_foof_step_is_sgd():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    blocks = foof.foof_blocks(model)
    F.cross_entropy(model(torch.randn(4, 1, 6, 6)), torch.tensor([0, 1, 2, 0])).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    eye = {n: torch.eye(b.module.weight[0].numel() + 1) for n, b in blocks.items()}
    foof.precondition_grads(model, blocks, foof.with_uppers(foof.factorize(eye, 0.0)))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n])


def _replies(model_params, foofs):
    return [{"params": p, "foof": a} for p, a in zip(model_params, foofs, strict=False)]


def _model():
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.Flatten(), nn.Linear(3 * 3 * 3, 4))


def _random_spd(d, g):
    M = torch.randn(d, d, generator=g)
    return M @ M.T / d


@pytest.mark.parametrize("name", ["fedpm", "localnewton"])
def test_identical_clients_give_back_the_same_model(name):
    torch.manual_seed(3)
    model = _model()
    blocks = foof.foof_blocks(model)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    A = {n: _random_spd(b.module.weight[0].numel() + 1, g) for n, b in blocks.items()}
    cfg = make_method(name, damping=0.5)
    # three clients with the same parameters but *different* matrices: mixing must return them
    As = [{n: a + i * torch.eye(a.shape[0]) for n, a in A.items()} for i in range(3)]
    new = aggregate(cfg, params, _replies([params] * 3, As), torch.full((3,), 1 / 3), blocks)
    for n in params:
        torch.testing.assert_close(new[n], params[n])
    one = aggregate(cfg, params, _replies([params], As[:1]), torch.ones(1), blocks)
    for n in params:
        torch.testing.assert_close(one[n], params[n])


def test_fedpm_mixes_blocks_with_their_matrices_and_averages_the_rest():
    torch.manual_seed(4)
    model = _model()
    blocks = foof.foof_blocks(model)
    g = torch.Generator().manual_seed(1)
    ps = [
        {n: p.detach() + 0.1 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()} for _ in range(2)
    ]
    As = [{n: _random_spd(b.module.weight[0].numel() + 1, g) for n, b in blocks.items()} for _ in range(2)]
    cfg = make_method("fedpm", damping=0.3)
    w = torch.tensor([0.25, 0.75])
    new = aggregate(cfg, ps[0], _replies(ps, As), w, blocks)
    lin = blocks["3"]
    th = [foof.get_theta(lin, p["3.weight"], p["3.bias"]) for p in ps]
    M = [As[i]["3"] + 0.3 * torch.eye(As[i]["3"].shape[0]) for i in range(2)]
    expect = torch.linalg.solve(w[0] * M[0] + w[1] * M[1], w[0] * M[0] @ th[0] + w[1] * M[1] @ th[1])
    torch.testing.assert_close(foof.get_theta(lin, new["3.weight"], new["3.bias"]), expect)
    torch.testing.assert_close(new["1.weight"], 0.25 * ps[0]["1.weight"] + 0.75 * ps[1]["1.weight"])


@pytest.mark.parametrize("damping", [0.0, 0.7])
def test_one_full_batch_foof_step_plus_fedpm_mixing_is_a_global_newton_step(damping):
    """One Linear layer, squared loss: A is the exact Hessian (per output), so FedPM-FOOF with one
    full-batch local step and sample-count weights equals a (damped) Newton step on the pooled data."""
    from fedpm_dnn.engine.sequential import foof_matrices  # noqa: F401  (schedule exercised in the e2e test)

    torch.manual_seed(5)
    d_in, d_out = 4, 3
    lin = nn.Linear(d_in, d_out)
    blocks = {"": foof.LinearBlock(lin)}
    xs = [torch.randn(n, d_in) + i for i, n in enumerate((5, 9, 13))]  # heterogeneous clients
    ys = [torch.randn(len(x), d_out) for x in xs]
    theta0 = {n: p.detach().clone() for n, p in lin.named_parameters()}
    replies = []
    for x, y in zip(xs, ys, strict=False):
        with torch.no_grad():
            lin.weight.copy_(theta0["weight"])
            lin.bias.copy_(theta0["bias"])
        A = foof.compute_foof(lin, blocks, [x])
        lin.zero_grad()
        (0.5 * ((lin(x) - y) ** 2).sum(1).mean()).backward()
        foof.precondition_grads(lin, blocks, foof.with_uppers(foof.factorize(A, damping)))
        with torch.no_grad():
            for p in lin.parameters():
                p.sub_(p.grad)  # lr = 1
        replies.append(
            {"params": {"weight": lin.weight.detach().clone(), "bias": lin.bias.detach().clone()}, "foof": A}
        )
    sizes = torch.tensor([len(x) for x in xs], dtype=torch.float64)
    cfg = make_method("fedpm", damping=damping)
    new = aggregate(cfg, theta0, replies, sizes / sizes.sum(), blocks)
    # Newton on the pooled data
    X = torch.cat([torch.cat([x, torch.ones(len(x), 1)], 1) for x in xs])
    Y = torch.cat(ys)
    T = foof.get_theta(blocks[""], theta0["weight"], theta0["bias"])
    H = X.T @ X / len(X)
    G = X.T @ (X @ T - Y) / len(X)
    expect = T - torch.linalg.solve(H + damping * torch.eye(d_in + 1), G)
    torch.testing.assert_close(foof.get_theta(blocks[""], new["weight"], new["bias"]), expect)


def test_non_positive_definite_matrix_is_reported():
    with pytest.raises(ArithmeticError, match="raise the damping"):
        foof.factorize({"fc": -torch.eye(3)}, 0.0)


def test_first_layer_cache_is_exact_after_the_parameters_change():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    blocks = foof.foof_blocks(model)
    batches = [torch.randn(7, 3, 8, 8), torch.randn(5, 3, 8, 8)]
    static = {}
    foof.compute_foof(model, blocks, batches, static)
    assert set(static) == {"0"}  # only the block fed the model input is cached
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    cached = foof.compute_foof(model, blocks, batches, static)
    fresh = foof.compute_foof(model, blocks, batches)
    for k in blocks:
        torch.testing.assert_close(cached[k], fresh[k])


def test_small_damping_on_large_rank_deficient_activations():
    """Dead ReLU units make A singular; with the paper's damping 1e-4 and activations of size
    ~100, float32 round-off leaves A indefinite beyond the damping.  The factorisation then uses
    the nearest PSD matrix, which differs from A only at round-off level."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(60, 3).float()
    x = (torch.randn(400, 5, generator=g) @ torch.randn(5, 60, generator=g) * 100).float()
    x[:, 40:] = 0.0  # dead units
    A = foof.compute_foof(lin, {"fc": foof.LinearBlock(lin)}, [x])["fc"]
    eye = torch.eye(61, dtype=torch.float64)
    assert int(torch.linalg.cholesky_ex(A.double() + 1e-4 * eye)[1]) != 0  # a plain Cholesky fails
    L = foof.factorize({"fc": A}, 1e-4, dtype=torch.float32)["fc"]
    assert L.dtype == torch.float32 and torch.isfinite(L).all()
    rebuilt = L.double() @ L.double().T
    assert torch.linalg.norm(rebuilt - (A.double() + 1e-4 * eye)) < 1e-6 * torch.linalg.norm(A.double())
    assert torch.linalg.eigvalsh(rebuilt).min() > 0.5e-4  # damping kept


def test_non_finite_matrix_names_divergence_not_damping():
    with pytest.raises(ArithmeticError, match="local training diverged"):
        foof.factorize({"conv2": torch.full((3, 3), float("nan"))}, 1.0)


@pytest.mark.parametrize("damping", [1e-4, 1.0])
@pytest.mark.parametrize("batch", [(), (4,)])
def test_solve_rows_is_the_damped_solve(damping, batch):
    """solve_rows(T, L) = T (A + lam I)^{-1} for a stack (vectorized engine) or one block (sequential),
    with the factor in float32 as the engines use it: within float32 accuracy of a float64 solve,
    and the rows layout gives the same as solving the transposed columns."""
    g = torch.Generator().manual_seed(3)
    d, rows = 41, 7
    X = torch.randn(*batch, 3 * d, d, generator=g, dtype=torch.float64)
    A = X.mT @ X / (3 * d)
    M = A + damping * torch.eye(d, dtype=torch.float64)
    T = torch.randn(*batch, rows, d, generator=g)
    L = (
        foof.factorize({"b": A[0] if batch else A}, damping, torch.float32)["b"]
        if not batch
        else torch.linalg.cholesky(M).float()
    )
    expect = torch.linalg.solve(M, T.double().mT).mT
    for U in (None, L.mT.contiguous()):
        got = foof.solve_rows(T, L, U)
        assert got.shape == T.shape and got.dtype == torch.float32
        err = torch.linalg.norm(got.double() - expect) / torch.linalg.norm(expect)
        assert err < 1e-6 * torch.linalg.cond(M).max().item() ** 0.5 + 1e-6


@pytest.mark.parametrize(
    "conv,shape",
    [
        (nn.Conv2d(3, 6, 5), (7, 3, 32, 32)),
        (nn.Conv2d(4, 5, 3, stride=2, padding=1, dilation=2), (3, 4, 11, 9)),
        (nn.Conv2d(2, 3, (3, 2), stride=(1, 2), padding=(2, 1)), (2, 2, 7, 8)),
        (nn.Conv2d(3, 4, 1), (5, 3, 6, 7)),  # its patches are a permuted view of x, not a copy
    ],
)
def test_conv_patches_are_unfolds_columns(conv, shape):
    """The strided-view patches are exactly F.unfold's, in its order, with stride, padding and dilation."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.functional.unfold(
        x, conv.kernel_size, dilation=conv.dilation, padding=conv.padding, stride=conv.stride
    ).transpose(1, 2)
    assert torch.equal(foof.conv_patches(conv, x), ref)
    S, total, rows = foof.Conv2dBlock(conv).gram(x)
    flat = ref.reshape(-1, ref.shape[-1]).double()
    assert rows == flat.shape[0]
    torch.testing.assert_close(S.double(), flat.T @ flat, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(total.double(), flat.sum(0), rtol=1e-5, atol=1e-4)


def test_one_cpu_thread_runs_the_solves_single_threaded_and_restores_the_count():
    from fedpm_dnn.foof import one_cpu_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(KeyError):
            with one_cpu_thread("cpu"):
                assert torch.get_num_threads() == 1
                raise KeyError("inside")
        assert torch.get_num_threads() == 2  # restored after an exception too
        with one_cpu_thread("meta"):  # not a CPU tensor's device: untouched
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("damping", [1e-4, 0.3])
def test_stacked_factorisation_is_the_per_client_factorisation(damping):
    """The vectorized engine's batched Cholesky (foof.batched.factorize_stacked) gives every client the factor
    of foof.factorize -- the sequential engine's -- also for a client whose matrix is indefinite beyond the
    damping and goes through the nearest-PSD repair (the damping must be added there as well)."""
    from fedpm_dnn.foof.batched import factorize_stacked

    g = torch.Generator().manual_seed(2)
    d = 7
    good = [_random_spd(d, g).double() for _ in range(3)]
    V = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    w = torch.tensor([-1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64)  # indefinite beyond the damping
    bad = (V * w) @ V.T
    bad = 0.5 * (bad + bad.T)
    stack = torch.stack([good[0], bad, good[1], good[2]])
    eye = torch.eye(d, dtype=torch.float64)
    assert int(torch.linalg.cholesky_ex(bad + damping * eye)[1]) != 0  # a plain Cholesky fails: repaired
    for dtype in (torch.float64, torch.float32):
        L = factorize_stacked({"b": stack}, damping, dtype)["b"]
        assert L.dtype == dtype
        for i in range(4):
            ref = foof.factorize({"b": stack[i]}, damping, dtype)["b"]
            torch.testing.assert_close(L[i], ref)
        # every factor is that of A_i + damping I (the repaired one: of its PSD part + damping I)
        rebuilt = L.double() @ L.double().mT
        assert torch.linalg.eigvalsh(rebuilt).min() >= 0.5 * damping
