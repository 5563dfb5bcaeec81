"""Write a federated image data set for Flower: each client's partition in a folder of its own.

    python -m validation.flower prepare --dataset cifar10 --data-dir DATA --clients 3 --out DIR
    python -m validation.flower prepare --dataset femnist --data-dir LEAF --out DIR

The split is validation.dnn's (--split: RelaySum's capped Dirichlet by default, --alpha, --seed); --train-subset /
--test-subset take class-balanced subsets first (CPU-sized runs), as in validation.dnn.  FEMNIST's
clients are its writers, in the loader's order (client-i holds writer i's training images alone;
--clients N keeps the first N writers, as validation.dnn; the test set is every writer's).  Then start
SuperNode i with ``--node-config "partition-id=i data-dir='DIR/client-i'"`` (the local deployment of
validation.flower does that for --data-dir DIR).
"""

from __future__ import annotations

import os

from validation import common

PROG = "python -m validation.flower prepare"


def parse_args(argv):
    p = common.OneLineParser(prog=PROG, doc=__doc__)
    p.add_argument("--dataset", choices=("cifar10", "cifar100", "femnist"), default="cifar10", help="the data set")
    p.add_argument("--data-dir", default=None, help="data folder (default: $FEDPM_DATA)")
    p.add_argument("--cache-dir", default=None, help="decoded-JPEG cache (default: $FEDPM_CACHE or ~/.cache/fedpm)")
    p.add_argument(
        "--clients", type=common.positive_int, default=None, help="clients (default: 3; FEMNIST: every writer)"
    )
    p.add_argument("--alpha", type=common.positive_float, default=None, help="Dirichlet concentration (default: 0.1)")
    p.add_argument(
        "--split",
        choices=("relaysum", "relaysum-even", "dirichlet"),
        default=None,
        help="as validation.dnn (default: relaysum)",
    )
    p.add_argument("--seed", type=common.seed_int, default=0, help="the split's and the subsets' seed")
    p.add_argument(
        "--train-subset", type=common.positive_int, default=None, help="class-balanced training subset (default: all)"
    )
    p.add_argument("--test-subset", type=common.positive_int, default=None, help="first N test images (default: all)")
    p.add_argument("--out", required=True, help="the folder to write (client-<i>/, server/, meta.json)")
    args = p.parse_args(argv)
    if args.dataset == "femnist":
        for flag, value in (("--alpha", args.alpha), ("--split", args.split), ("--train-subset", args.train_subset)):
            if value is not None:
                p.error(f"{flag} does not apply to --dataset femnist: its clients are its writers (use --clients)")
    else:
        args.clients = args.clients or 3
        args.alpha = 0.1 if args.alpha is None else args.alpha
        args.split = args.split or "relaysum"
    if (
        not os.path.islink(args.out)
        and os.path.exists(args.out)
        and (not os.path.isdir(args.out) or os.listdir(args.out))
    ):
        p.error(f"--out {args.out}: exists and is not an empty folder")
    common.check_out_arg(p, args.out)  # an empty path, a symbolic link, a parent that is not a writable folder
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        prepare(args)
    except (ValueError, OSError) as exc:
        common.fail(PROG, exc)
    return 0


def prepare(args) -> None:
    import json

    from fedpm_dnn.data import effective_classes, load_image_dataset, partition_table
    from fedpm_dnn.data.partition import make_partition
    from fedpm_flower import prepared
    from validation.dnn_experiment import balanced_subset, subset_problem
    from validation.outputs import ResultDir

    data, natural = load_image_dataset(args.dataset, args.data_dir, args.cache_dir)
    x, y, xt, yt = data.x_train, data.y_train, data.x_test, data.y_test
    for flag, n, labels, what in (
        ("--train-subset", args.train_subset, y, "training"),
        ("--test-subset", args.test_subset, yt, "test"),
    ):
        why = subset_problem(n, labels, data.num_classes) if n else None  # as validation.dnn
        if why:
            raise ValueError(f"{flag} {n}: {why.replace('images', what + ' images')}")
    if args.train_subset:
        keep = balanced_subset(y, args.train_subset, data.num_classes, args.seed)
        x, y = x[keep], y[keep]
    if args.test_subset:
        keep = balanced_subset(yt, args.test_subset, data.num_classes, args.seed)
        xt, yt = xt[keep], yt[keep]
    if natural is not None:  # FEMNIST: one client per writer, as validation.dnn
        if args.clients and args.clients > len(natural):
            raise ValueError(f"--clients {args.clients} exceeds the {len(natural)} writers of this FEMNIST folder")
        parts = natural[: args.clients] if args.clients else natural
    else:
        parts = make_partition(args.split, y, args.clients, args.alpha, seed=args.seed)
    meta = {
        "dataset": data.name,
        "num_classes": int(data.num_classes),
        "channels": int(x.shape[1]),
        "image_size": int(x.shape[2]),
        "mean": list(data.mean),
        "std": list(data.std),
        "clients": len(parts),
        "split": args.split or "natural (writers)",
        "alpha": args.alpha,
        "seed": args.seed,
        "client_sizes": [int(len(p)) for p in parts],
    }
    # written into a hidden sibling and moved into place when complete (an error or Ctrl-C leaves nothing)
    with ResultDir(args.out, marked=False) as tmp:  # a data set, not a result: --out is never replaced (parse_args)
        for i, part in enumerate(parts):
            prepared.write(prepared.client_folder(tmp, i), "train.npz", x[part], y[part], {**meta, "client": i})
        prepared.write(prepared.server_folder(tmp), "test.npz", xt, yt, meta)
        with open(os.path.join(tmp, "meta.json"), "w") as fh:
            counts = partition_table(y, parts, data.num_classes)
            split = {
                "class_counts": counts.tolist(),
                "effective_classes_per_client": float(effective_classes(counts).mean()),
            }
            json.dump({**meta, **split}, fh, indent=1)
    print(
        f"wrote {len(parts)} client folders ({', '.join(str(len(p)) for p in parts)} images) and server/ "
        f"({len(yt)} test images) to {args.out}"
    )
