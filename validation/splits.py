"""How heterogeneous a seed's Dirichlet split is: effective classes per client over a range of split seeds.

    python -m validation.splits --dataset cifar10 --data-dir DATA --alpha 0.1 --seeds 0-19

Prints, per split seed, the mean over clients of exp(entropy of the client's class shares) -- 1 when every
client holds one class, C when every client holds all C classes alike -- its rank from the most heterogeneous
split, and the mean +- std over the seeds.  The split is validation.dnn's (same labels, clients, alpha,
--train-subset draw): a run's summary.json records the same number for its --split-seed.
"""

from __future__ import annotations

import sys

import numpy as np

from validation import common

PROG = "python -m validation.splits"


def seed_range(text):
    """'A-B' (inclusive) or a single seed."""
    first, _, last = text.partition("-")
    a = common.seed_int(first)
    b = common.seed_int(last) if last else a
    if b < a:
        raise common.argparse.ArgumentTypeError(f"empty seed range {text}")
    return range(a, b + 1)


def parse_args(argv=None):
    p = common.OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=("cifar10", "cifar100"), default="cifar10", help="the image data set")
    p.add_argument("--data-dir", default=None, help="data folder (default: $FEDPM_DATA)")
    p.add_argument("--cache-dir", default=None, help="decoded-JPEG cache (default: $FEDPM_CACHE or ~/.cache/fedpm)")
    p.add_argument("--alpha", type=common.positive_float, default=0.1, help="Dirichlet concentration")
    p.add_argument("--clients", type=common.positive_int, default=10, help="clients")
    p.add_argument("--split", choices=("relaysum", "dirichlet"), default="relaysum", help="as validation.dnn --split")
    p.add_argument(
        "--train-subset", type=common.positive_int, default=None, help="as validation.dnn (default: every image)"
    )
    p.add_argument("--seeds", type=seed_range, default=range(20), help="split seeds, A-B inclusive (default: 0-19)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from fedpm_dnn.data import effective_classes, load_image_dataset, partition_table
    from fedpm_dnn.data.partition import make_partition
    from validation.dnn import balanced_subset

    try:
        data, _ = load_image_dataset(args.dataset, args.data_dir, args.cache_dir)
    except (ValueError, OSError) as exc:
        common.fail(PROG, exc)
    means = {}
    for seed in args.seeds:
        y = data.y_train
        if args.train_subset:
            y = y[balanced_subset(y, args.train_subset, data.num_classes, seed)]
        parts = make_partition(args.split, y, args.clients, args.alpha, seed=seed)
        means[seed] = float(effective_classes(partition_table(y, parts, data.num_classes)).mean())
    order = sorted(means, key=means.get)
    print(f"{args.dataset}, {args.split} split, alpha {args.alpha:g}, {args.clients} clients, {len(y)} images")
    print("split seed  effective classes per client  rank (1 = most heterogeneous)")
    for seed, value in means.items():
        print(f"{seed:>10}  {value:>28.2f}  {order.index(seed) + 1:>3} of {len(means)}")
    values = np.array(list(means.values()))
    print(f"mean +- std over {len(values)} seeds: {values.mean():.2f} +- {values.std(ddof=1):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_command(PROG, main))
