"""The experiments behind every figure and table, per profile, and a runner for the missing ones.

    python -m validation.experiments --profile quick --data-dir DATA     # compute what is missing

Profiles:
  quick  fits ~15 minutes on 2 CPU cores: the full Test 1, and the DNN studies on CIFAR-10 with a
         class-balanced 3,000-image training subset, a 2,000-image test subset, few rounds, 2 seeds.
         Every figure drawn from it says so.
  paper  the paper's sizes (all data, 100 rounds, 3 seeds, CIFAR-10 and CIFAR-100): for a GPU.
  cpu-full  the full-data check that fits a 2-core CPU in about an hour per method pair: all 50,000
         CIFAR-10 training images, 10 clients, alpha = 0.1, 5 local epochs, 20 rounds, seed 0, FedAvg,
         SCAFFOLD, LocalNewton and FedPM with the paper's table (no ablations).
Each run writes results/<profile>/<name>/{history.csv, summary.json} (summary.json holds the exact
command and versions).  A run whose summary.json exists with all its rounds is not recomputed.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from fedpm_dnn.algorithms import METHODS
from validation.progress import Progress

# FedPM preconditioner codecs measured on the CNN (fedconvex/codecs.py).  lowrank:0.02, lowrank:1 and the
# 2 % delta codecs are the ones whose bytes can meet issue 13's <= 25 % of the total upload (the parameters
# alone are 22.7 % of uncompressed FedPM's upload on the SimpleCNN)
CNN_CODECS = (
    "sym",
    "fp16",
    "bf16",
    "lowrank:0.1",
    "lowrank:0.02",
    "lowrank:1",
    "delta:topk:0.05",
    "delta:topk:0.02",
    "delta:rankr:0.02",
)
CONVEX_CODECS = (
    "none",
    "sym",
    "fp16",
    "bf16",
    "lowrank:0.1",
    "lowrank:0.3",
    "delta:identity",
    "delta:topk:0.05",
    "delta:rankr:0.05",
)


# (codec, --param-dtype) runs of FedPM with its parameters on the wire in 16 bits (issue 13: the float32
# parameters alone are 22.7 % of uncompressed FedPM's CNN upload, 10.8 % of ResNet18-GN's)
CNN_PARAM_DTYPE_RUNS = (("lowrank:0.02", "float16"), ("none", "float16"))


def codec_slug(codec: str) -> str:
    return codec.replace(":", "-")


def param_slug(dtype: str) -> str:
    """The run-name suffix of a --param-dtype ('' for the default float32)."""
    return "" if dtype == "float32" else f"-params-{dtype}"


DNN_METHODS = METHODS  # the DNN registry's methods, in the paper's order
ABLATION_METHODS = ("fedavg", "localnewton", "fedpm")


@dataclass(frozen=True)
class Run:
    name: str  # folder under results/<profile>/
    kind: str  # "superlinear" or "dnn"
    argv: tuple  # arguments of the runner (without --out)
    rounds: int = 0  # rounds expected in history (dnn)
    dataset: str = "cifar10"


PROFILES = {
    "quick": dict(
        seeds=(0, 1),
        rounds=4,
        subset=["--train-subset", "3000", "--test-subset", "2000"],
        datasets=("cifar10",),
        epoch_budget=20,
        label="quick profile: CIFAR-10 JPEG copy, 3k-image training subset, 2k test images, 4 rounds, 2 seeds",
    ),
    "paper": dict(
        seeds=(0, 1, 2),
        rounds=100,
        subset=[],
        datasets=("cifar10", "cifar100"),
        epoch_budget=100,
        label="paper profile: full data, 100 rounds, 3 seeds",
    ),
    "cpu-full": dict(
        seeds=(0,),
        rounds=20,
        subset=[],
        datasets=("cifar10",),
        alphas=("0.1",),
        methods=("fedavg", "scaffold", "localnewton", "fedpm"),
        ablations=False,
        label="cpu-full profile: all 50k CIFAR-10 images, alpha=0.1, 20 rounds, seed 0",
    ),
}


def plan(profile: str) -> list[Run]:
    p = PROFILES[profile]
    runs = [Run(f"superlinear-{d}", "superlinear", ("--dataset", d, "--quiet")) for d in ("w8a", "a9a")]
    # FedPM (K = 1, lr 1: Newton) per preconditioner codec; FedNL comes from superlinear-<dataset>
    runs += [
        Run(
            f"compression-{d}-{codec_slug(c)}",
            "superlinear",
            ("--dataset", d, "--methods", "fedpm", "--lr", "1", "--rounds", "15", "--precond-codec", c, "--quiet"),
        )
        for d in ("w8a", "a9a")
        for c in CONVEX_CODECS
    ]
    model = {"cifar10": "cnn", "cifar100": "resnet18gn"}
    for ds in p["datasets"]:
        for alpha in p.get("alphas", ("1.0", "0.1")):
            for m in p.get("methods", DNN_METHODS):
                for s in p["seeds"]:
                    runs.append(
                        Run(
                            f"main-{ds}-a{alpha}-{m}-s{s}",
                            "dnn",
                            (
                                "--dataset",
                                ds,
                                "--model",
                                model[ds],
                                "--method",
                                m,
                                "--preset",
                                f"{ds}-a{alpha}",
                                "--alpha",
                                alpha,
                                "--rounds",
                                str(p["rounds"]),
                                "--seed",
                                str(s),
                                *p["subset"],
                            ),
                            p["rounds"],
                            ds,
                        )
                    )
    if not p.get("ablations", True):
        return runs
    # local epochs 1 / 5 / 10 with the total number of local epochs fixed (CIFAR-10, alpha = 0.1)
    for epochs, preset in ((1, "cifar10-e1"), (5, "cifar10-a0.1"), (10, "cifar10-e10")):
        rounds = max(1, p["epoch_budget"] // epochs)
        for m in ABLATION_METHODS if profile == "quick" else DNN_METHODS:
            for s in p["seeds"]:
                runs.append(
                    Run(
                        f"epochs-{epochs}-{m}-s{s}",
                        "dnn",
                        (
                            "--dataset",
                            "cifar10",
                            "--method",
                            m,
                            "--preset",
                            preset,
                            "--local-epochs",
                            str(epochs),
                            "--rounds",
                            str(rounds),
                            "--seed",
                            str(s),
                            *p["subset"],
                        ),
                        rounds,
                    )
                )
    # client sampling: 2 / 5 / 8 / 10 participants of 10
    for part in (2, 5, 8, 10):
        for m in ABLATION_METHODS if profile == "quick" else tuple(x for x in DNN_METHODS if x != "fedadam"):
            for s in p["seeds"]:
                runs.append(
                    Run(
                        f"sampling-{part}-{m}-s{s}",
                        "dnn",
                        (
                            "--dataset",
                            "cifar10",
                            "--method",
                            m,
                            "--preset",
                            f"cifar10-sampling-{part}",
                            "--participants",
                            str(part),
                            "--rounds",
                            str(p["rounds"]),
                            "--seed",
                            str(s),
                            *p["subset"],
                        ),
                        p["rounds"],
                    )
                )
    # FOOF sample counts (FedPM)
    for k in ("64", "256", "1024", "all"):
        for s in p["seeds"]:
            runs.append(
                Run(
                    f"foof-{k}-fedpm-s{s}",
                    "dnn",
                    (
                        "--dataset",
                        "cifar10",
                        "--method",
                        "fedpm",
                        "--preset",
                        f"cifar10-foof-{k}",
                        "--foof-samples",
                        k,
                        "--rounds",
                        str(p["rounds"]),
                        "--seed",
                        str(s),
                        *p["subset"],
                    ),
                    p["rounds"],
                )
            )
    # preconditioner codecs (issue 13): FedPM on CIFAR-10 alpha = 0.1 per codec, beside the main runs'
    # FedAvg and uncompressed FedPM (main-cifar10-a0.1-*)
    for codec in CNN_CODECS:
        for s in p["seeds"]:
            runs.append(
                Run(
                    f"compression-cifar10-a0.1-{codec_slug(codec)}-s{s}",
                    "dnn",
                    (
                        "--dataset",
                        "cifar10",
                        "--model",
                        "cnn",
                        "--method",
                        "fedpm",
                        "--preset",
                        "cifar10-a0.1",
                        "--alpha",
                        "0.1",
                        "--precond-codec",
                        codec,
                        "--rounds",
                        str(p["rounds"]),
                        "--seed",
                        str(s),
                        *p["subset"],
                    ),
                    p["rounds"],
                )
            )
    for codec, dtype in CNN_PARAM_DTYPE_RUNS:
        for s in p["seeds"]:
            runs.append(
                Run(
                    f"compression-cifar10-a0.1-{codec_slug(codec)}{param_slug(dtype)}-s{s}",
                    "dnn",
                    (
                        "--dataset",
                        "cifar10",
                        "--model",
                        "cnn",
                        "--method",
                        "fedpm",
                        "--preset",
                        "cifar10-a0.1",
                        "--alpha",
                        "0.1",
                        "--precond-codec",
                        codec,
                        "--param-dtype",
                        dtype,
                        "--rounds",
                        str(p["rounds"]),
                        "--seed",
                        str(s),
                        *p["subset"],
                    ),
                    p["rounds"],
                )
            )
    return runs


def is_done(run: Run, folder: str) -> bool:
    path = os.path.join(folder, "summary.json")
    if not os.path.isfile(path):
        return False
    if run.kind == "superlinear":
        return True
    with open(path) as fh:
        summary = json.load(fh)
    # a run that diverged has recorded why; re-running it would diverge at the same round
    return summary.get("rounds_done", 0) >= run.rounds or "failed" in summary


def data_available(dataset: str, data_dir: str | None) -> bool:
    from fedpm_dnn.data import DatasetError, load_image_dataset

    try:
        load_image_dataset(dataset, data_dir)
        return True
    except (DatasetError, OSError, ValueError):
        return False


def _without(argv: tuple, flags: tuple) -> tuple:
    """``argv`` without the given flags and their values."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return tuple(out)


def _value(argv: tuple, flag: str, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


def stacks(runs: list) -> list:
    """The DNN runs grouped into stacks (``validation.dnn --seeds/--alpha``): runs equal but for seed and alpha, with
    their (seed, alpha) pairs a full product (else one stack per alpha); every other run alone.  Order kept."""
    groups, order = {}, []
    for r in runs:
        key = (r.kind, r.rounds, r.dataset, _without(r.argv, ("--seed", "--alpha"))) if r.kind == "dnn" else r
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(r)
    out = []
    for key in order:
        group = groups[key]
        if key is group[0] or len(group) == 1:
            out.append(group)
            continue
        pairs = [(_value(r.argv, "--seed", "0"), _value(r.argv, "--alpha")) for r in group]
        seeds, alphas = dict.fromkeys(p[0] for p in pairs), dict.fromkeys(p[1] for p in pairs)
        if len(pairs) == len(seeds) * len(alphas) and len(set(pairs)) == len(pairs):
            by = dict(zip(pairs, group, strict=True))
            out.append([by[(s, a)] for s in seeds for a in alphas])  # validation.dnn's order: seeds x alphas
        else:
            for alpha in alphas:
                out.append([r for r, p in zip(group, pairs, strict=True) if p[1] == alpha])
    return out


def stack_argv(group: list) -> list:
    """validation.dnn's arguments for a stack of runs (``stacks``), without --data-dir, --out and --resume."""
    first = group[0].argv
    seeds = list(dict.fromkeys(_value(r.argv, "--seed", "0") for r in group))
    alphas = list(dict.fromkeys(_value(r.argv, "--alpha") for r in group))
    argv = list(_without(first, ("--seed", "--alpha"))) + ["--seeds", ",".join(seeds)]
    if alphas != [None]:
        argv += ["--alpha", ",".join(alphas)]
    return argv + ["--run-names", ",".join(r.name for r in group)]


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def ensure(
    profile: str, data_dir: str | None, results: str = "results", only=None, log=print, stack: bool = True
) -> dict:
    """Compute the missing runs of ``profile``; returns {run name: folder} of the runs that exist.  ``stack``: the
    DNN runs that differ only in seed and alpha are trained together (``stacks``) where validation.dnn's engine is
    the vectorized one anyway (a GPU).  On a CPU every run stays alone on the sequential engine: a stack trains on
    the vectorized engine, which is no faster there and rounds differently, so it could not continue an earlier
    run's checkpoint."""
    stack = stack and _cuda()
    from validation import dnn, superlinear

    root = os.path.join(results, profile)
    runs = [r for r in plan(profile) if only is None or only(r)]
    have_data = {}
    todo = []
    for r in runs:
        folder = os.path.join(root, r.name)
        if is_done(r, folder):
            continue
        if r.kind == "dnn":
            if r.dataset not in have_data:
                have_data[r.dataset] = data_available(r.dataset, data_dir)
                if not have_data[r.dataset]:
                    log(f"skipping the {r.dataset} runs: no {r.dataset} data under --data-dir / $FEDPM_DATA")
            if not have_data[r.dataset]:
                continue
        todo.append(r)
    bar = Progress(len(todo), f"{profile} runs")
    for group in stacks(todo) if stack else [[r] for r in todo]:
        r = group[0]
        folder = os.path.join(root, r.name)
        try:
            if r.kind == "superlinear":
                superlinear.main(list(r.argv) + ["--out", folder])
            else:
                where = ["--data-dir", data_dir or os.environ.get("FEDPM_DATA", ""), "--quiet"]
                if len(group) == 1:
                    argv = list(r.argv) + where + ["--out", folder]
                else:
                    argv = stack_argv(group) + where + ["--out", root]
                if any(os.path.exists(os.path.join(root, g.name, "checkpoint.pt")) for g in group):
                    argv.append("--resume")
                code = dnn.main(argv)
                if code:
                    log(f"a run of {', '.join(g.name for g in group)} failed; its figures will lack it")
        except SystemExit as exc:  # a run that fails (e.g. diverges) has printed its one-line reason
            if exc.code not in (0, None):
                log(f"run {', '.join(g.name for g in group)} failed (exit {exc.code}); its figures will lack it")
        bar.update(len(group), ", ".join(g.name for g in group))
    return {
        r.name: os.path.join(root, r.name) for r in runs if os.path.isfile(os.path.join(root, r.name, "summary.json"))
    }


def check_results_arg(parser, path: str) -> None:
    """--results must be a folder (or not exist yet): every run writes below it."""
    if not path.strip():
        parser.error("--results: empty path")
    if os.path.lexists(path) and not os.path.isdir(path):
        parser.error(f"--results {path}: is not a folder")


def main(argv=None) -> int:
    from validation.common import OneLineParser

    p = OneLineParser(prog="python -m validation.experiments", description=__doc__.split("\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--results", default="results")
    p.add_argument("--list", action="store_true", help="list the runs and whether they exist")
    p.add_argument(
        "--no-stack",
        action="store_true",
        help="train every DNN run alone (default on a GPU: runs that differ only in seed and alpha train as one "
        "stack; on a CPU runs are always alone)",
    )
    args = p.parse_args(argv)
    check_results_arg(p, args.results)
    if args.list:
        for r in plan(args.profile):
            done = is_done(r, os.path.join(args.results, args.profile, r.name))
            print(f"{'done ' if done else 'todo '} {r.name}")
        return 0
    ensure(args.profile, args.data_dir, args.results, stack=not args.no_stack)
    return 0


if __name__ == "__main__":
    from validation.common import run_command

    sys.exit(run_command("python -m validation.experiments", main, "the runs already finished are kept"))
