"""Wall time per round and peak memory of a secure local Flower deployment with many SuperNodes.

    python benchmarks/flower_deployment_scale.py --nodes 20 --rounds 3 --out scale.json
    python benchmarks/flower_deployment_scale.py --nodes 20 --rounds 1 --result run.json --log-dir logs


One SuperLink and N SuperNodes on 127.0.0.1 (TLS and SuperNode authentication, as
``python -m validation.flower --mode deployment``), FedPM on a9a split into N clients.  Memory is the
sum of the resident set sizes of every process of the federation (SuperLink, SuperNodes, SuperExec,
ServerApp, ClientApps), sampled every 0.2 s; its peak is reported with the start-up and per-round times.
``--result`` keeps the run's own output (per-round history and final parameters, as ``validation.flower``
writes it), ``--log-dir`` the logs of the SuperLink and every SuperNode.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def settings(argv) -> list:
    """The command's arguments without where its files went (``--out``, ``--result``, ``--log-dir``)."""
    args, skip = [], False
    for a in argv if argv is not None else sys.argv[1:]:
        if skip or a.startswith(("--out=", "--result=", "--log-dir=")):
            skip = False
            continue
        skip = a in ("--out", "--result", "--log-dir")
        if not skip:
            args.append(a)
    return args


def main(argv=None) -> int:
    from fedconvex.algorithms import REGISTRY
    from fedconvex.history import round_seconds
    from validation.common import OneLineParser, positive_int, wait_seconds

    p = OneLineParser(prog="python benchmarks/flower_deployment_scale.py", doc=__doc__)
    p.add_argument("--nodes", type=positive_int, default=20)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--method", choices=sorted(REGISTRY), default="fedpm")
    p.add_argument("--insecure", action="store_true")
    p.add_argument("--timeout", type=wait_seconds, default=None, help="seconds the ServerApp waits for replies")
    p.add_argument("--out", default=None, help="write the measurement as JSON here")
    p.add_argument("--result", default=None, help="write the run's result (history, final parameters) as JSON here")
    p.add_argument("--log-dir", default=None, help="keep the federation's process logs in this folder")
    args = p.parse_args(argv)
    for flag, path in (("--out", args.out), ("--result", args.result)):  # found out before the federation starts
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"{flag} {path}: its folder does not exist")
    if args.log_dir is not None and os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
        p.error(f"--log-dir {args.log_dir}: not a folder")
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    from fedpm_flower.config import FlowerRunConfig
    from fedpm_flower.deploy import LocalFederation

    lr = REGISTRY[args.method].__dataclass_fields__["lr"].default
    with tempfile.TemporaryDirectory() as tmp:
        cfg = FlowerRunConfig(
            method=args.method,
            dataset="a9a",
            clients=args.nodes,
            rounds=args.rounds,
            lr=lr,
            out=os.path.abspath(args.result) if args.result else os.path.join(tmp, "r.json"),
            **({} if args.timeout is None else {"timeout": args.timeout}),
        )
        peak, stop = [0], threading.Event()
        t0 = time.perf_counter()
        log_dir = os.path.abspath(args.log_dir) if args.log_dir else None
        with LocalFederation(args.nodes, log_dir=log_dir, secure=not args.insecure) as fed:
            started = time.perf_counter() - t0

            def sample():
                while not stop.is_set():
                    pids = set(fed.descendants()) | {q.pid for q in fed.procs}
                    peak[0] = max(peak[0], sum(rss_bytes(pid) for pid in pids))
                    time.sleep(0.2)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t1 = time.perf_counter()
            result = fed.run(cfg, timeout=cfg.timeout)  # the launcher's watchdog, as validation.flower sets it
            run_seconds = time.perf_counter() - t1
            stop.set()
            sampler.join()
    history = result["history"][1:]
    per_round = round_seconds(history)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "command": " ".join(["python benchmarks/flower_deployment_scale.py"] + settings(argv)),
        "nodes": args.nodes,
        "rounds": args.rounds,
        "method": args.method,
        "secure": not args.insecure,
        "startup_seconds": round(started, 2),
        "submit_to_result_seconds": round(run_seconds, 2),
        "round_seconds": [round(s, 2) for s in per_round],
        "used_per_round": [h["used"] for h in history],
        "peak_rss_mib": round(peak[0] / 2**20, 1),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
