"""The benchmark scripts' timer: the best of repeated calls after a warm-up call."""

from __future__ import annotations

import time


def best_seconds(f, reps: int) -> float:
    """Minimum wall time of ``reps`` calls of ``f`` (one untimed call first: caches, lazy set-up)."""
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best
