"""Benchmark: FedPM rounds on w8a (142 clients, exact Hessians, float64).

    python -m validation.bench_convex            # table
    python -m validation.bench_convex --json     # {"seconds_per_round", "seconds_to_1e-9", "loop_ratio", ...}
    python -m validation.bench_convex --all-methods [--json]   # plus every method, see below
    python -m validation.bench_convex --device cuda            # the same on a GPU (CuPy arrays)

Measured in one run, on this machine:
  * seconds_per_round: median wall time of a FedPM (K=1, lr=1) round from the paper's theta0,
                       including the server's screening of every reply (PSD check of 142 blocks);
                       seconds_per_round_without_screening beside it;
  * seconds_to_1e-9:   wall time of the rounds from theta = 0 until ||grad f|| <= 1e-9;
  * loop_ratio:        (straightforward per-client Python loop, dense NumPy) / ours, per round,
                       for the same algorithm from the same point (the loop is also checked to
                       reach the same parameters).  The loop gets its best BLAS thread setting.

--all-methods adds, per method (second-order ones with each FedNL compressor and each FedNS sketch,
first-order ones for reference): seconds_per_round (median, from the paper's theta0, screening on),
round_vs_fedpm (that / FedPM's median round measured alternately with it, ``ALTERNATIONS`` runs each, given as
fedpm_seconds_per_round_beside), and seconds_to_1e-9 / rounds_to_1e-9 from theta = 0 within
``MAX_ROUNDS`` rounds and ``TIME_CAP`` seconds (null where the method does not get there; "diverged"
where it blows up; final_grad_norm says how far it got).
Every run pins BLAS to one thread (fedconvex.run does), so the numbers are per core.  With
``--device cuda`` our rounds run on the GPU (each round synchronised before its clock stops); the
naive loop stays the host NumPy loop, so loop_ratio there compares a GPU round with the CPU loop.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from fedconvex.algorithms import make_algorithm
from fedconvex.data import BUNDLED, load_dataset, paper_split_sizes, sequential_split
from fedconvex.problem import DEFAULT_LAM, FederatedLogReg
from fedconvex.reference import initial_point, solve_optimum
from fedconvex.run import Diverged, run
from validation.progress import Progress

MAX_ROUNDS = 40
ALTERNATIONS = 2  # runs of a method's rounds, each followed by a run of FedPM's, for its round_vs_fedpm
TIME_CAP = 10.0  # seconds of rounds after which a method's run from theta = 0 is given up


def all_methods(d):
    """(label, method, parameters): each FedNL compressor at its usual setting (unbiased ones with
    alpha = 1/(omega + 1)), each FedNS sketch at the paper's k = d."""
    n_up = d * (d + 1) // 2
    return [
        ("FedPM", "fedpm", {}),
        ("Newton (centralized)", "newton", {}),
        ("LocalNewton", "localnewton", {}),
        ("FedNL identity", "fednl", {}),
        ("FedNL Rank-1", "fednl", {"compressor": "rankr", "rank": 1}),
        ("FedNL Top-K (k=d)", "fednl", {"compressor": "topk", "k": d}),
        ("FedNL TopLEK (k=d)", "fednl", {"compressor": "toplek", "k": d}),
        ("FedNL Rand-K (k=d)", "fednl", {"compressor": "randk", "k": d, "alpha": d / n_up}),
        ("FedNL RandSeqK (k=d)", "fednl", {"compressor": "randseqk", "k": d, "alpha": d / n_up}),
        ("FedNL Natural", "fednl", {"compressor": "natural", "alpha": 8 / 9}),
        ("FedNL-LS identity", "fednl-ls", {}),
        ("FedNL-LS Rank-1", "fednl-ls", {"compressor": "rankr", "rank": 1}),
        ("FedNL-PP identity (all clients)", "fednl-pp", {}),
        ("FedNS Gaussian", "fedns", {}),
        ("FedNS Gaussian (Bartlett draw)", "fedns", {"gaussian_draw": "bartlett"}),
        ("FedNS SRHT", "fedns", {"sketch": "srht"}),
        ("FedNS CountSketch", "fedns", {"sketch": "countsketch"}),
        ("FedAvg", "fedavg", {"lr": 100.0}),
        ("SCAFFOLD", "scaffold", {"lr": 100.0}),
    ]


def _round_times(problem, alg, theta0, rounds, **kw):
    """Wall seconds of each round of a run (the run loop's own clock, metrics excluded)."""
    _, h = run(problem, alg, theta0, rounds, **kw)
    return [h[t]["seconds"] - h[t - 1]["seconds"] for t in range(1, len(h))]


def _measure_method(problem, alg, theta0, zero, fedpm, rounds, row):
    # the method's rounds alternate with FedPM's (ALTERNATIONS runs of each, back to back), and the ratio is
    # against those FedPM rounds: a machine that drifts during the minutes of the table (clock, cache, other
    # load) moves both sides of each ratio alike
    try:
        mine, theirs = [], []
        for _ in range(ALTERNATIONS):
            mine += _round_times(problem, alg, theta0, rounds)
            theirs += _round_times(problem, fedpm, theta0, rounds)
        row["seconds_per_round"] = statistics.median(mine)
        row["fedpm_seconds_per_round_beside"] = statistics.median(theirs)
        row["round_vs_fedpm"] = row["seconds_per_round"] / row["fedpm_seconds_per_round_beside"]
    except Diverged:
        row["seconds_per_round"] = row["round_vs_fedpm"] = None
    try:
        _, h0 = run(problem, alg, zero, MAX_ROUNDS, stop=lambda r: r["grad_norm"] <= 1e-9 or r["seconds"] > TIME_CAP)
        ok = h0[-1]["grad_norm"] <= 1e-9
        row["seconds_to_1e-9"] = h0[-1]["seconds"] if ok else None
        row["rounds_to_1e-9"] = h0[-1]["round"] if ok else None
        row["final_grad_norm"] = h0[-1]["grad_norm"]
    except Diverged:
        row["seconds_to_1e-9"] = row["rounds_to_1e-9"] = None
        row["final_grad_norm"] = "diverged"


def measure_all(problem, theta0, rounds=5, quiet=True):
    """Per method: median seconds per round from theta0 (and FedPM's, measured alternately with it), and
    seconds from 0 to ||grad f|| <= 1e-9."""
    zero = problem.to_backend(np.zeros(problem.d))
    fedpm = make_algorithm("fedpm", lr=1.0, local_steps=1)
    rows = []
    methods = all_methods(problem.d)
    bar = Progress(len(methods), "methods", enabled=not quiet, unit="method")
    for label, name, params in methods:
        alg = make_algorithm(name, **params)
        row = {"label": label, "method": name, "params": params}
        try:
            _measure_method(problem, alg, theta0, zero, fedpm, rounds, row)
        except Exception as exc:  # one method failing on a backend must not hide the others' numbers
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"bench_convex: {label} failed: {row['error']}", file=sys.stderr)
        rows.append(row)
        bar.update(1, label)
    return rows


def naive_fedpm_round(Xs, ys, theta, lam, lr=1.0):
    """FedPM K=1 as a user would first write it: one dense client at a time."""
    d = theta.shape[0]
    Ps, thetas = [], []
    for X, y in zip(Xs, ys, strict=False):
        m = y * (X @ theta)
        sig = 1.0 / (1.0 + np.exp(-m))
        g = X.T @ (-y * (1.0 - sig)) / len(y) + lam * theta
        P = X.T @ (X * (sig * (1 - sig))[:, None]) / len(y) + lam * np.eye(d)
        thetas.append(theta - lr * np.linalg.solve(P, g))
        Ps.append(P)
    Pbar = sum(Ps) / len(Ps)
    rhs = sum(P @ t for P, t in zip(Ps, thetas, strict=False)) / len(Ps)
    return np.linalg.solve(Pbar, rhs)


def measure(dataset="w8a", rounds=8, naive_rounds=3, all_methods=False, backend="numpy", seed=0, quiet=True):
    from fedconvex.backend import get_backend
    from validation.common import check_fits

    xp = get_backend(backend)
    ds = load_dataset(dataset)
    check_fits(ds, dataset)
    n_clients, per_client = paper_split_sizes(dataset) or (10, ds.n // 10)
    parts = sequential_split(ds.n, n_clients, per_client)
    problem = FederatedLogReg(ds.X, ds.y, parts, lam=DEFAULT_LAM, xp=xp)
    theta_star, f_star, _ = solve_optimum(problem)
    theta0 = initial_point(problem, theta_star, "paper", seed=seed)
    alg = make_algorithm("fedpm", lr=1.0, local_steps=1)

    # per-round time (the run loop's own clock excludes metric evaluation); with the server's
    # screening of client replies (default) and without it
    def median_round(**kw):
        return statistics.median(_round_times(problem, alg, theta0, rounds, **kw))

    per_round = median_round()
    per_round_unscreened = median_round(screen=False)

    # theta = 0 to ||grad f|| <= 1e-9
    zero = problem.to_backend(np.zeros(problem.d))
    _, hist0 = run(problem, alg, zero, 30, stop=lambda row: row["grad_norm"] <= 1e-9)
    reached = hist0[-1]["grad_norm"] <= 1e-9
    to_tolerance = hist0[-1]["seconds"] if reached else float("nan")

    # the straightforward loop, same start, same algorithm
    Xs = [ds.X[p].toarray() for p in parts]
    ys = [ds.y[p] for p in parts]
    best_naive = float("inf")
    for threads in (1, 2):
        with threadpool_limits(limits=threads, user_api="blas"):
            theta, times = problem.to_host(theta0), []
            for _ in range(naive_rounds):
                start = time.perf_counter()
                theta = naive_fedpm_round(Xs, ys, theta, problem.lam)
                times.append(time.perf_counter() - start)
        best_naive = min(best_naive, statistics.median(times))
    ours_theta = problem.to_host(run(problem, alg, theta0, naive_rounds)[0].theta)
    agree = float(np.linalg.norm(ours_theta - theta) / np.linalg.norm(theta))
    extra = {}
    if all_methods:
        extra["methods"] = measure_all(problem, theta0, quiet=quiet)
        extra["max_rounds_to_1e-9"] = MAX_ROUNDS
    return {
        **extra,
        "dataset": dataset,
        "clients": n_clients,
        "per_client": per_client,
        "d": problem.d,
        "seconds_per_round": per_round,
        "seconds_per_round_without_screening": per_round_unscreened,
        "seconds_to_1e-9": to_tolerance,
        "rounds_to_1e-9": hist0[-1]["round"],
        "naive_seconds_per_round": best_naive,
        "loop_ratio": best_naive / per_round,
        "naive_vs_ours_relative_difference": agree,
        "blas_threads": 1,
        "backend": backend,
        "device": _device_name(xp),
        "command": "python -m validation.bench_convex"
        + (f" --dataset {dataset}" if dataset != "w8a" else "")
        + (" --device cuda" if backend != "numpy" else "")
        + (f" --seed {seed}" if seed else "")
        + (" --all-methods" if all_methods else ""),
    }


def _device_name(xp) -> str:
    if xp is np:
        return f"cpu ({os.cpu_count()} cores)"
    try:
        return xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # an unknown CuPy build: name the library instead
        return xp.__name__


def main(argv=None) -> int:
    from validation.common import (
        DEFAULT_LIBSVM,
        USER_ERRORS,
        OneLineParser,
        add_convex_device_args,
        add_quiet_arg,
        add_seed_arg,
        convex_backend,
        fail,
    )

    prog = "python -m validation.bench_convex"
    p = OneLineParser(prog=prog, doc=__doc__)
    p.add_argument("--dataset", default=DEFAULT_LIBSVM, help=f"bundled name ({', '.join(BUNDLED)}) or a LibSVM file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--all-methods", action="store_true", help="also time every method (see the module doc)")
    add_convex_device_args(p)
    add_seed_arg(p)
    add_quiet_arg(p)
    args = p.parse_args(argv)
    if args.dataset not in BUNDLED and not os.path.isfile(args.dataset):
        p.error(f"--dataset {args.dataset}: neither a bundled dataset ({', '.join(BUNDLED)}) nor a file")
    try:
        backend = convex_backend(args.device)
        r = measure(args.dataset, all_methods=args.all_methods, backend=backend, seed=args.seed, quiet=args.quiet)
    except USER_ERRORS as exc:
        fail(prog, exc)
    # a method that failed (its row has "error") makes the run fail too, after every number is printed
    failed = 1 if any("error" in m for m in r.get("methods", ())) else 0
    if args.json:
        print(json.dumps(r))
        return failed
    print(
        f"FedPM on {r['dataset']}: {r['clients']} clients x {r['per_client']} rows, d={r['d']}, exact Hessians, "
        f"float64, {r['backend']} on {r['device']}"
    )
    print(
        f"  seconds per round (median)        {r['seconds_per_round']:.4f} s   ("
        f"{r['seconds_per_round_without_screening']:.4f} s without screening the replies)"
    )
    print(f"  theta=0 -> ||grad f|| <= 1e-9      {r['seconds_to_1e-9']:.3f} s in {r['rounds_to_1e-9']} rounds")
    print(f"  naive per-client loop per round   {r['naive_seconds_per_round']:.4f} s")
    print(
        f"  loop_ratio (naive / ours)         {r['loop_ratio']:.1f}x   (same iterates: rel. diff "
        f"{r['naive_vs_ours_relative_difference']:.1e})"
    )
    if "methods" in r:
        print(
            f"\n  {'method':34s} {'s/round':>9s} {'x FedPM':>8s} {'s to 1e-9':>10s} {'rounds':>6s} {'last |grad|':>11s}"
            f"   (from theta=0, <= {r['max_rounds_to_1e-9']} rounds)"
        )
        for m in r["methods"]:

            def f(v, fmt):
                return "-" if v is None else format(v, fmt)

            if "error" in m:
                print(f"  {m['label']:34s} failed: {m['error']}")
                continue
            last = m.get("final_grad_norm")
            last = (
                f"{last:11.1e}" if isinstance(last, float) else f"{last or '-':>11s}"
            )  # how far it got, or "diverged"
            print(
                f"  {m['label']:34s} {f(m.get('seconds_per_round'), '9.4f')} {f(m.get('round_vs_fedpm'), '8.2f')} "
                f"{f(m.get('seconds_to_1e-9'), '10.3f')} {f(m.get('rounds_to_1e-9'), '6d')} {last}"
            )
    print(f"reproduce: {r['command']}")
    return failed


if __name__ == "__main__":
    from validation.common import run_command

    sys.exit(run_command("python -m validation.bench_convex", main))
