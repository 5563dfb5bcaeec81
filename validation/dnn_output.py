"""What a run of ``python -m validation.dnn`` finds in and writes into its --out folder: a previous run's
checkpoint settled (the same run done, another run refused, --overwrite), the folder marked as this tool's and left
as found when no round completed, history.csv and summary.json after every round, and a failure's cause recorded in
the summary."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shlex
import shutil

import numpy as np

from fedconvex.files import DamagedFile, FolderSwapped, NotARegularFile, read_json_object, written_atomically
from fedconvex.results import read_summary
from validation import common
from validation.dnn_cli import OUTPUT, PROG
from validation.outputs import mark, written_by
from validation.run_settings import RunSettings


def settle_previous(run: RunSettings, exp, stacked: bool = False) -> tuple[str | None, RunSettings]:
    """For a run whose --out holds a checkpoint it was not asked to resume: with --overwrite the previous run's
    files are removed; when the checkpoint is this very run (the fingerprint compared resolved) with its rounds
    done, the line saying so (nothing to compute); else one line refusing it (exit 2): another run, or this one
    unfinished (--resume continues it).  Returns (that line or None, the run's settings: resuming where its files
    are written again from the checkpoint)."""
    from fedpm_dnn.engine import checkpoint as ck

    path = os.path.join(run.out, "checkpoint.pt")
    if run.resume or not os.path.lexists(path):
        return None, run
    if run.overwrite:
        for name in OUTPUT.files:  # a folder of ours holding only these (check_args, under the lock)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(run.out, name))
        return None, run
    try:
        done, diff = ck.stored(path, exp)
    except ck.CheckpointError as exc:
        common.fail(PROG, ValueError(f"{exc}, or --overwrite to replace it"))
    if diff:
        common.fail(
            PROG,
            ValueError(
                f"--out {run.out}: holds another run ({stack_advice(diff, run) if stacked else diff}); choose "
                "another --out, or --overwrite to replace it"
            ),
        )
    if done < run.rounds:
        common.fail(
            PROG,
            ValueError(
                f"--out {run.out}: holds {done} of the {run.rounds} rounds of this run; pass --resume to continue "
                "it, or --overwrite to start over"
            ),
        )
    damaged = outputs_problem(run.out, done)
    if damaged:  # the checkpoint holds every round's row: the files are written again from it (no round is run)
        if done > run.rounds:
            common.fail(
                PROG,
                ValueError(f"--out {run.out}: {damaged}; --rounds {done} writes history.csv and summary.json again"),
            )
        rounds = f"{done} round{'s' if done != 1 else ''}"
        print(f"{run.out}: {damaged}; history.csv and summary.json written again from checkpoint.pt ({rounds})")
        return None, dataclasses.replace(run, resume=True)
    best = ""
    with contextlib.suppress(ValueError, OSError, TypeError, KeyError):
        summary = read_summary(os.path.join(run.out, "summary.json"))  # its fields in range (fedconvex.results)
        best = f", best test accuracy {float(summary['best_test_acc']):.4f}"
    rounds = f"{done} round{'s' if done != 1 else ''}"
    return f"{run.out} already holds this run ({rounds}{best}); nothing to compute ({extend_advice(run)})", run


def extend_advice(run: RunSettings) -> str:
    """How to recompute or extend a finished run, in words that find it again: a default --out names the rounds,
    so more --rounds without it would name another folder; the folder is then given."""
    stacked = run.runs_parent
    out = stacked or run.out
    where = "" if run.out_given else f" --out {shlex.quote(out)}"
    what = "the stack" if stacked else "it"
    return f"--overwrite recomputes {what}; --resume --rounds N{where}, N more than now, extends {what}"


def outputs_problem(out: str, rounds: int) -> str | None:
    """What is wrong with a finished run's history.csv and summary.json (missing, damaged, fewer rows than the
    checkpoint's ``rounds``), or None."""
    from fedconvex.history import read_run

    missing = [name for name in ("history.csv", "summary.json") if not os.path.lexists(os.path.join(out, name))]
    if missing:
        return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
    try:
        read_json_object(os.path.join(out, "summary.json"))
    except (ValueError, OSError) as exc:
        return f"summary.json is damaged ({exc})"
    try:
        rows = read_run(os.path.join(out, "history.csv"))
    except (ValueError, OSError, KeyError) as exc:
        return f"history.csv is damaged ({exc})"
    if [r.get("round") for r in rows] != list(range(1, rounds + 1)):
        return f"history.csv does not hold rounds 1 to {rounds} as the checkpoint does"
    return None


def stack_advice(why: str, run: RunSettings) -> str:
    """``why`` (a checkpoint's difference) with the engine advice made one a stack can follow: a stack trains on
    the vectorized engine, so a run checkpointed by another engine continues alone."""
    import re

    from fedpm_dnn.engine.checkpoint import ENGINE_ADVICE

    pattern = re.escape(ENGINE_ADVICE).replace(re.escape("{}"), r"(\w+)")
    return re.sub(
        pattern,
        lambda m: (
            f"a stack trains on the vectorized engine: resume this run alone, with --engine {m.group(1)} "
            f"--out {run.out}"
        ),
        why,
    )


def write_atomic(path, text):
    with written_atomically(path) as fh:  # into a held --out only while it stands there (run)
        fh.write(text)


def write_outputs(out, history, summary):
    from fedconvex.history import history_csv
    from fedpm_dnn.engine.simulation import HISTORY_COLUMNS

    write_atomic(os.path.join(out, "history.csv"), history_csv(history, columns=HISTORY_COLUMNS))
    write_atomic(os.path.join(out, "summary.json"), json.dumps(summary, indent=2))


def summarize(desc, history, command):
    import torch

    accs = [r["test_acc"] for r in history]
    n = len(history)
    return {
        **desc,
        "rounds_done": n,
        "best_test_acc": max(accs) if accs else None,
        "final_test_acc": accs[-1] if accs else None,
        "mean_client_seconds_per_round": float(np.mean([r["client_seconds"] for r in history])) if n else None,
        "mean_server_seconds_per_round": float(np.mean([r["server_seconds"] for r in history])) if n else None,
        "bytes_up_per_round": history[-1]["bytes_up"] / n if n else None,
        "bytes_down_per_round": history[-1]["bytes_down"] / n if n else None,
        "peak_memory_mb": max(r["peak_memory_mb"] for r in history) if n else None,
        "command": command,
        "torch_threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        **common.provenance(
            torch.cuda.get_device_name(desc["device"]) if str(desc["device"]).startswith("cuda") else "none"
        ),
    }


def open_out(out) -> str:
    """Create ``out`` (marked as ours) if needed: 'created' (this run made it), 'marked' (it was an empty folder,
    now marked as ours) or 'ours' (a previous result)."""
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    if created or written_by(out) is None:  # new, or empty (check_args refused anything else)
        mark(out, PROG)
        return "created" if created else "marked"
    return "ours"


def undo_open_out(out, state: str, held) -> None:
    """A run that ended before its first round leaves ``out`` as it found it: a folder it created is removed,
    the marker it put into an empty folder too; nothing when ``out`` no longer names the ``held`` folder (it was
    swapped for someone else's)."""
    from validation.outputs import MARKER

    if held.problem():
        return
    if state == "created":
        shutil.rmtree(out, ignore_errors=True)
    elif state == "marked" and os.listdir(out) == [MARKER]:
        os.remove(os.path.join(out, MARKER))


def nobody_contributed(history, exp) -> str | None:
    """Why a finished run is no result: every reply of every round was rejected (the model never moved from its
    initialisation), or None.  Such a run must not end as a success with an accuracy."""
    per_round = min(exp.participants or len(exp.clients), len(exp.clients))
    if not history or any(int(row.get("rejected", 0)) < per_round for row in history):
        return None
    return (
        f"no client contributed to any of the {len(history)} rounds: every reply was rejected (the reasons are "
        "logged above), so the model never left its initialisation"
    )


def discard_outputs(out, state: str, held) -> None:
    """Remove what a run that is no result wrote into ``out`` (its files, then as ``undo_open_out``); nothing when
    ``out`` no longer names the ``held`` folder."""
    if held.problem():
        return
    for name in OUTPUT.files:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, name))
    undo_open_out(out, state, held)


def fail_run(run: RunSettings, exc):
    # keep what the run reached, and say why it stopped (a re-run would stop the same way)
    if isinstance(exc, ArithmeticError):
        common.fail(PROG, ArithmeticError(note_failure(os.path.join(run.out, "summary.json"), exc)))
    if isinstance(exc, OSError):  # a full disk, a folder made read-only: each file is replaced whole
        kept = os.path.isfile(os.path.join(run.out, "checkpoint.pt"))
        common.fail(
            PROG,
            OSError(
                f"{exc}; "
                + (f"{run.out} keeps the rounds done so far (--resume continues)" if kept else "nothing was written")
            ),
        )
    common.fail(PROG, exc)


def note_failure(summary_path, exc) -> str:
    """Record a diverged run's cause in its summary.json (the rounds before it stay); the line that reports it,
    which also names the summary when it is damaged or its folder was swapped (it is then left as it is)."""
    if not os.path.isfile(summary_path):
        return str(exc)
    try:
        partial = read_json_object(summary_path)
        write_atomic(summary_path, json.dumps({**partial, "failed": str(exc)}, indent=2))
    except (DamagedFile, NotARegularFile, FolderSwapped, OSError) as why:
        return f"{exc}; not recorded in the summary: {why}"
    return str(exc)
