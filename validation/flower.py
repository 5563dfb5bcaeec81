"""Any fedconvex method on Flower (flwr 1.42): the simulation engine, or a real local deployment.

    python -m validation.flower --problem logreg --method scaffold --clients 3 --rounds 2 --mode simulation --check
    python -m validation.flower --problem logreg --method fednl --clients 3 --rounds 2 --mode deployment --check
    python -m validation.flower prepare --dataset cifar10 --data-dir DATA --clients 3 --out PARTS
    python -m validation.flower --problem cnn --method fedpm --clients 3 --mode deployment --data-dir PARTS

Deployment starts a SuperLink and N SuperNodes on 127.0.0.1 as child processes, submits the app
with ``flwr run`` and stops every process it started when done (also on error or Ctrl-C).
``--check`` runs the same algorithm in-process (each client with its own random stream, as a SuperNode)
and fails when the models differ beyond round-off.  ``prepare`` (validation/flower_prepare.py) writes each
client's image partition to its own folder.  Writes OUT/result.json (final parameters, per-round history,
configuration, wall time) and OUT/history.csv (the history in the one format of fedconvex.history).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

from validation import common

PROG = "python -m validation.flower"


def _codec(spec):
    """--precond-codec: the delta codecs' per-client estimates live in the nodes' Context state."""
    return common.precond_codec(spec)


def parse_args(argv=None):
    p = common.OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--problem", choices=("logreg", "cnn"), default="logreg")
    from fedconvex.algorithms import REGISTRY
    from fedpm_dnn.algorithms import METHODS as DNN_METHODS

    p.add_argument(
        "--method",
        choices=sorted(set(REGISTRY) | set(DNN_METHODS)),
        default="fedpm",
        help="any registered fedconvex method on logreg; any registered fedpm_dnn method on the cnn",
    )
    p.add_argument(
        "--params",
        default="",
        help='more hyper-parameters of the method as JSON, e.g. \'{"compressor": "topk", "k": 50}\'',
    )
    p.add_argument(
        "--participants", type=common.positive_int, default=None, help="clients sampled per round (default all)"
    )
    p.add_argument("--weighting", choices=("uniform", "samples"), default="uniform")
    p.add_argument(
        "--dataset",
        default="a9a",
        help="bundled name or LibSVM path (logreg; the cnn uses a seeded "
        "synthetic image task so every SuperNode can rebuild its partition)",
    )
    p.add_argument("--clients", type=common.positive_int, default=3)
    p.add_argument("--rounds", type=common.positive_int, default=2)
    p.add_argument("--lr", type=common.positive_float, default=None, help="default: the method's own (fedavg: 10)")
    p.add_argument(
        "--local-steps",
        type=common.positive_int,
        default=1,
        help="local steps per round (logreg); with --problem cnn, local epochs over the client's data",
    )
    p.add_argument(
        "--lam",
        type=common.positive_float,
        default=1e-3,
        help="L2 regularisation (> 0: without it a client's Hessian can be singular)",
    )
    p.add_argument("--precond-dtype", choices=("float64", "float32", "float16"), default="float64")
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
    p.add_argument("--mode", choices=("simulation", "deployment"), default="simulation")
    p.add_argument("--timeout", type=common.positive_float, default=300.0)
    p.add_argument(
        "--max-ratio",
        type=common.nonneg_float,
        default=1000.0,
        help="server magnitude guard: reject a reply whose preconditioner trace or parameter norm "
        "exceeds R x the round's median (0 = off)",
    )
    p.add_argument("--check", action="store_true", help="compare with the in-process run")
    p.add_argument("--out", default=None, help="default results/flower-<problem>-<method>-<mode>")
    p.add_argument(
        "--write-app",
        metavar="DIR",
        default=None,
        help="only write the Flower app folder (pyproject.toml) for `flwr run` on a remote SuperLink",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join("results", f"flower-{args.problem}-{args.method}-{args.mode}")
    if args.max_ratio and args.max_ratio < 1:
        p.error(f"--max-ratio {args.max_ratio:g}: must be >= 1 (or 0 = off): below 1 even the median reply is rejected")
    if args.params:
        try:
            extra = json.loads(args.params)
        except ValueError as exc:
            p.error(f"--params {args.params!r}: not JSON ({exc})")
        if not isinstance(extra, dict):
            p.error(f"--params {args.params!r}: expected a JSON object of hyper-parameters")
    if args.participants is not None and args.participants > args.clients:
        p.error(f"--participants {args.participants} exceeds --clients {args.clients}")
    if args.write_app is not None and not args.write_app.strip():
        p.error("--write-app: empty path")
    if args.write_app:
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
            if not os.path.isfile(args.dataset):
                p.error(f"--dataset {args.dataset}: neither a bundled dataset ({', '.join(BUNDLED)}) nor a file")
            args.dataset = os.path.abspath(args.dataset)  # SuperNodes run in another folder
    elif args.dataset != p.get_default("dataset"):
        p.error(
            "--dataset does not apply to --problem cnn (it trains on a seeded synthetic image task, or on "
            "--data-dir prepared by `python -m validation.flower prepare`)"
        )
    if args.data_dir:
        if args.problem != "cnn":
            p.error("--data-dir applies to --problem cnn only")
        if not os.path.isfile(os.path.join(args.data_dir, "server", "meta.json")):
            p.error(f"--data-dir {args.data_dir}: not a folder written by `python -m validation.flower prepare`")
        args.data_dir = os.path.abspath(args.data_dir)
    common.check_out_arg(p, args.out)
    return args


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


def run_flower(cfg, mode: str, timeout: float) -> dict:
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    if mode == "simulation":
        from flwr.simulation import run_simulation

        from fedpm_flower.apps import make_client_app, make_server_app

        run_simulation(
            make_server_app(cfg),
            make_client_app(cfg),
            num_supernodes=cfg.clients,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
        if not os.path.isfile(cfg.out):
            raise RuntimeError("the Flower simulation ended without a result (its log is above)")
        with open(cfg.out) as fh:
            result = json.load(fh)
        if "error" in result:
            raise RuntimeError(f"the ServerApp failed: {result['error']}")
        return result
    from fedpm_flower.deploy import LocalFederation

    with LocalFederation(cfg.clients, data_dir=cfg.data_dir or None) as fed:
        return fed.run(cfg, timeout=timeout)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        from validation import flower_prepare

        return flower_prepare.main(argv[1:])
    args = parse_args(argv)
    if args.write_app:
        from fedpm_flower.deploy import write_app

        write_app(args.write_app, None)
        print(
            f"wrote {args.write_app}/pyproject.toml; submit with: flwr run {args.write_app} <connection> "
            f"--run-config \"method='fedpm' clients=N rounds=T out='/path/on/the/server/result.json'\""
        )
        return 0
    try:
        import flwr  # noqa: F401
    except ImportError:
        common.fail(PROG, ImportError("Flower is not installed: pip install -e '.[flower]'"))
    from fedpm_flower.config import FlowerRunConfig

    if args.problem == "cnn":  # SimpleCNN on the seeded synthetic image task, one local epoch per round
        from fedpm_dnn.algorithms import METHODS as DNN_METHODS
        from fedpm_dnn.algorithms import REGISTRY as DNN_REGISTRY

        if args.method not in DNN_METHODS:
            common.fail(PROG, ValueError(f"--method {args.method}: the cnn runs {', '.join(DNN_METHODS)}"))
        lr = args.lr if args.lr is not None else DNN_REGISTRY[args.method].__dataclass_fields__["lr"].default
    else:
        from fedconvex.algorithms import REGISTRY

        # FedAvg's tuned step on a9a (as before); every other method its own default
        lr = (
            args.lr
            if args.lr is not None
            else 10.0
            if args.method == "fedavg"
            else REGISTRY[args.method].__dataclass_fields__["lr"].default
        )
    from fedconvex.data import DataError
    from validation.outputs import OutputError, ResultDir

    cfg = FlowerRunConfig(
        problem=args.problem,
        method=args.method,
        params=args.params,
        participants=args.participants or 0,
        weighting=args.weighting,
        dataset=args.dataset,
        data_dir=args.data_dir,
        clients=args.clients,
        rounds=args.rounds,
        lr=lr,
        local_steps=args.local_steps,
        lam=args.lam,
        precond_dtype=args.precond_dtype,
        precond_codec=args.precond_codec,
        timeout=args.timeout,
        max_ratio=args.max_ratio,
        out="",
    )
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
        check_split(cfg)
        with ResultDir(args.out) as tmp:
            final = os.path.abspath(os.path.join(args.out, "result.json"))
            cfg = dataclasses.replace(cfg, out=os.path.join(tmp, "result.json"))
            finish(args, cfg, tmp, final)
    except (RuntimeError, TimeoutError, OSError, ValueError, DataError, OutputError) as exc:
        common.fail(PROG, exc)
    return 0


def finish(args, cfg, tmp, final) -> None:
    from fedconvex.history import history_csv

    start = time.perf_counter()
    result = run_flower(cfg, args.mode, args.timeout)
    wall = time.perf_counter() - start
    if not any(h.get("used", 0) for h in result["history"]):
        raise RuntimeError(
            f"no client contributed to any of the {args.rounds} rounds (every reply was dropped or "
            "rejected); nothing written"
        )
    result["config"]["out"] = final
    result["wall_seconds"] = wall
    result["mode"] = args.mode
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
    print(f"wrote {final} and history.csv beside it")


if __name__ == "__main__":
    rc = common.run_command(PROG, main)
    if rc in (130, 143):  # Ctrl-C or SIGTERM
        # Ctrl-C inside run_simulation leaves Flower's non-daemon threads waiting on dead Ray actors (up to
        # --timeout a round): the interpreter would print the line and then hang joining them.  The output's
        # temporary folder is already removed (ResultDir), so end here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
