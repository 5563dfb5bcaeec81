"""Executors of a sweep's units (validation/sweep.py): one after another in this process (local), or as Ray tasks
over the GPUs of this machine or of a cluster (ray).

Both run a unit through ``run_unit``, which reads the unit's folders again before it starts, so that a task Ray
retries after its worker died continues from the last checkpoint instead of starting over.  Workers write their
results into the results folder themselves (nothing is sent back but one line per run): across machines that
folder must be on a filesystem every node sees, at the same path.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass

NOT_STARTED = "not started (budget)"
BUSY = "computed by another process"  # its folder is held by another sweep or runner: left to it


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


def _busy(exc) -> str:
    """The outcome of a run whose folder another process holds (validation.outputs.exclusive's refusal)."""
    m = re.search(r"\(pid (\d+)\)", str(exc))
    return f"{BUSY} (pid {m.group(1)})" if m else BUSY


def run_unit(unit, job: Job, round_seconds: dict) -> list[tuple[str, str]]:
    """Compute the runs of ``unit`` that are not done; [(run name, outcome)].  Within a budget, a run starts only
    when its start-up and one round (``round_seconds``: the sweep's estimates) fit before ``job.end``, and gets a
    --deadline that lets the round in progress end before it: it stops checkpointed, partial.  Each run's folder
    is held (validation.outputs.exclusive, as the runner holds it) from before it is read until its outcome is
    known: a run another process is computing (another sweep on the same folder) is left to it (``BUSY``)."""
    from validation.outputs import OutputError, exclusive
    from validation.progress import sweep_runs
    from validation.sweep import DONE, STALE, START_SECONDS, describe, stack_argv, status

    todo, outcomes = [], []
    with contextlib.ExitStack() as held:
        held.enter_context(sweep_runs())  # the runs' flags are the profile's (a Ray worker's too)
        for run in unit:
            folder = os.path.join(job.root, run.name)
            try:
                held.enter_context(exclusive(folder))
            except OutputError as exc:
                outcomes.append((run.name, _busy(exc)))
                continue
            st = status(run, folder)
            if st.state in (DONE, STALE):
                outcomes.append((run.name, describe(run, st)))
                continue
            per_round = round_seconds.get(run.name, 0.0)
            if job.end is not None and time.time() + START_SECONDS + per_round > job.end:
                outcomes.append((run.name, NOT_STARTED))
                continue
            todo.append(run)
        if len(todo) > 1:  # a stack (validation.sweep.stacks): its runs in one validation.dnn call
            return outcomes + _run_stack(todo, job, round_seconds, stack_argv, status, describe)
        for run in todo:
            outcomes.append((run.name, _run_one(run, job, round_seconds.get(run.name, 0.0), status, describe)))
    return outcomes


def _run_stack(todo, job: Job, round_seconds: dict, stack_argv, status, describe) -> list[tuple[str, str]]:
    from validation import dnn
    from validation.sweep import DONE

    per_round = max(round_seconds.get(r.name, 0.0) for r in todo)
    argv = stack_argv(todo) + ["--data-dir", job.data_dir, "--out", job.root, "--quiet", "--device", job.device]
    if any(os.path.isfile(os.path.join(job.root, r.name, "checkpoint.pt")) for r in todo):
        argv.append("--resume")
    if job.end is not None:
        argv += ["--deadline", repr(job.end - per_round)]
    code = _exit_code(dnn.main, argv)
    outcomes = []
    for run in todo:
        st = status(run, os.path.join(job.root, run.name))
        ok = code in (0, dnn.EXIT_PARTIAL) or st.state == DONE
        outcomes.append((run.name, describe(run, st) if ok else f"failed (exit {code})"))
    return outcomes


def _run_one(run, job: Job, per_round: float, status, describe) -> str:
    from validation import dnn, superlinear

    folder = os.path.join(job.root, run.name)
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
    return describe(run, status(run, folder)) if ok else f"failed (exit {code})"


class LocalExecutor:
    """The units one after another, in this process; once one does not fit the budget, none after it starts
    (the priority order holds: a later, shorter unit does not jump the queue)."""

    def map(self, units, job: Job, round_seconds: dict):
        spent = False
        for unit in units:
            outcomes = [(run.name, NOT_STARTED) for run in unit] if spent else run_unit(unit, job, round_seconds)
            spent = spent or any(outcome == NOT_STARTED for _, outcome in outcomes)
            yield unit, outcomes


CONNECT_SECONDS = 10.0  # a cluster address that accepts no connection within this is refused
# Ray's own attempts to reach a cluster's GCS (about 36 s each): its default, 20, waits some 12 minutes on an
# address where something else listens
GCS_ATTEMPTS = 2
STOP_GRACE_SECONDS = 60.0  # after the budget's end, how long the tasks still queued or running are waited for
STOPPED = "stopped at the budget's end (not finished)"


def _host_port(address: str):
    """(host, port) of a cluster address "host:port" or "ray://host:port"; None for one without a port ("auto")."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    return (host.strip("[]"), int(port)) if sep and host and port.isdigit() else None


def _probe(address: str, timeout: float) -> None:
    """A ValueError of one line unless something accepts a TCP connection at ``address`` within ``timeout`` s
    ("auto": the address of the cluster Ray finds on this machine; none found is Ray's own quick error)."""
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            address = canonicalize_bootstrap_address("auto") or ""
        except Exception:  # no local cluster: ray.init says so at once
            return
    where = _host_port(address)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise ValueError(
            f"--executor ray: no Ray cluster at {address}: no connection within {timeout:.0f} s ({why})"
        ) from None


def _connect(ray, address: str | None, timeout: float) -> None:
    """ray.init at ``address`` (None: a Ray started here), every wait bounded: the address is probed first, and
    Ray's own connection attempts are limited to GCS_ATTEMPTS."""
    if address:
        _probe(address, timeout)
    try:
        from ray._private import ray_constants
    except ImportError:  # a Ray without this module: its own attempts stand
        ray_constants = None
    attempts = getattr(ray_constants, "NUM_REDIS_GET_RETRIES", None)
    if attempts is not None:
        ray_constants.NUM_REDIS_GET_RETRIES = min(attempts, GCS_ATTEMPTS)
    # ray.init replaces the SIGTERM handler (Python's with sys.exit, then its core worker's native one, which
    # prints a stack dump): the command's own handlers are put back, so SIGTERM and Ctrl-C stay one line, once it is
    # back.  Its Python handlers (sys.exit: a SIGTERM while Ray starts would end the command without a line) are
    # not installed at all: the command's one handler stays from its first line to its last.
    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        # a Ray started here runs no dashboard (nobody reads it; it only adds start-up time and warnings)
        with _keeping_sigterm_handler():
            ray.init(address=address, log_to_driver=False, **({} if address else {"include_dashboard": False}))
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, Exception... with long messages
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"--executor ray: no Ray cluster at {address or 'this machine'}: {first}") from None
    except BaseException:  # SIGTERM or Ctrl-C while Ray starts: the processes it started so far are stopped
        with contextlib.suppress(Exception):
            ray.shutdown()
        raise
    finally:
        if attempts is not None:
            ray_constants.NUM_REDIS_GET_RETRIES = attempts
        for signum, handler in handlers.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(signum, handler)


@contextlib.contextmanager
def _keeping_sigterm_handler():
    """Within the block Ray's ``set_sigterm_handler`` (called by ray.init for the driver and the node it starts)
    installs nothing; where this Ray has no such function, nothing changes."""
    try:
        from ray._private import utils
    except ImportError:
        yield
        return
    if not callable(getattr(utils, "set_sigterm_handler", None)):
        yield
        return
    original = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original


def task_resources(cluster: dict, gpus_per_task: float | None) -> dict:
    """The resources of one task ({"num_gpus", "num_cpus"}) on a cluster of ``cluster`` (ray.cluster_resources());
    a ValueError of one line where no task could ever be scheduled (Ray would queue it forever)."""
    have_gpus, have_cpus = cluster.get("GPU", 0), cluster.get("CPU", 0)
    gpus = gpus_per_task if gpus_per_task is not None else (1 if have_gpus >= 1 else 0)
    if gpus > have_gpus:
        raise ValueError(
            f"--gpus-per-task {gpus:g}: the Ray cluster has {have_gpus:g} GPUs, so no run could ever start; "
            "give --gpus-per-task 0 to run on its CPUs"
        )
    if have_cpus < 1:
        raise ValueError(f"--executor ray: the Ray cluster has {have_cpus:g} CPUs; each run needs one")
    return {"num_gpus": gpus, "num_cpus": 1}


class RayExecutor:
    """Each unit a Ray task holding ``gpus_per_task`` GPUs (default: 1 where the cluster has GPUs, else 0) and one
    CPU; a task whose worker dies is retried ``max_retries`` times.  Ray's GPU fractions share a device between
    tasks but do not limit the memory each takes.  ``address``: an existing cluster ("auto", "ray://host:10001");
    None: $RAY_ADDRESS, else a Ray started here on this machine's devices.

    Every wait is bounded: an address that accepts no connection within CONNECT_SECONDS (or the budget left, if
    less) is refused; so is a task no node could ever run (more GPUs than the cluster has); with a budget, the
    tasks not finished STOP_GRACE_SECONDS after its end are cancelled (a running one loses the round in progress
    since its last checkpoint; the next call continues it)."""

    def __init__(self, address: str | None = None, gpus_per_task: float | None = None, max_retries: int = 3):
        self.address, self.gpus_per_task, self.max_retries = address, gpus_per_task, max_retries

    def map(self, units, job: Job, round_seconds: dict):
        try:
            import ray
        except ImportError:
            from fedconvex.extras import install_hint

            raise ValueError("--executor ray: " + install_hint("Ray", "flower")) from None
        started = not ray.is_initialized()
        if started:
            timeout = CONNECT_SECONDS if job.end is None else max(1.0, min(CONNECT_SECONDS, job.end - time.time()))
            _connect(ray, self.address or os.environ.get("RAY_ADDRESS") or None, timeout)
        try:
            resources = task_resources(ray.cluster_resources(), self.gpus_per_task)
            task = ray.remote(run_unit).options(**resources, max_retries=self.max_retries)
            pending = {task.remote(unit, job, round_seconds): unit for unit in units}
            stop = None if job.end is None else job.end + STOP_GRACE_SECONDS
            while pending:
                wait = None if stop is None else max(0.0, stop - time.time())
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
                if not ready:  # the budget is spent and its grace too: what is left is stopped
                    for ref, unit in list(pending.items()):
                        ray.cancel(ref, force=True)
                        yield unit, [(run.name, STOPPED) for run in unit]
                    return
                ready = ready[0]
                unit = pending.pop(ready)
                try:
                    yield unit, ray.get(ready)
                except ray.exceptions.RayError as exc:  # retries spent, or the task raised
                    why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    yield unit, [(run.name, f"failed ({why})") for run in unit]
        finally:
            if started:
                ray.shutdown()
