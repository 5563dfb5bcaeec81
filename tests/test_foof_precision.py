"""--foof-precision: each mode's product and Gram against float64, within float32's own bound (fp32, split-tf32)
or the stated approximation bound (tf32, bf16) -- on the CPU by emulating TF32 rounding, on CUDA where there is one.

Bounds, with u = 2^-24 and |A||B| the product of the absolute values (k: the length of each sum):
* fp32 and split-tf32: elementwise |err| <= (k + 24) u |A||B| (float32's gamma_k, plus the split form's dropped
  lo lo term and its rounding of lo to TF32: at most 24 u per term, fedpm_dnn.foof.precision), and in the Frobenius norm
  the probabilistic float32 level ||err|| <= sqrt(k) u || |A||B| || (Higham & Mary 2019), which tf32 exceeds, so
  the test tells the split form from a plain TF32 product; the split form's error also stays within 1.25x the
  float32 product's own, measured beside it.
* tf32: inputs rounded to 11 significant bits: |err| <= (2^-10 + 2^-22 + k u) |A||B|.
* bf16: inputs and output rounded to 8 significant bits: |err| <= (2^-7 + 2^-16 + k u) |A||B| + 2^-8 |AB|.
"""

import math
import os

import pytest

torch = pytest.importorskip("torch")

from fedpm_dnn import foof  # noqa: E402
from fedpm_dnn.foof import batched, precision  # noqa: E402
from fedpm_dnn.models import make_model  # noqa: E402

U = 2.0**-24
SHAPES = [(120, 401, 401), (64, 4608, 48)]  # SimpleCNN's fc1 apply; a ResNet18-GN 4,608-wide block


@pytest.fixture(autouse=True)
def no_tf32():
    """TF32 off wherever results are compared with references (the modes switch it on for their products only)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    assert torch.backends.cuda.matmul.allow_tf32 is False  # no mode leaves it on
    torch.backends.cuda.matmul.allow_tf32 = old


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def tf32_reference(x: torch.Tensor) -> torch.Tensor:
    """Round to 11 significant bits, ties to even, in float64 arithmetic (frexp: x = m 2^e, 1/2 <= |m| < 1)."""
    m, e = torch.frexp(x.double())
    return torch.ldexp(torch.round(m * 2.0**11) / 2.0**11, e).float()  # torch.round: ties to even


def test_tf32_rounding_is_round_to_nearest_even_to_ten_mantissa_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-60, 60, (100_000,), generator=g).float())
    ties = torch.tensor([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, -(1.0 + 2.0**-11), 2.0**-11 * (1 + 2.0**-11)])
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0])])
    r = precision.round_tf32(x)
    assert torch.equal(r, tf32_reference(x))
    assert (r.view(torch.int32) & 0x1FFF).eq(0).all()  # the 13 low mantissa bits are gone
    assert ((r - x).abs() <= 2.0**-11 * x.abs()).all()
    assert r[-6:-2].tolist() == [1.0, 1.0 + 2**-9, -1.0, 2.0**-11]  # ties go to the even neighbour
    hi, lo = precision.split(x[:1000])
    assert torch.equal(hi + lo, x[:1000]) and (lo.abs() <= 2.0**-11 * x[:1000].abs()).all()
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    assert torch.equal(precision.round_tf32(special)[:2], special[:2]) and precision.round_tf32(special)[2].isnan()


def allowed(mode: str, k: int, absab: torch.Tensor, ab: torch.Tensor) -> torch.Tensor:
    if mode in ("fp32", "split-tf32"):
        return (k + 24) * U * absab
    if mode == "tf32":
        return (2.0**-10 + 2.0**-22 + k * U) * absab
    return (2.0**-7 + 2.0**-16 + k * U) * absab + 2.0**-8 * ab.abs()


# split-tf32 on tensor cores against cuBLAS's float32 product, in the Frobenius norm: the tensor cores accumulate
# their partial products in an order and width of their own, so a simulation of their rounding put the split form at
# 3.5-23x float32's error on these shapes (on the CPU's emulation it is within 1.25x); the elementwise worst-case
# bound holds on both
CUDA_SPLIT_RATIO = 32.0
MARGINS = os.environ.get("FOOF_PRECISION_MARGINS")  # a file to which each check appends by how much it passed


def _margin(line: str) -> None:
    if MARGINS:
        with open(MARGINS, "a") as fh:
            fh.write(line + "\n")


def check(mode, k, got, ref, absab, what, fp32_error=None):
    err = (got.double() - ref).abs()
    bound = allowed(mode, k, absab, ref)
    elementwise = float((err / bound.clamp_min(1e-300)).max())
    assert (err <= bound).all(), (what, mode, elementwise)
    level = math.sqrt(k) * U * float(absab.norm())  # float32's probabilistic level, in the Frobenius norm
    on_tensor_cores = got.device.type == "cuda" and mode != "fp32"
    if mode == "fp32" or (mode == "split-tf32" and not on_tensor_cores):
        assert float(err.norm()) <= level, (what, mode, float(err.norm()) / level)
    elif (
        mode != "split-tf32"
    ):  # not vacuous: the approximations err above float32's level, so the split form is told apart
        assert float(err.norm()) > level, (what, mode)
    ratio = float(err.norm()) / fp32_error if fp32_error else None
    if mode == "split-tf32":
        limit = CUDA_SPLIT_RATIO if on_tensor_cores else 1.25
        assert float(err.norm()) <= limit * fp32_error, (what, ratio, limit)
    _margin(
        f"{what} {mode} k={k} on {got.device.type}: worst entry {elementwise:.3g} of its bound"
        + (f", {ratio:.3g}x float32's error" if ratio is not None else "")
    )
    return float(err.norm())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_each_mode_of_the_apply_is_within_its_bound(device, m, k, n):
    g = torch.Generator().manual_seed(k)
    a = torch.randn(m, k, generator=g).to(device)
    b = (torch.randn(k, n, generator=g) / math.sqrt(k)).to(device)
    ref = a.double() @ b.double()
    absab = a.double().abs() @ b.double().abs()
    fp32 = check("fp32", k, precision.matmul(a, b, "fp32"), ref, absab, "apply")
    for mode in ("split-tf32", "tf32", "bf16"):
        check(mode, k, precision.matmul(a, b, mode), ref, absab, "apply", fp32)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("rows,d", [(2048, 401), (512, 1152)])
def test_each_mode_of_the_gram_is_within_its_bound_and_the_split_gram_is_exactly_symmetric(device, rows, d):
    g = torch.Generator().manual_seed(d)
    a = torch.relu(torch.randn(3, rows, d, generator=g)).to(device)  # post-ReLU activations, a stack of 3
    ref = a.double().mT @ a.double()
    absab = a.double().abs().mT @ a.double().abs()
    fp32 = check("fp32", rows, precision.gram(a, "fp32"), ref, absab, "gram")
    for mode in ("split-tf32", "tf32", "bf16"):
        S = precision.gram(a, mode)
        check(mode, rows, S, ref, absab, "gram", fp32)
        if mode == "split-tf32":
            assert torch.equal(S, S.mT)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("rows,d", [(64, 7), (300, 515), (512, 1152)])
def test_the_half_gram_keeps_each_modes_bound_and_is_exactly_symmetric(device, rows, d):
    """precision.half_gram (the lower triangle's block rows only; 1, 2 and 4 block rows here, odd widths) and
    gram(half=True) (half_gram where it multiplies less, else the full form symmetrised) within each mode's bound
    of the float64 Gram, the split form within 1.25x the full float32 product's own error; exactly symmetric."""
    g = torch.Generator().manual_seed(d)
    a = torch.relu(torch.randn(2, rows, d, generator=g)).to(device)
    ref = a.double().mT @ a.double()
    absab = a.double().abs().mT @ a.double().abs()
    fp32 = check("fp32", rows, precision.gram(a, "fp32"), ref, absab, "gram")
    for mode in precision.MODES:
        for S in (precision.half_gram(a, mode), precision.gram(a, mode, half=True)):
            check(mode, rows, S, ref, absab, "half gram", fp32)
            assert torch.equal(S, S.mT), mode


@pytest.mark.parametrize("d", [1, 255, 256, 511, 515, 1152, 4609])
def test_the_half_gram_is_the_full_product_up_to_summation_order(d):
    """In float64 the half form is a^T a to round-off, for one block row or many of unequal width; the block rows
    cover the triangle once, and its cost is what they multiply."""
    g = torch.Generator().manual_seed(d)
    a = torch.randn(3, 40, d, generator=g, dtype=torch.float64)
    S = precision.half_gram(a)
    torch.testing.assert_close(S, a.mT @ a, rtol=1e-13, atol=1e-12)
    assert torch.equal(S, S.mT)
    blocks = precision.triangle_blocks(d)
    assert (
        blocks[0][0] == 0
        and blocks[-1][1] == d
        and all(e == s for (_, e), (s, _) in zip(blocks, blocks[1:], strict=False))
    )
    t = len(blocks)
    assert t == max(1, d // precision.GRAM_BLOCK)
    assert precision.half_gram_cost(d) == pytest.approx(sum((e - s) * e for s, e in blocks) / d**2)
    if d % t == 0:  # equal widths: (t + 1) / (2 t) of the full product
        assert precision.half_gram_cost(d) == pytest.approx((t + 1) / (2 * t))


def test_the_half_form_is_taken_only_where_it_multiplies_less():
    """fp32 from 2 block rows on (3/4 of the product); split-tf32's three products of a triangle beat the full
    form's two from 4 block rows on."""
    assert not precision.half_pays(511, "fp32") and precision.half_pays(512, "fp32")
    assert not precision.half_pays(767, "split-tf32")  # 2 block rows: 3 x 3/4 > 2
    assert not precision.half_pays(1023, "split-tf32")  # 3 block rows: 3 x 2/3 = 2
    assert precision.half_pays(1024, "split-tf32") and precision.half_pays(4608, "split-tf32")


def test_fp32_is_the_plain_product_the_kernels_made_before():
    """The default changes nothing: the fp32 mode is bit for bit the product each call site made."""
    g = torch.Generator().manual_seed(1)
    a, b, x = torch.randn(4, 7, 9, generator=g), torch.randn(9, 9, generator=g), torch.randn(3, 50, 9, generator=g)
    assert precision.current() == "fp32"
    assert torch.equal(foof.direction(a, (b,)), torch.matmul(a, b))
    assert torch.equal(batched.stacked_gram(foof.LinearBlock(torch.nn.Linear(9, 2)), x)[0], torch.bmm(x.mT, x))
    assert torch.equal(precision.gram(x[0]), x[0].T @ x[0])


def test_the_kernels_follow_the_mode_and_keep_their_bound():
    """Inside precision.use(mode) the inverse apply and every block's Gram (Linear, and a conv's patch form, which
    the CPU then takes instead of its float64 row form) run in that mode; tf32 differs from fp32 (it reached
    them), split-tf32 stays within float32's bound of the float64 Gram."""
    torch.manual_seed(0)
    model = make_model("cnn", 10, 3, 32)
    blocks = foof.foof_blocks(model)
    x = torch.rand(16, 3, 32, 32)
    ref = foof.compute_foof(model.double(), foof.foof_blocks(model), [x.double()])
    model.float()
    got = {}
    for mode in ("fp32", "split-tf32", "tf32"):
        with precision.use(mode):
            got[mode] = foof.compute_foof(model, blocks, [x])
    for name in blocks:
        assert not torch.equal(got["tf32"][name], got["fp32"][name]), name
        err = (got["split-tf32"][name] - ref[name]).norm() / ref[name].norm()
        assert err < 64 * U * math.sqrt(got["fp32"][name].shape[0] * 16 * 32 * 32), (name, float(err))
    T, X = torch.randn(2, 120, 401), torch.randn(401, 401)
    with precision.use("split-tf32"):
        assert torch.equal(foof.direction(T, (X,)), precision.matmul(T, X, "split-tf32"))
    assert precision.current() == "fp32"


def cuda_forms(monkeypatch, conv_form):
    """The CUDA path's Gram forms on this device: half products everywhere, every conv in ``conv_form``."""
    monkeypatch.setattr(foof, "half_forms", lambda device: True)
    monkeypatch.setattr(foof, "conv_gram_form", lambda m, shape, device, mode: (conv_form, True))


class OddBlocks(torch.nn.Module):
    """Linear and Conv2d blocks with and without bias, odd sizes; fc2 525 wide (2 unequal block rows of the
    half products, a ragged last one)."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 5, 3, padding=1)
        self.c2 = torch.nn.Conv2d(5, 7, (3, 2), stride=2, bias=False)
        self.fc1 = torch.nn.Linear(7 * 3 * 5, 525, bias=False)
        self.fc2 = torch.nn.Linear(525, 3)

    def forward(self, x):
        x = torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("conv_form", ["patch", "row"])
def test_the_cuda_forms_give_every_blocks_matrix(conv_form, monkeypatch):
    """With the CUDA path's Gram forms (half products; the row form or the patch form for the convs), every
    block's FOOF matrix -- Linear and Conv2d, with and without bias -- is the full form's: to float64 round-off in
    float64, within float32's bound of the float64 matrix in fp32 and split-tf32, within 2^-8 relative in tf32
    and bf16; the stacked engine's Linear Gram too."""
    torch.manual_seed(0)
    model = OddBlocks()
    blocks = foof.foof_blocks(model)
    x = torch.rand(12, 3, 7, 11)
    ref = foof.compute_foof(model.double(), blocks, [x.double()])
    cuda_forms(monkeypatch, conv_form)
    got64 = foof.compute_foof(model, blocks, [x.double()])
    for name in blocks:
        torch.testing.assert_close(got64[name], ref[name], rtol=1e-12, atol=1e-12 * float(ref[name].abs().max()))
    model.float()
    for mode in precision.MODES:
        with precision.use(mode):
            got = foof.compute_foof(model, blocks, [x])
        for name in blocks:
            err = float((got[name] - ref[name]).norm() / ref[name].norm())
            limit = 64 * U * math.sqrt(ref[name].shape[0] * 12 * 7 * 11) if mode in ("fp32", "split-tf32") else 2**-8
            assert err < limit, (mode, name, err)
    a = torch.rand(2, 30, 525, dtype=torch.float64)
    S = batched.stacked_gram(blocks["fc2"], a)[0]
    torch.testing.assert_close(S, a.mT @ a, rtol=1e-13, atol=1e-12)
    assert torch.equal(S, S.mT)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_both_engines_train_in_the_methods_precision(engine, monkeypatch):
    """A FedPM round's replies (inverse apply) with foof_precision tf32 differ from fp32's (the mode reached the
    engine's kernels) and split-tf32's agree with fp32's to float32 round-off."""
    import numpy as np
    import test_foof_apply

    real = test_foof_apply.make_method

    def replies(mode):
        monkeypatch.setattr(test_foof_apply, "make_method", lambda *a, **k: real(*a, **{**k, "foof_precision": mode}))
        _, _, reps = test_foof_apply.one_round("cnn", "inverse", 1.0, engine)
        return np.concatenate([r["params"][k].double().flatten().numpy() for r in reps for k in sorted(r["params"])])

    fp32, split, tf32 = replies("fp32"), replies("split-tf32"), replies("tf32")
    assert np.abs(tf32 - fp32).max() > 0
    assert np.abs(split - fp32).max() <= 1e-5 * np.abs(fp32).max()


def test_a_mode_outside_the_list_is_refused():
    from fedpm_dnn.algorithms import make_method

    with pytest.raises(ValueError, match="foof precision must be one of fp32, split-tf32, tf32, bf16"):
        make_method("fedpm", foof_precision="fp16")
    with pytest.raises(ValueError, match="foof precision"), precision.use("half"):
        pass


def _square_splits(monkeypatch):
    """A list that grows by one at every ``precision.split`` of a square operand (an inverse; gradient rows and
    statistics patches are not square here)."""
    seen, real = [], precision.split

    def counted(x):
        if x.shape[-1] == x.shape[-2]:
            seen.append(tuple(x.shape))
        return real(x)

    monkeypatch.setattr(precision, "split", counted)
    return seen


def test_the_inverse_is_split_once_per_refresh_and_applies_as_the_plain_split_product(monkeypatch):
    """split-tf32's inverse operator keeps its TF32 parts: steps split only their gradient rows (0 splits of the
    inverse after the first), and every direction equals matmul's, which splits both operands, bit for bit."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 200, 41, generator=g, dtype=torch.float64)
    L = torch.linalg.cholesky(a.mT @ a / 200 + 0.1 * torch.eye(41, dtype=torch.float64))
    seen = _square_splits(monkeypatch)
    with precision.use("split-tf32"):
        op = foof.operators({"fc": L}, torch.float32, "inverse")["fc"]
        assert len(op) == 3 and seen == [(3, 41, 41)]
        for _ in range(4):
            T = torch.randn(3, 7, 41, generator=g)
            got = foof.direction(T, op)
            assert torch.equal(got, precision.matmul(T, op[0]))
    assert len(seen) == 1 + 4  # matmul's own reference splits, once per call; the directions none
    with precision.use("fp32"):
        assert len(foof.operators({"fc": L}, torch.float32, "inverse")["fc"]) == 1  # fp32: the inverse alone


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_a_rounds_splits_of_the_inverse_do_not_grow_with_its_steps(monkeypatch, engine):
    """A FedPM round in split-tf32 (emulated on the CPU) splits each inverse once when it is formed: twice the local
    epochs, the same count of splits."""
    from test_vectorized import CFG, experiment, make

    from fedpm_dnn.engine.simulation import run_experiment

    counts = []
    for epochs in (1, 2):
        seen = _square_splits(monkeypatch)
        cfg = make("fedpm", **{**CFG, "local_epochs": epochs, "foof_apply": "inverse", "foof_precision": "split-tf32"})
        run_experiment(experiment(cfg, engine, rounds=1))
        counts.append(len(seen))
        monkeypatch.undo()
    assert counts[0] == counts[1] > 0, counts


@pytest.mark.parametrize("kind", ["apply", "gram"])
def test_the_first_split_product_on_a_device_is_checked_and_a_wrong_one_falls_back_to_float32(monkeypatch, kind):
    """As on a device (emulation off: the 'tensor cores' are the CPU's float32 product): a product within the
    elementwise bound is kept; an injected error of 1e-3 (far outside it) gives one warning, the plain float32
    product from then on for that kind of product, and the reason in precision.fallbacks()."""
    monkeypatch.setattr(precision, "_verdicts", {})
    monkeypatch.setattr(precision, "_emulated", lambda t, emulate: False)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(5, 64, 33, generator=g), torch.randn(5, 33, 33, generator=g)

    def run():
        with precision.use("split-tf32"):
            if kind == "apply":
                return precision.matmul(a[:, :7], b), torch.matmul(a[:, :7], b)
            plain = torch.matmul(a.mT, a)
            return precision.gram(a), 0.5 * (plain + plain.mT)

    got, _ = run()
    assert (
        precision.fallbacks() == {}
        and precision.bound_ratio(*((a[:, :7], b) if kind == "apply" else (a.mT, a)), got) <= 1
    )
    monkeypatch.setattr(precision, "_verdicts", {})
    real = precision.tf32_product
    monkeypatch.setattr(precision, "tf32_product", lambda x, y, emulate=None: real(x, y, emulate) * (1 + 1e-3))
    with pytest.warns(RuntimeWarning, match=f"split-tf32 {kind} on cpu: .* times its bound"):
        got, plain = run()
    assert torch.equal(got, plain) and list(precision.fallbacks()) == [f"cpu {kind}"]
    again, plain = run()  # no second warning (pytest turns warnings into errors only where asked); float32 still
    assert torch.equal(again, plain)
