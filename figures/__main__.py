"""Draw every figure and table of the paper from saved results.

    make figures                               # the quick profile's figures from the runs that exist (seconds)
    make figures COMPUTE=1 DATA=DIR            # first compute its missing runs (CPU; its time: docs/sweeps.md)
    make figures PROFILE=paper COMPUTE=1 BUDGET=9  # at most 9 minutes of computing, then the figures of what exists
    python -m figures --profile quick [--compute --data-dir DATA]

Results come from results/<profile>/ (validation/experiments.py lists the runs), where the runs shipped in
reference/<profile>/ are copied first if missing.  Nothing is computed unless --compute is given: the runs still
missing are named, with the command that computes them, and a figure whose data is missing is skipped with a
message.  Output: figures/out/<profile>/*.png|pdf, tables also as .md and .tex.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from fedconvex.files import DamagedFile, FolderSwapped, held_folder, hidden_cause
from validation.common import OneLineParser, check_out_arg, fail
from validation.experiments import (
    DNN_METHODS,
    PROFILES,
    add_run_args,
    add_sweep_args,
    check_profile_folder,
    check_results_arg,
    check_run_args,
    ensure_from_args,
    femnist_plan,
    is_done,
    plan,
    seed_from_reference,
    shipped_runs,
)
from validation.outputs import TEMP_MARKER, Kind, OutputError, check_out, clean_stale, exclusive, mark, temp_folder

from . import compression, draw
from .results import best_by_seed, read_history, read_summary, runs_matching
from .tables import (
    LABELS,
    PAPER,
    PAPER_SEEDS,
    accuracy_table,
    max_pvalue,
    mean_std,
    pvalues,
    to_latex,
    to_markdown,
    versus_paper,
)

PROG = "python -m figures"
OUTPUT = Kind(PROG, ("*.png", "*.pdf", "*.md", "*.tex"))  # what a run writes into --out
BANDWIDTH = 1e9 / 8  # bytes/s of the 1 Gbit/s link used to turn bytes into communication time
# the paper's FEMNIST table (tab:femnist): best test accuracy [%], mean and std over 3 seeds, all 3,597 writers
PAPER_FEMNIST = {
    "fedavg": (75.83, 1.90),
    "fedavgm": (78.46, 0.82),
    "fedprox": (76.42, 0.43),
    "scaffold": (78.30, 2.72),
    "fedadam": (76.85, 1.46),
    "localnewton": (77.36, 1.12),
    "fedpm": (79.21, 1.69),
}


PEAK_NOTE = (
    ". Peak memory: the process's peak resident memory in a round on a CPU (the allocator's peak on a GPU), the most"
    " over seeds, the first round apart from the later ones: FedPM's first round on the vectorized engine peaks far"
    " above its steady state, which a maximum over all rounds would hide"
)


def peaks(folders) -> str:
    """'first / later': the most peak memory (MB) of round 1 and of the rounds after it over the runs' histories
    (the vectorized engine's first round is over twice its later ones on a CPU: a maximum over all rounds would
    show the one-time cost alone)."""
    first, later = [], []
    for f in folders:
        h = read_history(f)
        mb = h["peak_memory_mb"]
        first += list(mb[:1])
        later += list(mb[1:])
    return f"{max(first):.0f} / {max(later):.0f}" if later else (f"{max(first):.0f}" if first else "–")


def write_table(out, stem, header, rows, caption, label):
    with open(os.path.join(out, f"{stem}.md"), "w") as fh:
        fh.write(to_markdown(header, rows, caption))
    with open(os.path.join(out, f"{stem}.tex"), "w") as fh:
        fh.write(to_latex(header, rows, caption, label))
    draw.table_figure(header, rows, caption, out, stem)
    return [os.path.join(out, f"{stem}.{e}") for e in ("md", "tex", "png", "pdf")]


def incomplete(root, profile, prefix, log=print) -> str:
    """'' when every run of the profile's plan named ``prefix``* is done under ``root``; else a caption note
    saying how many are missing (a table drawn from part of its runs must say so), also logged."""
    if profile not in PROFILES:
        return ""
    runs = [r for r in plan(profile) if r.name.startswith(prefix)]
    missing = [r.name for r in runs if not is_done(r, os.path.join(root, r.name))]
    if not missing:
        return ""
    log(f"{prefix}* tables drawn from {len(runs) - len(missing)} of {len(runs)} runs; missing e.g. {missing[0]}")
    return (
        f" — INCOMPLETE: {len(missing)} of the profile's {len(runs)} runs missing (e.g. {missing[0]}; "
        "python -m validation.experiments --list)"
    )


def versus_paper_table(root, out, note="", profile=None) -> list:
    """Table 3 and FEMNIST's table from whatever runs exist, beside the paper's values (figures.tables.versus_paper):
    seeds counted against the profile's own, gaps in the paper's σ only for a profile in the paper's setting;
    [] when there are no main-* runs."""
    columns = {key: best_by_seed(root, f"main-{key}", DNN_METHODS) for key in PAPER}
    if not any(columns.values()):
        return []
    setting = PROFILES.get(profile, {})
    seeds = len(setting.get("seeds", ())) or PAPER_SEEDS
    gaps = setting.get("papers_setting", profile not in PROFILES)
    header, rows = versus_paper(columns, DNN_METHODS, seeds=seeds, gaps=gaps)
    caption = (
        "Best test accuracy [%], ours (mean ± std over the seeds present) beside the paper's Table 3 and FEMNIST table"
        + (
            "; gap = (ours − paper) / paper's σ"
            if gaps
            else "; no gaps in the paper's σ: these runs do not have the paper's setting"
        )
        + (f" ({note})" if note else "")
    )
    return write_table(out, "table3_vs_paper", header, rows, caption, "tab:versus_paper")


def build_all(root, out, profile, log=print):
    os.makedirs(out, exist_ok=True)
    note = PROFILES[profile]["label"] if profile in PROFILES else ""
    produced = []

    def add(paths, what):
        if paths:
            produced.extend(paths)
        else:
            log(f"skipped {what}: its results are missing under {root}")

    convex = {
        d: f
        for d in ("w8a", "a9a")
        for f in [os.path.join(root, f"superlinear-{d}")]
        if os.path.isfile(os.path.join(f, "history.csv"))
    }
    add(draw.test1(convex, out)[0] if convex else [], "the Test 1 figure")
    for ds in ("cifar10", "cifar100"):
        add(draw.test2_curves(root, ds, "0.1", out, note)[0], f"the Test 2 curves for {ds}")
    # Table 3 and the significance table
    columns, pvals = {}, []
    for ds in ("cifar10", "cifar100"):
        for alpha in ("1.0", "0.1"):
            best = best_by_seed(root, f"main-{ds}-a{alpha}", DNN_METHODS)
            if best:
                columns[f"{ds.upper()} α={alpha}"] = best
                p = max_pvalue(best)
                p_nl = max_pvalue(best, exclude=("localnewton",))
                pvals.append(
                    [
                        f"{ds.upper()}, α={alpha}",
                        "–" if p is None else f"{p:.2f}",
                        "–" if p_nl is None else f"{p_nl:.2f}",
                        str(min(len(v) for v in best.values())),
                    ]
                )
    for k in ("1", "10"):
        best = best_by_seed(root, f"epochs-{k}", DNN_METHODS)
        if len(best) > 1:
            p = max_pvalue(best)
            pvals.append(
                [
                    f"CIFAR10, {k} local epoch(s)",
                    "–" if p is None else f"{p:.2f}",
                    "–",
                    str(min(len(v) for v in best.values())),
                ]
            )
    for part in (2, 5, 8):
        best = best_by_seed(root, f"sampling-{part}", DNN_METHODS)
        if len(best) > 1:
            p = max_pvalue(best)
            pvals.append(
                [
                    f"CIFAR10, {part} participants",
                    "–" if p is None else f"{p:.2f}",
                    "–",
                    str(min(len(v) for v in best.values())),
                ]
            )
    if columns:
        header, rows = accuracy_table(columns, DNN_METHODS)
        gap = incomplete(root, profile, "main-", log)
        produced += write_table(
            out,
            "table3_accuracy",
            header,
            rows,
            "Table 3: best test accuracy [%], mean ± std over seeds" + (f" ({note})" if note else "") + gap,
            "tab:accuracy_table",
        )
        produced += write_table(
            out,
            "table_pvalues",
            ["Setting", "max p (FedPM > each)", "excl. LocalNewton", "seeds"],
            pvals,
            "Maximum one-sided Mann-Whitney U p-value of FedPM against every other method" + gap,
            "tab:p_values",
        )
    else:
        log(f"skipped Table 3 and the p-value table: no main-* results under {root}")
    produced += versus_paper_table(root, out, note, profile)
    add(draw.local_epochs(root, out, note)[0], "the local-epochs figure")
    add(draw.client_sampling(root, out, note)[0], "the client-sampling figure")
    add(draw.foof_samples(root, out, note)[0], "the FOOF sample-count figure")
    dist = {
        a: f for a in ("1.0", "0.1") for f in list(runs_matching(root, rf"main-cifar10-a{a}-fedavg-s0").values())[:1]
    }
    add(draw.data_distribution(dist, out, note)[0], "the data-distribution figure")
    # profiling table (CIFAR-10, alpha = 0.1 runs)
    prof_rows = []
    for m in DNN_METHODS:
        folders = runs_matching(root, rf"main-cifar10-a0\.1-{m}-s\d+")
        if not folders:
            continue
        sums = [read_summary(f) for f in folders.values()]
        up = sum(s["bytes_up_per_round"] for s in sums) / len(sums)
        down = sum(s["bytes_down_per_round"] for s in sums) / len(sums)
        clients = sums[0]["clients"]
        prof_rows.append(
            [
                LABELS[m],
                f"{sum(s['mean_client_seconds_per_round'] for s in sums) / len(sums):.2f}",
                f"{(up + down) / 2**20:.2f}",
                f"{clients * (up + down) / BANDWIDTH:.3f}",
                peaks(folders.values()),
            ]
        )
    if prof_rows:
        produced += write_table(
            out,
            "table_profiling",
            [
                "Method",
                "client train s/round",
                "MiB up+down per client/round",
                "comm. s/round at 1 Gbit/s",
                "peak memory MB, round 1 / later",
            ],
            prof_rows,
            "Profiling, CIFAR-10 α=0.1" + (f" ({note})" if note else "") + PEAK_NOTE,
            "tab:profiling",
        )
    else:
        log("skipped the profiling table: no main-cifar10-a0.1 results")
    # FedPM with compressed preconditioners
    produced += compression.build(root, out, write_table, note, log)
    produced += femnist_table(root, out, profile, note, log)
    return produced


def femnist_table(root, out, profile, note, log=print):
    """FEMNIST's table beside the paper's: best test accuracy over seeds and FedPM's one-sided Mann-Whitney
    p-value against each method.  Only finished runs count (a run in progress writes its summary every round)."""
    best = {}
    for r in femnist_plan(PROFILES["femnist"]):
        folder = os.path.join(root, r.name)
        if is_done(r, folder):
            best.setdefault(r.name.split("-")[1], []).append(read_summary(folder)["best_test_acc"])
    if not best:
        log(f"skipped the FEMNIST table: no femnist-* results under {root}")
        return []
    ps = pvalues(best)
    rows = []
    for m in DNN_METHODS:
        if m not in best:
            continue
        mu, sd = mean_std(best[m])
        paper = PAPER_FEMNIST[m]
        p = ps.get(m)
        rows.append(
            [
                LABELS[m],
                f"{mu:.1f} ± {sd:.1f}",
                str(len(best[m])),
                f"{paper[0]:.1f} ± {paper[1]:.1f}",
                "–" if p is None else f"{p:.2f}",
            ]
        )
    caption = (
        "FEMNIST: best test accuracy [%], mean ± std over seeds, beside the paper's (all 3,597 writers); "
        "p: one-sided Mann-Whitney U, FedPM > method" + (f" ({note})" if note else "")
    )
    return write_table(
        out,
        "table_femnist",
        ["Method", "here", "seeds", "paper", "p (FedPM >)"],
        rows,
        caption + incomplete(root, profile, "femnist-", log),
        "tab:femnist",
    )


def draw_into(out, root, profile) -> list:
    """``build_all`` into a private temporary sibling of ``out``, each file then moved into the folder ``out``
    named when it was held: files drawn by path (matplotlib) never follow ``out`` swapped for a link or someone
    else's folder meanwhile (FolderSwapped instead).  The sibling is removed on every exit; after a kill -9 the
    next run removes it (validation.outputs.clean_stale)."""
    parent = os.path.dirname(os.path.abspath(out))
    clean_stale(parent)
    with held_folder(out) as held:
        tmp = temp_folder(parent, "partial", os.path.basename(os.path.abspath(out)))
        try:
            drawn = build_all(root, tmp, profile)
            moved = {
                name: held.move_in(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp)) if name != TEMP_MARKER
            }
        except Exception as exc:  # a disk error names --out (main), not the temporary sibling that is removed
            cause = hidden_cause(exc)
            if isinstance(cause, OSError) and str(cause.filename or "").startswith(tmp):
                raise OSError(cause.errno, cause.strerror) from None
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return [moved[os.path.basename(f)] for f in drawn]


# the flags that only shape computing (python -m validation.experiments's), refused without --compute
COMPUTE_FLAGS = ("data_dir", "budget_minutes", "ray_address", "gpus_per_task", "max_retries", "seed")


def check_draw_only(p, args) -> None:
    """Drawing reads --results alone: a flag of computing given without --compute is one parser error (it would
    do nothing)."""
    given = [f"--{d.replace('_', '-')}" for d in COMPUTE_FLAGS if getattr(args, d) is not None]
    given += ["--executor"] * (args.executor != "local") + ["--no-stack"] * args.no_stack
    given += ["--device"] * (args.device != "auto")
    if given:
        p.error(f"{given[0]} applies to --compute (drawing reads only --results)")


def not_done(results: str, profile: str) -> list:
    """The names of the profile's runs not done under results/<profile>, in the sweep's priority order."""
    from validation.sweep import DONE, priority, statuses

    runs = priority(plan(profile))
    states = statuses(runs, os.path.join(results, profile))
    return [r.name for r in runs if states[r.name].state != DONE]


def compute_hint(profile: str) -> str:
    return (
        f"compute them with: make figures PROFILE={profile} COMPUTE=1 DATA=DIR (python -m figures --profile {profile} "
        f"--compute --data-dir DIR; python -m validation.experiments --profile {profile} --list shows each run)"
    )


def main(argv=None) -> int:
    started = time.time()  # the budget counts from here
    p = OneLineParser(prog="python -m figures", doc=__doc__)
    p.add_argument("--profile", choices=sorted(PROFILES), default="quick", help="which runs (validation.experiments)")
    p.add_argument(
        "--data-dir", default=None, help="with --compute: image data (default: $FEDPM_DATA); Test 1 needs none"
    )
    p.add_argument(
        "--results",
        default="results",
        help="the runs' root (validation.experiments --out): each run in RESULTS/<profile>/<name>",
    )
    p.add_argument("--out", default=None, help="the figures' folder (default: figures/out/<profile>)")
    p.add_argument(
        "--compute",
        action="store_true",
        help="first compute the profile's missing runs (python -m validation.experiments); without it the figures "
        "are drawn from the runs that exist",
    )
    p.add_argument("--no-compute", action="store_true", help="only draw what exists (what happens without --compute)")
    add_sweep_args(p)
    add_run_args(p)
    args = p.parse_args(argv)
    if args.compute and args.no_compute:
        p.error("--compute and --no-compute exclude each other")
    only = check_run_args(p, args)  # a seed the profile does not run, --device cuda without one: as computing says
    if not args.compute:
        check_draw_only(p, args)
    check_results_arg(p, args.results, computes=args.compute)
    check_profile_folder(p, args.results, args.profile)
    out = args.out or os.path.join("figures", "out", args.profile)
    check_out_arg(p, out, kind=OUTPUT)  # figures are written file by file into it: only ever into a folder of ours
    code = 0
    if args.compute:
        result = ensure_from_args(p, args, only, started)
        code = result.exit_code()
        if result.summary():
            sys.stderr.write(f"{PROG}: {result.summary()}\n")
    else:
        try:
            seed_from_reference(args.profile, args.results)
        except OSError as exc:  # a read-only or full results folder: the figures of what is there are still drawn
            sys.stderr.write(f"{PROG}: warning: {exc}; the figures lack those runs\n")
    try:
        with exclusive(out):
            check_out(out, kind=OUTPUT)
            os.makedirs(out, exist_ok=True)
            mark(out, PROG)  # before the first figure: a run that stops half-way leaves a folder a rerun may take
            produced = draw_into(out, os.path.join(args.results, args.profile), args.profile)
    except (DamagedFile, OutputError, FolderSwapped) as exc:
        fail(PROG, exc)
    except Exception as exc:  # a full disk, a read-only folder, also as a writer's own error (matplotlib's PDF)
        cause = hidden_cause(exc)
        if not isinstance(cause, OSError):
            raise
        fail(PROG, cause if cause.filename else OSError(f"--out {out}: cannot be written ({cause.strerror or cause})"))
    if not produced:
        root = os.path.join(args.results, args.profile)
        why = f"{root} holds no run of the {args.profile} profile that a figure draws"
        if not shipped_runs(args.profile):
            why += (
                f", and this copy ships none in reference/{args.profile} (a package installed with pip carries no "
                "reference/ folder)"
            )
        sys.stderr.write(f"{PROG}: wrote 0 files under {out}: {why}; {compute_hint(args.profile)}\n")
        return 1
    print(f"wrote {len(produced)} files under {out}:")
    for f in produced:
        print("  " + f)
    if not args.compute:
        missing = not_done(args.results, args.profile)
        if missing:
            sys.stderr.write(
                f"{PROG}: {len(missing)} of the {args.profile} profile's {len(plan(args.profile))} runs are not done "
                f"(next: {missing[0]}): the figures lack them; {compute_hint(args.profile)}\n"
            )
    return code


if __name__ == "__main__":
    from validation.common import run_command

    sys.exit(run_command(PROG, main, "the results already computed are kept"))
