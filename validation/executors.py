"""Executors of a sweep's units (validation/sweep.py): one after another in this process (local), or as Ray tasks
over the GPUs of this machine or of a cluster (ray).

Both run a unit through ``run_unit``, which reads the unit's folders again before it starts, so that a task Ray
retries after its worker died continues from the last checkpoint instead of starting over.  Workers write their
results into the results folder themselves (nothing is sent back but one line per run): across machines that
folder must be on a filesystem every node sees, at the same path.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

NOT_STARTED = "not started (budget)"


@dataclass(frozen=True)
class Job:
    """What every unit of one sweep call shares (sent to Ray workers as is)."""

    root: str  # results/<profile>
    data_dir: str  # image data ('' : the runner's default, $FEDPM_DATA)
    end: float | None = None  # the budget's end, seconds since the epoch (None: no budget)
    device: str = "auto"  # --device of the DNN runs


def _exit_code(main, argv) -> int:
    try:
        code = main(argv)
    except SystemExit as exc:  # a run that fails has printed its one-line reason
        code = exc.code
    return code if isinstance(code, int) else (0 if code is None else 1)


def run_unit(unit, job: Job, round_seconds: dict) -> list[tuple[str, str]]:
    """Compute the runs of ``unit`` that are not done; [(run name, outcome)].  Within a budget, a run starts only
    when its start-up and one round (``round_seconds``: the sweep's estimates) fit before ``job.end``, and gets a
    --deadline that lets the round in progress end before it: it stops checkpointed, partial."""
    from validation import dnn, superlinear
    from validation.sweep import DONE, STALE, START_SECONDS, describe, status

    todo, outcomes = [], []
    for run in unit:
        folder = os.path.join(job.root, run.name)
        st = status(run, folder)
        if st.state in (DONE, STALE):
            outcomes.append((run.name, describe(run, st)))
            continue
        per_round = round_seconds.get(run.name, 0.0)
        if job.end is not None and time.time() + START_SECONDS + per_round > job.end:
            outcomes.append((run.name, NOT_STARTED))
            continue
        todo.append(run)
    if len(todo) > 1:  # a stack (validation.experiments.stacks): its runs in one validation.dnn call
        from validation.experiments import stack_argv

        per_round = max(round_seconds.get(r.name, 0.0) for r in todo)
        argv = stack_argv(todo) + ["--data-dir", job.data_dir, "--out", job.root, "--quiet", "--device", job.device]
        if any(os.path.isfile(os.path.join(job.root, r.name, "checkpoint.pt")) for r in todo):
            argv.append("--resume")
        if job.end is not None:
            argv += ["--deadline", repr(job.end - per_round)]
        code = _exit_code(dnn.main, argv)
        for run in todo:
            folder = os.path.join(job.root, run.name)
            st = status(run, folder)
            ok = code in (0, dnn.EXIT_PARTIAL) or st.state == DONE
            outcomes.append((run.name, describe(run, st) if ok else f"failed (exit {code})"))
        return outcomes
    for run in todo:
        folder = os.path.join(job.root, run.name)
        per_round = round_seconds.get(run.name, 0.0)
        if run.kind == "superlinear":
            code = _exit_code(superlinear.main, list(run.argv) + ["--out", folder])
        else:
            argv = list(run.argv) + ["--data-dir", job.data_dir, "--out", folder, "--quiet", "--device", job.device]
            if os.path.isfile(os.path.join(folder, "checkpoint.pt")):
                argv.append("--resume")
            if job.end is not None:
                argv += ["--deadline", repr(job.end - per_round)]
            code = _exit_code(dnn.main, argv)
        ok = code in (0, dnn.EXIT_PARTIAL)
        outcomes.append((run.name, describe(run, status(run, folder)) if ok else f"failed (exit {code})"))
    return outcomes


class LocalExecutor:
    """The units one after another, in this process; once one does not fit the budget, none after it starts
    (the priority order holds: a later, shorter unit does not jump the queue)."""

    def map(self, units, job: Job, round_seconds: dict):
        spent = False
        for unit in units:
            outcomes = [(run.name, NOT_STARTED) for run in unit] if spent else run_unit(unit, job, round_seconds)
            spent = spent or any(outcome == NOT_STARTED for _, outcome in outcomes)
            yield unit, outcomes


class RayExecutor:
    """Each unit a Ray task holding ``gpus_per_task`` GPUs (default: 1 where the cluster has GPUs, else 0) and one
    CPU; a task whose worker dies is retried ``max_retries`` times.  Ray's GPU fractions share a device between
    tasks but do not limit the memory each takes.  ``address``: an existing cluster ("auto", "ray://host:10001");
    None: $RAY_ADDRESS, else a Ray started here on this machine's devices."""

    def __init__(self, address: str | None = None, gpus_per_task: float | None = None, max_retries: int = 3):
        self.address, self.gpus_per_task, self.max_retries = address, gpus_per_task, max_retries

    def map(self, units, job: Job, round_seconds: dict):
        try:
            import ray
        except ImportError:
            raise ValueError("--executor ray: ray is not installed: pip install -e '.[flower]'") from None
        started = not ray.is_initialized()
        if started:
            address = self.address or os.environ.get("RAY_ADDRESS") or None
            try:
                ray.init(address=address)
            except Exception as exc:  # Ray raises ConnectionError, RuntimeError, Exception... with long messages
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise ValueError(f"--executor ray: no Ray cluster at {address or 'this machine'}: {first}") from None
        try:
            gpus = self.gpus_per_task
            if gpus is None:
                gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
            task = ray.remote(run_unit).options(num_gpus=gpus, num_cpus=1, max_retries=self.max_retries)
            pending = {task.remote(unit, job, round_seconds): unit for unit in units}
            while pending:
                (ready,), _ = ray.wait(list(pending), num_returns=1)
                unit = pending.pop(ready)
                try:
                    yield unit, ray.get(ready)
                except ray.exceptions.RayError as exc:  # retries spent, or the task raised
                    why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    yield unit, [(run.name, f"failed ({why})") for run in unit]
        finally:
            if started:
                ray.shutdown()
