"""Per block of SimpleCNN and ResNet18-GN: the per-step cost of the two FOOF applies and their once-per-round cost.

    python benchmarks/foof_apply.py [--device cpu|cuda] [--clients K] [--json FILE]

solve    per step two triangular solves with the round's factor (foof.solve_rows), once a round L^T formed;
inverse  per step one product with (A + lam I)^{-1}, once a round the inverse from the float64 factor
         (foof.damped_inverse).
Times are medians of repeats at one torch thread on a CPU (the engines' solves run on one thread there).  The
rule that ``foof.resolve_apply`` states is fitted from these numbers (docs/stacking.md).
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch

from fedpm_dnn import foof
from fedpm_dnn.models import make_model
from validation.common import OneLineParser


def timed(fn, device, repeats):
    out = []
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def block_shapes(model: str) -> list:
    """Distinct (d, rows) of the model's FOOF blocks, with how many blocks have each."""
    counts = {}
    for b in foof.foof_blocks(make_model(model, 10, 3, 32)).values():
        key = (b.module.weight[0].numel() + b.has_bias, b.module.weight.shape[0])
        counts[key] = counts.get(key, 0) + 1
    return sorted((d, r, n) for (d, r), n in counts.items())


def measure(d, rows, K, device, repeats):
    g = torch.Generator().manual_seed(d)
    a = torch.randn(K, 4 * d, d, generator=g, dtype=torch.float64)
    A = (a.mT @ a / (4 * d)).to(device)
    L64 = torch.linalg.cholesky(A + 1e-2 * torch.eye(d, dtype=torch.float64, device=device))
    T = torch.randn(K, rows, d, generator=g).to(device)
    ops = {apply: foof.operators({"b": L64}, torch.float32, apply)["b"] for apply in ("solve", "inverse")}
    return {
        "d": d,
        "rows": rows,
        "clients": K,
        "solve_step_s": timed(lambda: foof.solve_rows(T, *ops["solve"]), device, repeats),
        "inverse_step_s": timed(lambda: torch.matmul(T, ops["inverse"][0]), device, repeats),
        "solve_round_s": timed(lambda: foof.operators({"b": L64}, torch.float32, "solve"), device, repeats),
        "inverse_round_s": timed(lambda: foof.operators({"b": L64}, torch.float32, "inverse"), device, repeats),
    }


def main():
    p = OneLineParser(prog="python benchmarks/foof_apply.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--models", default="cnn,resnet18gn", help="comma-separated, from cnn, resnet18gn")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for model in args.models.split(","):
        for d, r, n in block_shapes(model):
            row = {"model": model, "blocks": n, **measure(d, r, args.clients, args.device, args.repeats)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
