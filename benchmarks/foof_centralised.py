"""Centralised training with ``fedpm_dnn.FOOF`` against SGD with momentum and Adam: CIFAR-10, a small GroupNorm
CNN, the same epochs for every optimizer (accuracy after them) and the same training time (accuracy at the
shortest optimizer's total training time), several seeds, and FOOF at several statistics / inverse cadences.

Training time is the process's CPU time (evaluation excluded): with one torch thread it is the wall-clock the run
takes on a core of its own, and unlike the wall-clock it does not count the waits of a shared, loaded machine.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/foof_centralised.py --data-dir DIR \\
        --train-subset 5000 --test-subset 2000 --epochs 2 --seeds 0 1 2 --out result.json --figure foof_centralised

DIR holds CIFAR-10 as ``fedpm_dnn.data.load_image_dataset`` reads it (default: the FEDPM_DATA environment
variable); ``--synthetic`` uses generated images instead (for a quick check of the script).  Writes the JSON
(every run's evaluation curve, the table, the command, device, date and commit) and, with ``--figure``, a PNG
and a PDF of test accuracy against epochs and against training seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedconvex.files import read_json_object, written_atomically  # noqa: E402
from fedpm_dnn import FOOF  # noqa: E402
from validation import common  # noqa: E402
from validation.common import add_deprecated_alias, cpu_model, seed_int  # noqa: E402

PROG = "python benchmarks/foof_centralised.py"

# optimizer settings: fixed, not tuned per run (the JSON records them)
CONFIGS = {
    "sgd": {"label": "SGD + momentum", "kind": "sgd", "lr": 0.05, "momentum": 0.9},
    "adam": {"label": "Adam", "kind": "adam", "lr": 1e-3},
    "foof-epoch": {
        "label": "FOOF, statistics of 1,024 images once an epoch",
        "kind": "foof",
        "lr": 0.05,
        "momentum": 0.9,
        "damping": 1.0,
        "epoch_samples": 1024,
    },
    "foof-5-20": {
        "label": "FOOF, hooks every 5 steps, inverse every 20",
        "kind": "foof",
        "lr": 0.05,
        "momentum": 0.9,
        "damping": 1.0,
        "stats_every": 5,
        "inverse_every": 20,
    },
    "foof-1-10": {
        "label": "FOOF, hooks every step, inverse every 10",
        "kind": "foof",
        "lr": 0.05,
        "momentum": 0.9,
        "damping": 1.0,
        "stats_every": 1,
        "inverse_every": 10,
    },
}


class GroupNormCNN(nn.Module):
    """Three 3x3 conv layers with GroupNorm, ReLU and pooling, then one Linear: four FOOF blocks."""

    def __init__(self, classes: int = 10, width: int = 16):
        super().__init__()
        w = width
        self.conv1, self.gn1 = nn.Conv2d(3, w, 3, padding=1), nn.GroupNorm(4, w)
        self.conv2, self.gn2 = nn.Conv2d(w, 2 * w, 3, padding=1), nn.GroupNorm(4, 2 * w)
        self.conv3, self.gn3 = nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.GroupNorm(4, 4 * w)
        self.fc = nn.Linear(4 * w, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.gn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.gn2(self.conv2(x))), 2)
        x = F.relu(self.gn3(self.conv3(x))).mean((2, 3))
        return self.fc(x)


def load(args):
    """(x_train, y_train, x_test, y_test) as standardised float32 tensors, the first --train / --test images."""
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        n = args.train + args.test
        y = torch.randint(0, 10, (n,), generator=g)
        x = torch.randn(n, 3, 32, 32, generator=g) * 0.5 + y[:, None, None, None] / 10.0
        return x[: args.train], y[: args.train], x[args.train :], y[args.train :]
    from fedpm_dnn.data import load_image_dataset

    data, _ = load_image_dataset("cifar10", args.data_dir)

    def prep(x):
        x = torch.as_tensor(x).float() / 255.0
        return (x - torch.tensor(data.mean)[:, None, None]) / torch.tensor(data.std)[:, None, None]

    rng = np.random.default_rng(12345)  # one fixed subset for every optimizer and seed
    tr = rng.permutation(len(data.y_train))[: args.train]
    te = rng.permutation(len(data.y_test))[: args.test]
    return (
        prep(data.x_train[tr]),
        torch.as_tensor(data.y_train[tr]),
        prep(data.x_test[te]),
        torch.as_tensor(data.y_test[te]),
    )


def make_optimizer(cfg: dict, model):
    if cfg["kind"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    if cfg["kind"] == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    extra = {k: cfg[k] for k in ("stats_every", "inverse_every") if k in cfg}
    if "epoch_samples" in cfg:  # the paper's schedule: statistics only from update_statistics
        extra["stats_every"] = None
    return FOOF(model, lr=cfg["lr"], damping=cfg["damping"], momentum=cfg["momentum"], **extra)


@torch.no_grad()
def accuracy(model, x, y, batch=500) -> float:
    model.eval()
    hits = sum(int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum()) for i in range(0, len(x), batch))
    model.train()
    return hits / len(x)


def run(name: str, cfg: dict, seed: int, data, args) -> dict:
    """One training run; evaluation points (epoch, training seconds, test accuracy) every --eval-every steps."""
    x, y, xt, yt = data
    torch.manual_seed(seed)
    model = GroupNormCNN()
    opt = make_optimizer(cfg, model)
    g = torch.Generator().manual_seed(seed)
    steps_per_epoch = -(-len(x) // args.batch_size)
    curve = [{"epoch": 0.0, "seconds": 0.0, "test_acc": accuracy(model, xt, yt)}]
    seconds, step, losses = 0.0, 0, []
    for epoch in range(args.epochs):
        start = time.process_time()
        if "epoch_samples" in cfg:  # the paper's schedule: statistics once, at the start of the pass
            sub = torch.randperm(len(x), generator=g)[: cfg["epoch_samples"]]
            opt.update_statistics([x[sub[i : i + 256]] for i in range(0, len(sub), 256)])
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), args.batch_size):
            idx = order[i : i + args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
            if step % args.eval_every == 0 or step == (epoch + 1) * steps_per_epoch:
                seconds += time.process_time() - start
                curve.append({"epoch": step / steps_per_epoch, "seconds": seconds, "test_acc": accuracy(model, xt, yt)})
                start = time.process_time()
        seconds += time.process_time() - start
    finite = bool(np.isfinite(losses).all())
    return {"config": name, "seed": seed, "curve": curve, "train_seconds": curve[-1]["seconds"], "finite": finite,
            "final_train_loss": float(np.mean(losses[-steps_per_epoch:]))}  # fmt: skip


def at_seconds(curve: list, budget: float) -> float:
    """Test accuracy at the last evaluation point reached within ``budget`` training seconds."""
    return [p["test_acc"] for p in curve if p["seconds"] <= budget + 1e-9][-1]


def table(runs: list, names: list) -> dict:
    by = {n: [r for r in runs if r["config"] == n] for n in names}
    budget = min(float(np.mean([r["train_seconds"] for r in rs])) for rs in by.values())
    out = {"equal_seconds_budget": budget, "rows": {}}
    for n, rs in by.items():
        final = [r["curve"][-1]["test_acc"] for r in rs]
        timed = [at_seconds(r["curve"], budget) for r in rs]
        out["rows"][n] = {
            "label": CONFIGS[n]["label"],
            "acc_equal_epochs_mean": float(np.mean(final)),
            "acc_equal_epochs_std": float(np.std(final)),
            "acc_equal_seconds_mean": float(np.mean(timed)),
            "acc_equal_seconds_std": float(np.std(timed)),
            "train_seconds_mean": float(np.mean([r["train_seconds"] for r in rs])),
        }
    return out


def markdown(tab: dict, epochs: int) -> str:
    lines = [
        f"| optimizer | test accuracy after {epochs} epochs | training seconds | test accuracy at "
        f"{tab['equal_seconds_budget']:.0f} s |",
        "|---|---|---|---|",
    ]
    for r in tab["rows"].values():
        lines.append(
            f"| {r['label']} | {r['acc_equal_epochs_mean']:.3f} ± {r['acc_equal_epochs_std']:.3f} | "
            f"{r['train_seconds_mean']:.0f} | {r['acc_equal_seconds_mean']:.3f} ± {r['acc_equal_seconds_std']:.3f} |"
        )
    return "\n".join(lines)


def figure(runs: list, names: list, prefix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for n in names:
        rs = [r for r in runs if r["config"] == n]
        for ax, key in zip(axes, ("epoch", "seconds"), strict=True):
            grid = np.array([[p[key] for p in r["curve"]] for r in rs]).mean(0)
            acc = np.array([[p["test_acc"] for p in r["curve"]] for r in rs])
            line = ax.plot(grid, acc.mean(0), label=CONFIGS[n]["label"])[0]
            ax.fill_between(grid, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("epochs")
    axes[1].set_xlabel("training seconds (evaluation excluded)")
    axes[0].set_ylabel("test accuracy (mean, min-max over seeds)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(f"{prefix}.{ext}", dpi=150)
    plt.close(fig)


def _commit() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def parse_args(argv=None):
    p = common.OneLineParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $FEDPM_DATA)")
    p.add_argument("--synthetic", action="store_true", help="generated images instead of CIFAR-10")
    # the subset sizes as validation.dnn names them; --train / --test are the earlier spellings
    p.add_argument(
        "--train-subset", dest="train", type=positive, default=5000, help="training images (a fixed random subset)"
    )
    p.add_argument("--test-subset", dest="test", type=positive, default=2000, help="test images")
    add_deprecated_alias(p, "--train", "--train-subset", "train", type=positive)
    add_deprecated_alias(p, "--test", "--test-subset", "test", type=positive)
    p.add_argument("--epochs", type=positive, default=2)
    p.add_argument("--batch-size", type=positive, default=64)
    p.add_argument("--eval-every", type=positive, default=20, help="steps between evaluation points")
    p.add_argument("--seeds", type=seed_int, nargs="+", default=[0, 1, 2])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--threads", type=positive, default=1, help="torch CPU threads")
    p.add_argument("--out", required=True, help="the JSON result file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--figure", default=None, help="write PREFIX.png and PREFIX.pdf")
    p.add_argument("--replot", action="store_true", help="no training: the table and figure of the --out JSON")
    return p.parse_args(argv)


def check_args(args) -> None:
    """What can be refused before any data is read or any step trained: one line each (``common.fail``)."""
    for flag, values in (("--seeds", args.seeds), ("--configs", args.configs)):
        repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
        if repeated:
            common.fail(PROG, ValueError(f"{flag} names {', '.join(map(str, repeated))} more than once"))
    if args.replot:
        return
    for flag, path in (("--out", args.out), ("--figure", args.figure)):
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            common.fail(PROG, ValueError(f"{flag} {path}: the folder {parent} does not exist"))
        if not os.access(parent, os.W_OK | os.X_OK):
            common.fail(PROG, ValueError(f"{flag} {path}: the folder {parent} is not writable"))
    if os.path.isdir(args.out):
        common.fail(PROG, ValueError(f"--out {args.out}: is a folder; name the JSON file to write"))
    if os.path.lexists(args.out) and not (args.overwrite and os.path.isfile(args.out)):
        kind = "a file" if os.path.isfile(args.out) else "not a regular file"
        common.fail(
            PROG,
            ValueError(f"--out {args.out}: exists ({kind}); choose another --out, or --overwrite to replace a file"),
        )


def check_sizes(args, data) -> None:
    """The subsets asked for within the data read (generated data has any size)."""
    for flag, asked, have in (("--train-subset", args.train, len(data[0])), ("--test-subset", args.test, len(data[2]))):
        if asked > have:
            common.fail(PROG, ValueError(f"{flag} {asked}: the data holds only {have} images"))


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    if args.replot:
        try:
            saved = read_json_object(args.out)
        except (ValueError, OSError) as exc:
            common.fail(PROG, exc)
        names = [n for n in saved["configs"] if any(r["config"] == n for r in saved["runs"])]
        print(markdown(table(saved["runs"], names), saved["epochs"]))
        if args.figure:
            figure(saved["runs"], names, args.figure)
        return 0
    if not args.synthetic and not (args.data_dir or os.environ.get("FEDPM_DATA")):
        common.fail(PROG, ValueError("no data: pass --data-dir, set FEDPM_DATA, or use --synthetic"))
    torch.set_num_threads(args.threads)
    try:
        data = load(args)
    except (ValueError, OSError) as exc:  # fedpm_dnn.data's DatasetError is a ValueError
        common.fail(PROG, exc)
    check_sizes(args, data)
    runs = []
    for seed in args.seeds:
        for name in args.configs:
            r = run(name, CONFIGS[name], seed, data, args)
            runs.append(r)
            print(f"{name} seed {seed}: acc {r['curve'][-1]['test_acc']:.3f} in {r['train_seconds']:.1f} s", flush=True)
            write(args, argv, data, runs, partial=True)  # what is done so far survives an interrupted run
    tab = write(args, argv, data, runs, partial=False)
    print(markdown(tab, args.epochs))
    if args.figure:
        figure(runs, args.configs, args.figure)
    return 0


def write(args, argv, data, runs: list, partial: bool) -> dict:
    """The JSON result of ``runs`` (``partial``: written after each run, before the last); returns the table."""
    names = [n for n in args.configs if any(r["config"] == n for r in runs)]
    tab = table(runs, names)
    result = {
        "partial": partial,
        "command": "python benchmarks/foof_centralised.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": f"CPU: {cpu_model()}, {args.threads} torch thread(s); training seconds are process CPU time",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "torch": torch.__version__,
        "data": "generated" if args.synthetic else "CIFAR-10 (fedpm_dnn.data.load_image_dataset)",
        "train_images": len(data[0]),
        "test_images": len(data[2]),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "configs": {n: CONFIGS[n] for n in args.configs},
        "table": tab,
        "runs": runs,
    }
    with written_atomically(args.out) as fh:  # a private temporary file, renamed over --out; removed on an error
        json.dump(result, fh, indent=1)
    return tab


if __name__ == "__main__":
    sys.exit(common.run_command(PROG, main))
