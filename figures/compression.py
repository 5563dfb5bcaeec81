"""FedPM with compressed preconditioners (fedconvex/codecs.py), measured as accuracy per byte.

Three tables and one figure:
  compression_convex   w8a / a9a, K = 1: rounds to ||theta - theta*|| < 1e-10 and the uplink bytes per
                       client spent until then, per codec, beside FedNL (from the Test 1 run)
  compression_cnn      CIFAR-10 alpha = 0.1: best accuracy (mean over seeds) vs uplink MiB per client
                       per round, per codec, beside FedAvg and uncompressed FedPM; + the Pareto plot
  compression_resnet   ResNet18-GN at CIFAR-100 size: bytes per client per round per codec, with float32
                       and with float16 parameters (by formula from the FOOF block sizes; no training)
"""

from __future__ import annotations

import os

import numpy as np

from fedconvex.files import DamagedFile
from validation.experiments import CNN_CODECS, CNN_PARAM_DTYPE_RUNS, CONVEX_CODECS, codec_slug, param_slug
from validation.report import read_history as read_convex

from .results import read_history, read_summary, runs_matching

DIST_TOLERANCE = 1e-10
MiB = 2**20


def _convex_rows(folder, method):
    path = os.path.join(folder, "history.csv")
    try:
        rows = read_convex(path).get(method, [])
    except ValueError as exc:
        raise DamagedFile(f"damaged result: {exc}") from None
    return [(r["round"], r["dist"], r["bytes_up"]) for r in rows]


def _to_target(rows):
    for t, dist, b in rows:
        if dist < DIST_TOLERANCE:
            return t, b
    return None, None


def convex_table(root):
    header = [
        "dataset",
        "method / codec",
        f"rounds to dist < {DIST_TOLERANCE:g}",
        "uplink MiB per client until then",
        "uplink KiB per client per round",
        "vs FedPM none",
    ]
    rows = []
    for ds in ("w8a", "a9a"):
        base_rate = None
        entries = []
        for codec in CONVEX_CODECS:
            folder = os.path.join(root, f"compression-{ds}-{codec_slug(codec)}")
            if os.path.isfile(os.path.join(folder, "history.csv")):
                entries.append((f"FedPM {codec}", _convex_rows(folder, "fedpm")))
        t1 = os.path.join(root, f"superlinear-{ds}")
        if os.path.isfile(os.path.join(t1, "history.csv")):
            entries.append(("FedNL (Test 1, tuned)", _convex_rows(t1, "fednl")))
        for label, hist in entries:
            if not hist:
                continue
            t, b = _to_target(hist)
            per_round = hist[-1][2] / max(1, hist[-1][0])
            if label == "FedPM none":
                base_rate = per_round
            rows.append(
                [
                    ds,
                    label,
                    "not reached" if t is None else str(t),
                    "–" if b is None else f"{b / MiB:.3f}",
                    f"{per_round / 1024:.1f}",
                    f"{100 * per_round / base_rate:.0f} %" if base_rate else "–",
                ]
            )
    return header, rows


def _steady_mib(folder):
    """Uplink MiB per client per round after round 1 (a delta codec's first upload is its full matrix)."""
    up = list(read_history(folder)["bytes_up"])
    return (up[-1] - up[0]) / (len(up) - 1) / MiB if len(up) > 1 else up[0] / MiB


def cnn_points(root):
    """[(label, mean best acc, [accs], mean MiB up per client per round, rounds done, accuracy curves,
    MiB per client per round after round 1)] for FedAvg, FedPM none and each codec."""
    groups = [("FedAvg", r"main-cifar10-a0\.1-fedavg-s\d+"), ("FedPM none", r"main-cifar10-a0\.1-fedpm-s\d+")]
    groups += [
        (f"FedPM {c}", rf"compression-cifar10-a0\.1-{codec_slug(c).replace('.', '[.]')}-s\d+") for c in CNN_CODECS
    ]
    groups += [
        (
            f"FedPM {c}, {d} params",
            rf"compression-cifar10-a0\.1-{codec_slug(c).replace('.', '[.]')}"
            rf"{param_slug(d)}-s\d+",
        )
        for c, d in CNN_PARAM_DTYPE_RUNS
    ]
    out = []
    for label, pattern in groups:
        folders = list(runs_matching(root, pattern).values())
        sums = [read_summary(f) for f in folders]
        keep = [k for k, s in enumerate(sums) if s.get("best_test_acc") is not None]
        if keep:
            sums = [sums[k] for k in keep]
            curves = [list(read_history(folders[k])["test_acc"]) for k in keep]
            accs = [s["best_test_acc"] for s in sums]
            up = float(np.mean([s["bytes_up_per_round"] for s in sums])) / MiB
            steady = float(np.mean([_steady_mib(folders[k]) for k in keep]))
            out.append((label, float(np.mean(accs)), accs, up, [s.get("rounds_done") for s in sums], curves, steady))
    return out


def _best_until(curves, r):
    """Mean over the seeds that ran r rounds of the best accuracy within those r rounds."""
    return float(np.mean([max(c[:r]) for c in curves if len(c) >= r]))


def cnn_table(points):
    """Accuracy is compared within the rounds every run has (R); runs cut short say so in 'rounds done'."""
    R = min(max(len(c) for c in p[5]) for p in points)  # seeds with fewer rounds are left out of that column
    header = [
        "method / codec",
        f"best acc. [%] in rounds 1..{R} (mean)",
        "per seed (all rounds done)",
        "uplink MiB/client/round (mean over the run)",
        "vs FedPM none",
        "after round 1: MiB/client/round",
        "vs FedPM none",
        f"Δacc vs FedPM none [pt] (rounds 1..{R})",
        "rounds done",
    ]
    ref = next((p for p in points if p[0] == "FedPM none"), None)
    ref_acc = _best_until(ref[5], R) if ref else None
    rows = []
    for label, _acc, accs, up, done, curves, steady in points:
        a = _best_until(curves, R)
        rows.append(
            [
                label,
                f"{100 * a:.2f}",
                " / ".join(f"{100 * x:.2f}" for x in accs),
                f"{up:.3f}",
                _percent(up, ref[3] if ref else None),
                f"{steady:.3f}",
                _percent(steady, ref[6] if ref else None),
                f"{100 * (a - ref_acc):+.2f}" if ref else "–",
                "/".join(str(d) for d in done),
            ]
        )
    return header, rows


def _percent(x, ref) -> str:
    """x as a percentage of ref; '–' where there is no reference or it sent nothing (no ratio to 0 bytes)."""
    return f"{100 * x / ref:.1f} %" if ref else "–"


def _pareto_front(xy):
    """The points no other point beats in both bytes (smaller) and accuracy (larger), by bytes."""
    front = []
    for x, y in sorted(xy, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _marker(label):
    for key, m in (("FedAvg", "s"), ("none", "o"), ("sym", "o"), ("16", "^"), ("lowrank", "D"), ("delta", "X")):
        if key in label:
            return m
    return "o"


def pareto_figure(points, out_dir, note=""):
    """Best accuracy (seeds: small dots, mean: large marker, one colour per codec) vs uplink MiB per client
    per round (mean over the run; delta codecs also hollow at their after-round-1 rate), with the Pareto
    front of the means; the dotted lines mark a quarter of uncompressed FedPM's upload and its accuracy less one
    point, for reading the plot."""
    from .draw import plt, save

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colours = plt.get_cmap("tab20")(np.linspace(0, 1, 20))[:: max(1, 20 // max(1, len(points)))]
    ref = next((p for p in points if p[0] == "FedPM none"), None)
    if ref is not None:
        ax.axvline(0.25 * ref[3], color="0.5", lw=0.8, ls=":", zorder=0, label="¼ of FedPM none's upload")
        ax.axhline(100 * (ref[1] - 0.01), color="0.5", lw=0.8, ls="-.", zorder=0, label="FedPM none − 1 pt")
    for k, (label, acc, accs, up, _done, _curves, steady) in enumerate(points):
        c = colours[k % len(colours)]
        m = _marker(label)
        ax.scatter([up] * len(accs), [100 * a for a in accs], s=12, alpha=0.5, color=c, marker=m, zorder=2)
        ax.scatter([up], [100 * acc], s=60, marker=m, color=c, edgecolor="k", lw=0.5, label=label, zorder=3)
        if abs(steady - up) > 1e-3 * up:
            ax.scatter([steady], [100 * acc], s=60, marker=m, facecolor="none", edgecolor=c, zorder=3)
            ax.plot([steady, up], [100 * acc, 100 * acc], color=c, lw=0.8, ls="--", zorder=1)
    front = _pareto_front([(p[3], 100 * p[1]) for p in points])
    ax.plot(*zip(*front, strict=False), color="k", lw=0.8, alpha=0.6, zorder=1, label="Pareto front (means)")
    ax.set_xlabel("uplink MiB per client per round (hollow: delta codecs after their first, full upload)")
    ax.set_ylabel("best test accuracy [%]")
    ax.set_title(
        "CIFAR-10 α=0.1, SimpleCNN: accuracy vs upload per codec" + (f"\n({note})" if note else ""), fontsize=9
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center right", ncol=1)
    return save(fig, out_dir, "compression_pareto")


RESNET_CODECS = ("none", "sym", "fp16", "bf16", "lowrank:0.1", "lowrank:0.02", "delta:topk:0.01", "delta:rankr:0.01")
# rows with the parameters sent in float16 (validation.dnn --param-dtype float16; bfloat16 counts the same)
RESNET_HALF_PARAM_CODECS = ("none", "fp16", "lowrank:0.02", "delta:topk:0.01", "delta:rankr:0.01")


def resnet_table(
    codecs=RESNET_CODECS,
    model_name="resnet18gn",
    classes=100,
    title="ResNet18-GN, CIFAR-100",
    half_param_codecs=RESNET_HALF_PARAM_CODECS,
):
    """Bytes per client per round of FedPM by codec, from the block sizes: float32 parameters with every codec
    of ``codecs``, then float16 parameters (``--param-dtype float16``) with those of ``half_param_codecs``;
    percentages against the uncompressed upload (float32 parameters and matrices)."""
    from fedconvex.codecs import parse
    from fedpm_dnn import foof
    from fedpm_dnn.models import make_model

    model = make_model(model_name, classes)
    n_params = sum(p.numel() for p in model.parameters())
    widths = [b.module.weight[0].numel() + (1 if b.has_bias else 0) for b in foof.foof_blocks(model).values()]
    header = [
        "codec",
        "parameters",
        "matrices MiB",
        "total MiB/client/round (params + matrices)",
        "vs uncompressed total",
        "matrices vs uncompressed matrices",
    ]
    full = sum(4 * n * n for n in widths)
    uncompressed = 4 * n_params + full
    fmt = "{:.3f}" if uncompressed / MiB < 10 else "{:.1f}"
    rows = []
    for param_bytes, specs in ((4, codecs), (2, half_param_codecs)):
        params = param_bytes * n_params
        for spec in specs:
            c = parse(spec)
            mat = full if c is None else sum(c.payload_bytes(n, 4) for n in widths)
            note = " (steady state; first upload as sym)" if c is not None and c.stateful else ""
            rows.append(
                [
                    spec + note,
                    f"float{8 * param_bytes} ({fmt.format(params / MiB)} MiB)",
                    fmt.format(mat / MiB),
                    fmt.format((params + mat) / MiB),
                    f"{100 * (params + mat) / uncompressed:.1f} %",
                    f"{100 * mat / full:.1f} %",
                ]
            )
    caption = (
        f"{title}: {len(widths)} FOOF blocks (largest {max(widths)}), {n_params:,} parameters = "
        f"{4 * n_params / MiB:.3f} MiB in float32 = {100 * 4 * n_params / uncompressed:.2f} % of the "
        f"uncompressed upload ({uncompressed:,} B), {100 * 2 * n_params / uncompressed:.2f} % in float16"
    )
    return header, rows, caption


def build(root, out, write_table, note="", log=print):
    if not runs_matching(root, r"compression-.+"):
        log(f"skipped the compression tables and figure: no compression-* results under {root}")
        return []
    os.makedirs(out, exist_ok=True)
    produced = []
    header, rows = convex_table(root)
    if rows:
        produced += write_table(
            out,
            "table_compression_convex",
            header,
            rows,
            "FedPM (K=1, lr 1) per preconditioner codec vs FedNL: rounds to ||θ−θ*|| < 1e-10 "
            "and uplink bytes per client",
            "tab:compression_convex",
        )
    else:
        log(f"skipped the convex compression table: no compression-w8a-* / -a9a-* results under {root}")
    points = cnn_points(root)
    if points:
        header, rows = cnn_table(points)
        produced += write_table(
            out,
            "table_compression_cnn",
            header,
            rows,
            "CIFAR-10 α=0.1, SimpleCNN: best accuracy vs uplink per codec" + (f" ({note})" if note else ""),
            "tab:compression_cnn",
        )
        produced += pareto_figure(points, out, note)
    else:
        log(f"skipped the CNN compression table and Pareto plot: no CIFAR-10 α=0.1 FedPM results under {root}")
    try:
        header, rows, caption = resnet_table()
        produced += write_table(out, "table_compression_resnet", header, rows, caption, "tab:compression_resnet")
        header, rows, caption = resnet_table(
            ("none",) + CNN_CODECS,
            "cnn",
            10,
            "SimpleCNN, CIFAR-10 (by formula)",
            tuple(c for c, _ in CNN_PARAM_DTYPE_RUNS),
        )
        produced += write_table(out, "table_compression_cnn_bytes", header, rows, caption, "tab:compression_cnn_bytes")
    except ImportError:
        log("skipped the ResNet18-GN bytes table: torch is not installed")
    return produced
