"""FedPM's server mixing on ResNet18-GN's FOOF blocks: the kernel's earlier form against ``precond_mix`` now.

    OMP_NUM_THREADS=1 python benchmarks/mixing_solve_forms.py [--clients N] [--repeats R] [--min-side D]
        [--device cpu|cuda] [--json]

earlier  sum_i (w_i P_i X_i) and sum_i (w_i P_i) through (N, d, k) and (N, d, d) temporaries, the damping added as
         a dense identity, a general LU solve (2d^3/3 flops)
now      fedconvex.mixing.precond_mix: sum_i P_i (w_i X_i), one tensordot for sum_i w_i P_i, the damping on the
         diagonal, a Cholesky solve (d^3/3 flops)
Per distinct block shape (d, d_out) of the model, float64 torch tensors as fedpm_dnn.mixing passes them, the two forms
alternate ``--repeats`` times; the medians, their ratio, and the model's whole mixing (each shape times its count)
are printed.  It also prints the largest relative difference of the two results, which must be round-off.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time

import torch

from fedconvex.mixing import precond_mix
from fedpm_dnn import foof
from fedpm_dnn.models import make_model
from validation.common import OneLineParser


def earlier_precond_mix(P, X, w, damping):
    """The kernel's form before the Cholesky change, for this comparison only (dense torch stacks, (N, d, k) X)."""
    rhs = torch.sum(w[:, None, None] * torch.matmul(P, X), dim=0)
    Pbar = torch.sum(w[:, None, None] * P, dim=0)
    if damping:
        rhs = rhs + damping * torch.sum(w[:, None, None] * X, dim=0)
        Pbar = Pbar + damping * torch.eye(P.shape[1], dtype=P.dtype, device=P.device)
    Pbar = 0.5 * (Pbar + Pbar.T)
    return torch.linalg.solve(Pbar, rhs)


def block_shapes(model: str) -> list:
    """Distinct (d, d_out) of the model's FOOF blocks with their counts."""
    counts = {}
    for b in foof.foof_blocks(make_model(model, 10, 3, 32)).values():
        key = (b.module.weight[0].numel() + b.has_bias, b.module.weight.shape[0])
        counts[key] = counts.get(key, 0) + 1
    return sorted((d, k, n) for (d, k), n in counts.items())


def stack(d, k, clients, seed, device):
    """Client FOOF-like matrices (Grams of 2d activations: positive definite) and parameter blocks."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(clients, 2 * d, d, generator=g, dtype=torch.float64, device=device)
    P = a.mT @ a / (2 * d)
    return 0.5 * (P + P.mT), torch.randn(clients, d, k, generator=g, dtype=torch.float64, device=device)


def sync(device):
    if device != "cpu":
        torch.cuda.synchronize()


def main():
    p = OneLineParser(prog="python benchmarks/mixing_solve_forms.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18gn")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--damping", type=float, default=1e-4)
    p.add_argument("--min-side", type=int, default=0, help="only blocks at least this wide")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    w = torch.full((args.clients,), 1.0 / args.clients, dtype=torch.float64, device=args.device)
    rows, totals = [], {"earlier": 0.0, "now": 0.0}
    for d, k, count in block_shapes(args.model):
        if d < args.min_side:
            continue
        P, X = stack(d, k, args.clients, d, args.device)
        times, results = {"earlier": [], "now": []}, {}
        for _ in range(args.repeats):  # alternated, so that a change of load hits both forms alike
            for name, fn in (("earlier", earlier_precond_mix), ("now", precond_mix)):
                sync(args.device)
                t = time.perf_counter()
                results[name] = fn(P, X, w, damping=args.damping)
                sync(args.device)
                times[name].append(time.perf_counter() - t)
        med = {name: statistics.median(v) for name, v in times.items()}
        diff = float((results["now"] - results["earlier"]).norm() / results["earlier"].norm())
        for name in totals:
            totals[name] += count * med[name]
        rows.append(
            {"d": d, "d_out": k, "blocks": count, **{f"{n}_s": v for n, v in med.items()}, "relative_difference": diff}
        )
        if not args.json:
            print(
                f"d={d:5d} d_out={k:4d} x{count}: earlier {med['earlier']:.3f} s, now {med['now']:.3f} s, "
                f"ratio {med['earlier'] / med['now']:.2f}, relative difference {diff:.1e}",
                flush=True,
            )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {
        "model": args.model,
        "clients": args.clients,
        "damping": args.damping,
        "threads": args.threads,
        "repeats": args.repeats,
        "device": torch.cuda.get_device_name()
        if args.device != "cpu"
        else f"cpu ({platform.processor() or platform.machine()})",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "blocks": rows,
        "model_mixing_earlier_s": totals["earlier"],
        "model_mixing_now_s": totals["now"],
        "ratio": totals["earlier"] / totals["now"],
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"whole {args.model} mixing ({args.clients} clients): earlier {totals['earlier']:.2f} s, "
            f"now {totals['now']:.2f} s, ratio {out['ratio']:.2f} ({out['date']}, commit {commit})"
        )


if __name__ == "__main__":
    main()
