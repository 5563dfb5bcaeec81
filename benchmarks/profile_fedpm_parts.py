"""Where a FedPM round's time goes beyond FedAvg's, by part, on the current device.

    python benchmarks/profile_fedpm_parts.py [--model resnet18gn] [--sizes 2,16,1,2] [--foof-apply solve] [--threads 1]

Parts (wall time of the wrapped calls, rounds after the first, summed): the FOOF statistics pass, the Cholesky
factorisations, forming what the local steps multiply by (the inverse, for --foof-apply inverse), the server's PSD
screening of the clients' matrices, the server's preconditioned mixing, and the rest of the round (local training,
evaluation outside).  On a CPU under load the split, not the absolute seconds, is what to read.
"""

from __future__ import annotations

import json
import time

import torch

from fedconvex import messages
from fedpm_dnn import foof
from fedpm_dnn.algorithms import fedpm
from fedpm_dnn.engine import sequential, vectorized
from fedpm_dnn.engine.simulation import run_experiment
from fedpm_dnn.foof import batched
from validation.bench_dnn import BenchRun, _experiment, _sync
from validation.common import OneLineParser

PARTS = {
    "statistics": [(vectorized.VectorizedEngine, "foof_for"), (sequential, "foof_matrices")],
    "factorisations": [(batched, "factorize_stacked"), (foof, "factorize")],
    "operators": [(foof, "operators")],
    "screening": [(messages, "psd_problem")],  # the driver screens through fedconvex.messages
    "mixing": [(fedpm.FedPM, "mix")],
}


def main():
    p = OneLineParser(prog="python benchmarks/profile_fedpm_parts.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18gn")
    p.add_argument("--sizes", default="2,16,1,2")
    p.add_argument("--foof-apply", default="solve")
    p.add_argument("--engine", default="vectorized")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clients, per, epochs, rounds = (int(v) for v in args.sizes.split(","))
    seconds = {k: 0.0 for k in PARTS}
    depth, saved = [0], []

    def wrap(owner, name, part):
        fn = getattr(owner, name)
        saved.append((owner, name, fn))

        def timed(*a, **kw):
            if depth[0]:
                return fn(*a, **kw)
            _sync(args.device)
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync(args.device)
                seconds[part] += time.perf_counter() - t
                depth[0] -= 1

        setattr(owner, name, timed)

    for part, targets in PARTS.items():
        for owner, name in targets:
            wrap(owner, name, part)
    rows = {}
    for method in ("fedavg", "fedpm"):
        size = (clients, per, epochs, rounds)
        run = BenchRun(args.model, args.device, size, method=method, engine=args.engine, foof_apply=args.foof_apply)
        exp = _experiment(run)
        marks = []
        hist = run_experiment(exp, on_round=lambda row, h, marks=marks: marks.append(dict(seconds)))
        timed = hist[1:]
        rows[method] = {
            "round_seconds": sum(r["client_seconds"] + r["server_seconds"] for r in timed) / len(timed),
            **{k: (marks[-1][k] - marks[0][k]) / len(timed) for k in seconds},
        }
    for owner, name, fn in reversed(saved):
        setattr(owner, name, fn)
    fp, fa = rows["fedpm"], rows["fedavg"]
    extra = fp["round_seconds"] - fa["round_seconds"]
    parts = {k: fp[k] for k in PARTS}
    parts["local training and the rest"] = extra - sum(parts.values())
    out = {
        "model": args.model,
        "sizes": args.sizes,
        "foof_apply": args.foof_apply,
        "device": args.device,
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "fedavg_round_seconds": fa["round_seconds"],
        "fedpm_round_seconds": fp["round_seconds"],
        "extra_seconds": extra,
        "extra_by_part_seconds": parts,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
