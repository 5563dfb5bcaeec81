"""Learning-rate tuning over each method's log grid (the paper tunes every method to its best).

Score of a run: the mean over rounds 1..T of log10(max(f_gap, floor)), floor = 1e-15 max(1, |f*|)
(machine precision of f).  Lower is better; it rewards reaching a small gap *and* reaching it
early, which is what the paper's convergence plots compare.

The search is a race: candidates run one after another, and a candidate stops as soon as
even a perfect remainder (every later round at the floor) could not beat the best score so
far; a diverging candidate scores +inf.  The winner's run is returned, so the reported
history is the tuning run itself (nothing is re-run).  Chosen values are cached on disk.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os

import logging
from contextlib import contextmanager

import numpy as np

from fedconvex.algorithms import applicable, make_algorithm
from fedconvex.run import Diverged, run


@contextmanager
def _quiet_server():
    """Candidates with too large a step make some clients blow up; that is the search's business,
    not a warning for the user (rejections still show in the history's ``rejected`` column)."""
    logger = logging.getLogger("fedpm.server")
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


DIVERGENCE_FACTOR = 1e6  # a run whose gap grows by this factor over its start is diverging


def score_floor(f_star: float) -> float:
    return 1e-15 * max(1.0, abs(f_star))


def run_score(history, floor: float) -> float:
    vals = [math.log10(max(r["f_gap"], floor)) for r in history[1:]]
    return float(np.mean(vals)) if vals else math.inf


def candidates(method: str, fixed: dict):
    """Every combination of the method's search space, minus the fixed hyper-parameters.

    Learning rates are raced from the largest down: too-large ones diverge within a few
    rounds, and a good incumbent found early lets the race stop weaker candidates sooner."""
    space = {k: v for k, v in make_algorithm(method).search_space.items() if k not in fixed}
    if "lr" in space:
        space["lr"] = tuple(sorted(space["lr"], reverse=True))
    keys = list(space)
    for combo in itertools.product(*(space[k] for k in keys)):
        yield {**fixed, **dict(zip(keys, combo))}


class _Abort(Exception):
    pass


def _race_stop(rounds: int, floor: float, best: float, initial_gap: float):
    log_floor = math.log10(floor)
    total = 0.0

    def stop(row):
        nonlocal total
        gap = row["f_gap"]
        if not math.isfinite(gap) or gap > DIVERGENCE_FACTOR * max(initial_gap, floor):
            raise _Abort("diverging")
        total += math.log10(max(gap, floor))
        # best achievable final score if every remaining round sat at the floor
        bound = (total + (rounds - row["round"]) * log_floor) / rounds
        if bound > best:
            raise _Abort("cannot win")
        return False

    return stop


def tune(problem, method: str, fixed: dict, theta0, theta_star, f_star, rounds: int, *, participants=None,
         seed: int = 0, cached: dict | None = None, max_ratio: float | None = None):
    """Return (params, history, trials) of the best run.  ``cached`` skips the search;
    ``max_ratio`` turns on the server's magnitude guard (fedconvex.run)."""
    floor = score_floor(f_star)
    kw = dict(participants=participants, seed=seed, theta_star=theta_star, f_star=f_star, max_ratio=max_ratio)
    if cached is not None:
        _, hist = run(problem, make_algorithm(method, **applicable(method, cached)), theta0, rounds, **kw)
        return cached, hist, []
    initial_gap = abs(problem.value(theta0) - f_star)
    best, best_params, best_hist, trials = math.inf, None, None, []
    for params in candidates(method, fixed):
        alg = make_algorithm(method, **applicable(method, params))
        try:
            with _quiet_server():
                _, hist = run(problem, alg, theta0, rounds, stop=_race_stop(rounds, floor, best, initial_gap), **kw)
        except (_Abort, Diverged, ArithmeticError) as why:
            trials.append({**params, "score": None, "stopped": str(why).split(":")[0]})
            continue
        s = run_score(hist, floor)
        trials.append({**params, "score": s})
        if s < best:
            best, best_params, best_hist = s, params, hist
    if best_params is None:
        raise ArithmeticError(f"{method}: every learning rate in its grid diverged; pass --lr to choose one")
    return best_params, best_hist, trials


class TuningCache:
    """JSON file of chosen hyper-parameters keyed by everything that affects a run."""

    def __init__(self, path: str | None):
        self.path = path
        self.data = {}
        if path and os.path.exists(path):
            try:
                with open(path) as fh:
                    self.data = json.load(fh)
            except (OSError, ValueError):
                self.data = {}  # a corrupt cache is only a cache: re-tune

    @staticmethod
    def key(**parts) -> str:
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def get(self, key):
        return self.data.get(key)

    def put(self, key, params) -> None:
        if not self.path:
            return
        self.data[key] = params
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1, sort_keys=True)
        os.replace(tmp, self.path)
