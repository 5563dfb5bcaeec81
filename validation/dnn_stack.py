"""Several runs of ``python -m validation.dnn`` (--seeds / --alpha lists) trained together as one stack on the
vectorized engine (``fedpm_dnn.engine.stacked_runs``), each run writing its own folder under --out as a single run
does."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

from fedconvex.files import FolderSwapped, held_folder
from validation import common, dnn_output, progress
from validation.dnn_cli import EXIT_PARTIAL, PROG, preset_warning
from validation.dnn_experiment import build
from validation.dnn_output import note_failure, open_out, settle_previous, stack_advice, summarize, undo_open_out
from validation.outputs import sigterm_as_exit
from validation.progress import Progress
from validation.run_settings import RunSettings, run_fingerprint


def main_stack(stack: RunSettings) -> int:
    """The runs of ``stack.runs`` trained as one stack (``fedpm_dnn.engine.stacked_runs``), each writing its own
    folder as a single run does; a run that fails says why in one line and in its summary, the others go on."""
    from fedpm_dnn.data import DatasetError

    built, finished, runs = [], [], []
    for run in stack.runs:
        try:
            exp, desc = build(run)
        except (DatasetError, ValueError, OSError) as exc:
            common.fail(PROG, exc)
        exp.meta["fingerprint"] = run_fingerprint(run)
        done, run = settle_previous(run, exp, stacked=True)
        if done:  # nothing to compute: it stays out of the stack
            finished.append(done)
            continue
        runs.append(run)
        built.append((exp, {**desc, "stack": {"runs": [os.path.basename(r.out) for r in stack.runs]}}))
    for warning in dict.fromkeys(preset_warning(run) for run in stack.runs):  # as a single run, once per distinct line
        if warning:
            print(warning, file=sys.stderr)
    for line in finished:
        print(line)
    if not runs:
        return 0
    stack = dataclasses.replace(stack, runs=tuple(runs))
    try:
        os.makedirs(stack.out, exist_ok=True)
        opened = [open_out(run.out) for run in runs]
    except OSError as exc:
        common.fail(PROG, exc)
    with contextlib.ExitStack() as held_stack:  # each run writes into its folder, never through a swapped path
        held = [held_stack.enter_context(held_folder(run.out)) for run in runs]
        return stack_held(stack, built, opened, held)


def stack_held(stack: RunSettings, built, opened, held) -> int:
    from fedpm_dnn.engine.stacked_runs import run_stack

    runs = stack.runs
    bar = Progress(stack.rounds * len(runs), f"{stack.method} x{len(runs)} runs", enabled=not stack.quiet)

    def on_round(run, desc):
        first = {"round": True}

        def write(row, history):
            if first.pop("round", False):  # the rounds a resumed run did before this process: counted, not timed
                bar.done = bar.done + row["round"] - 1
            bar.update(1, f"{os.path.basename(run.out)} round {row['round']} acc {row['test_acc']:.3f}")
            progress.round_done(os.path.basename(run.out), row["round"], run.rounds)
            dnn_output.write_outputs(run.out, history, summarize(desc, history, stack.command))

        return write

    ckpts = [os.path.join(run.out, "checkpoint.pt") for run in runs]
    start = time.perf_counter()
    past_deadline = (lambda row: time.time() >= stack.deadline) if stack.deadline else None  # noqa: E731
    try:
        with sigterm_as_exit():
            results = run_stack(
                [exp for exp, _ in built],
                ckpts,
                [run.resume for run in runs],
                [on_round(r, d) for r, (_, d) in zip(runs, built, strict=True)],
                stop=past_deadline,
            )
    except BaseException as exc:
        for run, ck, state, h in zip(runs, ckpts, opened, held, strict=True):
            if not h.problem() and not os.path.exists(ck):
                undo_open_out(run.out, state, h)
        if isinstance(exc, KeyboardInterrupt):
            raise type(exc)(f"{stack.out}: every run keeps the rounds done so far; --resume continues") from None
        raise
    failed, stopped = 0, []
    for run, (built_exp, desc), ck, state, h, out in zip(runs, built, ckpts, opened, held, results, strict=True):
        name = os.path.basename(run.out)
        void = None if isinstance(out, BaseException) else dnn_output.nobody_contributed(out, built_exp)
        if void:
            dnn_output.discard_outputs(run.out, state, h)
            print(f"{PROG}: {name}: {void}; nothing was kept", file=sys.stderr)
            failed += 1
            continue
        if not isinstance(out, BaseException):
            summary = summarize(desc, out, stack.command)
            try:
                dnn_output.write_outputs(run.out, out, summary)
            except (OSError, FolderSwapped) as exc:
                out = exc
        if isinstance(out, BaseException):
            failed += 1
            if not h.problem() and not os.path.exists(ck):
                undo_open_out(run.out, state, h)
            if isinstance(out, ArithmeticError):
                out = note_failure(os.path.join(run.out, "summary.json"), out)
            print(f"{PROG}: {name}: {stack_advice(str(out), run)}", file=sys.stderr)
            continue
        if len(out) < run.rounds:  # only --deadline ends a run early
            stopped.append(f"{name} after {len(out)}")
        print(f"{name}: best test accuracy {summary['best_test_acc']:.4f}, final {summary['final_test_acc']:.4f}")
    done = len(runs) - failed - len(stopped)
    print(f"{done} of {len(runs)} runs done as one stack ({time.perf_counter() - start:.1f}s); wrote {stack.out}")
    print(f"reproduce: {stack.command}")
    if stopped:
        print(f"stopped at --deadline: {', '.join(stopped)} of {stack.rounds} rounds; --resume continues")
    return 1 if failed else (EXIT_PARTIAL if stopped else 0)
