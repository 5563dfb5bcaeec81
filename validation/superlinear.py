"""Paper Test 1: FL methods on L2 logistic regression, K local steps, T rounds.

    python -m validation.superlinear --dataset w8a
    python -m validation.superlinear --dataset a9a --methods fedpm,fednl --rounds 20

Writes history.csv, summary.json and convergence.{png,pdf} into --out (default
results/superlinear-<dataset>) and prints the summary table.  Every method's learning rate
is tuned over its log grid (cached; see validation/tuning.py) unless --lr fixes it.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import platform
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from fedconvex.algorithms import PAPER_TEST1, REGISTRY
from fedconvex.data import paper_split_sizes
from validation import common, report
from validation.progress import Progress
from fedconvex.run import Diverged
from validation.tuning import DIVERGENCE_FACTOR, TuningCache, score_floor, tune

PROG = "python -m validation.superlinear"


def parse_args(argv=None):
    p = common.OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    common.add_problem_args(p)
    p.add_argument("--rounds", type=common.positive_int, default=50)
    p.add_argument("--methods", default=",".join(PAPER_TEST1), help="comma-separated; default the paper's eight")
    p.add_argument("--local-steps", type=common.positive_int, default=1, help="K local steps (paper Test 1: 1)")
    p.add_argument("--participants", type=common.positive_int, default=None, help="clients sampled per round")
    p.add_argument("--max-ratio", type=common.nonneg_float, default=0.0,
                   help="server magnitude guard: reject a reply whose preconditioner trace or parameter norm exceeds "
                        "R x the round's median (default 0 = off, as in the paper's runs)")
    p.add_argument("--lr", type=common.positive_float, default=None, help="fix every method's learning rate")
    p.add_argument("--precond-codec", type=common.precond_codec, default="none",
                   help="how FedPM's preconditioners travel: none, sym, fp16, bf16, lowrank:R, delta:identity, "
                        "delta:topk:K, delta:rankr:R (R, K: a count or a fraction); see fedconvex/codecs.py")
    p.add_argument("--out", default=None, help="output folder (default results/superlinear-<dataset>)")
    p.add_argument("--jobs", type=common.positive_int, default=min(2, os.cpu_count() or 1),
                   help="methods run in parallel worker processes")
    p.add_argument("--no-cache", action="store_true", help="re-tune even if the chosen lr is cached")
    p.add_argument("--cache", default=os.environ.get("FEDPM_TUNING_CACHE", os.path.join("results", ".cache", "tuning.json")))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in REGISTRY]
    if unknown or not methods:
        p.error(f"unknown method(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(sorted(REGISTRY))}")
    args.methods = methods
    if args.out is None:
        stem = os.path.splitext(os.path.basename(args.dataset))[0]
        args.out = os.path.join("results", f"superlinear-{stem}")
    common.check_problem_args(p, args)
    if args.participants is not None:
        paper = paper_split_sizes(args.dataset)
        clients = args.clients or (paper[0] if paper else 10)   # as common.build_split chooses
        if args.participants > clients:
            p.error(f"--participants {args.participants} exceeds the {clients} clients"
                    + (" (--clients)" if args.clients else ""))
    if not args.no_cache and (os.path.isdir(args.cache) or (os.path.lexists(args.cache) and not os.path.isfile(args.cache))):
        p.error(f"--cache {args.cache}: is not a regular file; give a JSON file path (or --no-cache)")
    common.check_out_arg(p, args.out)
    return args


# The problem is built once in the parent; forked workers inherit it instead of rebuilding.
_CTX: dict = {}


def _run_method(method):
    c = _CTX
    fixed = {"local_steps": c["args"].local_steps}
    if c["args"].lr is not None:
        fixed["lr"] = c["args"].lr
    if c["args"].precond_codec != "none" and method == "fedpm":
        fixed["precond_codec"] = c["args"].precond_codec
    guard = {"max_ratio": c["args"].max_ratio} if c["args"].max_ratio else {}   # off: the cache keys stay as they were
    key = TuningCache.key(data=c["fingerprint"], split=c["split_desc"], method=method, fixed=fixed,
                          rounds=c["args"].rounds, participants=c["args"].participants, seed=c["args"].seed,
                          init=c["args"].init, lam=c["args"].lam, weighting=c["args"].weighting,
                          space={k: list(v) for k, v in REGISTRY[method].search_space.items()}, **guard)
    cached = None if c["args"].no_cache else c["cache"].get(key)
    start = time.perf_counter()
    if c["args"].lr is not None:  # a fixed lr is one run, no search
        cached = fixed
    params, hist, trials = tune(c["problem"], method, fixed, c["theta0"], c["theta_star"], c["f_star"],
                                c["args"].rounds, participants=c["args"].participants, seed=c["args"].seed,
                                cached=cached, max_ratio=c["args"].max_ratio or None)
    if c["args"].lr is not None:
        check_not_diverging(method, c["args"].lr, hist, c["f_star"])
    return method, key, params, hist, trials, cached is not None, time.perf_counter() - start


def check_not_diverging(method, lr, hist, f_star):
    """A fixed --lr whose gap grows by the tuner's divergence factor is an error, not a result."""
    start = max(hist[0]["f_gap"], score_floor(f_star))
    worst = max(r["f_gap"] for r in hist)
    if not math.isfinite(worst) or worst > DIVERGENCE_FACTOR * start:
        raise Diverged(f"{method} diverged with --lr {lr:g}: |f - f*| grew from {hist[0]['f_gap']:.3g} to "
                       f"{worst:.3g}; choose a smaller --lr")


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        problem, ds, theta_star, f_star, gnorm, theta0 = common.build_problem(args)
        if args.participants is not None and args.participants > problem.n_clients:
            raise ValueError(f"--participants {args.participants} exceeds the {problem.n_clients} clients")
    except common.USER_ERRORS as exc:
        common.fail(PROG, exc)
    desc = problem.describe()
    split_desc = {"split": args.split, "clients": problem.n_clients,
                  "per_client": int(problem.counts[0]) if args.split != "dirichlet" else None,
                  "alpha": args.alpha if args.split == "dirichlet" else None}
    _CTX.update(args=args, problem=problem, theta0=theta0, theta_star=theta_star, f_star=f_star,
                fingerprint=common.dataset_fingerprint(args.dataset), split_desc=split_desc,
                cache=TuningCache(None if args.no_cache else args.cache))
    bar = Progress(len(args.methods), "methods", enabled=not args.quiet)
    results = {}
    try:
        jobs = min(args.jobs, len(args.methods))
        if jobs > 1 and "fork" in mp.get_all_start_methods() and args.backend == "numpy":
            # a pool that notices a worker killed from outside (BrokenProcessPool), unlike mp.Pool
            with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
                # the slowest methods first so the two workers finish together
                cost = {"fedns": 0, "fednl": 1, "localnewton": 2, "fedadam": 3, "fedavgm": 4}
                order = sorted(args.methods, key=lambda m: cost.get(m, 9))
                for fut in as_completed([pool.submit(_run_method, m) for m in order]):
                    res = fut.result()
                    results[res[0]] = res
                    bar.update(1, f"{res[0]} {res[6]:.1f}s")
        else:
            for m in args.methods:
                results[m] = _run_method(m)
                bar.update(1, f"{m} {results[m][6]:.1f}s")
    except BrokenProcessPool:
        common.fail(PROG, RuntimeError("a worker process ended abnormally (killed?); nothing was written"))
    except common.USER_ERRORS as exc:
        common.fail(PROG, exc)
    cache = TuningCache(None if args.no_cache else args.cache)
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
    command = "python -m validation.superlinear " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    summary = {"dataset": args.dataset, "source": ds.source, **desc, "per_client": split_desc["per_client"],
               "split": args.split, "f_star": f_star, "theta_star_grad_norm": gnorm, "init": args.init,
               "seed": args.seed, "rounds": args.rounds, "local_steps": args.local_steps,
               "participants": args.participants or problem.n_clients, "backend": args.backend,
               "precond_codec": args.precond_codec,
               "command": command.strip(), "wall_seconds": None,
               "versions": {"python": platform.python_version(), "numpy": np.__version__},
               "methods": methods}
    title = (f"{args.dataset}: N={problem.n_clients}, d={problem.d}, lam={args.lam:g}, K={args.local_steps}, "
             f"T={args.rounds}, init={args.init}")
    try:
        with report.AtomicDir(args.out) as tmp:
            report.write_history(os.path.join(tmp, "history.csv"), histories)
            report.plot_convergence(histories, {m: REGISTRY[m].label for m in histories}, title,
                                    os.path.join(tmp, "convergence"), f_star=f_star)
            summary["wall_seconds"] = time.perf_counter() - t0
            report.dump_json(os.path.join(tmp, "summary.json"),
                             {**summary, "methods": {m: {k: v for k, v in s.items() if not k.endswith("_str")}
                                                     for m, s in methods.items()}})
    except OSError as exc:
        common.fail(PROG, exc)
    print(f"{title}   f* = {f_star:.12g}")
    print(report.format_table(summary))
    print(f"\nwrote {args.out}/history.csv, summary.json, convergence.png/.pdf in {summary['wall_seconds']:.1f}s")
    print(f"reproduce: {summary['command']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
