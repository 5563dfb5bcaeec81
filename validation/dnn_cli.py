"""The command line of ``python -m validation.dnn``, the command's boundary: its parser, the checks of its flags (all
before any data is read) and the settings the flags resolve to with a preset (``parse_args``: one frozen
``validation.run_settings.RunSettings``, every auto made concrete, the only thing that travels below), the
fingerprint of a command line (for the sweep) and the default --out named from the settings.  Nothing here imports
torch at module level: ``--help`` and the checks stay fast."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shlex
import sys
import time

from validation import common
from validation.outputs import Kind, reserved_name, written_by
from validation.run_settings import (
    AUTO_ENGINE,
    DEFAULT_CLIENTS,
    FINGERPRINT_FIELDS,
    FOOF_AUTO,
    RunSettings,
    canonical_alpha,
    engine_tag,
    on_device,
    recorded_choices,
    resolved_augment,
    resolved_fingerprint,
    run_fingerprint,
)

PROG = "python -m validation.dnn"
OUTPUT = Kind(PROG, ("history.csv", "summary.json", "checkpoint.pt"))  # what a run writes into --out
DEFAULT_ENGINE = "auto"
EXIT_PARTIAL = 75  # sysexits' EX_TEMPFAIL: stopped at --deadline with rounds left; --resume continues

# the names of validation.run_settings that this module's readers have always found here
__all__ = [
    "AUTO_ENGINE",
    "DEFAULT_CLIENTS",
    "FINGERPRINT_FIELDS",
    "RunSettings",
    "canonical_alpha",
    "engine_tag",
    "resolved_augment",
    "resolved_fingerprint",
    "run_fingerprint",
]


def build_parser(doc: str | None = None):
    """The argument parser alone (no defaults filled in, no checks of --out): see parse_args.  ``doc``: the
    command's description and examples for --help (validation.dnn's docstring)."""
    from fedpm_dnn.method_names import METHOD_NAMES as METHODS
    from fedpm_dnn.presets import PRESETS

    # the usage line names no flag: argparse's would repeat all of them (and the presets) before their help
    p = common.OneLineParser(prog=PROG, doc=doc, usage=f"{PROG} [FLAGS]   (the flags below)")
    p.add_argument(
        "--dataset",
        choices=("cifar10", "cifar100", "femnist"),
        default=None,
        help="the image data set (default: the preset's, else cifar10)",
    )
    p.add_argument("--data-dir", default=None, help="data folder (default: $FEDPM_DATA)")
    p.add_argument(
        "--cache-dir", default=None, help="where decoded JPEGs are cached (default: $FEDPM_CACHE or ~/.cache/fedpm)"
    )
    p.add_argument("--model", choices=("cnn", "resnet18gn"), default="cnn", help="SimpleCNN or ResNet18-GroupNorm")
    p.add_argument(
        "--gn-groups",
        type=common.positive_int,
        default=None,
        help="ResNet18-GN's GroupNorm group count, a divisor of 64; the paper does not state it (default: 2)",
    )
    p.add_argument("--method", choices=METHODS, default="fedpm", help="the federated method")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        metavar="PRESET",
        default=None,
        help="an appendix table: its setting (data set, alpha, clients, participants, local epochs, FOOF samples) "
        "and the method's hyper-parameters; explicit flags override it; docs/presets.md (default: none); one of "
        + ", ".join(sorted(PRESETS)),
    )
    p.add_argument(
        "--alpha",
        type=alpha_list,
        default=None,
        help="Dirichlet concentration, or a comma-separated list: one run per value, stacked (default: the "
        "preset's, else 0.1)",
    )
    p.add_argument(
        "--split",
        choices=("relaysum", "relaysum-even", "dirichlet"),
        default="relaysum",
        help="relaysum: the paper's Dirichlet split (Vogels et al. 2021; capped shares, every client >= 50%% "
        "of the mean size); relaysum-even: the same draw re-cut into equal clients, as RelaySum's CIFAR task "
        "trains (its distribute_evenly); dirichlet: plain per-class Dir(alpha) (default: relaysum)",
    )
    p.add_argument(
        "--clients",
        type=common.positive_int,
        default=None,
        help="clients (default: the preset's, else 10; FEMNIST: every writer)",
    )
    p.add_argument(
        "--augment",
        choices=("auto", "crop-flip", "none"),
        default="auto",
        help="training-batch augmentation: crop-flip = random crop of the 4-padded image + horizontal flip, as "
        "the RelaySum/MOON CIFAR pipelines; auto = crop-flip on CIFAR, none on FEMNIST (handwriting is not "
        "mirror-symmetric; LEAF does not augment); the paper is silent",
    )
    p.add_argument(
        "--participants",
        type=common.positive_int,
        default=None,
        help="clients sampled per round (default: the preset's, else all)",
    )
    p.add_argument("--rounds", type=common.positive_int, default=100, help="communication rounds")
    p.add_argument(
        "--local-epochs", type=common.positive_int, default=None, help="local epochs (default: the preset's, else 5)"
    )
    p.add_argument(
        "--lr-warmup-rounds",
        type=common.nonneg_int,
        default=None,
        help="local learning rate warmed up linearly over the first W rounds, round t at t/W of it; docs/presets.md "
        "(default: none)",
    )
    p.add_argument(
        "--lr-milestones",
        type=milestones_arg,
        default=None,
        help="PERCENT:FACTOR,...: the local learning rate times FACTOR once PERCENT %% of the rounds are done, e.g. "
        "75:0.1,90:0.1 as RelaySum's CIFAR runs; docs/presets.md (default: none)",
    )
    p.add_argument(
        "--seed", type=common.seed_int, default=None, help="model initialisation, batches, client sampling (default: 0)"
    )
    p.add_argument(
        "--seeds",
        type=seed_list,
        default=None,
        help="comma-separated seeds: one run per seed (and --alpha value), trained together as one stack on the "
        "vectorized engine; --out becomes their parent folder (default: one run, --seed)",
    )
    p.add_argument(
        "--run-names",
        type=lambda t: t.split(","),
        default=None,
        help="a stack's run folders under --out, comma-separated, in the order seeds x alphas (default: "
        "main-<dataset>-a<alpha>-<method>-s<seed>, validation.experiments' names)",
    )
    p.add_argument(
        "--split-seed",
        type=common.seed_int,
        default=None,
        help="the data a run sees: the Dirichlet split and the --train-subset / --test-subset draws (default: --seed)",
    )
    p.add_argument(
        "--foof-samples",
        choices=("64", "256", "1024", "all"),
        default=None,
        help="samples per client for the FOOF matrices (default: the preset's, else all)",
    )
    p.add_argument(
        "--train-subset",
        type=common.positive_int,
        default=None,
        help="class-balanced subset of the training set, for CPU-sized runs (default: every image)",
    )
    p.add_argument(
        "--test-subset",
        type=common.positive_int,
        default=None,
        help="first N test images, class order kept balanced (default: every image)",
    )
    common.add_device_arg(p)
    p.add_argument(
        "--engine",
        choices=("auto", "sequential", "vectorized"),
        default=DEFAULT_ENGINE,
        help="vectorized: the round's participants trained together on the device, clients as a batch "
        "axis (same models as sequential, client by client); auto: vectorized on a GPU, "
        "sequential on a CPU, where each is the faster (default: auto)",
    )
    common.add_max_ratio_arg(p, "in-process")
    float32_note = "; float32 sums, and so the last digits of a run, depend on it: summary.json records it"
    common.add_threads_arg(p, "torch's, all cores", float32_note)
    common.add_client_chunk_arg(p, "as many as fit in the free device memory")
    common.add_step_graph_arg(p)
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default: results/dnn-<preset or dataset>-<method>-s<seed>-r<rounds>, then what else "
        "differs from the preset: -train<N> -test<N> -a<alpha>, a digest of any other setting, the engine where it "
        "is not auto's; docs/dnn.md)",
    )
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="discard the run --out holds (its checkpoint, history and summary) and start over",
    )
    p.add_argument(
        "--deadline",
        type=common.positive_float,
        default=None,
        help="seconds since the epoch: stop after the round in which this time passes (checkpointed; exit 75 "
        "when rounds are left) (default: none)",
    )
    p.add_argument(
        "--budget-minutes",
        type=common.budget_minutes,
        default=None,
        help="stop after the round in which M minutes since the start pass (as --deadline, counted from now; a run's "
        "recorded command gives its --deadline so) (default: none)",
    )
    common.add_quiet_arg(p)
    g = p.add_argument_group("hyper-parameters (override the preset)")
    g.add_argument(
        "--lr", type=common.positive_float, help="local learning rate (default: the preset's, else the method's)"
    )
    g.add_argument(
        "--clip",
        type=common.nonneg_float,
        help="gradient-norm clip; 0 = none (default: the preset's, else the method's)",
    )
    g.add_argument(
        "--weight-decay", type=common.nonneg_float, help="weight decay (default: the preset's, else the method's)"
    )
    g.add_argument(
        "--mu", type=common.nonneg_float, help="FedProx proximal coefficient (default: the preset's, else the method's)"
    )
    g.add_argument(
        "--momentum",
        type=common.nonneg_float,
        help="FedAvgM server momentum (default: the preset's, else the method's)",
    )
    g.add_argument(
        "--server-lr",
        type=common.positive_float,
        help="FedAdam server learning rate (default: the preset's, else the method's)",
    )
    g.add_argument(
        "--momentum-form",
        choices=("heavy-ball", "ema"),
        help="FedAvgM's server momentum: ema v <- beta v + (1 - beta) Delta, or heavy-ball "
        "v <- beta v + Delta (Hsu et al.; its step is up to 1/(1 - beta) times larger); see docs/presets.md "
        "(default: ema)",
    )
    g.add_argument(
        "--bias-correction",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FedAvgM (momentum) and FedAdam (both moments): divide by 1 - beta^t, as Adam does; "
        "Reddi et al.'s FedAdam has none: --no-bias-correction (default: on)",
    )
    g.add_argument(
        "--damping",
        type=common.nonneg_float,
        help="FOOF damping, LocalNewton and FedPM (default: the preset's, else the method's)",
    )
    g.add_argument("--batch-size", type=common.positive_int, help="local mini-batch size (default: the method's)")
    g.add_argument(
        "--foof-apply",
        choices=("solve", "inverse", "auto"),
        help="how a local step applies (A + lam I)^{-1} (LocalNewton, FedPM): solve (two triangular solves with "
        "the Cholesky factor), inverse (one product with the inverse formed once per round, as the paper's cost "
        "table counts), auto (inverse on CUDA, solve on the CPU; a resumed run keeps the apply it recorded) "
        "(default: auto)",
    )
    g.add_argument(
        "--foof-precision",
        choices=("fp32", "split-tf32", "tf32", "bf16", "auto"),
        help="arithmetic of FOOF's apply product and statistics Gram (LocalNewton, FedPM; docs/stacking.md): fp32, "
        "split-tf32 (tensor cores at float32's accuracy), tf32 or bf16 (approximations, opt-in); auto is "
        "split-tf32 on CUDA where the cost model says it pays for the model (ResNet18-GN, not SimpleCNN), else fp32, "
        "and a resumed run keeps what it recorded; fp32 runs the convolutions in float32 too (default: auto)",
    )
    g.add_argument(
        "--refresh-every",
        type=common.positive_int,
        help="recompute FOOF matrices every s local steps (default: the method's)",
    )
    g.add_argument(
        "--weighting", choices=("uniform", "samples"), help="client weights in the mixing (default: the method's)"
    )
    g.add_argument(
        "--precond-dtype", choices=("float32", "float16"), help="dtype FedPM's matrices travel in (default: float32)"
    )
    g.add_argument(
        "--param-dtype",
        choices=("float32", "float16", "bfloat16"),
        help="dtype every method's model parameters travel up in (default: float32, as trained; the "
        "server upcasts them before mixing)",
    )
    g.add_argument(
        "--precond-codec",
        default=None,
        type=common.precond_codec,
        help="how FedPM's matrices travel (default: none): sym, fp16, bf16, lowrank:R, delta:identity, "
        "delta:topk:K, delta:rankr:R (R, K: a count or a fraction); see fedconvex/codecs.py",
    )
    g.add_argument(
        "--clip-stage",
        choices=("update", "gradient"),
        help="clip the preconditioned step (the reading under which the appendix's damping 1e-4 "
        "with clip 1.0 is stable) or the raw gradient before preconditioning (default: update)",
    )
    common.add_last_batch_arg(g)
    g.add_argument(
        "--weight-decay-mode",
        choices=("coupled", "decoupled"),
        help="coupled: wd*theta joins the gradient before preconditioning and clipping; "
        "decoupled: theta shrinks by lr*wd after the step (default: coupled)",
    )
    return p


def parse_args(argv=None, doc: str | None = None) -> RunSettings:
    """The command's settings, resolved once (``validation.run_settings.RunSettings``): the flags parsed and checked
    (all before any data is read), the preset applied under them, every auto made concrete, the default --out
    named; a stack's runs in ``runs``.  One parser error otherwise."""
    started = time.time()  # a --budget-minutes counts from here
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser(doc)
    args = p.parse_args(argv)
    if args.budget_minutes is not None:
        if args.deadline is not None:
            p.error("--deadline and --budget-minutes exclude each other")
        args.deadline = started + 60.0 * args.budget_minutes
    combos = settle(p, args)
    check_natural_split(p, args, p.given(argv))
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite exclude each other")
    command = recorded_command(argv, started)
    if len(combos) > 1 or args.seeds is not None or args.run_names is not None:
        stack = on_device(args.settings, stacked=True)
        runs = check_stack_args(p, args, combos, command, stack)
        return dataclasses.replace(stack, out=args.out, command=command, runs=runs)
    settings = on_device(args.settings)
    if args.out is None:
        typed = (args.alphas[0], args.alphas.typed[0]) if args.alphas and args.alphas.typed else None
        args.out = default_out(settings, typed_alpha=typed)
    check_args(p, args)
    check_device(p, args, settings)
    return for_resume(p, dataclasses.replace(settings, out=args.out, command=command))


def check_device(p, args, settings: RunSettings) -> None:
    """The check that needs the device: a flag of the vectorized engine where --engine auto is the sequential one
    on this device.  (Whether this machine has the --device asked for is the run's check: validation.dnn.run.)"""
    why = vectorized_only(args, settings.engine, settings.device)
    if why:
        p.error(why)


def for_resume(p, settings: RunSettings) -> RunSettings:
    """``settings`` with what a resumed checkpoint decides (validation.run_settings.recorded_choices), or one
    parser error naming the checkpoint that cannot be read."""
    try:
        return recorded_choices(settings)
    except ValueError as exc:  # fedpm_dnn.engine.checkpoint.CheckpointError: the file and why
        p.error(str(exc))


def settle(p, args) -> list:
    """The parsed flags made the run's settings, the one way every reader sees them (the run itself, its default
    --out, the sweep's comparison of a recorded command with a profile's: ``command_fingerprint``): --seed and
    --alpha as the first run's, the preset applied under the flags (args.resolved), alpha in its canonical form.
    Returns the (seed, alpha text) of each run a list of seeds and alphas makes."""
    if args.seeds is not None and args.seed is not None:
        p.error("--seed and --seeds exclude each other")
    seeds = args.seeds or [0 if args.seed is None else args.seed]
    args.alphas = args.alpha  # None (the preset's, else 0.1) or the canonical values (they name run folders)
    args.seed, args.alpha = seeds[0], None if args.alpha is None else float(args.alpha[0])
    check_preset(p, args)
    resolve_into(p, args)
    return list(itertools.product(seeds, args.alphas or [None]))


def check_natural_split(p, args, given: set) -> None:
    """FEMNIST's clients are its writers: the Dirichlet split's flags would change nothing it computes (yet enter
    its fingerprint), so one given explicitly is refused.  --split-seed still draws a --test-subset."""
    if args.dataset != "femnist":
        return
    for dest in ("alpha", "split", "split_seed"):
        if dest in given and not (dest == "split_seed" and args.test_subset):
            flag = "--" + dest.replace("_", "-")
            p.error(
                f"{flag} does not apply to --dataset femnist: its clients are its writers, not a Dirichlet split"
                + (" (--split-seed draws only a --test-subset)" if dest == "split_seed" else "")
            )


def default_out(s: RunSettings, stack: bool = False, typed_alpha: tuple | None = None) -> str:
    """The default --out of the settings ``s``: results/dnn-<preset or dataset>[-<model>]-<method>-s<seed>-r<rounds>,
    then -train<N> -test<N>, -a<alpha> when alpha is not the preset's (or the default 0.1), and a digest of every
    other resolved setting that differs from what the preset (or the defaults) give.  Commands that compute
    different runs get different folders; a flag repeating the preset's value does not change the name.  A stack's
    folder (``stack``) names neither seed nor alpha (each run's folder does).  ``typed_alpha``: (canonical, as
    typed) of --alpha, whose folder an earlier version named as typed (``legacy_alpha_folder``)."""
    import hashlib

    head = [f"dnn{'-stack' if stack else ''}", s.preset or s.dataset]
    if s.model != "cnn":
        head.append(s.model)
    head.append(s.method)
    base = ["--method", s.method, "--model", s.model] + (
        ["--preset", s.preset] if s.preset else ["--dataset", s.dataset]
    )
    if not stack:
        head.append(f"s{s.seed}")
        base += ["--seed", str(s.seed)]
    head.append(f"r{s.rounds}")
    for flag, value, tag in (
        ("--train-subset", s.train_subset, "train"),
        ("--test-subset", s.test_subset, "test"),
    ):
        if value:
            head.append(f"{tag}{value}")
            base += [flag, str(value)]
    want, plain = resolved_fingerprint(s), command_fingerprint(base)
    want["gn_groups"], plain["gn_groups"] = s.gn_groups, 2
    differs = sorted(k for k in set(want) | set(plain) if want.get(k) != plain.get(k))
    if stack:
        differs = [k for k in differs if k not in ("seed", "alpha")]
    if "alpha" in differs:
        head.append("a" + s.alpha_text)
        differs.remove("alpha")
    if differs:
        text = json.dumps({k: want.get(k) for k in differs}, sort_keys=True, default=str)
        head.append(hashlib.sha256(text.encode()).hexdigest()[:8])
    name = os.path.join("results", "-".join(head))
    if not stack and typed_alpha:
        name = legacy_alpha_folder(name, *typed_alpha)
    engine = None if stack else engine_tag(s)
    if engine:  # another engine than --engine auto's here: another folder (its float32 sums differ)
        untagged, name = name, f"{name}-{engine}"
        if not os.path.exists(name) and checkpoint_engine(untagged) == engine:
            name = untagged  # written before the folder named the engine: still this run's
    legacy = os.path.join("results", f"dnn-{s.dataset}-{s.method}-s{s.seed}")  # the earlier default
    if not stack and s.resume and not os.path.exists(name) and os.path.isfile(os.path.join(legacy, "checkpoint.pt")):
        return legacy
    return name


def checkpoint_engine(folder: str) -> str | None:
    """The engine a run's checkpoint in ``folder`` recorded, or None (none there, or not readable)."""
    path = os.path.join(folder, "checkpoint.pt")
    if not os.path.isfile(path):
        return None
    try:
        from fedpm_dnn.engine import checkpoint

        saved = checkpoint.load(path, map_location="cpu").get("fingerprint", {})
    except Exception:  # noqa: BLE001  (an unreadable checkpoint names no engine; the run says why later)
        return None
    return saved.get("engine", saved.get("run.engine")) if isinstance(saved, dict) else None


def settings_from(args) -> RunSettings:
    """The settled flags (``resolve_into``) as ``RunSettings``: the preset applied, alpha and the augmentation
    canonical, the schedule's milestones as rounds; the device's autos still to make concrete (``on_device``)."""
    res = args.resolved
    dataset = res.settings["dataset"]
    seed = 0 if args.seed is None else args.seed
    return RunSettings(
        dataset=dataset,
        data_dir=args.data_dir,
        cache_dir=args.cache_dir,
        split=args.split,
        alpha=float(res.settings["alpha"]),
        clients=res.settings["clients"],
        participants=res.settings["participants"],
        train_subset=args.train_subset,
        test_subset=args.test_subset,
        split_seed=seed if args.split_seed is None else args.split_seed,
        augment=resolved_augment(args.augment, dataset),
        model=args.model,
        gn_groups=args.gn_groups or 2,
        method=args.method,
        preset=args.preset,
        resolved=res,
        config=res.config,
        foof_auto=tuple(k for k in FOOF_AUTO if getattr(args, k) in (None, "auto")),
        rounds=args.rounds,
        seed=seed,
        lr_schedule=lr_schedule(args),
        device=args.device,
        engine=args.engine,
        step_graph=args.step_graph,
        client_chunk=args.client_chunk,
        max_ratio=args.max_ratio,
        threads=args.threads,
        out=args.out,
        out_given=args.out is not None,
        runs_parent=getattr(args, "runs_parent", None),
        resume=args.resume,
        overwrite=args.overwrite,
        deadline=args.deadline,
        quiet=args.quiet,
        command="",
    )


def resolve_into(p, args) -> None:
    """args.resolved (the preset under the flags), the data set it names and args.settings (``settings_from``), or
    one parser error."""
    try:
        args.resolved = resolve(args)
        args.dataset = args.resolved.settings["dataset"]
        args.settings = settings_from(args)
    except ValueError as exc:  # the preset has no row for the method, or a flag's value does not fit it
        p.error(str(exc))


def milestones_arg(text):
    """--lr-milestones: checked here (fedpm_dnn.engine.lr_schedule.parse_milestones), kept as given."""
    from fedpm_dnn.engine.lr_schedule import parse_milestones

    try:
        parse_milestones(text)
    except ValueError as exc:
        raise common.argparse.ArgumentTypeError(str(exc)) from None
    return text


def recorded_command(argv, started: float) -> str:
    """The command line a run records (summary.json, its ``reproduce:`` line): ``argv`` quoted, with an absolute
    --deadline (the sweep's budget clock) given as the --budget-minutes it left at ``started``, so that the line
    run again later stops as late after its start, not at once."""
    words, i = [], 0
    argv = list(argv)
    while i < len(argv):
        word = argv[i]
        value = None
        flag = word.split("=", 1)[0]
        is_deadline = len(flag) >= len("--dea") and "--deadline".startswith(flag)  # argparse takes a prefix
        if is_deadline and "=" not in word and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif is_deadline and "=" in word:
            value, i = word.split("=", 1)[1], i + 1
        else:
            words.append(word)
            i += 1
            continue
        left = max(float(value) - started, 0.0) / 60.0
        words += ["--budget-minutes", f"{max(math.ceil(left * 100) / 100, 0.01):g}"]
    return PROG + " " + " ".join(shlex.quote(w) for w in words)


def lr_schedule(args):
    """The run's fedpm_dnn.engine.lr_schedule.LrSchedule (milestones made absolute for --rounds), or None."""
    from fedpm_dnn.engine.lr_schedule import schedule_for

    return schedule_for(args.lr_warmup_rounds, args.lr_milestones, args.rounds)


class AlphaList(list):
    """--alpha's values in their canonical form (``canonical_alpha``); ``typed``: as given on the command line,
    which named run folders before names were canonical (found again under --resume: ``legacy_alpha_folder``)."""

    typed: tuple = ()


def alpha_list(text):
    """--alpha: one Dirichlet concentration or a comma-separated list of distinct values (1 and 1.0 are one)."""
    parts = text.split(",")
    values = AlphaList(canonical_alpha(common.positive_float(t)) for t in parts)
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"repeated value in {text} (as numbers: {', '.join(values)})")
    values.typed = tuple(parts)
    return values


def legacy_alpha_folder(folder: str, canonical: str, typed: str) -> str:
    """``folder``, named with an alpha in its canonical form, or the folder a run under the same flags wrote
    before names were canonical (the alpha as typed) where only that one holds a checkpoint to resume."""
    if typed == canonical or os.path.exists(folder):
        return folder
    head, tail = os.path.split(folder)
    old = os.path.join(head, tail.replace(f"a{canonical}", f"a{typed}", 1))
    return old if os.path.isfile(os.path.join(old, "checkpoint.pt")) else folder


def seed_list(text):
    seeds = [common.seed_int(t) for t in text.split(",")]
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"repeated seed in {text}")
    return seeds


def stack_run_name(dataset: str, alpha: str, method: str, seed: int) -> str:
    """A stacked run's folder: validation.experiments' name for the main run of these settings."""
    return f"main-{dataset}-a{alpha}-{method}-s{seed}"


def stack_names(args, combos) -> list:
    """A stack's run folder names, in the order seeds x alphas: --run-names, else validation.experiments' names
    of the main runs (alpha in its canonical form)."""
    alpha_text = [a if a is not None else args.settings.alpha_text for _, a in combos]
    return args.run_names or [
        stack_run_name(args.dataset, a, args.method, s) for (s, _), a in zip(combos, alpha_text, strict=True)
    ]


def check_stack_args(p, args, combos, command: str, stack: RunSettings) -> tuple:
    """Several runs (--seeds / --alpha lists): the settings of each run, its own seed, alpha (resolved with the
    preset as a run alone would be) and folder under --out, on the vectorized engine; a run folder with a
    checkpoint continues under --resume, one without starts.  ``stack``: the command's settings (its first run's,
    made concrete for the device)."""
    if args.engine == "sequential":
        p.error("--seeds / --alpha lists train the runs as one stack on the vectorized engine, not --engine sequential")
    names = stack_names(args, combos)
    if len(names) != len(combos):
        p.error(f"--run-names: {len(names)} names for {len(combos)} runs (seeds x alphas)")
    if len(set(names)) != len(names) or any(not n or os.sep in n or n in (".", "..") for n in names):
        p.error("--run-names: names must be distinct plain folder names")
    for n in names:
        why = reserved_name(n)
        if why:
            p.error(f"--run-names: {why}")
    if args.out is None:
        args.out = default_out(stack, stack=True)
    check_stack_out(p, args.out)
    typed = dict(zip(args.alphas or (), getattr(args.alphas, "typed", ()), strict=False))
    runs = []
    for (seed, alpha), name in zip(combos, names, strict=True):
        run = argparse.Namespace(**vars(args))
        run.seed, run.out, run.runs_parent = seed, os.path.join(args.out, name), args.out
        if args.run_names is None and alpha in typed:
            run.out = legacy_alpha_folder(run.out, alpha, typed[alpha])
        run.alpha, run.alphas = (None, None) if alpha is None else (float(alpha), [alpha])
        run.resume = args.resume and os.path.isfile(os.path.join(run.out, "checkpoint.pt"))
        run.overwrite = args.overwrite
        resolve_into(p, run)
        check_args(p, run)
        settings = dataclasses.replace(on_device(run.settings, stacked=True), out_given=args.settings.out_given)
        runs.append(dataclasses.replace(settings, command=command))
    check_device(p, args, stack)
    return tuple(for_resume(p, run) for run in runs)


def check_stack_out(p, out) -> None:
    """A stack's --out is the parent of its runs' folders: a real folder (not a link), never a run's own result
    folder (a run nested there could no longer be resumed), under a name this tool does not reserve."""
    if not out or not out.strip():
        p.error("--out: empty path")
    why = reserved_name(os.path.basename(os.path.abspath(out)))
    if why:
        p.error(f"--out {out}: {why}")
    if os.path.islink(out):
        p.error(f"--out {out}: is a symbolic link; give the real folder")
    if os.path.lexists(out) and not os.path.isdir(out):
        p.error(f"--out {out}: exists and is not a folder; choose another --out")
    if os.path.isdir(out):
        writer = written_by(out)
        if writer is not None or any(os.path.lexists(os.path.join(out, f)) for f in OUTPUT.files):
            p.error(
                f"--out {out}: is the result folder of {writer or 'a run'}; a stack's --out is the parent of its "
                "runs' folders: choose another --out"
            )


# flags that a preset's setting or its method rows may supply (fedpm_dnn.presets.resolve): None = not given
SETTING_FLAGS = ("dataset", "alpha", "clients", "participants", "local_epochs", "foof_samples")
HYPERPARAMETER_FLAGS = (
    *("lr", "clip", "weight_decay", "mu", "momentum", "server_lr", "momentum_form", "bias_correction", "damping"),
    *("batch_size", "refresh_every", "weighting", "precond_dtype", "param_dtype", "precond_codec", "clip_stage"),
    *("weight_decay_mode", "foof_apply", "foof_precision", "last_batch"),
)


def given_flags(args) -> dict:
    """The flags given explicitly, as the values they stand for (--clip 0: no clip; --foof-samples all: every
    sample, both None)."""
    given = {k: getattr(args, k) for k in SETTING_FLAGS + HYPERPARAMETER_FLAGS if getattr(args, k) is not None}
    if "clip" in given:
        given["clip"] = given["clip"] or None
    if "foof_samples" in given:
        given["foof_samples"] = None if given["foof_samples"] == "all" else int(given["foof_samples"])
    if given.get("foof_precision") == "auto":  # the device decides (concrete_foof_apply): the method's default
        del given["foof_precision"]
    return given


def resolve(args):
    from fedpm_dnn.presets import resolve

    return resolve(args.preset, args.method, given_flags(args))


def check_preset(p, args):
    """A preset's hyper-parameters belong to its data set: another --dataset is refused."""
    from fedpm_dnn.presets import PRESETS

    if args.preset is not None and args.dataset is not None:
        setting = PRESETS[args.preset]["setting"]
        if setting["dataset"] != args.dataset:
            p.error(f"--preset {args.preset} is for --dataset {setting['dataset']}, not {args.dataset}")


def preset_warning(s: RunSettings) -> str | None:
    """One line naming each flag that contradicts the preset's own setting (allowed: the flag wins)."""
    from validation.progress import in_sweep

    conflicts = s.resolved.conflicts
    if not conflicts or in_sweep():  # a sweep's runs: the profile set these flags, not the user
        return None

    def show(key, value):  # None: every client / every sample
        return f"{key.replace('_', '-')} {'all' if value is None else value}"

    flags = ", ".join("--" + show(k, c["flag"]) for k, c in conflicts.items())
    table = ", ".join(show(k, c["preset"]) for k, c in conflicts.items())
    return f"{PROG}: warning: {flags} override{'s' if len(conflicts) == 1 else ''} preset {s.preset}'s {table}"


def check_args(p, args):
    """Cross-flag consistency and the output folder, checked before any data is read."""
    clients = args.resolved.settings["clients"]
    if args.participants is not None and args.dataset != "femnist":  # FEMNIST's writers are counted at load
        if clients is not None and args.participants > clients:
            p.error(f"--participants {args.participants} exceeds --clients {clients}")
        if clients is None and args.participants > DEFAULT_CLIENTS:
            p.error(f"--participants {args.participants} exceeds the {DEFAULT_CLIENTS} clients (default --clients)")
    common.check_max_ratio(p, args)
    if args.gn_groups is not None:
        if args.model != "resnet18gn":
            p.error(f"--gn-groups applies to --model resnet18gn, not to --model {args.model}")
        if 64 % args.gn_groups:
            p.error(f"--gn-groups {args.gn_groups}: must divide 64, the channels of ResNet18-GN's first layer")
    schedule = args.settings.lr_schedule
    for first, _ in schedule.milestones if schedule else ():
        if first > args.rounds:
            p.error(f"--lr-milestones {args.lr_milestones}: a milestone starts at round {first}, after the last round")
    why = vectorized_only(args, args.engine)
    if why:
        p.error(why)
    common.check_out_arg(p, args.out, kind=OUTPUT)
    why = checkpoint_conflict(args)
    if why:
        p.error(why)


def vectorized_only(args, engine: str, device: str | None = None) -> str | None:
    """Why a flag of the vectorized engine (--client-chunk, --step-graph on/off) does not apply to ``engine``, the
    run's engine (``device``: the device --engine auto resolved it for), or None: such a flag is refused, never
    ignored."""
    if engine != "sequential":
        return None
    given = ["--client-chunk"] if args.client_chunk is not None else []
    given += [f"--step-graph {args.step_graph}"] if args.step_graph != "auto" else []
    if not given:
        return None
    what = " and ".join(given)
    verb = "apply" if len(given) > 1 else "applies"
    if device is None:
        return f"{what} {verb} to --engine vectorized (or auto on a GPU), not to --engine sequential"
    return (
        f"{what} {verb} to the vectorized engine, and --engine auto is the sequential one on this {device}: "
        "give --engine vectorized, or leave them out"
    )


def checkpoint_conflict(args) -> str | None:
    """Why --out's checkpoint and --resume do not go together, or None."""
    ckpt = os.path.join(args.out, "checkpoint.pt")
    if os.path.lexists(ckpt) and not os.path.isfile(ckpt):  # a folder (or a dangling link) by that name
        what = "is a folder" if os.path.isdir(ckpt) else "is not a regular file"
        return f"{ckpt}: {what}, not a checkpoint file; move it away or choose another --out"
    if args.resume and not os.path.isfile(ckpt):
        return f"--resume: {ckpt} does not exist; drop --resume to start a new run"
    return None  # a checkpoint not asked to resume: settled once the run is built (settle_previous)


# the flags that do not enter the fingerprint as given (the rest: FINGERPRINT_FIELDS, run_fingerprint); each flag
# is in one of the two (tests/test_settings_boundary.py), so that a new flag is placed, not forgotten.
# out, resume, quiet, device, rounds, data_dir, cache_dir, deadline, budget_minutes, overwrite: where the run writes,
# how it reports, when it stops, where the data is read, what happens to --out's previous run
# engine: the checkpoint records the resolved engine (fedpm_dnn.engine.checkpoint.fingerprint), not the flag, so that
# "auto" and the engine it stands for resume each other
# gn_groups: the resolved group count is in the model's entry of the fingerprint (fedpm_dnn.engine.checkpoint)
# seeds, run_names: how a stack is given (each run's fingerprint has its own seed and alpha), so a stacked run and
# the same run alone resume each other
# step_graph: how the vectorized engine issues its steps (the same kernels, replayed or not), recorded in the summary
# the hyper-parameters and the settings a preset supplies enter the fingerprint resolved, not as flags: the method's
# configuration (config.* in fedpm_dnn.engine.checkpoint.fingerprint) and the client and participant counts the run uses
# (n_clients, participants), so that a flag repeating the preset's value or a default is no difference, and a real
# difference is named by what differs (checkpoints that recorded these flags still resume: fedpm_dnn.engine.checkpoint)
NOT_IN_FINGERPRINT = {
    *("out", "resume", "quiet", "device", "rounds", "data_dir", "cache_dir", "engine", "deadline"),
    *("budget_minutes", "gn_groups", "seeds", "run_names", "overwrite", "step_graph"),
    *HYPERPARAMETER_FLAGS,
    *("local_epochs", "foof_samples", "clients", "participants"),
    *("lr_warmup_rounds", "lr_milestones"),  # in the fingerprint as the resolved lr_schedule (run_fingerprint)
}


def command_fingerprint(argv, run_name: str | None = None) -> dict:
    """What a command line computes, resolved without reading data (``resolved_fingerprint`` of its settings), its
    flags settled as the command itself settles them (``settle``: presets applied, alpha canonical), so that a
    flag left to the preset, or written another way (0.10, 1), is no difference.  A stack's command (--seeds,
    --alpha lists) is read for its run in the folder ``run_name`` (ValueError when it has none of that name).  The
    sweep compares a profile's run with the command a result folder's summary.json records this way
    (validation/sweep.py)."""
    p = build_parser()
    args = p.parse_args(list(argv))
    combos = settle(p, args)
    if len(combos) > 1 or args.seeds is not None or args.run_names is not None:
        names = stack_names(args, combos)
        if run_name not in names or len(names) != len(combos):
            raise ValueError(f"the stack's command has no run {run_name!r}")
        seed, alpha = combos[names.index(run_name)]
        args.seed, args.alpha = seed, None if alpha is None else float(alpha)
        resolve_into(p, args)
    return resolved_fingerprint(args.settings)
