"""Learning-rate tuning over each method's log grid (the paper tunes every method to its best).

Score of a run: the mean over rounds 1..T of log10(max(f_gap, floor)), floor = 1e-15 max(1, |f*|)
(machine precision of f).  Lower is better; it rewards reaching a small gap *and* reaching it
early, which is what the paper's convergence plots compare.

The search is a race: candidates run one after another, and a candidate stops as soon as
even a perfect remainder (every later round at the floor) could not beat the best score so
far; a diverging candidate scores +inf.  The winner's run is returned, so the reported
history is the tuning run itself (nothing is re-run).  Chosen values are cached on disk.
The runs may also be made in parallel, in any order (``race_candidate``), and settled afterwards by
``tune(records=...)``: the result, every trial included, is the sequential race's.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import itertools
import json
import logging
import math
import os
import weakref
from contextlib import contextmanager

import numpy as np

from fedconvex.algorithms import applicable, make_algorithm
from fedconvex.algorithms.normal_memo import remembering_normals
from fedconvex.backend import to_numpy
from fedconvex.files import replaced_atomically
from fedconvex.run import Diverged, known_point, reusing_last_point, run


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
        yield {**fixed, **dict(zip(keys, combo, strict=False))}


# Gaussian draws a process keeps for the candidates after the first (fedconvex.algorithms.normal_memo): every
# candidate starts from the same seed, so FedNS's candidates draw the same sketches round by round, and the race
# stops the losing ones within a few rounds (Test 1: 2 or 3).  The first 4 rounds' draws, at most 384 MiB
# (w8a: 119 MB a round, so its first three; a9a: 32 MB a round), freed when a worker moves on to another method.
NORMALS_KEPT, NORMALS_ROUNDS = 384 * 2**20, 4


# per problem: (theta0, what a run's view knows at theta0): every candidate's round-0 metrics (and, for the
# first-order methods, its clients' first gradients) are the same numbers, computed once per process
_STARTS = weakref.WeakKeyDictionary()


def _starting_view(problem, theta0):
    """``problem`` as a run from ``theta0`` sees it (``fedconvex.run.reusing_last_point``), already knowing the
    f and grad f of every client at ``theta0``."""
    try:
        start = _STARTS.get(problem)
    except TypeError:  # not weakly referable / hashable: nothing to remember it by
        return problem
    theta0_host = np.array(to_numpy(theta0))
    if start is None or not np.array_equal(start[0], theta0_host) or start[0].shape != theta0_host.shape:
        start = (theta0_host, known_point(problem, theta0))
        _STARTS[problem] = start
    return reusing_last_point(problem, start[1]) if start[1] is not None else problem


class _Abort(Exception):
    pass


# A race run in parallel stops a candidate against an earlier candidate's finished score plus this slack: the
# sequential race's own bar (the best score before that candidate) is at most that score up to the rounding of
# the race's running sums (~1e-13 here), so a parallel stop never comes later than the sequential one.
PARALLEL_SLACK = 1e-9


def _race_stop(rounds: int, floor: float, best, initial_gap: float, seen: list | None = None):
    """The race's stop rule; ``best`` is the score to beat, or a callable read at every round (a parallel
    race learns other candidates' scores while it runs); ``seen`` collects every row the rule checked."""
    log_floor = math.log10(floor)
    total = 0.0
    beat = best if callable(best) else (lambda: best)

    def stop(row):
        nonlocal total
        if seen is not None:
            seen.append(row)
        gap = row["f_gap"]
        if not math.isfinite(gap) or gap > DIVERGENCE_FACTOR * max(initial_gap, floor):
            raise _Abort("diverging")
        total += math.log10(max(gap, floor))
        # best achievable final score if every remaining round sat at the floor
        bound = (total + (rounds - row["round"]) * log_floor) / rounds
        if bound > beat():
            raise _Abort("cannot win")
        return False

    return stop


def race_candidate(
    problem,
    method: str,
    params: dict,
    theta0,
    theta_star,
    f_star,
    rounds: int,
    best,
    *,
    participants=None,
    seed: int = 0,
    max_ratio: float | None = None,
    initial_gap=None,
) -> dict:
    """One candidate's run under the race's stop rule against ``best`` (a score or a callable).
    Returns its record: the rows the rule saw, the full history if the run ended, and ``error`` if the
    run itself failed (an abort of the rule is re-derived from the rows by ``settle``)."""
    floor = score_floor(f_star)
    if initial_gap is None:
        initial_gap = abs(problem.value(theta0) - f_star)
    seen = []
    alg = make_algorithm(method, **applicable(method, params))
    try:
        with _quiet_server(), remembering_normals(NORMALS_KEPT, NORMALS_ROUNDS, owner=method):
            _, hist = run(
                _starting_view(problem, theta0),
                alg,
                theta0,
                rounds,
                stop=_race_stop(rounds, floor, best, initial_gap, seen),
                participants=participants,
                seed=seed,
                theta_star=theta_star,
                f_star=f_star,
                max_ratio=max_ratio,
            )
    except _Abort:
        return {"rows": seen, "hist": None, "error": None}
    except (Diverged, ArithmeticError) as why:
        return {"rows": seen, "hist": None, "error": str(why).split(":")[0]}
    return {"rows": seen, "hist": hist, "error": None}


def _verdict(rec, best, rounds, floor, initial_gap):
    """A candidate's fate in the sequential race against ``best``, from its record: a trial entry, or None
    when the record stops before that race would (then the candidate must be run against ``best``)."""
    stop = _race_stop(rounds, floor, best, initial_gap)
    try:
        for row in rec["rows"]:
            stop(row)
    except _Abort as why:
        return {"score": None, "stopped": str(why).split(":")[0]}
    if rec["error"] is not None:
        return {"score": None, "stopped": rec["error"]}
    if rec["hist"] is None:
        return None
    return {"score": run_score(rec["hist"], floor)}


def tune(
    problem,
    method: str,
    fixed: dict,
    theta0,
    theta_star,
    f_star,
    rounds: int,
    *,
    participants=None,
    seed: int = 0,
    cached: dict | None = None,
    max_ratio: float | None = None,
    records: dict | None = None,
):
    """Return (params, history, trials) of the best run: the first candidate with the lowest score.
    ``cached`` skips the search; ``max_ratio`` turns on the server's magnitude guard (fedconvex.run).

    ``records`` (candidate index -> ``race_candidate`` record) are runs a parallel race made, each raced
    against no more than the earlier candidates' finished scores (+ ``PARALLEL_SLACK``): they are judged
    here exactly as the sequential race judges a run, and a candidate without a record, or whose record
    stopped before the sequential race would stop it, is run here.  So the result, trials included, is
    the sequential race's, whatever order the runs were made in."""
    kw = dict(participants=participants, seed=seed, max_ratio=max_ratio)
    if cached is not None:
        _, hist = run(
            problem,
            make_algorithm(method, **applicable(method, cached)),
            theta0,
            rounds,
            theta_star=theta_star,
            f_star=f_star,
            **kw,
        )
        return cached, hist, []
    floor = score_floor(f_star)
    initial_gap = abs(problem.value(theta0) - f_star)
    records = records or {}
    best, best_params, best_hist, trials = math.inf, None, None, []
    for i, params in enumerate(candidates(method, fixed)):
        rec = records.get(i)
        verdict = _verdict(rec, best, rounds, floor, initial_gap) if rec is not None else None
        if verdict is None:
            rec = race_candidate(
                problem, method, params, theta0, theta_star, f_star, rounds, best, initial_gap=initial_gap, **kw
            )
            verdict = _verdict(rec, best, rounds, floor, initial_gap)
        trials.append({**params, **verdict})
        s = verdict["score"]
        if s is not None and s < best:
            best, best_params, best_hist = s, params, rec["hist"]
    if best_params is None:
        raise ArithmeticError(f"{method}: every learning rate in its grid diverged; pass --lr to choose one")
    return best_params, best_hist, trials


def shipped_cache() -> str:
    """The chosen hyper-parameters of the reference runs, shipped with the toolkit and only ever read: a run with
    the default cache finds them here and writes what it tunes anew to its own cache under results/.  One file,
    reference/tuning.json: read there in a clone, and from the package data an installed copy holds
    (validation/shipped/tuning.json, pyproject.toml's package-dir)."""
    clone = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reference", "tuning.json")
    if os.path.isfile(clone):
        return clone
    return str(importlib.resources.files("validation") / "shipped" / "tuning.json")


SHIPPED_CACHE = shipped_cache()
DEFAULT_CACHE = os.path.join("results", ".cache", "tuning.json")


def _read_cache(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}  # a corrupt cache is only a cache: re-tune
    return data if isinstance(data, dict) else {}


class TuningCache:
    """JSON file of chosen hyper-parameters keyed by everything that affects a run; ``shipped`` names a cache read
    after it and never written (the repository's reference/tuning.json)."""

    def __init__(self, path: str | None, shipped: str | None = None):
        self.path = path
        self.data = _read_cache(path)
        self.shipped = _read_cache(shipped) if path else {}

    @staticmethod
    def check(path: str) -> None:
        """Raise ValueError unless ``path`` may serve as the cache: absent, empty, a cache of ours (a JSON object of
        hyper-parameter objects), or a damaged one (text that opens a JSON object but does not parse: only a cache,
        re-tuned and rewritten).  Any other file -- not ours -- would be overwritten by ``put``."""
        if os.path.lexists(path) and not os.path.isfile(path):
            raise ValueError(f"--cache {path}: is not a regular file; give a JSON file path (or --no-cache)")
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            return
        try:
            with open(path, "rb") as fh:
                text = fh.read()
        except OSError as exc:
            raise ValueError(f"--cache {path}: cannot be read ({exc.strerror})") from None
        try:
            data = json.loads(text)
        except ValueError:
            if text.lstrip()[:1] == b"{":
                return  # a damaged cache of ours: re-tune
            data = None
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ValueError(
                f"--cache {path}: is not a tuning cache of this tool (not a JSON object of "
                f"hyper-parameters); choose another --cache, remove it, or pass --no-cache"
            )

    @staticmethod
    def key(**parts) -> str:
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def get(self, key, choices=None):
        """The entry under ``key``; with ``choices`` (the candidates it was chosen from) only when it is one of
        them: a damaged entry (edited, truncated, of another grid) is None, so the method is tuned again and the
        entry rewritten."""
        entry = self.data.get(key)
        if entry is None:
            entry = self.shipped.get(key)
        if choices is not None and not any(entry == c for c in choices):
            return None
        return entry

    def put(self, key, params) -> None:
        if not self.path:
            return
        self.data[key] = params
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with replaced_atomically(self.path) as tmp, open(tmp, "w") as fh:  # per-process tmp: caches are shared
            json.dump(self.data, fh, indent=1, sort_keys=True)
