"""Wall time per round and peak memory of a Flower simulation with many virtual clients.

    python -m validation.flower prepare --dataset femnist --data-dir FEMNIST --out PARTS
    python benchmarks/flower_simulation_scale.py --data-dir PARTS --clients 300 --participants 10 \
        --rounds 5 --out scale.json

Runs ``python -m validation.flower --problem cnn --preset femnist --mode simulation`` (each virtual client
reads only its own prepared folder, ``--participants`` of them sampled per round) and samples, every 0.2 s, the
summed resident set size of the command and every process under it (the simulation's child, Ray's GCS,
raylet and workers).  Round times come from the run's own history (its cumulative ``seconds`` column);
``outside_rounds_seconds`` is the rest of the command's wall time: Ray's start-up and shut-down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time


def _proc_table() -> dict:
    """pid -> (ppid, sid, rss bytes) of every readable process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            rss_pages = int(fields[21])
        except (OSError, IndexError, ValueError):
            continue
        table[int(name)] = (int(fields[1]), int(fields[3]), rss_pages * os.sysconf("SC_PAGE_SIZE"))
    return table


def tree_rss(root: int) -> int:
    """Resident bytes of ``root``, its descendants and every process in their sessions (a daemon that was
    re-parented to init keeps its session)."""
    table = _proc_table()
    members, grew = {root}, True
    while grew:
        sessions = {table[p][1] for p in members if p in table}
        more = {p for p, (ppid, sid, _) in table.items() if ppid in members or sid in sessions} - members
        members |= more
        grew = bool(more)
    return sum(table[p][2] for p in members if p in table)


def main(argv=None) -> int:
    from validation.common import OneLineParser

    p = OneLineParser(prog="python benchmarks/flower_simulation_scale.py", doc=__doc__)
    p.add_argument("--data-dir", required=True, help="a folder written by `python -m validation.flower prepare`")
    p.add_argument("--clients", type=int, default=300)
    p.add_argument("--participants", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--method", default="fedpm")
    p.add_argument("--preset", default="femnist")
    p.add_argument("--out", default=None, help="write the measurement as JSON here")
    args = p.parse_args(argv)
    if args.out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        p.error(f"--out {args.out}: its folder does not exist")  # found out before the simulation, not after it
    from fedconvex.history import round_seconds
    from validation.common import provenance

    with tempfile.TemporaryDirectory() as tmp:
        run_out = os.path.join(tmp, "run")
        cmd = [
            sys.executable,
            "-m",
            "validation.flower",
            "--problem",
            "cnn",
            "--preset",
            args.preset,
            "--method",
            args.method,
            "--clients",
            str(args.clients),
            "--participants",
            str(args.participants),
            "--rounds",
            str(args.rounds),
            "--mode",
            "simulation",
            "--data-dir",
            args.data_dir,
            "--out",
            run_out,
            "--quiet",
        ]
        peak, stop = [0], threading.Event()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd)

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], tree_rss(proc.pid))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        if rc != 0:
            print(f"flower_simulation_scale: the simulation failed (exit {rc}); its message is above", file=sys.stderr)
            return 1
        with open(os.path.join(run_out, "result.json")) as fh:
            result = json.load(fh)
    history = result["history"][1:]
    per_round = round_seconds(history)
    report = {
        "command": "python benchmarks/flower_simulation_scale.py " + " ".join(argv or sys.argv[1:]),
        "clients": args.clients,
        "participants": args.participants,
        "rounds": args.rounds,
        "method": args.method,
        "preset": args.preset,
        "command_wall_seconds": round(wall, 2),
        "outside_rounds_seconds": round(wall - history[-1]["seconds"], 2),
        "round_seconds": [round(s, 2) for s in per_round],
        "used_per_round": [h["used"] for h in history],
        "test_acc": result.get("test_acc"),
        "peak_rss_mib": round(peak[0] / 2**20, 1),
        **provenance(),
        "cores": os.cpu_count(),
        "threads": "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "unset"),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
