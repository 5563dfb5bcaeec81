"""FedPM on Flower (flwr 1.42): the simulation engine, or a real local deployment.

    python -m validation.flower --problem logreg --method fedpm --clients 3 --rounds 2 --mode simulation
    python -m validation.flower --problem logreg --method fedpm --clients 3 --rounds 2 --mode deployment --check

Deployment starts a SuperLink and N SuperNodes on 127.0.0.1 as child processes, submits the app
with ``flwr run`` and stops every process it started when done (also on error or Ctrl-C).
``--check`` runs the same algorithm in-process and prints the largest parameter difference.
Writes OUT/result.json (final parameters, per-round history, configuration, wall time).
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
    """--precond-codec on Flower: the stateless codecs only (a node keeps no per-client estimate)."""
    import argparse

    from fedconvex.codecs import parse

    spec = common.precond_codec(spec)
    codec = parse(spec)
    if codec is not None and codec.stateful:
        raise argparse.ArgumentTypeError(f"{spec}: the delta codecs keep per-client estimates; use them in "
                                         "validation.superlinear / validation.dnn")
    return spec


def parse_args(argv=None):
    p = common.OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--problem", choices=("logreg", "cnn"), default="logreg")
    p.add_argument("--method", choices=("fedpm", "localnewton", "fedavg"), default="fedpm")
    p.add_argument("--dataset", default="a9a", help="bundled name or LibSVM path (logreg; the cnn uses a seeded "
                   "synthetic image task so every SuperNode can rebuild its partition)")
    p.add_argument("--clients", type=common.positive_int, default=3)
    p.add_argument("--rounds", type=common.positive_int, default=2)
    p.add_argument("--lr", type=common.positive_float, default=None, help="default 1 (fedpm, localnewton), 10 (fedavg)")
    p.add_argument("--local-steps", type=common.positive_int, default=1)
    p.add_argument("--lam", type=common.nonneg_float, default=1e-3)
    p.add_argument("--precond-dtype", choices=("float64", "float32", "float16"), default="float64")
    p.add_argument("--precond-codec", default="none", type=_codec,
                   help="how FedPM's preconditioners travel: none, sym, fp16, bf16, lowrank:R (the delta codecs "
                        "need per-node estimates and are simulator-only); see fedconvex/codecs.py")
    p.add_argument("--mode", choices=("simulation", "deployment"), default="simulation")
    p.add_argument("--timeout", type=common.positive_float, default=300.0)
    p.add_argument("--max-ratio", type=common.nonneg_float, default=1000.0,
                   help="server magnitude guard: reject a reply whose preconditioner trace or parameter norm "
                        "exceeds R x the round's median (0 = off)")
    p.add_argument("--check", action="store_true", help="compare with the in-process run")
    p.add_argument("--out", default=None, help="default results/flower-<problem>-<method>-<mode>")
    p.add_argument("--write-app", metavar="DIR", default=None,
                   help="only write the Flower app folder (pyproject.toml) for `flwr run` on a remote SuperLink")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join("results", f"flower-{args.problem}-{args.method}-{args.mode}")
    if args.max_ratio and args.max_ratio < 1:
        p.error(f"--max-ratio {args.max_ratio:g}: must be >= 1 (or 0 = off): below 1 even the median reply is rejected")
    if args.write_app:
        if os.path.lexists(args.write_app) and not os.path.isdir(args.write_app):
            p.error(f"--write-app {args.write_app}: exists and is not a folder")
        toml = os.path.join(args.write_app, "pyproject.toml")
        if os.path.lexists(toml) and not _our_app(toml):
            p.error(f"--write-app {args.write_app}: holds a pyproject.toml that is not a FedPM Flower app; "
                    "choose another folder")
        return args
    if args.problem == "logreg":
        from fedconvex.data import BUNDLED

        if args.dataset not in BUNDLED:
            if not os.path.isfile(args.dataset):
                p.error(f"--dataset {args.dataset}: neither a bundled dataset ({', '.join(BUNDLED)}) nor a file")
            args.dataset = os.path.abspath(args.dataset)   # SuperNodes run in another folder
    elif args.dataset != p.get_default("dataset"):
        p.error("--dataset does not apply to --problem cnn (it trains on a seeded synthetic image task)")
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
    from fedconvex.algorithms import applicable, make_algorithm
    from fedconvex.data import load_dataset
    from fedconvex.problem import FederatedLogReg
    from fedconvex.run import run
    from fedpm_flower.logreg import split

    ds = load_dataset(cfg.dataset)
    problem = FederatedLogReg(ds.X, ds.y, split(cfg, ds.n), lam=cfg.lam)
    state, _ = run(problem, make_algorithm(cfg.method, **applicable(cfg.method, {"lr": cfg.lr, "local_steps": cfg.local_steps})), np.zeros(problem.d),
                   cfg.rounds)
    return state.theta


def run_flower(cfg, mode: str, timeout: float) -> dict:
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    if mode == "simulation":
        from flwr.simulation import run_simulation

        from fedpm_flower.apps import make_client_app, make_server_app

        run_simulation(make_server_app(cfg), make_client_app(cfg), num_supernodes=cfg.clients,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
        if not os.path.isfile(cfg.out):
            raise RuntimeError("the Flower simulation ended without a result (its log is above)")
        with open(cfg.out) as fh:
            result = json.load(fh)
        if "error" in result:
            raise RuntimeError(f"the ServerApp failed: {result['error']}")
        return result
    from fedpm_flower.deploy import LocalFederation

    with LocalFederation(cfg.clients) as fed:
        return fed.run(cfg, timeout=timeout)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_app:
        from fedpm_flower.deploy import write_app

        write_app(args.write_app, None)
        print(f"wrote {args.write_app}/pyproject.toml; submit with: flwr run {args.write_app} <connection> "
              f"--run-config \"method='fedpm' clients=N rounds=T out='/path/on/the/server/result.json'\"")
        return 0
    try:
        import flwr  # noqa: F401
    except ImportError:
        common.fail(PROG, ImportError("Flower is not installed: pip install -e '.[flower]'"))
    from fedpm_flower.config import FlowerRunConfig

    if args.problem == "cnn":   # SimpleCNN on the seeded synthetic image task, one local epoch per round
        lr = args.lr if args.lr is not None else 0.1
    else:
        lr = args.lr if args.lr is not None else (10.0 if args.method == "fedavg" else 1.0)
    from fedconvex.data import DataError
    from validation.outputs import OutputError, ResultDir

    cfg = FlowerRunConfig(problem=args.problem, method=args.method, dataset=args.dataset, clients=args.clients,
                          rounds=args.rounds, lr=lr, local_steps=args.local_steps, lam=args.lam,
                          precond_dtype=args.precond_dtype, precond_codec=args.precond_codec, timeout=args.timeout,
                          max_ratio=args.max_ratio, out="")
    try:
        check_split(cfg)
        with ResultDir(args.out) as tmp:
            final = os.path.abspath(os.path.join(args.out, "result.json"))
            cfg = dataclasses.replace(cfg, out=os.path.join(tmp, "result.json"))
            finish(args, cfg, tmp, final)
    except (RuntimeError, TimeoutError, OSError, ValueError, DataError, OutputError) as exc:
        common.fail(PROG, exc)
    return 0


def finish(args, cfg, tmp, final) -> None:
    start = time.perf_counter()
    result = run_flower(cfg, args.mode, args.timeout)
    wall = time.perf_counter() - start
    if not any(h.get("used", 0) for h in result["history"]):
        raise RuntimeError(f"no client contributed to any of the {args.rounds} rounds (every reply was dropped or "
                           "rejected); nothing written")
    result["config"]["out"] = final
    result["wall_seconds"] = wall
    result["mode"] = args.mode
    if args.check:
        if args.problem == "cnn":
            from fedpm_flower.cnn import in_process as in_process_cnn

            ref = in_process_cnn(cfg)
        else:
            ref = in_process(cfg)
        result["max_abs_diff_vs_in_process"] = float(np.max(np.abs(np.asarray(result["theta"]) - ref)))
    with open(cfg.out, "w") as fh:
        json.dump(result, fh, indent=1)
    for name in os.listdir(tmp):   # the ServerApp's own temporary files
        if name.endswith(".tmp"):
            os.remove(os.path.join(tmp, name))
    last = result["history"][-1]
    print(f"{args.method} on Flower ({args.mode}), {args.clients} clients, {args.rounds} rounds: wall {wall:.1f} s; "
          f"per client per round {last['bytes_up_per_client'] / 1e3:.1f} kB up, {last['bytes_down_per_client'] / 1e3:.1f} kB down")
    if args.check:
        print(f"largest |theta_flower - theta_in_process| = {result['max_abs_diff_vs_in_process']:.2e}")
    print(f"wrote {final}")


if __name__ == "__main__":
    sys.exit(main())
