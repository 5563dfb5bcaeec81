"""How heterogeneous a seed's Dirichlet split is: effective classes per client over a range of split seeds.

    python -m validation.splits --dataset cifar10 --data-dir DATA --alpha 0.1,1.0 --split all --seeds 0-19

Prints, per split seed, the mean over clients of exp(entropy of the client's class shares) -- 1 when every
client holds one class, C when every client holds all C classes alike -- for every split rule and alpha asked
for (one column each), beside it the smallest last batch of any client at --batch-size (the epoch's last partial
batch a client steps on under --last-batch keep: 1 means one client takes a full-rate step on a single image every
epoch; under drop, every preset's setting, it is left out), then the mean +- std over the seeds.  With one column it
also ranks the seeds from the most heterogeneous split.  The split is validation.dnn's (same labels, clients, alpha,
--train-subset draw): a run's summary.json records the same number for its --split-seed.  ``--markdown`` prints the
table as Markdown.
"""

from __future__ import annotations

import sys

import numpy as np

from validation import common

PROG = "python -m validation.splits"
RULES = ("relaysum", "relaysum-even", "dirichlet")  # fedpm_dnn.data.partition.SPLITS, without importing torch


def seed_range(text):
    """'A-B' (inclusive) or a single seed."""
    first, _, last = text.partition("-")
    a = common.seed_int(first)
    b = common.seed_int(last) if last else a
    if b < a:
        raise common.argparse.ArgumentTypeError(f"empty seed range {text}")
    return range(a, b + 1)


def split_list(text):
    """'all' or a comma-separated list of split rules."""
    names = list(RULES) if text == "all" else text.split(",")
    for name in names:
        if name not in RULES:
            raise common.argparse.ArgumentTypeError(f"unknown split {name!r}; choose from {', '.join(RULES)} or all")
    if len(set(names)) != len(names):
        raise common.argparse.ArgumentTypeError(f"a split is named twice in {text!r}")
    return names


def alpha_list(text):
    values = [common.positive_float(t) for t in text.split(",")]
    if len(set(values)) != len(values):
        raise common.argparse.ArgumentTypeError(f"an alpha is named twice in {text!r}")
    return values


def parse_args(argv=None):
    p = common.OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=("cifar10", "cifar100"), default="cifar10", help="the image data set")
    p.add_argument("--data-dir", default=None, help="data folder (default: $FEDPM_DATA)")
    p.add_argument("--cache-dir", default=None, help="decoded-JPEG cache (default: $FEDPM_CACHE or ~/.cache/fedpm)")
    p.add_argument(
        "--alpha", type=alpha_list, default=[0.1], help="Dirichlet concentration(s), comma-separated (default: 0.1)"
    )
    p.add_argument("--clients", type=common.positive_int, default=10, help="clients")
    p.add_argument(
        "--split",
        type=split_list,
        default=["relaysum"],
        help=f"as validation.dnn --split: {', '.join(RULES)}, a comma list of them, or all (default: relaysum)",
    )
    p.add_argument(
        "--train-subset", type=common.positive_int, default=None, help="as validation.dnn (default: every image)"
    )
    p.add_argument(
        "--batch-size",
        type=common.positive_int,
        default=64,
        help="the local batch size the last batches are counted at (default: 64, every preset's)",
    )
    p.add_argument("--seeds", type=seed_range, default=range(20), help="split seeds, A-B inclusive (default: 0-19)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    return p.parse_args(argv)


def check_sizes(args, labels, num_classes: int) -> None:
    """The sizes validation.dnn would refuse, refused before any split is drawn."""
    from validation.dnn_experiment import subset_problem

    why = subset_problem(args.train_subset, labels, num_classes) if args.train_subset is not None else None
    if why:
        raise ValueError(f"--train-subset {args.train_subset}: {why.replace('images', 'training images')}")
    n_images = len(labels)
    n = args.train_subset or n_images
    if args.clients > n:
        raise ValueError(f"--clients {args.clients}: more clients than the {n} training images")


def smallest_last_batch(sizes, batch_size: int) -> int:
    """The smallest last batch of an epoch over clients of ``sizes`` samples: a client whose size is a multiple of
    the batch size ends on a full batch; one smaller than a batch has a single batch of all it holds."""
    return min(n % batch_size or min(n, batch_size) for n in sizes)


def table(args, labels, num_classes) -> dict:
    """(split, alpha) -> {seed: (mean effective classes per client, smallest last batch)}."""
    from fedpm_dnn.data import effective_classes, partition_table
    from fedpm_dnn.data.partition import make_partition
    from validation.dnn_experiment import balanced_subset

    out = {}
    for split in args.split:
        for alpha in args.alpha:
            col = {}
            for seed in args.seeds:
                y = labels
                if args.train_subset:
                    y = y[balanced_subset(y, args.train_subset, num_classes, seed)]
                parts = make_partition(split, y, args.clients, alpha, seed=seed)
                col[seed] = (
                    float(effective_classes(partition_table(y, parts, num_classes)).mean()),
                    smallest_last_batch([len(p) for p in parts], args.batch_size),
                )
            out[split, alpha] = col
    return out


def render(args, cols: dict, n_images: int) -> str:
    keys = list(cols)
    heads = [f"{s} a={a:g}" for s, a in keys]
    eff = {k: {seed: v[0] for seed, v in cols[k].items()} for k in keys}
    last = {k: {seed: v[1] for seed, v in cols[k].items()} for k in keys}
    lines = [
        f"{args.dataset}, {args.clients} clients, {n_images} images: effective classes per client "
        "(exp of the class-share entropy, mean over clients) and the smallest last batch of any client at batch "
        f"size {args.batch_size} (in brackets)"
    ]
    single = len(keys) == 1
    if single:
        order = sorted(eff[keys[0]], key=eff[keys[0]].get)
    if args.markdown:
        lines += ["", "| split seed | " + " | ".join(f"{h} | last batch" for h in heads) + " |"]
        lines.append("|---:|" + "---:|---:|" * len(heads))
        for seed in args.seeds:
            lines.append(f"| {seed} | " + " | ".join(f"{eff[k][seed]:.2f} | {last[k][seed]}" for k in keys) + " |")
        stats = [np.array(list(eff[k].values())) for k in keys]
        lines.append("| mean +- std | " + " | ".join(f"{v.mean():.2f} +- {_std(v):.2f} | " for v in stats) + " |")
        return "\n".join(lines)
    width = max(12, *(len(h) for h in heads))
    lines.append(
        "split seed"
        + "".join(f"  {h:>{width}} {'(last)':>6}" for h in heads)
        + ("  rank (1 = most heterogeneous)" * single)
    )
    for seed in args.seeds:
        row = f"{seed:>10}" + "".join(f"  {eff[k][seed]:>{width}.2f} {f'({last[k][seed]})':>6}" for k in keys)
        if single:
            row += f"  {order.index(seed) + 1:>3} of {len(order)}"
        lines.append(row)
    stats = [np.array(list(eff[k].values())) for k in keys]
    lines.append(
        f"mean +- std over {len(args.seeds)} seeds: "
        + ", ".join(f"{h} {v.mean():.2f} +- {_std(v):.2f}" for h, v in zip(heads, stats, strict=True))
    )
    return "\n".join(lines)


def _std(values) -> float:
    return float(values.std(ddof=1)) if len(values) > 1 else 0.0


def main(argv=None) -> int:
    args = parse_args(argv)
    from fedpm_dnn.data import load_image_dataset

    try:
        data, _ = load_image_dataset(args.dataset, args.data_dir, args.cache_dir)
        check_sizes(args, data.y_train, data.num_classes)
        cols = table(args, data.y_train, data.num_classes)
    except (ValueError, OSError) as exc:
        common.fail(PROG, exc)
    print(render(args, cols, args.train_subset or len(data.y_train)))
    return 0


if __name__ == "__main__":
    sys.exit(common.run_command(PROG, main))
