"""The experiments behind every figure and table, per profile, and a runner for the missing ones.

    python -m validation.experiments --profile quick --data-dir DATA     # compute what is missing

Profiles:
  quick  for 2 CPU cores (time: --list, docs/sweeps.md): the full Test 1, and the DNN studies on CIFAR-10 with a
         class-balanced 3,000-image training subset, a 2,000-image test subset, few rounds, 2 seeds.
         Every figure drawn from it says so.
  paper  the paper's sizes (all data, 100 rounds, 3 seeds, CIFAR-10 and CIFAR-100): for a GPU.
  cpu-full  the full-data check that fits a 2-core CPU in about an hour per method pair: all 50,000
         CIFAR-10 training images, 10 clients, alpha = 0.1, 5 local epochs, 20 rounds, seed 0, FedAvg,
         SCAFFOLD, LocalNewton and FedPM with the paper's table (no ablations).
  smoke  4 tiny CIFAR-10 runs (120 images, 3 clients, 3 rounds): checks the machinery in about a minute.
  femnist  FEMNIST's table: LEAF's writers as clients (10 sampled per round, 5 local epochs), 100 rounds,
         the 7 methods x seeds 0-2 with the paper's FEMNIST hyper-parameters (--preset femnist).
         --only GLOB (repeatable) restricts any profile to the runs whose names match, e.g. to run
         two halves of a profile side by side.
Each run writes results/<profile>/<name>/{history.csv, summary.json} (summary.json holds the exact
command and versions).  The results folder is the only state (validation/sweep.py): a done run is not
recomputed, a partial one continues from its checkpoint, in a fixed priority order.  The runs the repository
ships (reference/<profile>/) are copied into results/<profile>/ where that lacks them, so a figure is drawn from
them without recomputing; reference/ itself is only read.

    python -m validation.experiments --profile paper --budget-minutes 9     # stop cleanly within 9 minutes
    python -m validation.experiments --profile paper --executor ray         # one run per GPU (Ray)
    python -m validation.experiments --profile paper --list                 # done / partial / missing, time left
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import sys
import time
from dataclasses import dataclass

from validation.progress import Progress, sweep_runs
from validation.sweep import DNN_METHODS, stack_argv, stacks  # noqa: F401  (stack_argv: this module's API)

# FedPM preconditioner codecs measured on the CNN (fedconvex/codecs.py).  lowrank:0.02, lowrank:1 and the
# 2 % delta codecs are the ones whose bytes can stay within 25 % of uncompressed FedPM's upload (the parameters
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


# (codec, --param-dtype) runs of FedPM with its parameters on the wire in 16 bits (the float32
# parameters alone are 22.7 % of uncompressed FedPM's CNN upload, 10.8 % of ResNet18-GN's)
CNN_PARAM_DTYPE_RUNS = (("lowrank:0.02", "float16"), ("none", "float16"))


def codec_slug(codec: str) -> str:
    return codec.replace(":", "-")


def param_slug(dtype: str) -> str:
    """The run-name suffix of a --param-dtype ('' for the default float32)."""
    return "" if dtype == "float32" else f"-params-{dtype}"


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
        last_batch="keep",  # as its shipped runs were made (PINNED_LAST_BATCH)
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
        papers_setting=True,  # Table 3's sizes: our accuracies compare with the paper's in its σ
    ),
    "cpu-full": dict(
        last_batch="keep",  # as its shipped runs were made (PINNED_LAST_BATCH)
        seeds=(0,),
        rounds=20,
        subset=[],
        datasets=("cifar10",),
        alphas=("0.1",),
        methods=("fedavg", "scaffold", "localnewton", "fedpm"),
        ablations=False,
        label="cpu-full profile: all 50k CIFAR-10 images, alpha=0.1, 20 rounds, seed 0",
    ),
    "smoke": dict(
        seeds=(0, 1),
        rounds=3,
        subset=["--train-subset", "120", "--test-subset", "40", "--clients", "3", "--local-epochs", "1"]
        + ["--threads", "1"],
        datasets=("cifar10",),
        alphas=("0.1",),
        methods=("fedpm", "fedavg"),
        ablations=False,
        convex=False,
        label="smoke profile: 120 CIFAR-10 images, 3 clients, 3 rounds, 2 seeds (checks the pipeline, not the paper)",
    ),
    "femnist": dict(
        last_batch="keep",  # as its shipped runs were made (PINNED_LAST_BATCH)
        seeds=(0, 1, 2),
        rounds=100,
        subset=[],
        datasets=("femnist",),
        label="femnist profile: LEAF FEMNIST writers, 10 per round, 5 local epochs, 100 rounds, 3 seeds",
    ),
}


# A profile whose runs ship in reference/ pins what they did with an epoch's last partial batch: they were made
# before the presets dropped it, so the profile and its shipped runs stay one computation.  The paper profile, whose
# runs are made on GPUs from the presets, drops it as the presets do (fedpm_dnn.presets.PRESET_LAST_BATCH).
def pinned_last_batch(p: dict) -> tuple:
    return ("--last-batch", p["last_batch"]) if "last_batch" in p else ()


def femnist_plan(p: dict) -> list[Run]:
    """The paper's FEMNIST table: every method with its preset row (participants and epochs from the preset)."""
    return [
        Run(
            f"femnist-{m}-s{s}",
            "dnn",
            # one torch thread: the float32 sums, and so every digit of the history, are those of the reference
            (
                "--dataset",
                "femnist",
                "--method",
                m,
                "--preset",
                "femnist",
                "--rounds",
                str(p["rounds"]),
                "--seed",
                str(s),
            )
            + ("--threads", "1")
            + pinned_last_batch(p),
            p["rounds"],
            "femnist",
        )
        for m in DNN_METHODS
        for s in p["seeds"]
    ]


def plan(profile: str) -> list[Run]:
    p = PROFILES[profile]
    p = {**p, "subset": [*p["subset"], *pinned_last_batch(p)]}  # every DNN run of the profile carries it
    if p["datasets"] == ("femnist",):
        return femnist_plan(p)
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
    if not p.get("convex", True):
        runs = []  # a profile of DNN runs only
    model = {"cifar10": "cnn", "cifar100": "resnet18gn"}

    def dnn(name, seed, *flags, rounds=p["rounds"], dataset="cifar10"):
        """A DNN run of the profile: its own flags, then the rounds, the seed and the profile's common flags."""
        return Run(name, "dnn", (*flags, "--rounds", str(rounds), "--seed", str(seed), *p["subset"]), rounds, dataset)

    for ds in p["datasets"]:
        for alpha in p.get("alphas", ("1.0", "0.1")):
            for m in p.get("methods", DNN_METHODS):
                for s in p["seeds"]:
                    flags = ("--dataset", ds, "--model", model[ds], "--method", m, "--preset", f"{ds}-a{alpha}")
                    runs.append(dnn(f"main-{ds}-a{alpha}-{m}-s{s}", s, *flags, "--alpha", alpha, dataset=ds))
    if not p.get("ablations", True):
        return runs
    # local epochs 1 / 5 / 10 with the total number of local epochs fixed (CIFAR-10, alpha = 0.1)
    for epochs, preset in ((1, "cifar10-e1"), (5, "cifar10-a0.1"), (10, "cifar10-e10")):
        rounds = max(1, p["epoch_budget"] // epochs)
        for m in ABLATION_METHODS if profile == "quick" else DNN_METHODS:
            for s in p["seeds"]:
                flags = ("--dataset", "cifar10", "--method", m, "--preset", preset, "--local-epochs", str(epochs))
                runs.append(dnn(f"epochs-{epochs}-{m}-s{s}", s, *flags, rounds=rounds))
    # client sampling: 2 / 5 / 8 / 10 participants of 10
    for part in (2, 5, 8, 10):
        for m in ABLATION_METHODS if profile == "quick" else tuple(x for x in DNN_METHODS if x != "fedadam"):
            for s in p["seeds"]:
                flags = ("--dataset", "cifar10", "--method", m, "--preset", f"cifar10-sampling-{part}")
                runs.append(dnn(f"sampling-{part}-{m}-s{s}", s, *flags, "--participants", str(part)))
    # FOOF sample counts (FedPM)
    for k in ("64", "256", "1024", "all"):
        for s in p["seeds"]:
            flags = ("--dataset", "cifar10", "--method", "fedpm", "--preset", f"cifar10-foof-{k}", "--foof-samples", k)
            runs.append(dnn(f"foof-{k}-fedpm-s{s}", s, *flags))
    # preconditioner codecs: FedPM on CIFAR-10 alpha = 0.1 per codec, beside the main runs'
    # FedAvg and uncompressed FedPM (main-cifar10-a0.1-*); then with the parameters sent in a narrower dtype
    fedpm_a01 = ("--dataset", "cifar10", "--model", "cnn", "--method", "fedpm", "--preset", "cifar10-a0.1")
    for codec in CNN_CODECS:
        for s in p["seeds"]:
            name = f"compression-cifar10-a0.1-{codec_slug(codec)}-s{s}"
            runs.append(dnn(name, s, *fedpm_a01, "--alpha", "0.1", "--precond-codec", codec))
    for codec, dtype in CNN_PARAM_DTYPE_RUNS:
        for s in p["seeds"]:
            name = f"compression-cifar10-a0.1-{codec_slug(codec)}{param_slug(dtype)}-s{s}"
            runs.append(dnn(name, s, *fedpm_a01, "--alpha", "0.1", "--precond-codec", codec, "--param-dtype", dtype))
    return runs


def is_done(run: Run, folder: str) -> bool:
    """Whether ``folder`` holds ``run`` complete (or diverged) with the profile's configuration."""
    from validation.sweep import DONE, status

    return status(run, folder).state == DONE


def data_available(dataset: str, data_dir: str | None) -> bool:
    from fedpm_dnn.data import DatasetError, load_image_dataset

    try:
        load_image_dataset(dataset, data_dir)
        return True
    except (DatasetError, OSError, ValueError):
        return False


EXIT_PARTIAL = 75  # validation.dnn's status of a run stopped with rounds left (sysexits' EX_TEMPFAIL)
REFERENCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reference")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def shipped_runs(profile: str, reference: str | None = None) -> dict:
    """{name: folder} of the runs of ``profile`` this copy ships (reference/<profile>/<name>/ holding a
    summary.json); {} where it ships none (a package installed with pip carries no reference/)."""
    src_root = os.path.join(REFERENCE if reference is None else reference, profile)
    try:
        names = sorted(os.listdir(src_root))
    except OSError:
        return {}
    return {n: os.path.join(src_root, n) for n in names if os.path.isfile(os.path.join(src_root, n, "summary.json"))}


def seed_from_reference(profile: str, results: str = "results", reference: str | None = None) -> list[str]:
    """Copy each shipped run of ``profile`` (``shipped_runs``) to results/<profile>/ where no folder of that name
    exists; returns the names copied.  A folder already there -- a run of the user's, finished or not -- is left
    as it is.  Each run is copied into a temporary sibling and renamed into place whole, so a copy cut short (a
    full disk, a kill) never leaves a half-copied run, and two calls copying at once both end with one copy.
    A copy that fails is an OSError naming the folder and the cause (the temporary copy removed)."""
    from validation.outputs import clean_stale, temp_folder

    shipped = shipped_runs(profile, reference)
    root = os.path.join(results, profile)
    wanted = [n for n in shipped if not os.path.lexists(os.path.join(root, n))]
    if not wanted:
        return []
    copied = []
    try:
        os.makedirs(root, exist_ok=True)
        clean_stale(root)  # temporary copies of calls killed before their rename
        for name in wanted:
            tmp = temp_folder(root, "partial", name)  # its marker lets a later call remove it after a kill
            try:
                shutil.copytree(shipped[name], os.path.join(tmp, name))
                dst = os.path.join(root, name)
                if not os.path.lexists(dst):  # another call may have copied it meanwhile: its copy stays
                    os.rename(os.path.join(tmp, name), dst)
                    copied.append(name)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if isinstance(exc, shutil.Error) and exc.args and exc.args[0]:  # copytree's list of (src, dst, why)
            why = str(exc.args[0][0][-1])
        raise OSError(f"cannot copy the runs shipped in reference/{profile} into {root}: {why}") from None
    return copied


def ensure(
    profile: str,
    data_dir: str | None,
    results: str = "results",
    only=None,
    log=print,
    budget=None,
    executor=None,
    device="auto",
    quiet=False,
    stack: bool = True,
) -> Outcome:
    """Compute the missing and partial runs of ``profile`` in the sweep's priority order (validation/sweep.py),
    within ``budget`` (a sweep.Budget; None: no limit), on ``executor`` (default: here, one after another);
    returns an ``Outcome``: {run name: folder} of the runs that exist, and which runs are done and which not, and
    why.  ``stack``: the DNN runs that differ only in seed and
    alpha are trained together (``stacks``, one unit of work) where validation.dnn's engine is the vectorized one
    anyway (a GPU).  On a CPU every run stays alone on the sequential engine: a stack trains on the vectorized
    engine, which is no faster there and rounds differently, so it could not continue an earlier run's
    checkpoint."""
    stack = stack and _cuda()
    from validation import sweep
    from validation.executors import BUSY, NOT_STARTED, Job, LocalExecutor

    seed_from_reference(profile, results)
    root = os.path.join(results, profile)
    budget = budget or sweep.Budget(None)
    runs = [r for r in plan(profile) if only is None or only(r)]
    states = sweep.statuses(runs, root)
    have_data = {}
    todo = []
    for r in runs:
        st = states[r.name]
        if st.state == sweep.STALE:
            log(f"keeping {os.path.join(root, r.name)}: {sweep.describe(r, st)}")
        if st.state not in (sweep.MISSING, sweep.PARTIAL):
            continue
        if r.kind == "dnn":
            if r.dataset not in have_data:
                have_data[r.dataset] = data_available(r.dataset, data_dir)
                if not have_data[r.dataset]:
                    log(f"skipping the {r.dataset} runs: no {r.dataset} data under --data-dir / $FEDPM_DATA")
            if not have_data[r.dataset]:
                continue
        todo.append(r)
    here = sweep.this_device()
    estimates = sweep.round_seconds(runs, states, here, sweep.this_machine(here))
    job = Job(root, data_dir or os.environ.get("FEDPM_DATA", ""), budget.end, device)
    bar = Progress(len(todo), f"{profile} runs", enabled=not quiet, unit="run")
    seen = {}
    done_units = (executor or LocalExecutor()).map(sweep.units(todo, stacks if stack else None), job, estimates)
    # what the runs print goes above the bar, and their rounds beside it (runs computed here; Ray's run elsewhere)
    with bar.lines_above(), sweep_runs(lambda run, done, rounds: bar.note(f"{run}: round {done} of {rounds}")):
        try:
            for _, outcomes in done_units:
                for name, outcome in outcomes:
                    seen[name] = outcome
                    if outcome.startswith("failed"):
                        log(f"run {name} {outcome}; its figures will lack it")
                    elif outcome.startswith(BUSY):
                        log(f"run {name} is {outcome}: left to it; a later call reads its result")
                    bar.update(1, f"{name}: {outcome}")
        finally:  # on every exit (an error, SIGTERM, Ctrl-C) the executor's clean-up (Ray's shutdown) runs at once
            getattr(done_units, "close", lambda: None)()
    not_started = [n for n, o in seen.items() if o == NOT_STARTED]
    if not_started:
        log(
            f"budget spent: {len(not_started)} runs not started (next: {not_started[0]}); the same command "
            "continues them"
        )
    result = Outcome(
        {r.name: os.path.join(root, r.name) for r in runs if os.path.isfile(os.path.join(root, r.name, "summary.json"))}
    )
    final = sweep.statuses(runs, root)
    for r in runs:
        st, outcome = final[r.name], seen.get(r.name, "")
        if st.state == sweep.DONE:
            result.done.append(r.name)
        elif outcome.startswith("failed"):
            result.failed.append(r.name)
        elif st.state == sweep.STALE:
            result.stale.append(r.name)
        elif r.kind == "dnn" and not have_data.get(r.dataset, True):
            result.no_data.append(r.name)
        else:  # not started (budget), stopped at its deadline, or computed by another process
            result.unfinished.append(r.name)
    return result


class Outcome(dict):
    """What a sweep call leaves: {run name: folder} of the runs with a result (as ``ensure`` always returned), and
    the runs asked for by state: done, failed, stale (kept, not recomputed), no_data (skipped: no data) and
    unfinished (not started within the budget, stopped at its deadline, computed by another process)."""

    def __init__(self, folders=()):
        super().__init__(folders)
        self.done, self.failed, self.stale, self.no_data, self.unfinished = [], [], [], [], []

    def exit_code(self) -> int:
        """0: every run asked for is done; 1: some need the user (failed, stale, no data); else 75 (EX_TEMPFAIL,
        validation.dnn's "partial"): the same command continues the rest."""
        if self.failed or self.stale or self.no_data:
            return 1
        return EXIT_PARTIAL if self.unfinished else 0

    def summary(self) -> str:
        """One line: how many runs are done, and which are not and why ('' when all are)."""
        parts = [
            f"{len(names)} {what} ({names[0]}{', ...' if len(names) > 1 else ''})"
            for what, names in (
                ("failed", self.failed),
                ("stale (kept; move them away to recompute)", self.stale),
                ("without data (--data-dir)", self.no_data),
                ("unfinished (the same command continues them)", self.unfinished),
            )
            if names
        ]
        total = len(self.done) + sum(len(n) for n in (self.failed, self.stale, self.no_data, self.unfinished))
        return f"partial result: {len(self.done)} of {total} runs done; " + "; ".join(parts) if parts else ""


def run_seed(run: Run) -> int:
    """The --seed a run is made with (the commands' default 0 where its arguments name none)."""
    argv = list(run.argv)
    return int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0


def add_run_args(p) -> None:
    """--seed, --device, --quiet of the commands that compute a profile's runs (experiments, figures)."""
    from validation.common import add_device_arg, add_quiet_arg, seed_int

    p.add_argument("--seed", type=seed_int, default=None, help="only the profile's runs of this seed (default: all)")
    add_device_arg(p, what="device of the DNN runs (the convex runs are float64 NumPy); auto: cuda when visible")
    add_quiet_arg(p)


def check_run_args(parser, args):
    """The ``only`` of ensure() for --seed (None: every run); one parser error for a seed not in the profile or
    --device cuda without a GPU visible to torch (before any run starts)."""
    if args.device == "cuda":
        try:
            import torch

            usable = torch.cuda.is_available()
        except ImportError:
            usable = False
        if not usable:
            parser.error("--device cuda: no CUDA device is visible to torch (the DNN runs need one)")
    if args.seed is None:
        return None
    seeds = sorted({run_seed(r) for r in plan(args.profile)})
    if args.seed not in seeds:
        parser.error(f"--seed {args.seed}: the {args.profile} profile runs seeds {', '.join(map(str, seeds))}")
    return lambda r: run_seed(r) == args.seed


def check_results_arg(parser, path: str, flag: str = "--results", computes: bool = True) -> None:
    """The runs' root (experiments --out, figures --results) must be a folder (or not exist yet): every run writes
    below it.  Where runs are computed (``computes``) it is not the shipped results' folder: reference/ is only
    read (its runs are copied into the runs' root where that lacks them)."""
    if not path.strip():
        parser.error(f"{flag}: empty path")
    if os.path.lexists(path) and not os.path.isdir(path):
        parser.error(f"{flag} {path}: is not a folder")
    if computes and within(path, REFERENCE):
        parser.error(
            f"{flag} {path}: is the folder of the shipped results, which is only read; give another folder (its "
            "runs are copied there where it lacks them)"
        )


def within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or below it, links resolved (a path that does not exist yet included)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def add_sweep_args(p) -> None:
    """The flags of how a profile is computed (also those of python -m figures)."""
    from validation.common import budget_minutes, nonneg_float, positive_int

    p.add_argument(
        "--no-stack",
        action="store_true",
        help="train every DNN run alone (without it, on a GPU, runs that differ only in seed and alpha train as "
        "one stack; on a CPU runs are always alone)",
    )
    p.add_argument(
        "--budget-minutes",
        type=budget_minutes,
        default=None,
        help="stop cleanly within M minutes (runs cut short are checkpointed; the same command continues them) "
        "(default: no limit)",
    )
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="local: the runs one after another here; ray: each run a Ray task on a GPU of this machine or a cluster",
    )
    p.add_argument("--ray-address", default=None, help="--executor ray: an existing cluster (default: $RAY_ADDRESS)")
    p.add_argument(
        "--gpus-per-task",
        type=nonneg_float,
        default=None,
        help="--executor ray: GPUs each run holds; a fraction shares a GPU, without limiting its memory "
        "(default: 1 where there are GPUs)",
    )
    p.add_argument(
        "--max-retries",
        type=positive_int,
        default=None,
        help="--executor ray: retries of a run whose worker died (default: 3)",
    )


def budget(args, started: float):
    """The budget clock of --budget-minutes, started at ``started`` (seconds since the epoch)."""
    from validation.sweep import Budget

    clock = Budget(args.budget_minutes)
    if clock.end is not None:
        clock.end = started + 60.0 * args.budget_minutes
    return clock


def executor(p, args):
    """The executor the flags name (None: local); --ray-address, --gpus-per-task and --max-retries without
    --executor ray are refused."""
    if args.executor == "ray":
        from validation.executors import RayExecutor

        return RayExecutor(args.ray_address, args.gpus_per_task, 3 if args.max_retries is None else args.max_retries)
    flags = (("--ray-address", args.ray_address), ("--gpus-per-task", args.gpus_per_task))
    given = [f for f, v in flags + (("--max-retries", args.max_retries),) if v is not None]
    if given:
        p.error(f"{given[0]} applies to --executor ray")
    return None


def check_profile_folder(parser, results: str, profile: str, flag: str = "--results") -> None:
    """results/<profile> must be a folder, or not exist yet (it is made): a file or a link to nothing in its place
    is one parser error naming ``flag`` (the command's name of the runs' root)."""
    root = os.path.join(results, profile)
    if os.path.lexists(root) and not os.path.isdir(root):
        what = "a symbolic link to nothing" if os.path.islink(root) else "not a folder"
        parser.error(f"{flag} {results}: {root} is {what}; the runs of profile {profile} are kept in a folder")


def main(argv=None) -> int:
    from validation.common import OneLineParser, add_deprecated_alias

    started = time.time()  # the budget counts from here: loading torch and the data is part of it

    p = OneLineParser(prog="python -m validation.experiments", doc=__doc__)
    p.add_argument("--profile", choices=sorted(PROFILES), default="quick", help="which runs (see above)")
    p.add_argument("--data-dir", default=None, help="image data (default: $FEDPM_DATA); Test 1 needs none")
    # --out: the folder this command writes, as on every command; the runs' root, which figures reads as --results
    p.add_argument(
        "--out",
        dest="results",
        metavar="OUT",
        default="results",
        help="the runs' root: each run in OUT/<profile>/<name>",
    )
    add_deprecated_alias(p, "--results", "--out", "results")
    p.add_argument(
        "--list",
        action="store_true",
        help="list the runs in the order they are computed: done, partial (rounds done) or missing, and the "
        "estimated time left, naming the machine whose measured rounds it comes from: this one once it has run one "
        "(writes nothing; the shipped runs are read where they are)",
    )
    add_sweep_args(p)
    add_run_args(p)
    p.add_argument(
        "--only",
        action="append",
        metavar="GLOB",
        help="only the runs whose names match, repeatable; see --list (default: every run)",
    )
    args = p.parse_args(argv)
    by_seed = check_run_args(p, args)
    check_results_arg(p, args.results, "--out", computes=not args.list)
    check_profile_folder(p, args.results, args.profile, "--out")
    by_name = None
    if args.only:
        names = [r.name for r in plan(args.profile)]
        for g in args.only:
            if not fnmatch.filter(names, g):
                p.error(f"--only {g}: matches no run of profile {args.profile} (see --list)")
        by_name = lambda r: any(fnmatch.fnmatchcase(r.name, g) for g in args.only)  # noqa: E731
    # --seed and --only together: the runs both select
    only = None if by_seed is None and by_name is None else lambda r: all(f(r) for f in (by_seed, by_name) if f)
    if args.list:
        from validation.sweep import listing

        executor(p, args)  # the sweep's flags are checked alike
        root = os.path.join(args.results, args.profile)
        print("\n".join(listing(list(filter(only, plan(args.profile))), root, shipped=shipped_runs(args.profile))))
        return 0
    result = ensure_from_args(p, args, only, started)
    if result.summary():
        sys.stderr.write(f"{p.prog}: {result.summary()}\n")
    return result.exit_code()


def ensure_from_args(p, args, only, started: float) -> Outcome:
    """``ensure`` with the flags of add_sweep_args / add_run_args (experiments, figures); a Ray cluster that
    cannot be reached, or shipped runs that cannot be copied into the runs' root, is one line."""

    try:
        return _ensure_from_args(p, args, only, started)
    except KeyboardInterrupt as exc:  # SIGTERM (Terminated) or Ctrl-C: what continues is this command, as it was
        raise type(exc)(
            "the runs finished are kept, and a run cut short keeps its rounds done; the same command continues"
        ) from None


def _ensure_from_args(p, args, only, started: float) -> Outcome:
    from validation import common

    try:
        return ensure(
            args.profile,
            args.data_dir,
            args.results,
            only,
            budget=budget(args, started),
            executor=executor(p, args),
            device=args.device,
            quiet=args.quiet,
            stack=not args.no_stack,
        )
    except (ValueError, OSError) as exc:  # --executor ray without a cluster to reach; a results folder not writable
        common.fail(p.prog, exc)


if __name__ == "__main__":
    from validation.common import run_command

    sys.exit(run_command("python -m validation.experiments", main, "the runs already finished are kept"))
