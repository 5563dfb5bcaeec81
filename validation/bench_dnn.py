"""Benchmark the DNN simulator: local-training throughput and FedPM / FedAvg round time.

    python -m validation.bench_dnn                 # both models, sizes chosen for the device
    python -m validation.bench_dnn --json

Measured in one run on synthetic CIFAR-shaped data (the speed does not depend on pixel
values): images/s of local training (FedAvg's SGD steps), the mean wall time of a FedAvg and
of a FedPM round (FOOF statistics, per-step preconditioning, mixing included), their ratio
(paper: 1.23x on CIFAR-10, 1.61x on CIFAR-100; our target <= 1.10x), and the projected time
of the paper's 100-round, 10-client, 5-local-epoch run on the full dataset.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

# (clients, samples per client, local epochs, rounds) per device.  Local epochs are the paper's 5:
# FOOF statistics are computed once per round, so the ratio depends on the epochs per round.
# Only rounds after the first are timed (the first also builds each client's initial matrices).
SIZES = {
    ("cnn", "cpu"): (10, 300, 5, 3), ("resnet18gn", "cpu"): (1, 64, 5, 2),
    ("cnn", "cuda"): (10, 5000, 5, 3), ("resnet18gn", "cuda"): (10, 5000, 5, 3),
}
CLASSES = {"cnn": 10, "resnet18gn": 100}
PAPER = {"cnn": dict(ratio=1.23, minutes=None), "resnet18gn": dict(ratio=1.61, minutes=None)}


def _experiment(model, method, device, clients, per_client, epochs, rounds, seed=0):
    import torch

    from fedpm_dnn.client import ClientData
    from fedpm_dnn.methods import MethodConfig
    from fedpm_dnn.simulation import Experiment

    g = torch.Generator().manual_seed(seed)
    k = CLASSES[model]
    data = [ClientData(torch.randint(0, 256, (per_client, 3, 32, 32), generator=g, dtype=torch.uint8).to(device),
                       torch.randint(0, k, (per_client,), generator=g).to(device), (0.5,) * 3, (0.25,) * 3)
            for _ in range(clients)]
    xt = torch.randint(0, 256, (256, 3, 32, 32), generator=g, dtype=torch.uint8).to(device)
    yt = torch.randint(0, k, (256,), generator=g).to(device)
    cfg = MethodConfig(method, lr=0.05, clip=1.0, local_epochs=epochs, damping=1.0)
    return Experiment(cfg=cfg, model=model, num_classes=k, clients=data, x_test=xt, y_test=yt, mean=(0.5,) * 3,
                      std=(0.25,) * 3, rounds=rounds, seed=seed, device=device)


def measure(model, device, sizes=None, repeats=None):
    from fedpm_dnn.simulation import run_experiment

    if repeats is None:  # ResNet rounds on a CPU take minutes: one repeat there
        repeats = 1 if (model == "resnet18gn" and not device.startswith("cuda")) else 2
    clients, per_client, epochs, rounds = sizes or SIZES[(model, "cuda" if device.startswith("cuda") else "cpu")]
    times = {"fedavg": [], "fedpm": []}
    for _ in range(repeats):  # alternate the methods so machine drift hits both alike
        for method in ("fedavg", "fedpm"):
            hist = run_experiment(_experiment(model, method, device, clients, per_client, epochs, rounds))
            times[method] += [r["client_seconds"] + r["server_seconds"] for r in hist[1:] or hist]
    avg, pm = float(np.median(times["fedavg"])), float(np.median(times["fedpm"]))
    images = clients * per_client * epochs
    full_round = avg * 50000 * 5 / images          # paper: 10 clients, 5 local epochs over all 50k images
    return {"model": model, "device": device, "clients": clients, "samples_per_client": per_client,
            "local_epochs": epochs, "images_per_second": images / avg, "fedavg_round_seconds": avg,
            "fedpm_round_seconds": pm, "fedpm_over_fedavg": pm / avg, "paper_ratio": PAPER[model]["ratio"],
            "projected_paper_run_minutes_fedpm": 100 * full_round * pm / avg / 60}


def main(argv=None) -> int:
    from validation.common import OneLineParser

    p = OneLineParser(prog="python -m validation.bench_dnn", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="cnn,resnet18gn", help=f"comma-separated, from {', '.join(CLASSES)}")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in CLASSES]
    if unknown or not models:
        p.error(f"--models: unknown model(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(CLASSES)}")
    try:
        import torch
    except ImportError:
        p.error("torch is not installed: pip install -e '.[dnn]'")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch")

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if args.device == "auto" else args.device)
    results = [measure(m, device) for m in models]
    if args.json:
        print(json.dumps(results))
        return 0
    name = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {name}")
    for r in results:
        print(f"{r['model']:<11} {r['clients']} clients x {r['samples_per_client']} images x {r['local_epochs']} epoch: "
              f"{r['images_per_second']:.0f} img/s local training; round FedAvg {r['fedavg_round_seconds']:.3f}s, "
              f"FedPM {r['fedpm_round_seconds']:.3f}s -> FedPM/FedAvg {r['fedpm_over_fedavg']:.2f}x "
              f"(paper {r['paper_ratio']:.2f}x, target <= 1.10x); projected 100-round paper run "
              f"{r['projected_paper_run_minutes_fedpm']:.0f} min")
    print("reproduce: python -m validation.bench_dnn" + (" --json" if args.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
