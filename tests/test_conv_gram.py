"""The conv Gram of the FOOF blocks (foof.conv_gram, both forms, and the half products CUDA takes) against a float64
F.unfold reference; CUDA's forms are run on the CPU here (the same code; only the choice is CUDA's)."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedpm_dnn import foof  # noqa: E402
from fedpm_dnn.foof import precision  # noqa: E402


def half_patch(m, x):
    return foof.patch_gram(m, x, half=True)


def half_row(m, x):
    return foof.row_form_gram(m, x, half=True)


FORMS = [foof.conv_gram, foof.patch_gram, foof.row_form_gram, half_patch, half_row]
SYMMETRIC = (foof.row_form_gram, half_patch, half_row)  # exactly symmetric by construction
U32 = 2.0**-24  # float32 unit round-off


def reference(m, x):
    """(sum a a^T, sum a, patches per image) over every F.unfold patch a of every image, in float64."""
    K = x.shape[0]
    a = F.unfold(x.flatten(0, 1).double(), m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
    L = a.shape[2]
    a = a.transpose(1, 2).reshape(K, -1, a.shape[1])
    return a.mT @ a, a.sum(1), L, a


def activations(shape, seed, dtype=torch.float64):
    """Post-ReLU-like inputs: non-negative, half of them zero, so that sums grow with their length."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g).relu() * 3 + (torch.rand(*shape, generator=g) < 0.5)).to(dtype)


def rel(got, want):
    return (torch.linalg.norm(got.double() - want) / torch.linalg.norm(want)).item()


CASES = {
    "simplecnn-conv2": (nn.Conv2d(6, 16, 5), (1, 12, 6, 14, 14)),
    "3x3-pad1": (nn.Conv2d(8, 4, 3, padding=1), (1, 5, 8, 10, 10)),
    "odd": (nn.Conv2d(3, 2, (3, 2), padding=(2, 1)), (2, 3, 3, 9, 11)),
    "stride2": (nn.Conv2d(4, 5, 3, stride=2, padding=1), (2, 4, 4, 9, 8)),
    "stride-dilation": (nn.Conv2d(3, 2, (4, 3), stride=(2, 1), padding=3, dilation=(3, 2)), (2, 3, 3, 5, 11)),
    "1x1-stride2": (nn.Conv2d(5, 3, 1, stride=2), (1, 4, 5, 7, 7)),
    "stacks-one-zero": (nn.Conv2d(6, 16, 5), (3, 4, 6, 14, 14)),
    # wide enough for several block rows of the half products: patches 576 and 1,539 wide, rows 513
    "wide-3x3": (nn.Conv2d(64, 4, 3, padding=1), (1, 2, 64, 5, 5)),
    "wide-rows": (nn.Conv2d(171, 2, 3, padding=1), (2, 1, 171, 4, 5)),
}


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES)
def test_float64_gram_is_the_sum_over_every_patch(form, case):
    """Every form gives the reference sums to float64 round-off, S exactly symmetric; a client whose images
    are all zero (the vectorized engine's padding) gets exactly zero."""
    m, shape = CASES[case]
    m = m.double()
    x = activations(shape, 0)
    if case == "stacks-one-zero":
        x[1] = 0.0
    S_ref, total_ref, L_ref, _ = reference(m, x)
    S, total, L = form(m, x)
    assert L == L_ref and S.shape == S_ref.shape and total.shape == total_ref.shape
    assert rel(S, S_ref) < 1e-12 and rel(total, total_ref) < 1e-12
    if form in SYMMETRIC:
        assert torch.equal(S, S.mT)
    if case == "stacks-one-zero":
        assert not S[1].any() and not total[1].any()


@settings(max_examples=60, deadline=None)
@given(
    C=st.integers(1, 4),
    kh=st.integers(1, 4),
    kw=st.integers(1, 4),
    sh=st.integers(1, 3),
    sw=st.integers(1, 3),
    ph=st.integers(0, 2),
    pw=st.integers(0, 2),
    dh=st.integers(1, 2),
    dw=st.integers(1, 2),
    H=st.integers(1, 12),
    W=st.integers(1, 12),
    K=st.integers(1, 3),
    B=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_row_form_matches_the_patches_for_any_geometry(C, kh, kw, sh, sw, ph, pw, dh, dw, H, W, K, B, seed):
    m = nn.Conv2d(C, 2, (kh, kw), stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw)).double()
    if H + 2 * ph < dh * (kh - 1) + 1 or W + 2 * pw < dw * (kw - 1) + 1:
        return  # no output position
    x = torch.randn(K, B, C, H, W, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    S_ref, total_ref, L_ref, _ = reference(m, x)
    for form in (foof.row_form_gram, foof.conv_gram, half_row, half_patch):
        S, total, L = form(m, x)
        assert L == L_ref
        torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=1e-12 * S_ref.abs().max().item())
        torch.testing.assert_close(total, total_ref, rtol=1e-12, atol=1e-12 * total_ref.abs().max().item())
        if form in SYMMETRIC:
            assert torch.equal(S, S.mT)


@pytest.mark.parametrize("case", ["simplecnn-conv2", "3x3-pad1", "stride2", "stacks-one-zero"])
def test_float32_error_is_within_the_dot_product_bound(case):
    """float32 inputs: |S - S_ref| <= gamma_n |A|^T |A| entrywise with n = every patch of a stack, the
    textbook bound of a float32 sum of n products, which the patch form meets too."""
    m, shape = CASES[case]
    x = activations(shape, 1, torch.float32)
    S_ref, _, L, a = reference(m, x)
    n = shape[1] * L
    bound = (n * U32 / (1 - n * U32)) * (a.abs().mT @ a.abs())
    for form in FORMS:
        assert ((form(m.float(), x)[0].double() - S_ref).abs() <= bound).all()


@pytest.mark.parametrize(
    "conv,shape",
    [
        (nn.Conv2d(6, 16, 5), (1, 300, 6, 14, 14)),  # SimpleCNN's conv2, the profiled pass
        (nn.Conv2d(6, 16, 5), (10, 30, 6, 14, 14)),  # the same as 10 clients' stacks
        (nn.Conv2d(3, 6, 5), (1, 64, 3, 32, 32)),  # SimpleCNN's conv1
        (nn.Conv2d(32, 8, 3, padding=1), (1, 16, 32, 16, 16)),  # a ResNet-style 3x3 conv
        (nn.Conv2d(32, 8, 3, stride=2, padding=1), (1, 16, 32, 16, 16)),  # and its stride-2 form
    ],
)
def test_float32_error_is_no_worse_than_the_patch_forms(conv, shape):
    """Against the float64 sums of the same float32 inputs, the row form (and so conv_gram, whichever form
    it takes) is no less accurate (Frobenius norm) than the patch form's float32 sums that it replaces."""
    m = conv.float()
    x = activations(shape, 2, torch.float32)
    S_ref, total_ref, _, _ = reference(m, x)
    S_old, total_old, _ = foof.patch_gram(m, x)
    for form in (foof.row_form_gram, foof.conv_gram):
        S, total, _ = form(m, x)
        assert rel(S, S_ref) <= rel(S_old, S_ref)
        assert rel(total, total_ref) <= rel(total_old, total_ref)


def test_appended_zero_images_add_nothing():
    """The vectorized engine pads clients to the largest with zeroed inputs: they leave every sum as it was."""
    m = nn.Conv2d(6, 16, 5).double()
    x = activations((2, 5, 6, 14, 14), 3)
    padded = torch.cat([x, torch.zeros(2, 3, 6, 14, 14, dtype=torch.float64)], 1)
    for form in FORMS:
        for got, want in zip(form(m, padded)[:2], form(m, x)[:2], strict=False):
            torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "conv,message",
    [
        (nn.Conv2d(4, 4, 4, padding="same"), "even kernel span"),
        (nn.Conv2d(4, 4, 3, groups=2), "groups=1 only"),
        (nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), "zero padding only"),
    ],
)
def test_unsupported_convs_raise_as_before(form, conv, message):
    with pytest.raises(ValueError, match=message):
        form(conv, torch.randn(1, 2, 4, 8, 8))


def test_a_border_mode_without_padding_is_no_border_at_all():
    """padding_mode only matters where there is padding: an unpadded 'reflect' conv is an ordinary one."""
    m = nn.Conv2d(3, 4, 3, padding_mode="reflect")
    x = activations((1, 5, 3, 9, 9), 4)
    ref = nn.Conv2d(3, 4, 3)
    for form in FORMS:
        for got, want in zip(form(m, x)[:2], form(ref, x)[:2], strict=False):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_convolution_without_kernel_rows_to_share_keeps_the_patch_form():
    """A 1-row kernel has no overlap between output rows: the row form would save nothing."""
    for m in (nn.Conv2d(64, 8, 1, stride=2), nn.Conv2d(16, 8, (1, 3), padding=(0, 1))):
        assert foof.row_form_costs(m, (1, 64, m.in_channels, 16, 16))[0] == 0
        assert not foof.row_form_pays(m, (1, 64, m.in_channels, 16, 16))


def test_a_device_neither_cpu_nor_cuda_keeps_the_full_patch_form(monkeypatch):
    """Elsewhere (here the meta device) conv_gram stays the full patch form."""

    def refuse(*_):
        raise AssertionError("row form used off the CPU")

    monkeypatch.setattr(foof, "row_form_gram", refuse)
    m = nn.Conv2d(6, 16, 5)
    S, total, L = foof.conv_gram(m, torch.empty(1, 300, 6, 14, 14, device="meta"))
    assert S.device.type == "meta" and S.shape == (1, 150, 150) and L == 100
    assert foof.row_form_pays(m, (1, 300, 6, 14, 14))  # on the CPU, the same input takes the row form


def bound(mode, k, absab, ab):
    """tests/test_foof_precision.py's elementwise bound of a product of length k in ``mode``."""
    if mode in ("fp32", "split-tf32"):
        return (k + 24) * U32 * absab
    if mode == "tf32":
        return (2.0**-10 + 2.0**-22 + k * U32) * absab
    return (2.0**-7 + 2.0**-16 + k * U32) * absab + 2.0**-8 * ab.abs()


@pytest.mark.parametrize("case", ["3x3-pad1", "stride2", "stride-dilation", "wide-3x3", "wide-rows"])
@pytest.mark.parametrize("mode", precision.MODES)
def test_cudas_forms_keep_each_precision_modes_bound(case, mode):
    """float32 inputs, every --foof-precision mode (TF32 emulated): the half patch form and the row form with
    half products are within the mode's elementwise bound of the float64 sums (n = every patch of a stack), and
    exactly symmetric; fp32 and split-tf32 within float32's own bound."""
    m, shape = CASES[case]
    x = activations(shape, 5, torch.float32)
    S_ref, total_ref, L, a = reference(m, x)
    n = shape[1] * L
    absab = a.abs().mT @ a.abs()
    with precision.use(mode):
        for form in (half_patch, half_row):
            S, total, _ = form(m.float(), x)
            assert ((S.double() - S_ref).abs() <= bound(mode, n, absab, S_ref)).all(), (form.__name__, mode)
            assert torch.equal(S, S.mT)
            assert rel(total, total_ref) < n * U32


def test_cuda_takes_the_row_form_where_its_products_pay_and_half_products_always():
    """conv_gram_form on CUDA (the rule alone; no device needed), at a 512-image statistics chunk of 10 clients:
    ResNet18-GN's first-stage 3x3 convs (64 channels, 32 x 32: many output rows share their input rows) take the
    row form in every mode; its later 3x3 convs (few output rows: the row form's float64 window sums of wide blocks
    outweigh the products saved), SimpleCNN's 5x5 convs (small products, many launches) and a 1x1 conv the patch
    form; all with half products.  The CPU's choices stay as they were."""
    resnet = [(nn.Conv2d(64, 64, 3, padding=1), (10, 512, 64, 32, 32))]
    small = [
        (nn.Conv2d(256, 512, 3, stride=2, padding=1), (10, 512, 256, 8, 8)),
        (nn.Conv2d(512, 512, 3, padding=1), (10, 512, 512, 4, 4)),
        (nn.Conv2d(3, 6, 5), (10, 512, 3, 32, 32)),
        (nn.Conv2d(6, 16, 5), (10, 512, 6, 14, 14)),
        (nn.Conv2d(256, 512, 1, stride=2), (10, 512, 256, 8, 8)),
    ]
    for mode in precision.MODES:
        for m, shape in resnet:
            assert foof.conv_gram_form(m, shape, "cuda", mode) == ("row", True)
        for m, shape in small:
            assert foof.conv_gram_form(m, shape, "cuda", mode) == ("patch", True)
    m, shape = nn.Conv2d(6, 16, 5), (1, 300, 6, 14, 14)
    assert foof.conv_gram_form(m, shape, "cpu", "fp32") == ("row", False)
    assert foof.conv_gram_form(m, shape, "cpu", "split-tf32") == ("patch", False)


def test_the_row_forms_counts_match_a_hand_count():
    """ResNet18-GN's last 3x3 conv (512 channels, 4 x 4, padding 1): padded rows 6; the row form multiplies 6 rows
    with themselves, 5 + 4 with their neighbours at kernel-row offsets 1 and 2, each (C kw)^2 per output column,
    against the patch form's 4 output rows x 9 kernel-row pairs; the half products count the lower triangle."""
    m = nn.Conv2d(512, 512, 3, padding=1)
    c = foof.row_form_counts(m, (1, 1, 512, 4, 4))
    unit = 4 * 1536**2  # output columns x (C kw)^2
    assert c["patch_ma"] == 36 * unit and c["row_ma"] == 15 * unit and c["row_other_ma"] == 9 * unit
    # 1,536 = 6 block rows of 256: (1 + ... + 6) / 36 of a product; 4,608 = 18 of 256: 19 / 36
    assert c["row_half_ma"] == pytest.approx((9 + 6 * 21 / 36) * unit)
    assert c["patch_half_ma"] == pytest.approx(36 * 19 / 36 * unit)
