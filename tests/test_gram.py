"""fedpm_dnn.gram: the FOOF Grams by symmetric rank-k updates (CPU) against float64 references."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fedpm_dnn import gram


@pytest.fixture(autouse=True)
def one_torch_thread():
    """syrk is taken where torch runs one thread (fedpm_dnn.gram); these tests check it there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rows(n, D, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(n, D, generator=g, dtype=torch.float64)).to(dtype)   # ReLU-like inputs


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 70), D=st.integers(1, 40), seed=st.integers(0, 2 ** 31))
def test_gram_is_the_symmetric_product(n, D, seed):
    a = rows(n, D, seed)
    ref = a.double().T @ a.double()
    S = gram.gram(a)
    assert S.dtype == torch.float32 and S.shape == (D, D)
    assert torch.equal(S, S.T)
    torch.testing.assert_close(S.double(), ref, rtol=1e-5, atol=1e-5 * max(1.0, float(ref.abs().max())))


def test_float64_rows_give_the_product_to_round_off():
    a = rows(200, 33, 1, torch.float64)
    torch.testing.assert_close(gram.gram(a), a.T @ a, rtol=1e-13, atol=1e-12)


def test_stacked_grams_are_each_clients_own():
    a = torch.stack([rows(50, 17, s) for s in range(4)])
    S = gram.stacked_grams(a)
    for k in range(4):
        torch.testing.assert_close(S[k], gram.gram(a[k]), rtol=0, atol=0)
        torch.testing.assert_close(S[k].double(), a[k].double().T @ a[k].double(), rtol=1e-5, atol=1e-4)


def test_add_gram_accumulates_in_place_in_the_lower_triangle():
    a, b = rows(40, 9, 2, torch.float64), rows(30, 9, 3, torch.float64)
    S = torch.full((9, 9), 7.0, dtype=torch.float64)
    before = S.data_ptr()
    gram.add_gram(S, a)
    gram.add_gram(S, b)
    assert S.data_ptr() == before
    want = 7.0 + a.T @ a + b.T @ b
    torch.testing.assert_close(S.tril(), want.tril(), rtol=1e-13, atol=1e-12)
    assert torch.equal(S.triu(1), torch.full((9, 9), 7.0, dtype=torch.float64).triu(1))   # untouched there
    torch.testing.assert_close(gram.mirror(S), want, rtol=1e-13, atol=1e-12)


def test_rows_in_a_graph_and_other_devices_take_the_general_product():
    a = rows(20, 5, 4).requires_grad_()
    assert not gram.uses_syrk(a) and not gram.uses_syrk(torch.empty(3, 3, device="meta"))
    assert not gram.uses_syrk(torch.ones(3, 3, dtype=torch.float16))
    S = gram.gram(a)
    assert S.requires_grad                                        # the differentiable product, unchanged
    torch.testing.assert_close(S, a.T @ a)
    assert gram.stacked_grams(torch.empty(2, 7, 3, device="meta")).shape == (2, 3, 3)


def test_syrk_runs_on_one_blas_thread_which_is_restored_after():
    libs = gram._controller().lib_controllers
    before = [c.num_threads for c in libs]
    with gram.one_blas_thread():
        assert all(c.num_threads == 1 for c in libs)
    assert [c.num_threads for c in libs] == before


def test_more_torch_threads_keep_torchs_product(monkeypatch):
    """On two threads torch's multithreaded product is used (a one-thread syrk only matched it here and loses on
    more cores): the same numbers as a.T @ a, bit for bit."""
    torch.set_num_threads(2)
    a = rows(64, 20, 6)
    assert not gram.uses_syrk(a) and not gram.syrk_on_cpu(torch.float32)
    assert torch.equal(gram.gram(a), a.T @ a)
    assert torch.equal(gram.stacked_grams(a[None]), torch.bmm(a[None].transpose(1, 2), a[None]))


def test_a_non_contiguous_input_is_read_correctly():
    base = rows(60, 24, 5)
    a = base[::2, ::3]                     # strided rows and columns
    assert not a.is_contiguous()
    torch.testing.assert_close(gram.gram(a).double(), a.double().T @ a.double(), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(gram.gram(a).numpy(), gram.gram(a.contiguous()).numpy())
