"""The per-step FOOF solves (paper eq. foof_local) of every block, spread over the CPU's threads.

Each solve is small (SimpleCNN's largest, fc1, is 401 x 401 with 120 gradient rows per client), so one solve
on an OpenMP team of two pays the team's hand-off instead of splitting useful work (``foof.one_cpu_thread``
runs them on one).  But the steps' solves are independent row by row and client by client: here the large
ones are halved (by clients when they are batched, else by rows), the pieces dealt to as many Python threads
as torch had OpenMP threads, and each thread runs its pieces at one OpenMP thread (torch and MKL release the
GIL inside them).  Measured on this project's 2-core CPU for fc1 of 10 stacked clients: 8.0 ms on one thread,
5.0 ms on two (results/cpu-bench-2026-11-26/session3/).  Small solves stay whole (``MIN_SPLIT_WORK``).

The pieces are the same triangular solves on fewer rows or fewer clients; MKL may block a solve of fewer rows
differently, so a row can differ from the unsplit solve's in the last float32 bits (the engines' equivalence
tolerance covers that; a run's result never depends on anything but its thread count).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

# Below this many multiply-adds (rows x d^2 per triangular solve) a block is solved whole.  A second thread's
# piece pays only when it is long: on this project's CPU one trsm with a 401 x 401 factor took 0.32 ms on
# 120 rows whole and 0.54 ms halved over two threads (the idle core's wake-up), 1.52 ms against 0.85 ms on
# 600 rows (46 M) and 7.6 against 4.1 ms on 2,400 (results/cpu-bench-2026-11-26/session3/).  So a single
# client's steps keep one thread (SimpleCNN's fc1: 120 x 401^2 = 19 M), while the vectorized engine's ten
# stacked clients (193 M for fc1) are halved by clients.
MIN_SPLIT_WORK = 40_000_000

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _workers(n: int) -> ThreadPoolExecutor:
    """A pool with ``n`` threads, kept for the process (steps call this hundreds of times a round)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers != n:      # the thread count changed: a pool of the new size
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="foof-solve")
        return _pool


def split_work(problems: dict, threads: int) -> list:
    """The solves of ``problems`` (name -> (T, L, U): T (..., rows, d), L/U (..., d, d) batched like T or not)
    as ``threads`` lists of pieces (name, index) -- index selects the piece's part of T, of the output and,
    for a batched split, of L and U -- balanced by multiply-adds (largest piece first, to the lightest list)."""
    pieces = []
    for name, (T, L, _) in problems.items():
        d = T.shape[-1]
        work = T.numel() * d
        if threads < 2 or work < MIN_SPLIT_WORK:
            pieces.append((work, name, (Ellipsis,), False))
            continue
        batched = T.dim() >= 3 and L.dim() >= 3 and T.shape[0] >= threads
        n = T.shape[0] if batched else T.shape[-2]
        if n < threads:
            pieces.append((work, name, (Ellipsis,), False))
            continue
        bounds = [n * i // threads for i in range(threads + 1)]
        for a, b in zip(bounds, bounds[1:]):
            index = (slice(a, b),) if batched else (Ellipsis, slice(a, b), slice(None))
            pieces.append((work * (b - a) // n, name, index, batched))
    lists, loads = [[] for _ in range(max(threads, 1))], [0] * max(threads, 1)
    for work, name, index, batched in sorted(pieces, key=lambda p: -p[0]):
        i = loads.index(min(loads))
        lists[i].append((name, index, batched))
        loads[i] += work
    return lists


def solve_all(problems: dict, threads: int, solve) -> dict:
    """name -> solve(T, L, U, out) for every problem name -> (T, L, U), the work split over ``threads`` CPU
    threads (``split_work``); the caller holds torch at one OpenMP thread (``foof.one_cpu_thread``)."""
    out = {name: torch.empty(T.shape, dtype=T.dtype, device=T.device) for name, (T, _, _) in problems.items()}
    lists = split_work(problems, threads)

    def run(pieces):
        for name, index, batched in pieces:
            T, L, U = problems[name]
            if index == (Ellipsis,):
                solve(T, L, U, out[name])
            elif batched:
                solve(T[index], L[index], U[index], out[name][index])
            else:
                solve(T[index], L, U, out[name][index])

    busy = [p for p in lists[1:] if p]
    if not busy:
        run(lists[0])
        return out
    futures = [_workers(len(lists) - 1).submit(run, p) for p in busy]
    try:
        run(lists[0])
    finally:
        for f in futures:
            f.result()          # re-raises a worker's error here
    return out
