"""Paper Test 2: federated DNN training with FedPM (FOOF) and its baselines.

    python -m validation.dnn --dataset cifar10 --data-dir DATA --model cnn --method fedpm \\
        --alpha 0.1 --clients 10 --participants 10 --rounds 100 --local-epochs 5 --preset cifar10-a0.1 --out DIR

Writes DIR/history.csv, DIR/summary.json (with the per-client class-count table) and
DIR/checkpoint.pt every round; ``--resume`` continues a killed run to the identical result.
``--deadline T`` (seconds since the epoch) ends the run after the round in which T passes, checkpointed, with
exit status 75 (EXIT_PARTIAL): the sweep's budget clock (validation/sweep.py) stops runs this way.

``--seeds 0,1,2`` and ``--alpha 0.1,1.0`` (lists: one run per combination) train the runs together as one
stack on the vectorized engine (``fedpm_dnn.engine.stacked_runs``); DIR is then the parent of one folder per run,
named as ``validation.experiments`` names its main runs (main-<dataset>-a<alpha>-<method>-s<seed>, or
``--run-names``).
"""

# The command is split where a reader looks for one thing: its flags (validation.dnn_cli), the experiment they
# describe (validation.dnn_experiment), what a run writes (validation.dnn_output) and the stacked runs
# (validation.dnn_stack); this module is the entry point and the single run, and every name stays importable here.

from __future__ import annotations

import contextlib
import os
import sys
import time

from fedconvex.files import FolderSwapped, held_folder
from validation import common, dnn_cli, dnn_output, progress
from validation.dnn_cli import (
    DEFAULT_ENGINE,
    EXIT_PARTIAL,
    HYPERPARAMETER_FLAGS,
    NOT_IN_FINGERPRINT,
    OUTPUT,
    PROG,
    SETTING_FLAGS,
    alpha_list,
    build_parser,
    check_args,
    check_natural_split,
    check_preset,
    check_stack_args,
    check_stack_out,
    checkpoint_conflict,
    command_fingerprint,
    default_out,
    given_flags,
    lr_schedule,
    milestones_arg,
    preset_warning,
    resolve,
    resolve_into,
    seed_list,
    settings_from,
    stack_run_name,
)
from validation.dnn_experiment import (
    balanced_subset,
    build,
    subset_problem,
)
from validation.dnn_output import (
    fail_run,
    note_failure,
    open_out,
    settle_previous,
    stack_advice,
    summarize,
    undo_open_out,
    write_atomic,
    write_outputs,
)
from validation.dnn_stack import (
    main_stack,
    stack_held,
)
from validation.outputs import sigterm_as_exit
from validation.progress import Progress
from validation.run_settings import (
    AUTO_ENGINE,
    AUTO_FOOF_APPLY,
    DEFAULT_CLIENTS,
    FINGERPRINT_FIELDS,
    FOOF_AUTO,
    RunSettings,
    on_device,
    recorded_choices,
    resolved_augment,
    resolved_fingerprint,
    run_fingerprint,
    torch_device_type,
)

# the names other modules and tests use from validation.dnn, wherever they now live
__all__ = [
    "AUTO_ENGINE",
    "AUTO_FOOF_APPLY",
    "DEFAULT_CLIENTS",
    "DEFAULT_ENGINE",
    "EXIT_PARTIAL",
    "FINGERPRINT_FIELDS",
    "FOOF_AUTO",
    "HYPERPARAMETER_FLAGS",
    "NOT_IN_FINGERPRINT",
    "OUTPUT",
    "PROG",
    "RunSettings",
    "SETTING_FLAGS",
    "alpha_list",
    "balanced_subset",
    "build",
    "build_parser",
    "check_args",
    "check_natural_split",
    "check_preset",
    "check_stack_args",
    "check_stack_out",
    "checkpoint_conflict",
    "command_fingerprint",
    "default_out",
    "fail_run",
    "given_flags",
    "lr_schedule",
    "main",
    "main_stack",
    "milestones_arg",
    "note_failure",
    "on_device",
    "open_out",
    "parse_args",
    "preset_warning",
    "recorded_choices",
    "resolve",
    "resolve_into",
    "resolved_augment",
    "resolved_fingerprint",
    "run",
    "run_fingerprint",
    "run_held",
    "seed_list",
    "settings_from",
    "settle_previous",
    "stack_advice",
    "stack_held",
    "stack_run_name",
    "subset_problem",
    "summarize",
    "torch_device_type",
    "undo_open_out",
    "write_atomic",
    "write_outputs",
]


def parse_args(argv=None) -> RunSettings:
    """The command's settings, resolved once (validation.dnn_cli.parse_args), with this docstring's examples in
    --help."""
    return dnn_cli.parse_args(argv, doc=__doc__)


def main(argv=None) -> int:
    if not {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):  # --help answers without torch
        require_torch()  # before the flags: resolving them reads the methods' settings, which need torch
    settings = parse_args(argv)  # the boundary: below it, only these settings travel
    runs = settings.runs or (settings,)
    # a stack: --out is the parent of its runs' folders, each held and checked as a run's own; the lock creates
    # the parent and removes it again when the stack leaves it empty
    with contextlib.ExitStack() as held:
        for r in runs:
            held.enter_context(common.holding_out(PROG, r.out, OUTPUT))
        for r in runs:
            why = checkpoint_conflict(r)  # again, now that no other run can change it
            if why:
                common.fail(PROG, ValueError(why))
        return run(settings)


def require_torch() -> None:
    """One line naming what to install where torch (the [dnn] extra) is missing, not an import's traceback."""
    try:
        import torch  # noqa: F401
    except ImportError:
        from fedconvex.extras import install_hint

        common.fail(PROG, ImportError(install_hint("torch", "dnn")))


def run(settings: RunSettings) -> int:
    import torch

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    from fedpm_dnn.data import DatasetError

    if settings.device == "cuda" and not torch.cuda.is_available():  # the machine, not the flags: checked here
        common.fail(PROG, ValueError("--device cuda: no CUDA device is visible to torch"))

    if settings.runs:
        return main_stack(settings)
    try:
        exp, desc = build(settings)
    except (DatasetError, ValueError, OSError) as exc:
        common.fail(PROG, exc)
    warning = preset_warning(settings)  # after the checks: an error stays one line
    if warning:
        print(warning, file=sys.stderr)
    exp.meta["fingerprint"] = run_fingerprint(settings)
    done, settings = settle_previous(settings, exp)
    if done:
        print(done)
        return 0
    try:
        opened = open_out(settings.out)
    except OSError as exc:
        common.fail(PROG, exc)
    with held_folder(settings.out) as held:  # every write below goes into this folder, never through a swapped path
        return run_held(settings, exp, desc, opened, held)


def cost_line(exp) -> str | None:
    """fedpm_dnn.cost's line for a FedPM run (None for other methods), on a model of its own built with the
    random generators forked, so that the run itself draws exactly what it drew without it."""
    import torch

    from fedpm_dnn.foof.run_cost import method_line
    from fedpm_dnn.models import make_model

    with torch.random.fork_rng(devices=[]):
        model = make_model(exp.model, exp.num_classes, exp.in_channels, exp.image_size, exp.gn_groups)
    return method_line(exp.cfg, model, exp.clients)


def run_held(s: RunSettings, exp, desc, opened, held) -> int:
    from fedpm_dnn.engine.simulation import run_experiment

    ckpt = os.path.join(s.out, "checkpoint.pt")
    bar = Progress(s.rounds, f"{s.method}", enabled=not s.quiet)

    def on_round(row, history):
        # results on disk after every round, each file replaced atomically
        bar.done = row["round"] - 1
        bar.update(1, f"round {row['round']} acc {row['test_acc']:.3f}")
        progress.round_done(os.path.basename(os.path.normpath(s.out)), row["round"], s.rounds)
        dnn_output.write_outputs(s.out, history, summarize(desc, history, s.command))

    if not s.quiet:
        line = cost_line(exp)
        if line:
            print(line)
    start = time.perf_counter()
    past_deadline = (lambda row: time.time() >= s.deadline) if s.deadline else None  # noqa: E731
    try:
        with sigterm_as_exit():  # SIGTERM unwinds like Ctrl-C, so the cleanup below runs
            history = run_experiment(exp, checkpoint=ckpt, resume=s.resume, on_round=on_round, stop=past_deadline)
    except BaseException as exc:
        # no round completed: leave --out as it was found, as if never started
        if not held.problem() and not os.path.exists(ckpt):
            undo_open_out(s.out, opened, held)
        if isinstance(exc, KeyboardInterrupt) and os.path.exists(ckpt):  # said in one line (run_command)
            raise type(exc)(f"{s.out} keeps the rounds done so far; --resume continues") from None
        if not isinstance(exc, (ArithmeticError, ValueError, OSError)):
            raise
        fail_run(s, exc)
    void = dnn_output.nobody_contributed(history, exp)
    if void:
        dnn_output.discard_outputs(s.out, opened, held)
        common.fail(PROG, RuntimeError(f"{void}; nothing was kept in {s.out}"))
    summary = summarize(desc, history, s.command)
    try:
        dnn_output.write_outputs(s.out, history, summary)
    except KeyboardInterrupt as exc:  # each file is replaced whole: the last round's files stand
        raise type(exc)(f"{s.out} keeps the rounds done so far; --resume continues") from None
    except (OSError, FolderSwapped) as exc:
        fail_run(s, exc)
    print(
        f"{s.method}: best test accuracy {summary['best_test_acc']:.4f}, final {summary['final_test_acc']:.4f} "
        f"after {len(history)} rounds ({time.perf_counter() - start:.1f}s)"
    )
    print(f"wrote {s.out}/history.csv, summary.json, checkpoint.pt")
    print(f"reproduce: {s.command}")
    if len(history) < s.rounds:  # only --deadline ends a run early
        print(f"stopped at --deadline after {len(history)} of {s.rounds} rounds; --resume continues")
        return EXIT_PARTIAL
    return 0


if __name__ == "__main__":
    sys.exit(common.run_command(PROG, main))
