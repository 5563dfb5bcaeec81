"""Generated command lines for every command, from its own argparse definition: each flag's type, choices and
whether it takes a value, with hostile values mixed in (huge, tiny, NaN, inf, negative, empty, odd unicode; paths
that are FIFOs, links, folders, files, names with missing parents).  Each case runs in this process, parse and
validation only: the function that would start the real work is replaced by one that stops the case there
(``Reached``), and every case is bounded in time.  ``run_case`` says what a case broke, if anything:

* it ended in an exit status other than 0, 2, 75, 130, 143, or with an exception (a traceback for a user);
* exit 2 without exactly one line ``PROG: error: ...`` as its last line on stderr;
* exit 0 after printing an error;
* it wrote anything into the sandbox (every command's refusal, and every stop before the work, leaves no trace).

    python tests/argv_fuzz.py [--cases N] [--seed S]     # the counts by command and outcome, and the failures
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import os
import random
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ALLOWED_EXITS = {0, 2, 75, 130, 143}
CASE_SECONDS = 10.0  # a case still running after this hangs


class Reached(BaseException):
    """The command got past its checks to the work itself: the case stops here, as valid."""


class Hung(BaseException):
    """The case ran past CASE_SECONDS."""


def _reached(*args, **kwargs):
    raise Reached()


def _script(name: str):
    """A benchmark script (benchmarks/NAME.py) as a module."""
    spec = importlib.util.spec_from_file_location(f"fuzz_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _script_run(name: str):
    """A benchmark script run as ``python benchmarks/NAME.py ARGV`` would run it (its parser reads sys.argv)."""
    import runpy

    path = os.path.join(ROOT, "benchmarks", f"{name}.py")

    def run(argv):
        saved = sys.argv
        sys.argv = [path, *argv]
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            sys.argv = saved
        return 0

    return run


@dataclass
class Command:
    """One command: ``entry(argv)`` runs it; ``guards`` are the (module, attribute) pairs replaced by ``_reached``
    (where the work starts); ``prefix``: words before the flags (a subcommand)."""

    name: str
    entry: object  # () -> callable(argv)
    guards: tuple = ()
    prefix: tuple = ()
    stop_after_parse: bool = False  # a script whose work follows its parse at once: the case stops there
    parser: object = None  # filled by ``definition``
    extra: list = field(default_factory=list)  # words a case may add besides the parser's flags


def _module(name):
    return lambda: importlib.import_module(name).main


COMMANDS = [
    Command("validation.dnn", _module("validation.dnn"), (("validation.dnn", "run"),)),
    Command("validation.experiments", _module("validation.experiments"), (("validation.experiments", "ensure"),)),
    Command("validation.superlinear", _module("validation.superlinear"), (("validation.superlinear", "run"),)),
    Command("validation.flower", _module("validation.flower"), (("validation.flower", "run_config"),)),
    Command(
        "validation.flower keys",
        _module("validation.flower"),
        (("fedpm_flower.credentials", "write_credentials"),),
        prefix=("keys",),
    ),
    Command(
        "validation.flower prepare",
        _module("validation.flower"),
        (("validation.flower_prepare", "prepare"),),
        prefix=("prepare",),
    ),
    Command("validation.splits", _module("validation.splits"), (("fedpm_dnn.data", "load_image_dataset"),)),
    Command("validation.bench_convex", _module("validation.bench_convex"), (("validation.bench_convex", "measure"),)),
    Command("validation.bench_dnn", lambda: importlib.import_module("validation.bench_dnn").parse_args),
    Command(
        "figures",
        _module("figures.__main__"),
        (("figures.__main__", "seed_from_reference"), ("figures.__main__", "ensure_from_args")),
    ),
    Command("benchmarks/foof_centralised.py", lambda: _script("foof_centralised").parse_args),
    Command(
        "benchmarks/flower_deployment_scale.py",
        lambda: _script("flower_deployment_scale").main,
        (("fedpm_flower.deploy", "LocalFederation"),),
    ),
    *(
        Command(f"benchmarks/{name}.py", lambda name=name: _script_run(name), stop_after_parse=True)
        for name in ("flower_simulation_scale", "foof_apply", "foof_gram_forms", "mixing_solve_forms")
        + ("profile_fedpm_parts", "cuda_round_profile", "cuda_fedavg_fedpm_round_ratio", "step_graph_round")
    ),
]


def _fedpm_entry():
    from validation.cli import main

    return main


FEDPM = Command("fedpm", _fedpm_entry)  # the dispatcher: its own words, then a command refused at parse


@contextlib.contextmanager
def guarded(command: Command):
    saved = []
    for module, attr in command.guards:
        mod = importlib.import_module(module)
        saved.append((mod, attr, getattr(mod, attr)))
        setattr(mod, attr, _reached)
    if command.stop_after_parse:
        parse = argparse.ArgumentParser.parse_args

        def parse_then_stop(self, args=None, namespace=None):
            parse(self, args, namespace)
            raise Reached()

        saved.append((argparse.ArgumentParser, "parse_args", parse))
        argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)


def definition(command: Command):
    """The command's parser, captured from its own --help (built as the command builds it)."""
    seen = []
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        seen.append(self)
        return original(self, args, namespace)

    argparse.ArgumentParser.parse_known_args = capture
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            with contextlib.suppress(SystemExit), guarded(command):
                command.entry()([*command.prefix, "--help"])
    finally:
        argparse.ArgumentParser.parse_known_args = original
    command.parser = seen[-1]  # a dispatcher's subcommand parser is the last one asked
    return command.parser


NUMBERS = ["0", "1", "2", "3", "7", "-1", "-0", "1e300", "-1e300", "1e-300", "1e309", "nan", "inf", "-inf", "0.5"]
NUMBERS += ["1.5", "1_000", "0x10", "9" * 400, "٣", "२", "½", "1e3", "10000000000", "  4 ", "+2", "4294967296"]
TEXT = ["", " ", "a", "--", "-x", "é", "\u202eevil", "a b", "x" * 300, "a,b", "1,1", "0,1,2", "1,1.0", "1,,2"]
TEXT += ["../..", "/", ".", ":", "75:0.1,90:0.1", "200:2", "lowrank:2", "delta:topk:0.5", "fp16", "::1"]
TEXT += ["example.org:9092", "*", "main-*", "none", "auto", "cifar10-a0.1"]
PATHS = ["new", "fifo", "dangling", "link-to-folder", "folder", "folder-with-a-file", "file", "missing/parent/x"]
PATHS += ["", " ", ".", "é\u202e", "x" * 300]
PATH_DESTS = {"out", "results", "data_dir", "cache_dir", "write_app", "dataset", "result", "log_dir", "cache"}
PATH_DESTS |= {"shipped_cache", "figure", "json", "train", "test"}


def sandbox(root: str) -> None:
    """The paths a case may name, under ``root`` (made once; a case must leave them as they are)."""
    os.makedirs(os.path.join(root, "folder"), exist_ok=True)
    os.makedirs(os.path.join(root, "folder-with-a-file"), exist_ok=True)
    with open(os.path.join(root, "folder-with-a-file", "someone-elses.txt"), "w") as fh:
        fh.write("keep me\n")
    with open(os.path.join(root, "file"), "w") as fh:
        fh.write("not ours\n")
    if not os.path.lexists(os.path.join(root, "fifo")):
        os.mkfifo(os.path.join(root, "fifo"))
    for name, target in (("dangling", "nowhere"), ("link-to-folder", "folder")):
        if not os.path.lexists(os.path.join(root, name)):
            os.symlink(os.path.join(root, target), os.path.join(root, name))


def snapshot(root: str) -> dict:
    seen = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                seen[rel] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                with open(path, "rb") as fh:
                    seen[rel] = ("file", fh.read())
            else:
                seen[rel] = ("other", None)
    return seen


def _value(rng: random.Random, action, root: str) -> list[str]:
    """The words one flag of ``action`` takes in a case."""
    if action.nargs == 0:
        return []
    if action.dest in PATH_DESTS and rng.random() < 0.85:
        pick = rng.choice(PATHS)
        return [os.path.join(root, pick) if pick.strip() and pick not in (".",) else pick]
    if action.choices is not None and rng.random() < 0.75:
        return [str(rng.choice(list(action.choices)))]
    pool = NUMBERS if action.type not in (None, str) or rng.random() < 0.3 else TEXT
    count = rng.randint(1, 3) if action.nargs in ("+", "*") else 1
    return [rng.choice(pool) for _ in range(count)]


def argv_for(command: Command, rng: random.Random, root: str) -> list[str]:
    """One case: some of the command's flags (its required ones most often), each with a generated value."""
    actions = [a for a in command.parser._actions if a.option_strings and a.dest != "help"]  # noqa: SLF001
    chosen = [a for a in actions if a.required and rng.random() < 0.9]
    chosen += rng.sample(actions, min(len(actions), rng.randint(0, 5)))
    argv = list(command.prefix)
    for action in chosen:
        flag = rng.choice(action.option_strings)
        words = _value(rng, action, root)
        if words and rng.random() < 0.1 and not words[0].startswith("-"):
            argv.append(f"{flag}={words[0]}")  # the --flag=value spelling
        else:
            argv += [flag, *words]
    if rng.random() < 0.03:
        argv.append(rng.choice(["--no-such-flag", "positional", "-"]))
    return argv


def fedpm_argv(rng: random.Random, root: str) -> list[str]:
    """The dispatcher: its own words, or a command refused by its parser before any work (an unknown flag)."""
    first = rng.choice(["", "-h", "--help", "nope", "DNN", "é", "--version", "dnn", "superlinear", "figures"])
    argv = [first] if first else []
    if first in ("dnn", "superlinear", "figures"):
        argv += ["--no-such-flag", rng.choice(TEXT)]
    return argv


@dataclass
class Outcome:
    command: str
    argv: list
    code: object  # the exit status, "reached", or the exception's name
    problem: str = ""  # what the case broke ('' : nothing)


def _alarm(signum, frame):
    raise Hung()


def run_case(command: Command, argv: list, root: str, before: dict) -> Outcome:
    out, err = io.StringIO(), io.StringIO()
    code, problem = None, ""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    cwd = os.getcwd()
    os.chdir(os.path.join(root, "cwd"))  # a default --out (results/...) lands in the sandbox too
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), guarded(command):
            try:
                result = command.entry()(argv)
                code = result if isinstance(result, int) else 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Reached:
                code = "reached"
    except Hung:
        code, problem = "hung", f"still running after {CASE_SECONDS:.0f} s"
    except Exception as exc:  # noqa: BLE001  (a traceback for a user: the case's finding)
        code, problem = type(exc).__name__, f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.chdir(cwd)
    text = err.getvalue()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not problem:
        if code != "reached" and code not in ALLOWED_EXITS:
            problem = f"exit {code}"
        elif "Traceback" in text:
            problem = "a traceback on stderr"
        elif code == 2 and not (lines and ": error: " in lines[-1]):
            problem = "exit 2 without an error line last"
        elif code == 2 and sum(": error: " in ln or ln.startswith("usage:") for ln in lines) != 1:
            problem = "exit 2 with more than one line for its error"
        elif code in (0, "reached") and any(": error: " in ln for ln in lines):
            problem = "exit 0 after an error"
    after = snapshot(root)
    if after != before:
        changed = sorted(set(after) ^ set(before) | {k for k in after if k in before and after[k] != before[k]})
        problem = problem or f"left {', '.join(changed[:3])} in the sandbox"
    return Outcome(command.name, argv, code, problem)


def restore(root: str, before: dict) -> None:
    """Put the sandbox back as it was (after a case that changed it)."""
    import shutil

    for rel in sorted(set(snapshot(root)) - set(before), key=len, reverse=True):
        path = os.path.join(root, rel)
        if os.path.islink(path) or os.path.isfile(path):
            os.remove(path)
        elif os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
    sandbox(root)


def fuzz(root: str, cases: int, seed: int = 0, commands=None) -> list[Outcome]:
    """``cases`` generated cases spread over the commands (and the ``fedpm`` dispatcher), seeded: the same seed
    gives the same command lines."""
    commands = list(commands or COMMANDS)
    sandbox(root)
    os.makedirs(os.path.join(root, "cwd"), exist_ok=True)
    for command in commands:
        definition(command)
    before = snapshot(root)
    outcomes = []
    for i in range(cases):
        rng = random.Random(seed * 1_000_003 + i)
        if i % (len(commands) + 1) == len(commands):
            outcome = run_case(FEDPM, fedpm_argv(rng, root), root, before)
        else:
            command = commands[i % (len(commands) + 1)]
            outcome = run_case(command, argv_for(command, rng, root), root, before)
        if outcome.problem.startswith("left") or snapshot(root) != before:
            restore(root, before)
        outcomes.append(outcome)
    return outcomes


def report(outcomes: list[Outcome]) -> str:
    by = Counter((o.command, "failed" if o.problem else str(o.code)) for o in outcomes)
    lines = [f"{len(outcomes)} cases, {sum(bool(o.problem) for o in outcomes)} failing"]
    for command in dict.fromkeys(o.command for o in outcomes):
        counts = ", ".join(f"{k}: {n}" for (c, k), n in sorted(by.items(), key=str) if c == command)
        lines.append(f"  {command}: {counts}")
    for o in outcomes:
        if o.problem:
            lines.append(f"FAIL {o.command} {o.argv!r}: {o.problem}")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile

    p = argparse.ArgumentParser(description="generated command lines for every command")
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    sys.path.insert(0, HERE)
    with tempfile.TemporaryDirectory() as d:
        print(report(fuzz(d, a.cases, a.seed)))
