"""Any fedconvex method on Flower (flwr 1.42): the simulation engine, or a real local deployment.

    python -m validation.flower --problem logreg --method scaffold --clients 3 --rounds 2 --mode simulation --check
    python -m validation.flower --problem logreg --method fednl --clients 3 --rounds 2 --mode deployment --check
    python -m validation.flower prepare --dataset cifar10 --data-dir DATA --clients 3 --out PARTS
    python -m validation.flower --problem cnn --method fedpm --clients 3 --mode deployment --data-dir PARTS
    python -m validation.flower keys --out KEYS --nodes 3 --host server.example.org

Deployment starts a SuperLink and N SuperNodes on 127.0.0.1 as child processes, submits the app
with ``flwr run`` and stops every process it started when done (also on error or Ctrl-C).  It runs with
TLS (a throw-away certificate authority) and SuperNode authentication (one registered key pair per
SuperNode) unless ``--insecure`` is given; the credentials live in the run's private temporary folder and
are removed with it.  ``keys`` (validation/flower_keys.py) writes the same files for machines of your own.
``--check`` runs the same algorithm in-process (each client with its own random stream, as a SuperNode)
and fails when the models differ beyond round-off.  ``prepare`` (validation/flower_prepare.py) writes each
client's image partition to its own folder.  Writes OUT/result.json (final parameters, per-round history,
configuration, wall time), OUT/history.csv (the history in the one format of fedconvex.history) and OUT/logs/
(Flower's and Ray's output, kept out of the terminal: flower.log of a simulation, one log per process of a
deployment).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from validation import common
from validation.outputs import Kind

PROG = "python -m validation.flower"
OUTPUT = Kind(PROG, ("result.json", "history.csv", "logs"))  # what a run writes into --out
COMMANDS = {
    "prepare": "write each client's image partition to its own folder (prepare --help)",
    "keys": "write TLS certificates and SuperNode keys for a deployment across machines (keys --help)",
}


def _codec(spec):
    """--precond-codec: the delta codecs' per-client estimates live in the nodes' Context state."""
    return common.precond_codec(spec)


def parse_args(argv=None):
    p = common.OneLineParser(prog=PROG, doc=__doc__, commands=COMMANDS)
    p.add_argument(
        "--problem", choices=("logreg", "cnn"), default="logreg", help="logistic regression, or the SimpleCNN"
    )
    from fedconvex.algorithms import REGISTRY
    from fedpm_dnn.method_names import METHOD_NAMES as DNN_METHODS

    p.add_argument(
        "--method",
        choices=sorted(set(REGISTRY) | set(DNN_METHODS)),
        default="fedpm",
        help="any registered fedconvex method on logreg; any registered fedpm_dnn method on the cnn",
    )
    p.add_argument(
        "--params",
        default="",
        help='more hyper-parameters of the method as JSON, e.g. \'{"compressor": "topk", "k": 50}\' (default: none)',
    )
    p.add_argument(
        "--participants", type=common.positive_int, default=None, help="clients sampled per round (default: all)"
    )
    p.add_argument("--weighting", choices=("uniform", "samples"), default="uniform", help="client weights")
    p.add_argument(
        "--dataset",
        default=common.DEFAULT_LIBSVM,
        help="logreg: bundled name or LibSVM path, as Test 1 (the cnn uses a seeded "
        "synthetic image task so every SuperNode can rebuild its partition, or --data-dir)",
    )
    p.add_argument("--clients", type=common.positive_int, default=3, help="clients (SuperNodes)")
    p.add_argument("--rounds", type=common.positive_int, default=2, help="communication rounds")
    p.add_argument(
        "--lr", type=common.positive_float, default=None, help="learning rate (default: the method's own; fedavg 10)"
    )
    p.add_argument(
        "--local-steps",
        type=common.positive_int,
        default=None,
        help="logreg: local steps per round; with --problem cnn a deprecated alias of --local-epochs (default: 1)",
    )
    p.add_argument(
        "--local-epochs",
        type=common.positive_int,
        default=None,
        help="cnn: local epochs over the client's data per round (default: the preset's, else 1)",
    )
    from fedpm_dnn.presets import PRESETS

    common.add_last_batch_arg(p, scope="cnn: ")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS) + ["none"],
        default=None,
        help="cnn: hyper-parameters of an appendix table; with --data-dir the prepared data set's (femnist, or "
        "cifar10/cifar100 at its alpha) where the table has the method; none: the method's own settings (default: the "
        "prepared data set's with --data-dir, else none)",
    )
    common.add_seed_arg(p)
    common.add_device_arg(p, "auto", "the clients train on the CPU (cuda is refused; auto = cpu)")
    common.add_quiet_arg(p)
    p.add_argument(
        "--lam",
        type=common.positive_float,
        default=1e-3,
        help="L2 regularisation (> 0: without it a client's Hessian can be singular)",
    )
    p.add_argument(
        "--precond-dtype",
        choices=("float64", "float32", "float16"),
        default="float64",
        help="dtype the preconditioners travel in (the cnn's: float32 or float16)",
    )
    p.add_argument(
        "--precond-codec",
        default="none",
        type=_codec,
        help="how FedPM's preconditioners travel: none, sym, fp16, bf16, lowrank:R, delta:C (the delta "
        "codecs' estimates live on the nodes); see fedconvex/codecs.py",
    )
    p.add_argument(
        "--data-dir",
        default="",
        help="cnn: a data set prepared by `python -m validation.flower prepare` "
        "(default: the seeded synthetic image task); in deployment SuperNode i reads only DIR/client-i",
    )
    p.add_argument(
        "--mode",
        choices=("simulation", "deployment"),
        default="simulation",
        help="Flower's simulation engine, or a SuperLink and SuperNodes as processes",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="deployment only: no TLS and no SuperNode authentication -- anyone who reaches the SuperLink's "
        "port can read every model and join as a SuperNode",
    )
    p.add_argument(
        "--timeout",
        type=common.wait_seconds,
        default=300.0,
        help="seconds the server waits for the SuperNodes' replies in a round (or to a question); a node that "
        "has not answered by then is left out of that round.  Bounds each wait, not the whole run (the first "
        "question to a node, which starts its ClientApp, waits 30 s more)",
    )
    common.add_max_ratio_arg(p, "flower")
    p.add_argument("--check", action="store_true", help="compare with the in-process run")
    p.add_argument("--out", default=None, help="output folder (default: results/flower-<problem>-<method>-<mode>)")
    p.add_argument(
        "--write-app",
        metavar="DIR",
        default=None,
        help="only write the Flower app folder (pyproject.toml) for `flwr run` on a remote SuperLink (default: run)",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join("results", f"flower-{args.problem}-{args.method}-{args.mode}")
    if args.insecure and args.mode != "deployment":
        p.error("--insecure applies to --mode deployment only (the simulation has no network)")
    if args.params:
        try:
            extra = json.loads(args.params)
        except ValueError as exc:
            p.error(f"--params {args.params!r}: not JSON ({exc})")
        if not isinstance(extra, dict):
            p.error(f"--params {args.params!r}: expected a JSON object of hyper-parameters")
        _fold_params(p, args, extra, argv)
    args.preset_default = False  # whether the preset is the prepared data set's, not one given
    if args.preset == "none":
        args.preset = None
    elif args.preset is None and args.problem == "cnn" and args.data_dir:
        args.preset = prepared_preset(args.data_dir, args.method)
        args.preset_default = args.preset is not None
    check_vocabulary(p, args)  # after --params: a key there may set --local-epochs
    common.check_max_ratio(p, args)
    # on the cnn every method takes --local-steps (as local_epochs); --precond-codec and --precond-dtype only the
    # methods that send a preconditioner
    if args.problem == "logreg" and args.method in REGISTRY:
        common.refuse_foreign(p, REGISTRY, [args.method], args, ("precond_codec", "local_steps"))
        # a logreg preconditioner travels as the blocks its codec encodes (fedpm_flower.wire.flatten casts those
        # alone): a method without a preconditioner codec sends none for --precond-dtype to apply to
        if args.precond_dtype != p.get_default("precond_dtype") and "precond_codec" not in REGISTRY.hyperparameters(
            args.method
        ):
            p.error(f"--precond-dtype does not apply: {args.method} sends no preconditioner")
    elif args.method in DNN_METHODS:
        from fedpm_dnn.algorithms import REGISTRY as DNN_REGISTRY

        if "precond_dtype" in p.given(argv if argv is not None else sys.argv[1:]) and args.precond_dtype == "float64":
            p.error("--precond-dtype float64: the cnn's preconditioners travel as float32 (its default) or float16")
        common.refuse_foreign(p, DNN_REGISTRY, [args.method], args, ("precond_codec", "precond_dtype"))
    if args.participants is not None and args.participants > args.clients:
        p.error(f"--participants {args.participants} exceeds --clients {args.clients}")
    if args.write_app is not None and not args.write_app.strip():
        p.error("--write-app: empty path")
    if args.write_app:
        given = p.given(argv if argv is not None else sys.argv[1:])
        for name in WRITE_APP_REFUSES:
            if name in given:
                p.error(
                    f"--{name.replace('_', '-')} does not apply to --write-app (the app folder carries the run's "
                    "settings; `flwr run` starts it on your SuperLink)"
                )
        if os.path.lexists(args.write_app) and not os.path.isdir(args.write_app):
            p.error(f"--write-app {args.write_app}: exists and is not a folder")
        toml = os.path.join(args.write_app, "pyproject.toml")
        if os.path.lexists(toml) and not _our_app(toml):
            p.error(
                f"--write-app {args.write_app}: holds a pyproject.toml that is not a FedPM Flower app; "
                "choose another folder"
            )
        return args
    if args.problem == "logreg":
        from fedconvex.data import BUNDLED

        if args.dataset not in BUNDLED:
            if os.path.lexists(args.dataset) and not os.path.isfile(args.dataset):
                from fedconvex.files import not_a_file  # a FIFO, a folder, a link to nothing: named as what it is

                p.error(f"--dataset {args.dataset}: {not_a_file(args.dataset)}; give a bundled name or a LibSVM file")
            if not os.path.isfile(args.dataset):
                p.error(f"--dataset {args.dataset}: neither a bundled dataset ({', '.join(BUNDLED)}) nor a file")
            args.dataset = os.path.abspath(args.dataset)  # SuperNodes run in another folder
    elif "dataset" in p.given(argv if argv is not None else sys.argv[1:]):  # given, even as the default's value
        p.error(
            "--dataset does not apply to --problem cnn (it trains on a seeded synthetic image task, or on "
            "--data-dir prepared by `python -m validation.flower prepare`)"
        )
    if args.data_dir:
        if args.problem != "cnn":
            p.error("--data-dir applies to --problem cnn only")
        if not os.path.isfile(os.path.join(args.data_dir, "server", "meta.json")):
            p.error(f"--data-dir {args.data_dir}: not a folder written by `python -m validation.flower prepare`")
        from fedpm_flower import prepared

        try:
            prepared.check(args.data_dir, args.clients)
        except (ValueError, OSError) as exc:
            p.error(f"--data-dir {args.data_dir}: {exc}")
        args.data_dir = os.path.abspath(args.data_dir)
    common.check_out_arg(p, args.out, kind=OUTPUT)
    return args


# flags that say how this command runs, not what the app runs: refused beside --write-app rather than dropped
WRITE_APP_REFUSES = ("mode", "check", "insecure", "out", "quiet")

# --params keys that have a flag of their own (problem -> hyper-parameter -> the flag's dest)
FLAG_PARAMS = {
    "logreg": {"lr": "lr", "local_steps": "local_steps", "precond_codec": "precond_codec"},
    "cnn": {"lr": "lr", "local_epochs": "local_epochs", "precond_codec": "precond_codec", "weighting": "weighting"},
}


def _fold_params(p, args, extra: dict, argv) -> None:
    """A --params key that a flag also sets: refused when the flag is given too (which would win is a guess),
    else moved to the flag's setting, so that the run and result.json's configuration say the value used."""
    given = p.given(argv if argv is not None else sys.argv[1:])
    for key, dest in FLAG_PARAMS[args.problem].items():
        if key not in extra:
            continue
        # the cnn's --local-steps is the deprecated spelling of --local-epochs: either collides with the key
        spellings = (dest, "local_steps") if (args.problem, dest) == ("cnn", "local_epochs") else (dest,)
        for name in spellings:
            if name in given:
                p.error(f"--params sets {key!r} and so does --{name.replace('_', '-')}: give it once")
        value = extra.pop(key)
        if dest == "precond_codec":
            try:
                value = _codec(value if isinstance(value, str) else repr(value))
            except argparse.ArgumentTypeError as exc:
                p.error(f"--params {key!r}: {exc}")
        setattr(args, dest, value)
    args.params = json.dumps(extra) if extra else ""


def check_vocabulary(p, args) -> None:
    """--local-steps (logreg) / --local-epochs (cnn), --preset and --device, as one parser error each; sets
    args.local_steps to what FlowerRunConfig carries on the cnn (epochs; on logreg it stays as given, None for the
    method's default, so that a method without local steps is not handed one)."""
    if args.device == "cuda":
        p.error("--device cuda: the Flower clients train on the CPU (logreg in NumPy, the cnn in CPU torch)")
    if args.problem == "logreg":
        for flag, value in (
            ("--local-epochs", args.local_epochs),
            ("--preset", args.preset),
            ("--last-batch", args.last_batch),
        ):
            if value is not None:
                p.error(f"{flag} applies to --problem cnn only")
        return
    if args.local_steps is not None:  # it meant epochs on the cnn
        common.warn_deprecated(PROG, "--local-steps with --problem cnn", "--local-epochs")
        if args.local_epochs is None:
            args.local_epochs = args.local_steps
    if args.last_batch is not None and "last_batch" in json.loads(args.params or "{}"):
        p.error("--params sets 'last_batch' and so does --last-batch: give it once")
    try:
        preset = preset_row(args.preset, args.method) if args.preset else {}
    except ValueError as exc:
        p.error(str(exc))
    args.local_steps = args.local_epochs if args.local_epochs is not None else preset.get("local_epochs", 1)


def prepared_preset(data_dir: str, method: str) -> str | None:
    """The preset of the data set prepared in ``data_dir`` (its server/meta.json): femnist's, or cifar10's /
    cifar100's at the split's alpha; None where there is none for it or for ``method`` (or the folder cannot be
    read: parse_args names that)."""
    from fedpm_dnn.presets import PRESETS
    from fedpm_flower import prepared

    try:
        meta = prepared.meta(prepared.server_folder(data_dir))
    except (OSError, ValueError):
        return None
    dataset, alpha = meta.get("dataset"), meta.get("alpha")
    if dataset == "femnist":
        name = "femnist"
    elif dataset in ("cifar10", "cifar100") and isinstance(alpha, (int, float)) and not isinstance(alpha, bool):
        name = f"{dataset}-a{float(alpha)}"
    else:
        return None
    return name if name in PRESETS and method in PRESETS[name]["methods"] else None


def run_dataset(args) -> str:
    """What the run trains on, for its configuration: the LibSVM data set (logreg), the prepared data set's name
    (cnn with --data-dir), or the cnn's seeded synthetic task."""
    if args.problem == "logreg":
        return args.dataset
    if not args.data_dir:
        return "synthetic"
    from fedpm_flower import prepared

    try:
        return str(prepared.meta(prepared.server_folder(args.data_dir)).get("dataset", "prepared"))
    except (OSError, ValueError):
        return "prepared"


def preset_row(preset: str, method: str) -> dict:
    """The appendix table's hyper-parameters of ``method`` (fedpm_dnn.presets), with the table's local epochs and
    the presets' last-batch rule."""
    from fedpm_dnn.presets import PRESET_LAST_BATCH, PRESETS

    table = PRESETS[preset]
    if method not in table["methods"]:
        raise ValueError(f"--preset {preset}: has no row for --method {method}")
    return {
        **table["methods"][method],
        "last_batch": PRESET_LAST_BATCH,
        "local_epochs": table["setting"].get("local_epochs", 1),
    }


def _our_app(toml: str) -> bool:
    try:
        with open(toml) as fh:
            return 'name = "fedpm-flower-app"' in fh.read()
    except (OSError, UnicodeDecodeError):
        return False


def check_split(cfg) -> None:
    """Every client must get data: checked before any process is started."""
    if cfg.problem == "logreg":
        from fedconvex.data import load_dataset
        from fedpm_flower.logreg import split

        ds = load_dataset(cfg.dataset)
        common.check_fits(ds, cfg.dataset)
        split(cfg, ds.n)


def in_process(cfg):
    """The same run in-process (fedconvex.run), each client drawing from its own random stream as a
    SuperNode does (``client_streams``): final parameters."""
    from fedconvex.data import load_dataset
    from fedconvex.problem import FederatedLogReg
    from fedconvex.run import run
    from fedpm_flower.logreg import algorithm, split

    ds = load_dataset(cfg.dataset)
    problem = FederatedLogReg(ds.X, ds.y, split(cfg, ds.n), lam=cfg.lam, weighting=cfg.weighting)
    state, _ = run(
        problem,
        algorithm(cfg),
        np.zeros(problem.d),
        cfg.rounds,
        participants=cfg.participants or None,
        seed=cfg.seed,
        client_streams=True,
    )
    return state.theta


LOGS = "logs"  # the run's folder of Flower's and Ray's output (simulation: flower.log; deployment: one per process)


def log_folder(cfg) -> str | None:
    """Where the run writing ``cfg.out`` keeps Flower's and Ray's output: beside its result (None without one)."""
    return os.path.join(os.path.dirname(cfg.out), LOGS) if cfg.out else None


def _simulate(cfg) -> None:
    """The Flower simulation, in a process of its own (``simulate``): Ray starts in the process that starts the
    simulation runtime and takes SIGTERM there for itself.  The runtime is flwr's ``_run_simulation``, the one that
    both of Flower's entry points run (``flwr run`` on a simulation SuperLink through ``flwr-simulation``, and the
    deprecated ``run_simulation`` with its banner); this process's output -- Flower's log, Ray's start-up warnings,
    what the Ray workers print through it -- goes to the run's logs/flower.log, not to the user's terminal."""
    os.setsid()  # its own process group: the parent stops the simulation's whole tree at once
    os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"  # no C++ abort trace when it is stopped
    folder = log_folder(cfg)
    if folder:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, "flower.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    from fedpm_flower import apps

    _run_simulation(
        num_supernodes=cfg.clients,
        exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
        client_app=apps.make_client_app(cfg),
        server_app=apps.make_server_app(cfg),
        backend_name="ray",
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )


def simulation_log_problem(cfg) -> str | None:
    """The error the simulation's log reports (its first Python exception line, the cause the later ones follow
    from, else its first ERROR line), for the message of a run that failed: the log goes with the unfinished
    output."""
    import re

    folder = log_folder(cfg)
    try:
        with open(os.path.join(folder, "flower.log"), errors="replace") as fh:
            lines = [ln.strip() for ln in fh.read().splitlines() if ln.strip()]
    except (OSError, TypeError):
        return None
    exceptions = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", ln)]
    errors = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in lines if "ERROR" in ln]
    found = exceptions or errors
    return found[0][:300] if found else None


RESULT_GRACE = 30.0  # seconds the simulation may take to shut down once its result is written


def simulate(cfg, on_rounds=None) -> None:
    """Run the simulation in a child process and wait for it.  Ray, in the process that starts it, answers
    SIGTERM with an abort (exit 134, no cleanup) or an exit while the ServerApp's thread keeps the process
    alive; here this process keeps the command's own SIGTERM and Ctrl-C (one line, exit 143 / 130, the
    output's temporary folder removed) and stops the child's whole process tree, Ray's included.

    --timeout as in deployment (fedpm_flower.deploy): the ServerApp's waits for replies are bounded by it and
    marked as they end; a silence of 2 x --timeout + 60 s is a stuck simulation, and once the result is written a
    slow client's unfinished work does not hold the command beyond RESULT_GRACE.  ``on_rounds(done)`` each time
    the count of rounds done, which the ServerApp writes to its progress file, grows (as in deployment)."""
    import multiprocessing

    from fedpm_flower.config import RoundsWatch, progress_file
    from fedpm_flower.deploy import IDLE_GRACE, stop_tree

    count_rounds = RoundsWatch(cfg.out, on_rounds)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_simulate, args=(cfg,), daemon=False)
    child.start()
    idle, last, written = 2 * cfg.timeout + IDLE_GRACE, time.time(), None
    try:
        while child.exitcode is None:
            child.join(0.5)
            count_rounds()
            now = time.time()
            try:
                last = max(last, os.stat(progress_file(cfg.out)).st_mtime)
            except OSError:
                pass
            if cfg.out and os.path.exists(cfg.out):
                written = written or now
                if now - written > RESULT_GRACE:
                    break  # the result is complete (written atomically); the tree is stopped below
            elif now - last > idle:
                raise TimeoutError(
                    f"the simulation made no progress for {idle:.0f}s (2 x --timeout {cfg.timeout:g}s + "
                    f"{IDLE_GRACE:.0f}s): it is stuck"
                )
    finally:
        if child.exitcode is None:  # interrupted here: the simulation does not outlive the command
            stop_tree(child.pid)
            child.join()
        count_rounds()


def run_flower(cfg, mode: str, timeout: float, secure: bool = True, quiet: bool = True) -> dict:
    """The run in ``mode``, with a bar over its rounds on a terminal unless ``quiet``: the ServerApp runs in
    another process in either mode and writes its count of rounds done beside its result (Heartbeat.on_round),
    which the waits below read."""
    from validation.progress import Progress

    with Progress(cfg.rounds, f"{cfg.method} rounds", enabled=not quiet, unit="round") as bar:
        return _run_flower(cfg, mode, timeout, secure, lambda done: bar.update(done - bar.done))


def _run_flower(cfg, mode: str, timeout: float, secure: bool, on_rounds) -> dict:
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    if mode == "simulation":
        simulate(cfg, on_rounds)
        if not os.path.isfile(cfg.out):
            why = simulation_log_problem(cfg) or "no error in its log"
            raise RuntimeError(f"the Flower simulation ended without a result ({why})")
        with open(cfg.out) as fh:
            result = json.load(fh)
        if "error" in result:
            raise RuntimeError(f"the ServerApp failed: {result['error']}")
        return result
    from fedpm_flower.deploy import LocalFederation

    with LocalFederation(cfg.clients, log_dir=log_folder(cfg), data_dir=cfg.data_dir or None, secure=secure) as fed:
        return fed.run(cfg, timeout=timeout, on_rounds=on_rounds)


def run_config(args):
    """The run's FlowerRunConfig from the parsed flags: the method's (or the preset's) learning rate, a preset's
    other hyper-parameters under --params (whose own keys win)."""
    from fedpm_flower.config import FlowerRunConfig

    if args.problem == "cnn":  # SimpleCNN on the seeded synthetic image task, one local epoch per round
        from fedpm_dnn.algorithms import METHODS as DNN_METHODS
        from fedpm_dnn.algorithms import REGISTRY as DNN_REGISTRY

        if args.method not in DNN_METHODS:
            common.fail(PROG, ValueError(f"--method {args.method}: the cnn runs {', '.join(DNN_METHODS)}"))
        preset = preset_row(args.preset, args.method) if args.preset else {}
        lr = (
            args.lr
            if args.lr is not None
            else preset.get("lr", DNN_REGISTRY[args.method].__dataclass_fields__["lr"].default)
        )
        # the preset's other hyper-parameters under --params (whose own keys win)
        hyper = {k: v for k, v in preset.items() if k not in ("lr", "local_epochs")}
        if args.last_batch is not None:  # the flag wins over the preset (--params cannot set it too: check_vocabulary)
            hyper["last_batch"] = args.last_batch
        args.params = json.dumps({**hyper, **json.loads(args.params or "{}")}) if hyper else args.params
    else:
        from fedconvex.algorithms import REGISTRY

        # FedAvg's step as tuned on a9a (it converges on w8a too); every other method its own default
        lr = (
            args.lr
            if args.lr is not None
            else 10.0
            if args.method == "fedavg"
            else REGISTRY[args.method].__dataclass_fields__["lr"].default
        )
    return FlowerRunConfig(
        problem=args.problem,
        method=args.method,
        params=args.params,
        participants=args.participants or 0,
        weighting=args.weighting,
        dataset=run_dataset(args),
        data_dir=args.data_dir,
        clients=args.clients,
        rounds=args.rounds,
        lr=lr,
        local_steps=1 if args.local_steps is None else args.local_steps,
        lam=args.lam,
        seed=args.seed,
        precond_dtype=args.precond_dtype,
        precond_codec=args.precond_codec,
        timeout=args.timeout,
        max_ratio=args.max_ratio,
        out="",
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        from validation import flower_prepare

        return flower_prepare.main(argv[1:])
    if argv[:1] == ["keys"]:
        from validation import flower_keys

        return flower_keys.main(argv[1:])
    args = parse_args(argv)
    try:
        import flwr  # noqa: F401
    except ImportError:
        from fedconvex.extras import install_hint

        common.fail(PROG, ImportError(install_hint("Flower", "flower")))
    cfg = run_config(args)
    if args.preset_default and not args.quiet:
        print(f"{PROG}: --preset {args.preset}, the prepared data set's (--preset none runs the method's defaults)")
    from fedconvex.data import DataError
    from validation.outputs import OutputError, ResultDir

    try:
        if args.problem == "cnn":
            from fedpm_flower.cnn import algorithm as cnn_algorithm

            cnn_algorithm(cfg)  # unknown or bad hyper-parameters: before any process starts
        if args.problem == "logreg":
            from fedpm_flower.logreg import algorithm

            alg = algorithm(cfg)  # unknown hyper-parameters, bad codec settings: before any process starts
            if args.check and getattr(alg, "gaussian_draw", None) == "bartlett":
                raise ValueError(
                    "--check compares with the in-process run to round-off, and FedNS's "
                    "gaussian_draw 'bartlett' is not round-off-stable (README, FedNS's Gaussian sketch); "
                    "check with 'dense'"
                )
        if args.write_app:
            return write_app(args, cfg)
        check_split(cfg)
        with ResultDir(args.out, kind=OUTPUT) as tmp:
            final = os.path.abspath(os.path.join(args.out, "result.json"))
            cfg = dataclasses.replace(cfg, out=os.path.join(tmp, "result.json"))
            finish(args, cfg, tmp, final)
    except (RuntimeError, TimeoutError, OSError, ValueError, DataError, OutputError) as exc:
        common.fail(PROG, exc)
    return 0


def write_app(args, cfg) -> int:
    """--write-app DIR: the app folder whose run config holds this command's settings (``flwr run``'s
    --run-config overrides any of them; ``out`` names the result file on the server machine)."""
    from fedpm_flower.deploy import write_app as write_app_folder

    write_app_folder(args.write_app, cfg)
    print(
        f"wrote {args.write_app}/pyproject.toml with these settings; submit with: flwr run {args.write_app} "
        f"<connection> --run-config \"out='/path/on/the/server/result.json'\" (any other setting overrides too)"
    )
    return 0


def finish(args, cfg, tmp, final) -> None:
    from fedconvex.history import history_csv

    start = time.perf_counter()
    result = run_flower(cfg, args.mode, args.timeout, secure=not args.insecure, quiet=args.quiet)
    wall = time.perf_counter() - start
    if not any(h.get("used", 0) for h in result["history"]):
        why = simulation_log_problem(cfg) if args.mode == "simulation" else None
        raise RuntimeError(
            f"no client contributed to any of the {args.rounds} rounds (every reply was dropped or "
            "rejected" + (f"; the simulation's log: {why}" if why else "") + "); nothing written"
        )
    result["config"]["out"] = final
    result["preset"] = args.preset
    result["wall_seconds"] = wall
    result["mode"] = args.mode
    if args.mode == "deployment":
        result["transport_security"] = "insecure" if args.insecure else "tls+supernode-auth"
    if args.check:
        if args.problem == "cnn":
            from fedpm_flower.cnn import in_process as in_process_cnn

            ref = in_process_cnn(cfg)
        else:
            ref = in_process(cfg)
        diff = float(np.max(np.abs(np.asarray(result["theta"]) - ref)))
        result["max_abs_diff_vs_in_process"] = diff
        # round-off only: float64 clients (logreg) or float32 torch (cnn); float16 preconditioners differ by design
        tol = (1e-4 if args.problem == "cnn" else 1e-9) * max(1.0, float(np.max(np.abs(ref))))
        if args.precond_dtype == "float64" and not diff <= tol:
            raise RuntimeError(
                f"--check: the Flower model differs from the in-process one by {diff:.2e} (tolerance {tol:.1e})"
            )
    with open(cfg.out, "w") as fh:
        json.dump(result, fh, indent=1)
    # the history in the one format every front-end writes (fedconvex.history), beside the raw result
    with open(os.path.join(tmp, "history.csv"), "w") as fh:
        fh.write(history_csv(result["history"]))
    for name in os.listdir(tmp):  # the ServerApp's own temporary files
        if name.endswith(".tmp"):
            os.remove(os.path.join(tmp, name))
    last = result["history"][-1]
    print(
        f"{args.method} on Flower ({args.mode}), {args.clients} clients, {args.rounds} rounds: wall {wall:.1f} s; "
        f"per client per round {last['bytes_up'] / args.rounds / 1e3:.1f} kB up, "
        f"{last['bytes_down'] / args.rounds / 1e3:.1f} kB down"
    )
    if args.check:
        print(f"largest |theta_flower - theta_in_process| = {result['max_abs_diff_vs_in_process']:.2e}")
    if "test_acc" in result:
        print(f"test accuracy of the final model: {100 * result['test_acc']:.1f} %")
    # the folder as the user named it, as every other command prints it (result.json records the absolute path)
    print(f"wrote {os.path.join(args.out, 'result.json')} and history.csv beside it")


if __name__ == "__main__":
    rc = common.run_command(PROG, main)
    if rc in (130, 143):  # Ctrl-C or SIGTERM
        # Ctrl-C inside the simulation runtime leaves Flower's non-daemon threads waiting on dead Ray actors (up to
        # --timeout a round): the interpreter would print the line and then hang joining them.  The output's
        # temporary folder is already removed (ResultDir), so end here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
