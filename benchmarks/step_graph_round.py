"""SimpleCNN rounds on the vectorized engine with --step-graph on against off, alternated in one process, and the
agreement of the two: the clients' parameters after the first round (relative difference, largest over clients and
tensors) and its training loss.  The paper's 10 clients x 5,000 images x 5 epochs unless --sizes says otherwise.

    python benchmarks/step_graph_round.py [--device cuda|cpu] [--sizes C,N,E,R] [--methods fedavg,fedpm] [--tol T]

Prints one JSON object; exits 1 when a method's parameters differ by more than their bound: --tol (default 1e-3),
or, where they differ by more, DRIFT times the spread of two eager rounds of the same run (a second 'off' run, made
only then), since TF32 convolutions and cuDNN's non-deterministic gradients leave a spread of their own after a
round's hundreds of steps on a GPU.  On a CPU both forms give the same parameters bit for bit ('on' is the static
step run eagerly there: no graph)."""

import json
import sys

import numpy as np
import torch

from fedpm_dnn.engine import step_graph
from fedpm_dnn.engine.simulation import run_experiment
from validation.bench_dnn import BenchRun, _experiment, _sync
from validation.common import OneLineParser

p = OneLineParser(prog="python benchmarks/step_graph_round.py")
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
p.add_argument("--sizes", default="10,5000,5,3", help="clients,images per client,local epochs,rounds")
p.add_argument("--methods", default="fedavg,fedpm")
p.add_argument("--foof-apply", default="inverse")
p.add_argument("--foof-precision", default="fp32")
p.add_argument("--repeats", type=int, default=1)
p.add_argument("--tol", type=float, default=1e-3)
args = p.parse_args()
clients, per_client, epochs, rounds = (int(v) for v in args.sizes.split(","))


def one_run(method, mode):
    """(seconds of each round after the first, round 1's replies, graph replays of each chunk of each round)."""
    replies, replays = {}, []
    release = step_graph.Runner.release

    def counted(runner):
        replays.append(runner.replays)
        release(runner)

    def tamper(t, i, reply):
        if t == 1:
            replies[i] = {k: v.detach().double().cpu() for k, v in reply["params"].items()}
        return reply

    run = BenchRun("cnn", args.device, (clients, per_client, epochs, rounds), method=method)
    exp = _experiment(run.but(foof_apply=args.foof_apply, foof_precision=args.foof_precision, step_graph=mode))
    step_graph.Runner.release = counted
    try:
        hist = run_experiment(exp, tamper=tamper)
        _sync(args.device)
    finally:
        step_graph.Runner.release = release
    secs = [r["client_seconds"] + r["server_seconds"] for r in hist[1:]] or [hist[0]["client_seconds"]]
    return secs, replies, hist[0]["train_loss"], replays


DRIFT = 4.0  # the graphed round may differ from the eager one by this many times two eager rounds' own spread


def rel(a, b):
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


out = {"device": args.device, "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"}
out.update({"sizes": [clients, per_client, epochs, rounds], "foof_apply": args.foof_apply, "tol": args.tol})
ok = True
for method in args.methods.split(","):
    times, first = {"off": [], "on": []}, {}
    for _ in range(args.repeats):
        for mode in ("off", "on"):  # alternated: machine drift hits both alike
            secs, replies, loss, replays = one_run(method, mode)
            times[mode] += secs
            first.setdefault(mode, (replies, loss, replays))
    (r_off, loss_off, _), (r_on, loss_on, replays_on) = first["off"], first["on"]
    diff = max(rel(r_on[i][k], v) for i, params in r_off.items() for k, v in params.items())
    spread, bound = None, args.tol
    if diff > args.tol:  # the eager form's own run-to-run spread bounds what the graph may add
        _, r_again, _, _ = one_run(method, "off")
        spread = max(rel(r_again[i][k], v) for i, params in r_off.items() for k, v in params.items())
        bound = max(args.tol, DRIFT * spread)
    med = {m: float(np.median(v)) for m, v in times.items()}
    out[method] = {
        "round_seconds": med,
        "rounds_timed": {m: len(v) for m, v in times.items()},
        "off_over_on": med["off"] / med["on"],
        "round1_max_rel_param_diff": diff,
        "round1_train_loss": {"off": loss_off, "on": loss_on},
        "graph_replays_per_chunk": replays_on,  # each chunk of each round, in order (0: no graph, e.g. on a CPU)
        "eager_rerun_max_rel_param_diff": spread,  # measured only where the difference exceeds --tol
        "bound": bound,
        "agree": diff <= bound,
    }
    ok = ok and diff <= bound
print(json.dumps(out, indent=1))
sys.exit(0 if ok else 1)
