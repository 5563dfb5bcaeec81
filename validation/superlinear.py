"""Paper Test 1: FL methods on L2 logistic regression, K local steps, T rounds.

    python -m validation.superlinear --dataset w8a
    python -m validation.superlinear --dataset a9a --methods fedpm,fednl --rounds 20

Writes history.csv, summary.json and convergence.{png,pdf} into --out (default
results/superlinear-<dataset>) and prints the summary table.  Every method's learning rate
is tuned over its log grid unless --lr fixes it; the chosen values are cached (validation/tuning.py): read from
the shipped reference/tuning.json, new ones written to results/.cache/tuning.json.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import platform
import shlex
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from fedconvex.algorithms import PAPER_TEST1, REGISTRY
from fedconvex.data import paper_split_sizes
from fedconvex.run import Diverged
from validation import common, report
from validation.outputs import Kind, OutputError
from validation.progress import Progress
from validation.tuning import (
    DEFAULT_CACHE,
    DIVERGENCE_FACTOR,
    PARALLEL_SLACK,
    SHIPPED_CACHE,
    TuningCache,
    candidates,
    race_candidate,
    run_score,
    score_floor,
    tune,
)

PROG = "python -m validation.superlinear"
OUTPUT = Kind(PROG, ("history.csv", "summary.json", "convergence.png", "convergence.pdf"))


def parse_args(argv=None):
    p = common.OneLineParser(prog=PROG, doc=__doc__)
    common.add_problem_args(p)
    p.add_argument("--rounds", type=common.positive_int, default=50, help="communication rounds")
    p.add_argument(
        "--method",
        "--methods",
        dest="methods",
        default=",".join(PAPER_TEST1),
        help="comma-separated (default: the paper's eight)",
    )
    p.add_argument("--local-steps", type=common.positive_int, default=1, help="K local steps (paper Test 1: 1)")
    p.add_argument(
        "--participants", type=common.positive_int, default=None, help="clients sampled per round (default: all)"
    )
    common.add_max_ratio_arg(p, "in-process")
    p.add_argument(
        "--lr",
        type=common.positive_float,
        default=None,
        help="fix every method's learning rate (default: each method's tuned one, from the cache)",
    )
    p.add_argument(
        "--precond-codec",
        type=common.precond_codec,
        default="none",
        help="how FedPM's preconditioners travel: none, sym, fp16, bf16, lowrank:R, delta:identity, "
        "delta:topk:K, delta:rankr:R (R, K: a count or a fraction); see fedconvex/codecs.py",
    )
    p.add_argument("--out", default=None, help="output folder (default: results/superlinear-<dataset>)")
    p.add_argument(
        "--jobs",
        type=common.positive_int,
        default=min(2, os.cpu_count() or 1),
        help="worker processes; the methods' tuning runs are spread over them",
    )
    p.add_argument("--no-cache", action="store_true", help="re-tune even if the chosen lr is cached")
    p.add_argument(
        "--cache",
        default=None,
        help=f"tuning cache written and read (default: $FEDPM_TUNING_CACHE or {DEFAULT_CACHE}, read over the "
        "shipped reference/tuning.json; a --cache given here is read alone)",
    )
    common.add_quiet_arg(p)
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in REGISTRY]
    if unknown or not methods:
        p.error(f"unknown method(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(sorted(REGISTRY))}")
    args.methods = methods
    common.refuse_foreign(p, REGISTRY, methods, args, ("precond_codec", "local_steps"))
    common.check_max_ratio(p, args)
    if args.out is None:
        stem = os.path.splitext(os.path.basename(args.dataset))[0]
        args.out = os.path.join("results", f"superlinear-{stem}")
    common.check_problem_args(p, args)
    if args.participants is not None:
        paper = paper_split_sizes(args.dataset)
        clients = args.clients or (paper[0] if paper else 10)  # as common.build_split chooses
        if args.participants > clients:
            p.error(
                f"--participants {args.participants} exceeds the {clients} clients"
                + (" (--clients)" if args.clients else "")
            )
    # the shipped cache is read under the default one only: a --cache of one's own tunes afresh
    args.shipped_cache = SHIPPED_CACHE if args.cache is None else None
    if args.cache is None:
        args.cache = os.environ.get("FEDPM_TUNING_CACHE", DEFAULT_CACHE)
    if not args.no_cache:
        try:
            TuningCache.check(args.cache)
        except ValueError as exc:
            p.error(str(exc))
    common.check_out_arg(p, args.out, kind=OUTPUT)
    return args


def _gpu_name(backend: str) -> str:
    if backend != "cupy":
        return "none"
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    except Exception:  # the name is only a record: a failure to read it must not fail the run
        return "unknown"


# The problem is built once in the parent; forked workers inherit it instead of rebuilding.
_CTX: dict = {}


def _plan(method):
    """(cache key, fixed hyper-parameters, chosen ones if known) of one method."""
    c = _CTX
    fixed = {"local_steps": c["args"].local_steps}
    if c["args"].lr is not None:
        fixed["lr"] = c["args"].lr
    if c["args"].precond_codec != "none" and method == "fedpm":
        fixed["precond_codec"] = c["args"].precond_codec
    guard = {"max_ratio": c["args"].max_ratio} if c["args"].max_ratio else {}  # off: the cache keys stay as they were
    key = TuningCache.key(
        data=c["fingerprint"],
        split=c["split_desc"],
        method=method,
        fixed=fixed,
        rounds=c["args"].rounds,
        participants=c["args"].participants,
        seed=c["args"].seed,
        init=c["args"].init,
        lam=c["args"].lam,
        weighting=c["args"].weighting,
        space={k: list(v) for k, v in REGISTRY[method].search_space.items()},
        **guard,
    )
    cached = None if c["args"].no_cache else c["cache"].get(key, choices=list(candidates(method, fixed)))
    if c["args"].lr is not None:  # a fixed lr is one run, no search
        cached = fixed
    return key, fixed, cached


def _run_method(method, records=None, seconds=0.0):
    """Tune (or run with its known parameters) one method; ``records`` are its candidates' parallel runs."""
    c = _CTX
    key, fixed, cached = _plan(method)
    start = time.perf_counter()
    params, hist, trials = tune(
        c["problem"],
        method,
        fixed,
        c["theta0"],
        c["theta_star"],
        c["f_star"],
        c["args"].rounds,
        participants=c["args"].participants,
        seed=c["args"].seed,
        cached=cached,
        max_ratio=c["args"].max_ratio or None,
        records=records,
    )
    if c["args"].lr is not None:
        check_not_diverging(method, c["args"].lr, hist, c["f_star"])
    return method, key, params, hist, trials, cached is not None, seconds + time.perf_counter() - start


def _run_candidate(method, i):
    """Worker: candidate ``i`` of ``method``'s grid, raced against the finished scores of the candidates
    before it (shared with the other workers as they finish: see tuning.tune on why this is the same race)."""
    c = _CTX
    start = time.perf_counter()
    scores = c["scores"][method]

    def best():
        return min(scores[:i], default=math.inf) + PARALLEL_SLACK

    rec = race_candidate(
        c["problem"],
        method,
        c["candidates"][method][i],
        c["theta0"],
        c["theta_star"],
        c["f_star"],
        c["args"].rounds,
        best,
        participants=c["args"].participants,
        seed=c["args"].seed,
        max_ratio=c["args"].max_ratio or None,
        initial_gap=c["initial_gap"],
    )
    if rec["hist"] is not None:
        scores[i] = run_score(rec["hist"], score_floor(c["f_star"]))
    return method, i, rec, time.perf_counter() - start


# rough share of Test 1's work per method (w8a, a9a): the scheduler starts the costliest first
COST_RANK = ("fedns", "localnewton", "fedadam", "fedavgm", "fedpm", "fednl", "scaffold", "fedavg")


def worker_pool(jobs: int) -> ProcessPoolExecutor:
    """``jobs`` forked workers that Ctrl-C interrupts only inside a task (``interruptible``).  A terminal sends
    SIGINT to the whole process group: a worker waiting for its next task would die of it with a traceback on
    stderr, while the command itself stops with one line (common.run_command)."""
    return ProcessPoolExecutor(
        jobs, mp_context=mp.get_context("fork"), initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)
    )


def interruptible(fn, *args):
    """Worker: ``fn(*args)`` with Ctrl-C raised as KeyboardInterrupt (the task's exception, sent to the command)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return fn(*args)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _race_in_pool(jobs, methods, bar):
    """Every method's tuning as candidate runs over ``jobs`` worker processes, all busy to the end.

    A method's candidates are started in the grid's order, each once the one before has finished (so it
    is raced against every earlier score, as in the sequential race), the costliest method first; a worker
    with nothing else to do starts a method's next candidate early (it learns the earlier scores while it
    runs).  A cached or fixed method is one task.  Each method is then settled here by ``tune`` from its
    records, which gives exactly the sequential race's result (see tuning.tune)."""
    c = _CTX
    plans = {m: _plan(m) for m in methods}
    grid = {m: list(candidates(m, fixed)) for m, (_, fixed, cached) in plans.items() if cached is None}
    # shared before the workers fork: a candidate's score, +inf until its run has ended
    c.update(
        candidates=grid,
        initial_gap=abs(c["problem"].value(c["theta0"]) - c["f_star"]),
        scores={m: mp.get_context("fork").RawArray("d", [math.inf] * len(g)) for m, g in grid.items()},
    )
    ranked = sorted(methods, key=lambda m: COST_RANK.index(m) if m in COST_RANK else len(COST_RANK))
    total = {m: len(grid[m]) if m in grid else 1 for m in methods}
    started, running = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0)
    records, seconds = {m: {} for m in grid}, dict.fromkeys(methods, 0.0)
    results, in_flight, warm = {}, set(), False

    def next_method():
        waiting = [m for m in ranked if started[m] < total[m]]
        ready = [m for m in waiting if not running[m]]
        return (ready or waiting or [None])[0]

    with worker_pool(jobs) as pool:
        while True:
            while len(in_flight) < jobs and (m := next_method()) is not None:
                i = started[m]
                task = (_run_candidate, m, i) if m in grid else (_run_method, m)
                in_flight.add(pool.submit(interruptible, *task))
                started[m] += 1
                running[m] += 1
            if not in_flight:
                break
            if not warm:  # the workers are busy: plotting's imports now cost this process half their time
                report.import_pyplot()
                warm = True
            done, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
            for fut in done:
                res = fut.result()
                m = res[0]
                running[m] -= 1
                if m not in grid:
                    results[m] = res
                else:
                    records[m][res[1]] = res[2]
                    seconds[m] += res[3]
                    if len(records[m]) < total[m]:
                        continue
                    results[m] = _run_method(m, records[m], seconds[m])  # settles the race, runs nothing new
                bar.update(1, f"{m} {results[m][6]:.1f}s")
    return results


def check_not_diverging(method, lr, hist, f_star):
    """A fixed --lr whose gap grows by the tuner's divergence factor is an error, not a result."""
    start = max(hist[0]["f_gap"], score_floor(f_star))
    worst = max(r["f_gap"] for r in hist)
    if not math.isfinite(worst) or worst > DIVERGENCE_FACTOR * start:
        raise Diverged(
            f"{method} diverged with --lr {lr:g}: |f - f*| grew from {hist[0]['f_gap']:.3g} to "
            f"{worst:.3g}; choose a smaller --lr"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    with common.holding_out(PROG, args.out, OUTPUT):  # two runs never write one --out
        return run(args, argv)


def run(args, argv) -> int:
    t0 = time.perf_counter()
    try:
        problem, ds, theta_star, f_star, gnorm, theta0 = common.build_problem(args)
        if args.participants is not None and args.participants > problem.n_clients:
            raise ValueError(f"--participants {args.participants} exceeds the {problem.n_clients} clients")
    except common.USER_ERRORS as exc:
        common.fail(PROG, exc)
    desc = problem.describe()
    split_desc = {
        "split": args.split,
        "clients": problem.n_clients,
        "per_client": int(problem.counts[0]) if args.split != "dirichlet" else None,
        "alpha": args.alpha if args.split == "dirichlet" else None,
    }
    _CTX.update(
        args=args,
        problem=problem,
        theta0=theta0,
        theta_star=theta_star,
        f_star=f_star,
        fingerprint=common.dataset_fingerprint(args.dataset),
        split_desc=split_desc,
        cache=TuningCache(None if args.no_cache else args.cache, args.shipped_cache),
    )
    bar = Progress(len(args.methods), "methods", enabled=not args.quiet)
    results = {}
    try:
        jobs = args.jobs
        if jobs > 1 and "fork" in mp.get_all_start_methods() and args.backend == "numpy":
            # a pool that notices a worker killed from outside (BrokenProcessPool), unlike mp.Pool
            results = _race_in_pool(jobs, args.methods, bar)
        else:
            for m in args.methods:
                results[m] = _run_method(m)
                bar.update(1, f"{m} {results[m][6]:.1f}s")
    except BrokenProcessPool:
        common.fail(PROG, RuntimeError("a worker process ended abnormally (killed?); nothing was written"))
    except common.USER_ERRORS as exc:
        common.fail(PROG, exc)
    cache = TuningCache(None if args.no_cache else args.cache, args.shipped_cache)
    histories, methods = {}, {}
    for m in args.methods:
        _, key, params, hist, trials, was_cached, _ = results[m]
        if not was_cached and args.lr is None:
            try:
                cache.put(key, params)
            except OSError as exc:
                common.fail(PROG, OSError(f"--cache {args.cache}: cannot be written ({exc.strerror or exc})"))
        histories[m] = hist
        summ = report.method_summary(REGISTRY[m].label, params, hist, trials, was_cached)
        summ["f_gap_str"], summ["dist_str"] = f"{summ['final_f_gap']:.2e}", f"{summ['final_dist']:.2e}"
        methods[m] = summ
    command = "python -m validation.superlinear " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    summary = {
        "dataset": args.dataset,
        "source": ds.source,
        **desc,
        "per_client": split_desc["per_client"],
        "split": args.split,
        "f_star": f_star,
        "theta_star_grad_norm": gnorm,
        "init": args.init,
        "seed": args.seed,
        "rounds": args.rounds,
        "local_steps": args.local_steps,
        "participants": args.participants or problem.n_clients,
        "backend": args.backend,
        "precond_codec": args.precond_codec,
        "command": command.strip(),
        "wall_seconds": None,
        "versions": {"python": platform.python_version(), "numpy": np.__version__},
        **common.provenance(_gpu_name(args.backend)),
        "methods": methods,
    }
    title = (
        f"{args.dataset}: N={problem.n_clients}, d={problem.d}, lam={args.lam:g}, K={args.local_steps}, "
        f"T={args.rounds}, init={args.init}"
    )
    try:
        with report.AtomicDir(args.out, OUTPUT) as tmp, report.writing(f"--out {args.out}"):
            report.write_history(os.path.join(tmp, "history.csv"), histories)
            report.plot_convergence(
                histories,
                {m: REGISTRY[m].label for m in histories},
                title,
                os.path.join(tmp, "convergence"),
                f_star=f_star,
            )
            summary["wall_seconds"] = time.perf_counter() - t0
            report.dump_json(
                os.path.join(tmp, "summary.json"),
                {
                    **summary,
                    "methods": {m: {k: v for k, v in s.items() if not k.endswith("_str")} for m, s in methods.items()},
                },
            )
    except (OSError, OutputError) as exc:
        common.fail(PROG, exc)
    print(f"{title}   f* = {f_star:.12g}")
    print(report.format_table(summary))
    print(f"\nwrote {args.out}/history.csv, summary.json, convergence.png/.pdf in {summary['wall_seconds']:.1f}s")
    print(f"reproduce: {summary['command']}")
    return 0


if __name__ == "__main__":
    common.keep_freed_memory()  # as a command only: the workers fork from here and inherit it
    sys.exit(common.run_command(PROG, main))
