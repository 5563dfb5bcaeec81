"""The per-step FOOF solves spread over CPU threads (fedpm_dnn.cpu_solves) solve the same systems."""
import threading

import pytest

torch = pytest.importorskip("torch")

from fedpm_dnn import cpu_solves, foof  # noqa: E402
from test_vectorized import CFG, assert_same, make, run  # noqa: E402


def factor(d, batch=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (d, d + 30) if batch is None else (batch, d, d + 30)
    X = torch.randn(shape, generator=g, dtype=torch.float64)
    A = X @ X.mT / (d + 30) + 0.1 * torch.eye(d, dtype=torch.float64)
    L = torch.linalg.cholesky(A).float()
    return A, L, L.mT.contiguous()


def problems(batch=None):
    """Blocks of unequal sizes, batched over clients or not, with their exact float64 systems."""
    out, exact = {}, {}
    for i, (rows, d) in enumerate([(9, 37), (5, 20), (12, 8), (1, 15)]):
        A, L, U = factor(d, batch, seed=i)
        shape = (rows, d) if batch is None else (batch, rows, d)
        T = torch.randn(shape, generator=torch.Generator().manual_seed(10 + i))
        out[f"b{i}"] = (T, L, U)
        exact[f"b{i}"] = torch.linalg.solve(A, T.double().mT).mT      # T A^{-1}, A symmetric
    return out, exact


@pytest.mark.parametrize("batch", [None, 4, 3])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_solves_solve_every_system(batch, threads, monkeypatch):
    monkeypatch.setattr(cpu_solves, "MIN_SPLIT_WORK", 0)      # split every block that can be split
    probs, exact = problems(batch)
    got = cpu_solves.solve_all(probs, threads, foof.solve_rows)
    for name, (T, L, U) in probs.items():
        whole = foof.solve_rows(T, L, U)
        assert got[name].shape == T.shape
        # the same triangular solves on fewer rows or clients: float32 round-off of the unsplit solve
        assert torch.allclose(got[name], whole, rtol=1e-5, atol=1e-5), name
        assert torch.allclose(got[name].double(), exact[name], rtol=1e-4, atol=1e-4), name


@pytest.mark.parametrize("batch", [None, 5])
@pytest.mark.parametrize("threads", [2, 3])
def test_the_pieces_cover_each_block_once_and_balance_the_work(batch, threads, monkeypatch):
    monkeypatch.setattr(cpu_solves, "MIN_SPLIT_WORK", 0)
    probs, _ = problems(batch)
    lists = cpu_solves.split_work(probs, threads)
    assert len(lists) == threads
    for name, (T, _, _) in probs.items():
        mark = torch.zeros(T.shape, dtype=torch.int64)
        for pieces in lists:
            for n, index, _ in pieces:
                if n == name:
                    mark[index] += 1
        assert bool((mark == 1).all()), name         # every entry of T in exactly one piece
    loads = [sum(probs[n][0][i].numel() * probs[n][0].shape[-1] for n, i, _ in p) for p in lists]
    largest_piece = max(probs[n][0][i].numel() * probs[n][0].shape[-1] for p in lists for n, i, _ in p)
    assert max(loads) - min(loads) <= largest_piece    # greedy largest-first: within one piece of even


def test_small_blocks_and_one_thread_are_not_split():
    probs, _ = problems(4)
    assert cpu_solves.split_work(probs, 1) == [[(n, (Ellipsis,), False) for n in
                                               sorted(probs, key=lambda n: -probs[n][0].numel() * probs[n][0].shape[-1])]]
    # the default threshold keeps a single client's SimpleCNN-sized block (120 x 401) whole
    T = torch.zeros(120, 401)
    assert [len(p) for p in cpu_solves.split_work({"fc1": (T, None, None)}, 2)] in ([1, 0], [0, 1])
    T10 = torch.zeros(10, 120, 401)
    L10 = torch.zeros(10, 401, 401)
    lists = cpu_solves.split_work({"fc1": (T10, L10, L10)}, 2)
    assert sorted(i for p in lists for _, i, batched in p if batched) == [(slice(0, 5),), (slice(5, 10),)]


def test_a_workers_error_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(cpu_solves, "MIN_SPLIT_WORK", 0)
    probs, _ = problems(4)
    main = threading.get_ident()

    def solve(T, L, U, out):
        if threading.get_ident() != main:
            raise ArithmeticError("worker failed")
        return foof.solve_rows(T, L, U, out)

    with pytest.raises(ArithmeticError, match="worker failed"):
        cpu_solves.solve_all(probs, 2, solve)


def test_precondition_grads_on_two_threads_matches_one(monkeypatch):
    """The sequential engine's step: the same directions whether the solves are split or not."""
    from fedpm_dnn.models import SimpleCNN

    torch.manual_seed(0)
    m = SimpleCNN()
    blocks = foof.foof_blocks(m)
    x, y = torch.randn(40, 3, 32, 32), torch.randint(0, 10, (40,))
    factors = foof.with_uppers(foof.factorize(foof.compute_foof(m, blocks, [x]), 0.5, torch.float32))
    torch.nn.functional.cross_entropy(m(x), y).backward()
    g0 = {n: p.grad.clone() for n, p in m.named_parameters()}
    results = []
    n = torch.get_num_threads()
    for threads, min_work in ((1, cpu_solves.MIN_SPLIT_WORK), (2, 0)):
        for name, p in m.named_parameters():
            p.grad.copy_(g0[name])
        monkeypatch.setattr(cpu_solves, "MIN_SPLIT_WORK", min_work)
        torch.set_num_threads(threads)
        try:
            foof.precondition_grads(m, blocks, factors)
        finally:
            torch.set_num_threads(n)
        results.append({name: p.grad.clone() for name, p in m.named_parameters()})
    for name in g0:
        assert torch.allclose(results[0][name], results[1][name], rtol=1e-5, atol=1e-7), name
        assert not torch.equal(results[0][name], g0[name])   # preconditioned, not left as is


def test_the_vectorized_engine_with_split_solves_gives_the_sequential_replies(monkeypatch):
    monkeypatch.setattr(cpu_solves, "MIN_SPLIT_WORK", 0)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = make("fedpm", **CFG)
        _, r_seq = run(cfg, "sequential", participants=None)
        _, r_vec = run(cfg, "vectorized", participants=None)
    finally:
        torch.set_num_threads(n)
    assert_same(r_vec, r_seq)
