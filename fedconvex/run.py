"""The in-process convex front-end of the round driver (``fedconvex.driver``): clients stacked on one
problem, metrics |f - f*|, ||theta - theta*||, ||grad f||.

Algorithms never loop over rounds, log or count; the driver does, for every method alike.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .backend import to_numpy
from .driver import Diverged, Driver, InProcess, message_bytes, sample_clients, screen_message  # noqa: F401
from .problem import FederatedLogReg
from .screening import dtype_problem

COLUMNS = ("round", "f_gap", "dist", "grad_norm", "bytes_up", "bytes_down", "seconds", "rejected")


def metrics(problem, theta, theta_star, f_star) -> dict:
    f, g = problem.value_and_gradient(theta)
    return {
        "f_gap": abs(f - f_star) if f_star is not None else math.nan,
        "dist": float(np.linalg.norm(to_numpy(theta - theta_star))) if theta_star is not None else math.nan,
        "grad_norm": float(np.linalg.norm(to_numpy(g))),
    }


def blas_single_thread():
    """Per-client work is many small BLAS/LAPACK calls; OpenBLAS's thread hand-offs cost more
    than they gain there (measured on w8a: 2.5 s -> 1.1 s for 10 FedPM rounds on 2 cores)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


class _ReusingLogReg(FederatedLogReg):
    """``reusing_last_point``'s view: ``values_and_gradients`` answers a repeated question from memory."""

    _last = None

    def values_and_gradients(self, thetas, sel=None):
        n = self.n_clients
        if sel is not None and len(sel) == n and np.array_equal(np.asarray(sel), np.arange(n)):
            sel = None  # every client, as the problem itself treats it
        last = self._last
        if (
            last is not None
            and isinstance(thetas, np.ndarray)
            and last[0].shape == thetas.shape
            and last[0].dtype == thetas.dtype
            and (sel is None) == (last[1] is None)
            and (sel is None or np.array_equal(sel, last[1]))
            and np.array_equal(thetas, last[0])
        ):
            return last[2].copy(), last[3].copy()
        vals, grads = super().values_and_gradients(thetas, sel)
        self._last = (np.array(thetas), None if sel is None else np.array(sel), vals.copy(), grads.copy())
        return vals, grads


def reusing_last_point(problem, known=None):
    """A shallow view of ``problem`` that answers ``values_and_gradients`` at the point it was last asked
    about from memory (copies of the very arrays computed then, so every result is bit-identical).
    ``known`` (from ``known_point``) is such a point it remembers from the start.

    In a round the clients start from the broadcast model, which is the point at which the previous
    round's metrics evaluated f and grad f over every client: with full participation the clients'
    first gradients are that computation again (for first-order methods with K = 1, half of a round).
    Only for ``FederatedLogReg`` on NumPy, whose oracles are pure functions of their arguments; any
    other problem is returned as it is."""
    if type(problem) is not FederatedLogReg or problem.xp is not np:
        return problem
    view = object.__new__(_ReusingLogReg)
    view.__dict__.update(problem.__dict__)  # shares every array; the problem itself is not touched
    if known is not None:
        view._last = known  # never written into: a hit answers copies, a miss replaces it
    return view


def known_point(problem, theta):
    """What ``reusing_last_point``'s view remembers once it has answered f and grad f of every client at
    ``theta`` (None where it remembers nothing): passed back as ``known``, a run from ``theta`` starts knowing
    its round-0 metrics and its clients' first gradients, which are those numbers.  A search that runs many
    candidates from one point computes them once instead of once a candidate."""
    view = reusing_last_point(problem)
    if view is problem:
        return None
    view.values_and_gradients(view._stack(theta))  # the question the round-0 metrics ask (value_and_gradient)
    return view._last


def _check_run_args(problem, theta0, rounds) -> None:
    """One clear error for a round count that is not an integer >= 0 or a theta0 that is not a finite (d,) array."""
    if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral):
        raise TypeError(f"rounds must be an integer, got {rounds!r}")
    if rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0, got {rounds}")
    d = problem.d
    if not hasattr(theta0, "shape"):
        raise TypeError(f"theta0 must be an array of shape ({d},), got {type(theta0).__name__}")
    if tuple(theta0.shape) != (d,):
        raise ValueError(f"theta0 must have shape ({d},) (the problem's {d} features), got {tuple(theta0.shape)}")
    if dtype_problem(theta0, "fiu"):  # complex, bool or object: not a point of R^d
        raise TypeError(f"theta0 must be a real array, got dtype {str(theta0.dtype).replace('torch.', '')}")
    if not np.isfinite(to_numpy(theta0)).all():
        raise ValueError("theta0 holds NaN or Inf")


def run(problem, algorithm, theta0, rounds: int, **kwargs):
    """Run ``rounds`` rounds; see ``_run`` (this wrapper pins BLAS to one thread on NumPy).  ``rounds`` = 0
    evaluates ``theta0`` only (the history's round-0 row)."""
    _check_run_args(problem, theta0, rounds)
    problem = reusing_last_point(problem)
    # overflow on the way to divergence is reported once, as Diverged, not as NumPy warnings
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if problem.xp is np:
            with blas_single_thread():
                return _run(problem, algorithm, theta0, rounds, **kwargs)
        return _run(problem, algorithm, theta0, rounds, **kwargs)


def _run(
    problem,
    algorithm,
    theta0,
    rounds: int,
    *,
    participants: int | None = None,
    seed: int = 0,
    theta_star=None,
    f_star=None,
    stop=None,
    on_round=None,
    tamper=None,
    screen: bool = True,
    max_ratio: float | None = None,
    client_streams: bool = False,
):
    """Run ``rounds`` rounds; returns (final state, list of per-round metric dicts, round 0 first).

    ``screen`` (default on) rejects unusable client replies before the server step (see
    fedconvex.screening); ``tamper(round, up) -> up`` injects faults for tests; ``max_ratio`` R turns
    on the magnitude guard (off by default, as in the paper's runs).  ``stop(row) -> bool`` ends the run early (the
    tuner uses it); ``on_round(t)`` is called
    after each round (progress bars).  ``client_streams``: every client
    draws from its own stream ``fedconvex.driver.client_rng(seed, round, client)``, as on Flower (off by default:
    the paper's runs share one stream, and their histories depend on it).  Raises ``Diverged`` when the iterate is not
    finite.
    bytes_up / bytes_down are per participating client and cumulative; ``seconds`` is the
    cumulative wall time of the rounds themselves (metric evaluation excluded).
    """
    rng = np.random.default_rng(seed)
    xp = problem.xp
    n = problem.n_clients

    def weights(sel):
        return problem.client_weights[xp.asarray(sel)] if len(sel) < n else problem.client_weights

    driver = Driver(
        algorithm,
        problem,
        InProcess(problem, seed if client_streams else None),
        weights,
        evaluate=lambda state: metrics(problem, state.theta, theta_star, f_star),
        n_clients=n,
        participants=participants,
        d=problem.d,
        screen=screen,
        max_ratio=max_ratio,
        tamper=tamper,
        label=f"{algorithm.label} (lr={algorithm.lr:g})",
        synchronize=(xp.cuda.Stream.null.synchronize if xp is not np and hasattr(xp, "cuda") else None),
        finite=lambda state: bool(xp.all(xp.isfinite(state.theta))),
    )
    return driver.run(
        algorithm.init(problem, theta0),
        rounds,
        rng,
        on_round=(lambda row, _: on_round(row["round"])) if on_round is not None else None,
        stop=stop,
    )
