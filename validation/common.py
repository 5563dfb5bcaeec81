"""Shared set-up for the convex experiments: data, split, problem, optimum, initial point."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from fedconvex.backend import BackendError, get_backend
from fedconvex.data import (
    BUNDLED,
    DataError,
    dirichlet_split,
    load_dataset,
    paper_split_sizes,
    sequential_split,
    shuffled_split,
)
from fedconvex.files import memory_bytes
from fedconvex.problem import DEFAULT_LAM, FederatedLogReg
from fedconvex.reference import initial_point, solve_optimum
from validation.outputs import lost_signals_sent_again


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help that shows every flag's default in one style, "(default: X)", appended unless the help already
    states it so (a default in words: "(default: the preset's)"), and keeps the layout of the examples in the
    description and epilog.  tests/test_cli_help.py holds every command's flags to it."""

    def _format_action(self, action):
        default = action.default
        shown = action.option_strings and action.nargs != 0 and default not in (None, "", argparse.SUPPRESS)
        if shown and action.help is not argparse.SUPPRESS and "(default: " not in (action.help or ""):
            action = copy.copy(action)
            action.help = f"{action.help} (default: %(default)s)" if action.help else "(default: %(default)s)"
        return super()._format_action(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line naming the cause (no usage dump).

    ``doc``: the module docstring; its first line is the description and the rest (the examples) the
    epilog of --help.  ``commands``: {name: what it does} of subcommands dispatched before parsing, listed
    in --help."""

    def __init__(self, *args, doc: str | None = None, commands: dict | None = None, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        if doc:
            first, _, rest = doc.strip().partition("\n")
            kw.setdefault("description", first)
            kw.setdefault("epilog", textwrap.dedent(rest).strip("\n") or None)
        if commands:
            listed = "\n".join(f"  {name:10s} {what}" for name, what in commands.items())
            kw["description"] = f"{kw.get('description') or ''}\n\ncommands:\n{listed}".lstrip()
        super().__init__(*args, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def given(self, argv) -> set:
        """The dests that ``argv`` sets explicitly (a flag equal to its default is still a choice); argparse's
        own parse, so abbreviations and ``--flag=value`` count as they do there."""
        unset = object()
        saved = [(a, a.default) for a in self._actions]
        try:
            for a, _ in saved:
                a.default = unset
            ns, _ = type(self).parse_known_args(self, argv)  # the class's parse: no deprecation warned again
        finally:
            for a, default in saved:
                a.default = default
        return {k for k, v in vars(ns).items() if v is not unset and k != _SPELLED}


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores into the new flag's dest (through ``convert``) and prints one
    deprecation line on stderr.  Hidden from --help (docs/cli.md lists the aliases).  Given together with the new
    spelling, in either order, it is refused (``_one_spelling``): the last would otherwise win silently."""

    def __init__(self, option_strings, dest, new: str, convert=None, **kw):
        kw.update(help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kw)
        self.new, self.convert = new, convert

    def __call__(self, parser, namespace, values, option_string=None):
        _one_spelling(parser, self, namespace, option_string)
        setattr(namespace, self.dest, self.convert(values) if self.convert else values)


class _NewSpelling:
    """Mixed into the action of a flag that has a DeprecatedAlias: it notes its spelling for ``_one_spelling``."""

    old: str = ""

    def __call__(self, parser, namespace, values, option_string=None):
        _one_spelling(parser, self, namespace, option_string)
        super().__call__(parser, namespace, values, option_string)


_SPELLED = "_spelled_as"  # on the namespace while it is parsed: {dest: the spelling given}; removed after parsing


def _one_spelling(parser, action, namespace, option_string) -> None:
    """The rule for the old and new spellings of one flag: either, not both (the last would win silently)."""
    spelled = namespace.__dict__.setdefault(_SPELLED, {})
    other = spelled.get(action.dest)
    if other is not None and other != option_string:
        old, new = (option_string, other) if isinstance(action, DeprecatedAlias) else (other, option_string)
        parser.error(f"{old} is the earlier spelling of {new}: give one of them")
    spelled[action.dest] = option_string


def warn_deprecated(prog: str, old: str, new: str) -> None:
    sys.stderr.write(f"{prog}: warning: {old} is deprecated; use {new}\n")


def add_deprecated_alias(p, old: str, new: str, dest: str, convert=None, **kw) -> None:
    p.add_argument(old, dest=dest, action=DeprecatedAlias, new=new, convert=convert, **kw)
    newer = p._option_string_actions[new]  # noqa: SLF001  (argparse keeps no public map of flags to actions)
    if not isinstance(newer, _NewSpelling):
        newer.__class__ = type(type(newer).__name__, (_NewSpelling, type(newer)), {})
    if "parse_known_args" not in vars(p):  # the parser's own method, on this parser alone

        def parse_spelled(args=None, namespace=None):
            # what a parse returns holds no note of the spellings it saw (_one_spelling); the class's method looked
            # up at each parse, not bound once when the parser was built
            ns, rest = type(p).parse_known_args(p, args, namespace)
            for flag in ns.__dict__.pop(_SPELLED, {}).values():  # after the parse: an error stays one line
                action = p._option_string_actions[flag]  # noqa: SLF001
                if isinstance(action, DeprecatedAlias):
                    warn_deprecated(p.prog, flag, action.new)
            return ns, rest

        p.parse_known_args = parse_spelled


LAST_BATCH = ("keep", "drop")  # --last-batch: fedpm_dnn's DnnAlgorithm.last_batch


def add_last_batch_arg(p, default=None, scope: str = ""):
    """--last-batch for every DNN command: ``default`` None leaves it to the preset (drop), else keep."""
    said = "the preset's, drop; keep without a preset" if default is None else default
    p.add_argument(
        "--last-batch",
        choices=LAST_BATCH,
        default=default,
        help=f"{scope}an epoch's last partial batch: drop it (the paper's cited code) or step on it; a client smaller "
        f"than one batch trains on what it has (default: {said})",
    )


def add_step_graph_arg(p):
    """--step-graph for every command that runs the vectorized engine."""
    p.add_argument(
        "--step-graph",
        choices=("auto", "on", "off"),
        default="auto",
        help="vectorized: the local steps every client of a chunk takes as one function of static buffers, on CUDA "
        "replayed as one CUDA graph a step (the same operations as the loop); auto: on CUDA, off on a CPU, where no "
        "graph can be captured (default: auto)",
    )


DEVICES = ("auto", "cpu", "cuda")


def add_device_arg(p, default: str = "auto", what: str = "") -> None:
    p.add_argument("--device", choices=DEVICES, default=default, help=what or "auto: cuda when one is visible")


def add_threads_arg(p, default_text: str = "all cores", note: str = "") -> None:
    """--threads for every DNN command: torch's CPU threads."""
    help_text = f"torch CPU threads (default: {default_text}){note}"
    p.add_argument("--threads", type=positive_int, default=None, help=help_text)


def add_client_chunk_arg(p, default_text: str = "auto") -> None:
    """--client-chunk for every command that runs the vectorized engine."""
    p.add_argument(
        "--client-chunk",
        type=positive_int,
        default=None,
        help=f"vectorized: clients per chunk (default: {default_text})",
    )


def add_quiet_arg(p) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")


def add_seed_arg(p) -> None:
    p.add_argument("--seed", type=seed_int, default=0, help="random seed")


def _backend_as_device(name: str) -> str:
    """--backend numpy|cupy (deprecated) as the --device it means."""
    if name not in ("numpy", "cupy"):
        raise argparse.ArgumentTypeError(f"unknown backend {name!r}; choose one of numpy, cupy (or use --device)")
    return "cpu" if name == "numpy" else "cuda"


def add_convex_device_args(p) -> None:
    """--device for the float64 convex code (cuda = CuPy), and --backend numpy|cupy as its deprecated alias.
    The default is cpu: the reference results are NumPy's, and auto would change them by round-off."""
    add_device_arg(p, "cpu", "cuda runs the rounds on CuPy; auto: cuda when CuPy sees a GPU")
    add_deprecated_alias(p, "--backend", "--device", "device", type=_backend_as_device)


def convex_backend(device: str) -> str:
    """The array library (numpy or cupy) of --device, or a BackendError of one line when cuda is asked
    for and CuPy or a GPU is missing."""
    if device == "cpu":
        return "numpy"
    try:
        get_backend("cupy")
    except BackendError as exc:
        if device == "auto":
            return "numpy"
        raise BackendError(f"--device cuda: {exc}") from None
    return "cupy"


MAX_INT = 2**31 - 1  # counts (rounds, clients, rows, ...) far beyond any run that fits in memory
# bounds of the numbers that overflow downstream: a budget becomes a deadline (now + 60 x minutes) passed on to each
# run as a finite --deadline; a certificate's validity a date (X.509 ends in year 9999); a wait a timeout that
# every blocking call takes (threading.TIMEOUT_MAX)
MAX_MINUTES = 10**7  # about 19 years
MAX_DAYS = 36500  # 100 years
MAX_WAIT_SECONDS = min(threading.TIMEOUT_MAX, 10**9)

# One validator per kind of number (argparse types): each returns a value of its kind -- the type, finite, in its
# range -- or raises ArgumentTypeError whose message is one line naming the rule and the value as given.


def _shown(text, quoted: bool = False) -> str:
    """The given value for a message, on one line and cut short: as typed where that is plain (a short printable
    word), else quoted and escaped."""
    text = text if isinstance(text, str) else str(text)
    if not quoted and text.isprintable() and text.strip() == text and 0 < len(text) <= 40:
        return text
    shown = repr(text)
    return shown if len(shown) <= 42 else shown[:40] + "..."


def _number(text, kind=float):
    try:
        v = kind(text)
    except (TypeError, ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"must be {'an integer' if kind is int else 'a number'}, got {_shown(text, quoted=True)}"
        ) from None
    # the one rule for numbers of every entry point (fedconvex.hyperparams.number_problem); each flag's range, and
    # the float32 limit of a DNN hyper-parameter, follow where the value is used (make_method runs the same rule)
    from fedconvex.hyperparams import number_problem

    problem = number_problem(v, integer=kind is int)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem}, got {_shown(text)}")
    return v + 0.0 if kind is float else v  # -0.0 is 0.0


def positive_int(text):
    v = _number(text, int)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {_shown(text)}")
    if v > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_INT}, got {_shown(text)}")
    return v


def nonneg_int(text):
    v = _number(text, int)
    if not 0 <= v <= MAX_INT:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..{MAX_INT}, got {text}")
    return v


def seed_int(text):
    """A random seed: an integer in 0 .. 2**32 - 1 (what NumPy and torch accept alike)."""
    v = _number(text, int)
    if not 0 <= v < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..{2**32 - 1}, got {_shown(text)}")
    return v


def nonneg_float(text):
    v = _number(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {_shown(text)}")
    return v


def positive_float(text):
    v = _number(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {_shown(text)}")
    return v


def budget_minutes(text):
    """A time budget in minutes: > 0 and at most MAX_MINUTES, so that the deadline it gives stays finite."""
    v = positive_float(text)
    if v > MAX_MINUTES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_MINUTES} minutes, got {_shown(text)}")
    return v


def wait_seconds(text):
    """How long one wait may last, in seconds: > 0 and at most what every blocking call accepts."""
    v = positive_float(text)
    if v > MAX_WAIT_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_WAIT_SECONDS:g} seconds, got {_shown(text)}")
    return v


def certificate_days(text):
    """How many days a certificate is valid: 1 .. MAX_DAYS (its end must be a date X.509 can write)."""
    v = positive_int(text)
    if v > MAX_DAYS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_DAYS} days, got {_shown(text)}")
    return v


def check_out_arg(parser, path, flag="--out", kind=None):
    """Refuse, as one parser error, an output path that cannot receive ``kind``'s results without loss."""
    from validation.outputs import OutputError, check_out

    try:
        check_out(path, flag, kind)
    except OutputError as exc:
        parser.error(str(exc))


@contextlib.contextmanager
def holding_out(prog: str, path: str, kind=None):
    """For the block this process alone writes the output folder ``path`` (validation.outputs.exclusive): a run
    into a folder another run is writing is refused in one line, and the folder is checked again now that no
    other run can change it.  What killed runs left beside it (temporary folders, lock files) is removed."""
    from validation.outputs import OutputError, check_out, clean_stale, exclusive

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive(path))
            clean_stale(os.path.dirname(os.path.abspath(path)))
            check_out(path, kind=kind)
        except OutputError as exc:
            fail(prog, exc)
        yield


def precond_codec(spec):
    """argparse type of --precond-codec: a codec name of fedconvex.codecs (validated, normalised)."""
    from fedconvex.codecs import validate

    try:
        return validate(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


DEFAULT_LIBSVM = "w8a"  # every command's --dataset of logistic regression: the paper's Test 1 data set

# --max-ratio auto (every command's default): the magnitude guard off where every client runs in this process, as
# in the paper's runs (the shipped in-process results were computed without it), and on where the replies come
# from other processes (Flower's simulation and deployment)
MAX_RATIO_AUTO = {"in-process": 0.0, "flower": 1000.0}


def add_max_ratio_arg(p, where: str) -> None:
    """--max-ratio R, one flag on every command that runs a server: ``auto`` (the default) is
    MAX_RATIO_AUTO[where]; the parsed value is the number (check_max_ratio checks it)."""
    auto = MAX_RATIO_AUTO[where]

    def max_ratio(text):
        return auto if isinstance(text, str) and text.strip() == "auto" else nonneg_float(text)

    here = f"{auto:g}" if auto else "off"
    p.add_argument(
        "--max-ratio",
        type=max_ratio,
        default="auto",  # argparse passes a string default through ``type``: args.max_ratio is a number
        metavar="R",
        help="server magnitude guard: reject a reply whose preconditioner trace or parameter norm exceeds R x the "
        "round's median; 0 = off; auto = off where every client runs in this process (as in the paper's runs), "
        f"{MAX_RATIO_AUTO['flower']:g} where replies come from other processes (Flower); here {here}",
    )


def check_max_ratio(parser, args) -> None:
    """--max-ratio R: 0 (off) or >= 1 (fedconvex.screening.max_ratio_problem), one parser error otherwise."""
    from fedconvex.screening import max_ratio_problem

    problem = max_ratio_problem(args.max_ratio)
    if problem:
        parser.error(f"--max-ratio {args.max_ratio:g}: {problem}")


def refuse_foreign(parser, registry, methods, args, dests) -> None:
    """One parser error for a hyper-parameter flag (dest = the field's name) set away from its default when
    none of ``methods`` has that hyper-parameter: it would apply to nothing."""
    given = {d: getattr(args, d) for d in dests if getattr(args, d) != parser.get_default(d)}
    foreign = registry.foreign(methods, given)
    if foreign:
        flags = ", ".join("--" + k.replace("_", "-") for k in foreign)
        who = f"{methods[0]} has no" if len(methods) == 1 else f"none of {', '.join(methods)} has the"
        verb = "does" if len(foreign) == 1 else "do"
        parser.error(f"{flags} {verb} not apply: {who} hyper-parameter {', '.join(foreign)}")


DEFAULT_ALPHA = 0.5


def add_problem_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset", default=DEFAULT_LIBSVM, help=f"bundled name ({', '.join(BUNDLED)}) or path to a LibSVM file"
    )
    p.add_argument(
        "--n-features",
        type=positive_int,
        default=None,
        help="columns of a LibSVM file given by path (default: its largest feature index)",
    )
    p.add_argument(
        "--clients", type=positive_int, default=None, help="N clients (default: the paper's, w8a 142, a9a 80; else 10)"
    )
    p.add_argument(
        "--per-client", type=positive_int, default=None, help="M rows per client (default: the paper's, else rows/N)"
    )
    p.add_argument(
        "--split",
        choices=("sequential", "shuffled", "dirichlet"),
        default="sequential",
        help="sequential = the paper's file-order split",
    )
    p.add_argument(
        "--alpha",
        type=positive_float,
        default=None,
        help=f"Dirichlet concentration for --split dirichlet (default: {DEFAULT_ALPHA})",
    )
    p.add_argument(
        "--lam",
        type=positive_float,
        default=DEFAULT_LAM,
        help="L2 regularisation lambda (> 0: the problem must have a unique optimum)",
    )
    p.add_argument(
        "--weighting",
        choices=("uniform", "samples"),
        default="uniform",
        help="client weights in f and in the mixing (paper: uniform 1/N)",
    )
    p.add_argument("--init", choices=("paper", "zero"), default="paper", help="theta0 = theta* + N(0, 0.1^2 I), or 0")
    add_seed_arg(p)
    add_convex_device_args(p)


def check_problem_args(parser, args) -> None:
    """Cross-flag consistency of add_problem_args, as one parser error naming the flag."""
    if args.n_features is not None and args.dataset in BUNDLED:
        parser.error(
            f"--n-features applies to a LibSVM file given by path, not to the bundled {args.dataset} "
            f"({BUNDLED[args.dataset][1]} features)"
        )
    if args.alpha is not None and args.split != "dirichlet":
        parser.error(f"--alpha applies to --split dirichlet only (this run's split is {args.split})")
    try:
        args.backend = convex_backend(args.device)
    except BackendError as exc:
        parser.error(str(exc))
    if args.split == "dirichlet" and args.alpha is None:
        args.alpha = DEFAULT_ALPHA
    if args.per_client is not None and args.split == "dirichlet":
        parser.error("--per-client does not apply to --split dirichlet (client sizes follow the Dirichlet draw)")
    if os.path.isdir(args.dataset):
        parser.error(
            f"--dataset {args.dataset}: is a folder; give a bundled name ({', '.join(BUNDLED)}) or a LibSVM file"
        )
    if args.dataset not in BUNDLED and os.path.lexists(args.dataset) and not os.path.isfile(args.dataset):
        from fedconvex.files import not_a_file  # a FIFO, a device, a link to nothing: what it is, not "no file"

        parser.error(
            f"--dataset {args.dataset}: {not_a_file(args.dataset)}; give a bundled name ({', '.join(BUNDLED)}) or "
            "a LibSVM file"
        )


def check_fits(ds, dataset: str) -> None:
    """The reference solution builds dense d x d Hessians: refuse a d whose matrices cannot fit."""
    need = 3 * 8 * ds.d * ds.d
    have = memory_bytes()
    if need > have // 2:
        raise DataError(
            f"--dataset {dataset}: {ds.d} features (largest feature index); the dense {ds.d} x {ds.d} "
            f"Hessians need {need / 2**30:.3g} GiB, more than half of this machine's "
            f"{have / 2**30:.3g} GiB; pass --n-features or fix the file"
        )


def build_split(args, ds):
    default = paper_split_sizes(args.dataset) if args.clients is None else None
    clients = args.clients or (default[0] if default else 10)
    per_client = args.per_client or (default[1] if default and args.per_client is None else None)
    if args.split == "sequential":
        return sequential_split(ds.n, clients, per_client)
    if args.split == "shuffled":
        return shuffled_split(ds.n, clients, per_client, seed=args.seed)
    return dirichlet_split(ds.y, clients, DEFAULT_ALPHA if args.alpha is None else args.alpha, seed=args.seed)


def dataset_fingerprint(name_or_path: str) -> str:
    if name_or_path in BUNDLED:
        return BUNDLED[name_or_path][2]
    st = os.stat(name_or_path)
    return hashlib.sha256(f"{os.path.abspath(name_or_path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


def build_problem(args):
    """(problem, dataset, theta*, f*, theta0) for the parsed arguments."""
    xp = get_backend(args.backend)
    ds = load_dataset(args.dataset, args.n_features)
    check_fits(ds, args.dataset)
    parts = build_split(args, ds)
    problem = FederatedLogReg(ds.X, ds.y, parts, lam=args.lam, weighting=args.weighting, xp=xp, hessian_plan=False)
    # the client-Hessian plan is built in a thread while the optimum is solved (which never uses it): both are
    # mostly SciPy sparse products, which release the GIL (w8a: 1.5 s -> 0.9 s on 2 cores)
    with ThreadPoolExecutor(1) as pool:
        plan = pool.submit(problem.build_hessian_plan)
        theta_star, f_star, gnorm = solve_optimum(problem)
        problem.set_hessian_plan(plan.result())
    theta0 = initial_point(problem, theta_star, args.init, seed=args.seed)
    return problem, ds, theta_star, f_star, gnorm, theta0


REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args) -> str | None:
    try:
        r = subprocess.run(["git", "-C", REPOSITORY, *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


@functools.cache
def toolkit_version() -> str:
    """This toolkit's version: from the checkout's pyproject.toml when run from a clone (the metadata of whatever
    copy is installed may be older), else from the installed package's metadata; "unknown" without either."""
    try:
        with open(os.path.join(REPOSITORY, "pyproject.toml"), encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        text = ""
    found = re.search(r'^name = "fedpm"\n(?:.*\n)*?version = "([^"]+)"$', text, re.M)
    if found:
        return found.group(1)
    try:
        return importlib.metadata.version("fedpm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def provenance(gpu: str = "none") -> dict:
    """Where a result comes from, for its summary.json: the toolkit's version, the commit of this checkout
    ("+modified" when tracked files differ from it; "unknown" outside a git checkout of the repository, as in an
    installed copy), the UTC date, the CPU and the GPU (its name, or "none")."""
    commit = "unknown"
    if _git("rev-parse", "--show-toplevel") == REPOSITORY:
        commit = _git("rev-parse", "--short", "HEAD") or "unknown"
        if commit != "unknown" and _git("status", "--porcelain", "--untracked-files=no"):
            commit += "+modified"
    return {
        "version": toolkit_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "cpu": f"{cpu_model()}, {os.cpu_count()} cores",
        "gpu": gpu,
    }


def keep_freed_memory(mmap_threshold: int = 32 * 2**20, trim_threshold: int = 2**30) -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the kernel at once.

    A Test 1 round allocates tens of MB of per-client arrays (w8a FedNS: the 142 sketched roots and their
    Grams, ~70 MB) and frees them at the round's end; with glibc's default, adaptive thresholds the heap top is
    trimmed and the next round faults the same pages in again (w8a: 1.7 M page faults, ~3 s of system CPU in a
    full run).  Fixed thresholds (blocks below ``mmap_threshold`` from the heap, the heap trimmed only past
    ``trim_threshold`` of free top) keep those pages mapped.  Only where the process runs on glibc (elsewhere
    nothing is changed); where an array lives does not change what is computed.  True if applied."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt, _glibc = libc.mallopt, libc.gnu_get_libc_version  # glibc only (musl has no version call)
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl has no version call)
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(mallopt(M_TRIM_THRESHOLD, int(trim_threshold)))


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill PID``, a scheduler, ``Popen.terminate``), unwound through the same cleanup as Ctrl-C."""


def run_command(prog: str, main, what_is_kept: str = "nothing was written") -> int:
    """A command's ``__main__``: ``sys.exit(run_command(PROG, main))``.  Ctrl-C ends it with one line and exit
    130 (128 + SIGINT, as a shell reports it) instead of a traceback; SIGTERM likewise with exit 143: it is
    raised as ``Terminated`` (a KeyboardInterrupt), so ``main``'s own cleanup (temporary folders, child
    processes, a worker pool that would otherwise be orphaned) has run by then.  A KeyboardInterrupt carrying a
    message (validation.dnn: what the output folder keeps) says that instead of ``what_is_kept``."""

    received = []  # the SIGTERMs that arrived: a library that turns Terminated into a plain KeyboardInterrupt (Ray's
    # waits report any interruption so) still ends as a SIGTERM, in its own words and exit status

    def terminated(signum, frame):
        received.append(signum)
        raise Terminated()

    def signal_of(exc):  # SIGTERM or Ctrl-C raised where it cannot propagate: sent again (outputs)
        if isinstance(exc, Terminated):
            return signal.SIGTERM
        if isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            return signal.SIGINT
        return None

    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, terminated) if main_thread else None
    try:
        with lost_signals_sent_again(signal_of):
            return main()
    except KeyboardInterrupt as exc:
        if not isinstance(exc, Terminated) and not received:
            sys.stderr.write(f"{prog}: error: interrupted (Ctrl-C); {str(exc) or what_is_kept}\n")
            return 130
        sys.stderr.write(f"{prog}: error: terminated (SIGTERM); {str(exc) or what_is_kept}\n")
        return 128 + signal.SIGTERM
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)


def fail(prog: str, exc: BaseException) -> None:
    """Print one line naming the cause and exit 2 (no traceback for user errors)."""
    sys.stderr.write(f"{prog}: error: {exc}\n")
    raise SystemExit(2)


USER_ERRORS = (DataError, BackendError, ValueError, ArithmeticError, OSError)
