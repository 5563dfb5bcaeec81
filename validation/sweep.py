"""The sweep's planner: which runs of a profile exist, in which order the rest are computed, and a budget clock.

The results folder is the sweep's only state.  A run's folder is read, never trusted blindly:

* done     summary.json and history.csv parse, history.csv holds the rounds the profile asks for (or the run
           diverged and said so), and the command summary.json records has the profile's configuration
           fingerprint (validation.dnn_cli.command_fingerprint: every flag that shapes the run; the data itself is
           checked by the checkpoint's fingerprint when a run resumes);
* partial  fewer rounds, with a checkpoint.pt to continue from (validation.dnn --resume);
* missing  nothing usable (a folder without a checkpoint is recomputed from round 1);
* stale    the folder holds a different configuration: it is never overwritten, the sweep names the flag.

Any number of calls, on any machines that see the folder, therefore fill a profile in the same priority order
(``priority``): Table 3's CIFAR-10 alpha = 0.1 column first (FedPM and FedAvg, seed by seed, then the other
methods), then alpha = 1.0, FEMNIST, CIFAR-100, the ablations, and the convex runs last.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
import shlex
import time
from dataclasses import dataclass

from fedconvex.results import read_history, read_summary
from fedpm_dnn.method_names import METHOD_NAMES as METHODS  # the names alone: no torch before a command parses

DNN_METHODS = METHODS  # the DNN registry's methods, in the paper's order (the plan's and the priority's)

DONE, PARTIAL, MISSING, STALE = "done", "partial", "missing", "stale"

# Table 3's columns (and FEMNIST's table) in the order they are filled; within each, FedPM and FedAvg first
COLUMNS = ("cifar10-a0.1", "cifar10-a1.0", "femnist", "cifar100-a0.1", "cifar100-a1.0")
FIRST_METHODS = ("fedpm", "fedavg")
MAIN_RUN = re.compile(r"main-(?P<column>.+)-(?P<method>[a-z0-9]+)-s(?P<seed>\d+)")
SEED_SUFFIX = re.compile(r"-s\d+$")
# what a run costs besides its rounds (process start, data loading, the last writes): reserved from the budget
START_SECONDS = 20.0


@dataclass(frozen=True)
class Status:
    state: str  # DONE, PARTIAL, MISSING or STALE
    rounds_done: int = 0
    round_seconds: float | None = None  # measured wall seconds per round (history.csv), on ``device``
    device: str | None = None
    machine: str | None = None  # the machine that measured it: summary.json's gpu on cuda, its cpu elsewhere
    why: str = ""  # STALE: what differs; DONE: "diverged" when the run stopped on a divergence


def priority(runs) -> list:
    """``runs`` in the order a sweep computes them (stable: the plan's order within a group)."""

    def key(item):
        index, run = item
        m = MAIN_RUN.fullmatch(run.name)
        column = m and next((i for i, c in enumerate(COLUMNS) if m["column"].startswith(c)), None)
        if column is not None:
            method = m["method"]
            order = DNN_METHODS.index(method) if method in DNN_METHODS else len(DNN_METHODS)
            tier = 0 if method in FIRST_METHODS else 1
            first = FIRST_METHODS.index(method) if tier == 0 else order
            return (column, tier, int(m["seed"]), first, index)
        return (len(COLUMNS) + (run.kind != "dnn"), 0, 0, 0, index)

    return [r for _, r in sorted(enumerate(runs), key=key)]


def units(runs, group=None) -> list[tuple]:
    """The units of work: tuples of runs computed together (``group(runs) -> [[run, ...], ...]``, e.g. seeds
    stacked on a batch axis), else one run each; in the priority order of each unit's first run."""
    ordered = priority(runs)
    rank = {r.name: i for i, r in enumerate(ordered)}
    groups = [tuple(g) for g in group(ordered)] if group else [(r,) for r in ordered]
    return sorted(groups, key=lambda u: min(rank[r.name] for r in u))


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


@functools.lru_cache(maxsize=4096)
def _fingerprint(argv: tuple, run_name: str | None = None) -> dict | None:
    """``argv``'s settings as validation.dnn settles them (a stack's command: its run in folder ``run_name``)."""
    from validation.dnn_cli import command_fingerprint

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the parser's one-line complaint: we say "stale"
            return command_fingerprint(argv, run_name)
    except (SystemExit, ValueError):  # a recorded command this version no longer takes: another configuration
        return None


def recorded_argv(summary: dict) -> list | None:
    """The runner's arguments in summary.json's ``command`` ("python -m validation.dnn ARGS"); None for a command
    that is not such a line (not text, an unbalanced quote: a file read back is untrusted input)."""
    command = summary.get("command", "")
    if not isinstance(command, str):
        return None
    try:
        words = shlex.split(command)
    except ValueError:  # "No closing quotation", "No escaped character"
        return None
    return words[3:] if words[:3] == ["python", "-m", "validation.dnn"] else None


def trained_last_batch(summary: dict) -> str:
    """What a run did with an epoch's last partial batch, as its summary records it; a summary from before the
    setting existed records none: every batch was kept then."""
    config = summary.get("config")
    value = config.get("last_batch", "keep") if isinstance(config, dict) else "keep"
    return value if value in ("keep", "drop") else "keep"


def first_difference(want: dict, have: dict | None) -> str:
    if have is None:
        return "its recorded command does not parse"
    for k in sorted(set(want) | set(have)):
        if want.get(k) != have.get(k):
            flag = k[len("config.") :].replace("_", " ") if k.startswith("config.") else "--" + k.replace("_", "-")
            return f"{flag} is {have.get(k)!r}, the profile's {want.get(k)!r}"
    return ""


def status(run, folder: str) -> Status:
    """What ``folder`` holds of ``run`` (see the module's docstring)."""
    summary_path = os.path.join(folder, "summary.json")
    resumable = os.path.isfile(os.path.join(folder, "checkpoint.pt"))
    if not os.path.lexists(summary_path):
        return Status(PARTIAL if resumable else MISSING)
    try:
        summary = read_summary(summary_path)  # a regular file of one object, its fields in range (fedconvex.results)
    except ValueError as exc:
        return Status(STALE, why=f"summary.json does not parse ({exc})")
    if run.kind != "dnn":
        return Status(DONE)
    # a summary without a command (written by hand, or before summaries recorded one) cannot be checked
    want = _fingerprint(tuple(run.argv))
    if "command" in summary and want is not None:
        argv = recorded_argv(summary)
        have = None if argv is None else _fingerprint(tuple(argv), os.path.basename(os.path.normpath(folder)))
        if have is not None and "config.last_batch" in have:  # as trained, whatever this version's default is
            have = {**have, "config.last_batch": trained_last_batch(summary)}
        diff = first_difference(want, have)
        # the augmentation the run trained with, as its summary records it: a command that gave none trained
        # with the default of its version, which may not be this version's
        if not diff and summary.get("augment") not in (None, want.get("augment")):
            diff = f"--augment is {summary['augment']!r}, the profile's {want.get('augment')!r}"
        if diff:
            return Status(STALE, why=diff)
    try:
        runs = read_history(os.path.join(folder, "history.csv"))  # cells in range, rounds increasing
        if len(runs) != 1:
            raise ValueError(f"holds {len(runs)} runs")
        rows = next(iter(runs.values()))
    except (OSError, ValueError, KeyError) as exc:
        return Status(PARTIAL if resumable else MISSING, why=f"history.csv does not parse ({exc})")
    done = len(rows)
    measured = dict(rounds_done=done, round_seconds=_seconds_per_round(rows), device=summary.get("device"))
    if not isinstance(measured["device"], str):
        measured["device"] = None
    machine = summary.get("gpu" if measured["device"] == "cuda" else "cpu")
    measured["machine"] = machine if isinstance(machine, str) and machine != "unknown" else None
    if "failed" in summary:  # diverged: a re-run would diverge at the same round
        return Status(DONE, why="diverged", **measured)
    if done >= run.rounds:
        return Status(DONE, **measured)
    return Status(PARTIAL if resumable else MISSING, **measured)


def _seconds_per_round(rows) -> float | None:
    """The wall seconds per round a history measured; None where it holds none usable (no rows, no or a bad
    wall_seconds cell: an estimate is left out rather than made up)."""
    try:
        seconds = float(rows[-1]["wall_seconds"]) / len(rows)
    except (IndexError, KeyError, TypeError, ValueError, OverflowError):
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def statuses(runs, root: str, shipped: dict | None = None) -> dict:
    """{run name: Status} of the runs' folders under ``root``; a run without a folder there is read from
    ``shipped`` ({name: folder}, the runs the repository ships) where that has it."""
    shipped = shipped or {}

    def folder(name):
        here = os.path.join(root, name)
        return shipped[name] if name in shipped and not os.path.lexists(here) else here

    return {r.name: status(r, folder(r.name)) for r in runs}


def this_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def this_machine(device: str) -> str:
    """This machine as a summary.json names it: the GPU's name on cuda, "<CPU model>, <n> cores" elsewhere."""
    if device == "cuda":
        try:
            import torch

            return torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - no name is no match, never an error of --list
            return "unknown"
    from validation.common import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores"


def _measurements(states: dict, device: str, machine: str | None) -> dict:
    """{run name: seconds per round} an estimate may use: the runs measured on this machine once it has one,
    until then those measured on any machine of this device kind (the shipped runs' machine, say)."""
    usable = {n: st for n, st in states.items() if st.round_seconds and st.device == device}
    mine = {n: st.round_seconds for n, st in usable.items() if machine and st.machine == machine}
    return mine or {n: st.round_seconds for n, st in usable.items()}


def measured_on(states: dict, device: str, machine: str | None) -> list[str]:
    """The machines whose runs the estimates of ``round_seconds`` come from (sorted; "unknown" for a summary
    that does not name its machine)."""
    used = _measurements(states, device, machine)
    return sorted({states[n].machine or "unknown" for n in used})


def round_seconds(runs, states: dict, device: str, machine: str | None = None) -> dict:
    """{run name: estimated seconds per round on ``device``}: the run's own measurement, else its other seeds',
    else the mean of its column's (name without method and seed); runs with nothing measured are left out.  Only
    this machine's measurements count once it has one (``machine``), before that every machine's of ``device``."""
    usable = _measurements(states, device, machine)
    by_seedless, by_column = {}, {}
    for r in runs:
        s = usable.get(r.name)
        if s is not None:
            by_seedless.setdefault(SEED_SUFFIX.sub("", r.name), []).append(s)
            by_column.setdefault(SEED_SUFFIX.sub("", r.name).rsplit("-", 1)[0], []).append(s)
    out = {}
    for r in runs:
        own = usable.get(r.name)
        seedless = SEED_SUFFIX.sub("", r.name)
        pool = by_seedless.get(seedless) or by_column.get(seedless.rsplit("-", 1)[0])
        if own is not None:
            out[r.name] = own
        elif pool:
            out[r.name] = sum(pool) / len(pool)
    return out


# Seconds a round of the paper's setting (10 clients, 5,000 images each, 5 local epochs) on one NVIDIA H100, from
# the shipped measurements of reference/gpu/2026-11-27-h100/ (commit 9097157): for the runs of which nothing was
# measured on this device, so that an estimate names where it comes from instead of being left out.
#   SimpleCNN (CIFAR-10): stack3_cnn.json's single rounds, FedAvg 1.99 s, FedPM 2.50 s (the stacked seeds 1 and 2
#     of main-cifar10-a0.1-fedpm-s1/s2 took 4.94 s a round for two: 2.47 s each);
#   ResNet18-GN (CIFAR-100): resnet_applies.json at 10 x 1,000 images x 1 epoch, FedAvg 1.22 s x 25 (images x
#     epochs) = 30.4 s, FedPM its projected_100_round_minutes 277.0 / 100 rounds = 166.2 s.
# LocalNewton is costed as FedPM (the same FOOF statistics and solves), the other methods as FedAvg; rounds with
# fewer local epochs or participants (the ablations) cost less, so those estimates are upper bounds.
H100 = "NVIDIA H100 80GB HBM3"
H100_ROUND_SECONDS = {
    "cifar10": {"first-order": 1.99, "foof": 2.50},
    "cifar100": {"first-order": 30.4, "foof": 166.2},
}
FOOF_METHODS = ("fedpm", "localnewton")


def elsewhere_round_seconds(run) -> float | None:
    """Seconds a round of ``run`` on one NVIDIA H100 (H100_ROUND_SECONDS); None for what was not measured there."""
    by_family = H100_ROUND_SECONDS.get(run.dataset)
    resized = {"--train-subset", "--test-subset", "--clients"} & set(run.argv)
    if run.kind != "dnn" or by_family is None or resized:  # measured at the paper's data size only
        return None
    method = run.argv[run.argv.index("--method") + 1] if "--method" in run.argv else "fedpm"
    return by_family["foof" if method in FOOF_METHODS else "first-order"]


class Budget:
    """A wall clock that ends ``minutes`` after it starts (None: never)."""

    def __init__(self, minutes: float | None, clock=time.time):
        self.clock = clock
        self.end = None if minutes is None else clock() + 60.0 * minutes

    def left(self) -> float:
        return math.inf if self.end is None else self.end - self.clock()


def time_left(runs, states: dict, estimates: dict) -> tuple[float, int]:
    """(estimated seconds to finish the runs not done, how many of them have no estimate)."""
    total, unknown = 0.0, 0
    for r in runs:
        st = states[r.name]
        if st.state == DONE or r.kind != "dnn":
            continue
        if r.name in estimates:
            total += estimates[r.name] * max(r.rounds - st.rounds_done, 0) + START_SECONDS
        else:
            unknown += 1
    return total, unknown


def describe(run, st: Status) -> str:
    if st.state == PARTIAL:
        return f"partial ({st.rounds_done} of {run.rounds} rounds)"
    if st.state == STALE:
        return f"stale: {st.why}; move it away to recompute"
    if st.state == DONE and st.why:
        return f"done ({st.why})"
    return st.state


def hours(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def listing(runs, root: str, device: str | None = None, shipped: dict | None = None, machine=None) -> list[str]:
    """--list: every run in priority order with its state, then the counts and the estimated time left.  A run
    with no folder under ``root`` is read where the repository ships it (``shipped``): nothing is written.  The
    estimates say which machine measured the rounds they come from: this machine once it has run one, else the
    machines of this device kind that did (the shipped runs'), else one NVIDIA H100 (H100_ROUND_SECONDS)."""
    device = device or this_device()
    machine = machine or this_machine(device)
    ordered = priority(runs)
    states = statuses(ordered, root, shipped)
    est = round_seconds(ordered, states, device, machine)
    lines = []
    for r in ordered:
        st = states[r.name]
        left = ""
        if st.state != DONE and r.name in est:
            left = f"  ~{hours(est[r.name] * max(r.rounds - st.rounds_done, 0))} left"
        lines.append(f"{describe(r, st):<34} {r.name}{left}")
    counts = {s: sum(st.state == s for st in states.values()) for s in (DONE, PARTIAL, MISSING, STALE)}
    total, unknown = time_left(ordered, states, est)
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + f" of {len(ordered)} runs")
    sources = measured_on(states, device, machine)
    here = f"this machine ({device}: {machine})"
    line = f"estimated time left on {here}: "
    if sources:
        source = "its own runs" if sources == [machine] else f"runs measured on {' and '.join(sources)}, not on it"
        line += f"{hours(total)} from {source}" + (f"; {unknown} runs not estimated" if unknown else "")
    else:
        line += f"unknown for {unknown} runs (no run like them measured on {device})" if unknown else "0 s"
    rest = [r for r in ordered if states[r.name].state != DONE and r.kind == "dnn" and r.name not in est]
    left = [(r, s) for r, s in ((r, elsewhere_round_seconds(r)) for r in rest) if s is not None]
    if left:
        on_h100 = sum(s * max(r.rounds - states[r.name].rounds_done, 0) + START_SECONDS for r, s in left)
        line += f"; {len(left)} of those: ~{hours(on_h100)} on one {H100} (from the rounds measured on it)"
    lines.append(line)
    return lines
