"""The experiment a parsed ``python -m validation.dnn`` command describes (``build``): the data set loaded, its
class-balanced subsets, its split into clients, and the method and model on the device and engine that run them."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from validation.dnn_cli import AUTO_ENGINE, DEFAULT_CLIENTS, settings_of, vectorized_only


def subset_problem(n, labels, num_classes) -> str | None:
    """Why a class-balanced subset of ``n`` of ``labels`` cannot be drawn exactly (it never rounds), or None."""
    if not num_classes <= n <= len(labels):
        return f"must be between the {num_classes} classes and the {len(labels)} images"
    if n % num_classes:
        lo = n - n % num_classes
        return (
            f"a class-balanced subset takes the same number of each of the {num_classes} classes: "
            f"{lo} or {lo + num_classes}"
        )
    short = [c for c in range(num_classes) if np.count_nonzero(labels == c) < n // num_classes]
    if short:
        return f"class {short[0]} has fewer than the {n // num_classes} images a class-balanced subset takes of it"
    return None


def balanced_subset(labels, n, num_classes, seed):
    """``n`` indices of ``labels``, n / num_classes of each class (``subset_problem`` says when that cannot be)."""
    why = subset_problem(n, labels, num_classes)
    if why:
        raise ValueError(f"subset of {n}: {why}")
    rng = np.random.default_rng(seed)
    per = n // num_classes
    idx = []
    for c in range(num_classes):
        pool = np.flatnonzero(labels == c)
        idx.append(rng.choice(pool, per, replace=False))
    return np.sort(np.concatenate(idx))


# --foof-apply auto (the default) on each device: the whole run's apply, decided once and recorded in the checkpoint
AUTO_FOOF_APPLY = {"cuda": "inverse", "cpu": "solve"}
# --foof-precision auto (the default): fedpm_dnn.foof.cost.auto_mode; a checkpoint from before it: fp32
FOOF_AUTO = {"foof_apply": "solve", "foof_precision": "fp32"}  # what a checkpoint without the entry ran


def concrete_foof_apply(args, cfg, device: str):
    """``cfg`` with --foof-apply and --foof-precision auto (or no flag) made concrete: on --resume what the
    checkpoint recorded (a run started under an earlier default continues as it began; a checkpoint from before an
    option ran FOOF_AUTO), else AUTO_FOOF_APPLY and cost.auto_mode for the device and model.  The flag's own value
    follows the checkpoint's too, so that neither differs."""
    if not getattr(cfg, "uses_foof", False):
        return cfg
    from fedpm_dnn.foof.cost import auto_mode

    auto = [k for k in FOOF_AUTO if getattr(args, k, None) in (None, "auto")]
    if not auto:
        return cfg
    concrete = {
        "foof_apply": AUTO_FOOF_APPLY.get(torch_device_type(device), "solve"),
        "foof_precision": auto_mode(device, args.model),
    }
    if args.resume and os.path.isfile(os.path.join(args.out, "checkpoint.pt")):
        from fedpm_dnn.engine import checkpoint

        recorded = checkpoint.load(os.path.join(args.out, "checkpoint.pt"), map_location="cpu")["fingerprint"]
        for k in auto:
            concrete[k] = recorded.get(f"config.{k}", FOOF_AUTO[k])
            if recorded.get(f"run.{k}") in (None, "auto"):
                setattr(args, k, recorded.get(f"run.{k}"))
    return dataclasses.replace(cfg, **{k: concrete[k] for k in auto})


def resolved_step_graph(mode: str, engine: str, device: str) -> str | None:
    """--step-graph as the run uses it: 'on' or 'off' on the vectorized engine, None on the sequential one."""
    if engine != "vectorized":
        return None
    from fedpm_dnn.engine import step_graph

    return "on" if step_graph.resolve(mode, device) else "off"


def torch_device_type(device: str) -> str:
    return str(device).split(":")[0]


def build(args):
    """(Experiment, description dict) for the parsed arguments; raises on any user error."""
    import torch

    from fedpm_dnn.data import effective_classes, load_image_dataset, partition_table
    from fedpm_dnn.data.partition import make_partition
    from fedpm_dnn.engine.sequential import ClientData
    from fedpm_dnn.engine.simulation import Experiment
    from fedpm_dnn.foof import precision
    from fedpm_dnn.presets import PRESETS

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    device = (
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    engine = AUTO_ENGINE[device] if args.engine == "auto" else args.engine
    why = vectorized_only(args, engine, device)  # before any data is read
    if why:
        raise ValueError(why)
    res = args.resolved
    cfg, settings = concrete_foof_apply(args, res.config, device), res.settings
    data, natural = load_image_dataset(args.dataset, args.data_dir, args.cache_dir)
    x, y = data.x_train, data.y_train
    n_clients = settings["clients"]
    run = settings_of(args)  # resolved once, at the command's boundary
    split_seed = run.split_seed
    if natural is not None:
        # FEMNIST (paper appendix): every writer is a client; --clients N keeps the first N writers
        if args.train_subset:
            raise ValueError("--train-subset does not apply to FEMNIST's writer partition; use --clients")
        if n_clients and n_clients > len(natural):
            raise ValueError(f"--clients {n_clients} exceeds the {len(natural)} writers of this FEMNIST folder")
        parts = natural[:n_clients] if n_clients else natural
    else:
        if args.train_subset:
            why = subset_problem(args.train_subset, y, data.num_classes)
            if why:
                raise ValueError(f"--train-subset {args.train_subset}: {why.replace('images', 'training images')}")
            keep = balanced_subset(y, args.train_subset, data.num_classes, split_seed)
            x, y = x[keep], y[keep]
        parts = make_partition(args.split, y, n_clients or DEFAULT_CLIENTS, settings["alpha"], seed=split_seed)
    participants = settings["participants"]
    if participants and participants >= len(parts) and "participants" not in res.from_flags:
        participants = None  # the preset samples more clients than this run has: everyone takes part
    xt, yt = data.x_test, data.y_test
    if args.test_subset:
        why = subset_problem(args.test_subset, yt, data.num_classes)
        if why:
            raise ValueError(f"--test-subset {args.test_subset}: {why.replace('images', 'test images')}")
        keep = balanced_subset(yt, args.test_subset, data.num_classes, split_seed)
        xt, yt = xt[keep], yt[keep]
    if participants and participants > len(parts):
        raise ValueError(f"--participants {participants} exceeds the {len(parts)} clients")
    to = lambda a: torch.as_tensor(a).to(device)  # noqa: E731
    augment = run.augment == "crop-flip"
    clients = [ClientData(to(x[p]), to(y[p]), data.mean, data.std, augment=augment) for p in parts]
    exp = Experiment(
        cfg=cfg,
        model=args.model,
        num_classes=data.num_classes,
        clients=clients,
        x_test=to(xt),
        y_test=to(yt),
        mean=data.mean,
        std=data.std,
        rounds=args.rounds,
        participants=participants,
        seed=args.seed,
        device=device,
        in_channels=x.shape[1],
        image_size=x.shape[2],
        engine=engine,
        client_chunk=args.client_chunk,
        step_graph=args.step_graph,
        max_ratio=args.max_ratio or None,
        gn_groups=args.gn_groups or 2,
        lr_schedule=run.lr_schedule,
    )
    counts = partition_table(y, parts, data.num_classes)
    desc = {
        "dataset": data.name,
        "train_samples": int(len(y)),
        "test_samples": int(len(yt)),
        "num_classes": data.num_classes,
        "clients": len(parts),
        "alpha": settings["alpha"] if natural is None else None,
        "partition": args.split if natural is None else "natural (writers)",
        "seed": args.seed,
        "split_seed": split_seed if natural is None else None,
        # exp of the entropy of each client's class shares, averaged: 1 = one class per client, C = all alike
        "effective_classes_per_client": float(effective_classes(counts).mean()),
        "participants": participants or len(parts),
        "augment": run.augment,
        "client_sizes": [int(len(p)) for p in parts],
        "class_counts": counts.tolist(),
        "preset": args.preset,
        "preset_table": PRESETS[args.preset]["table"] if args.preset else None,
        # where each setting and hyper-parameter came from; the rest are the defaults
        "from_preset": res.from_preset,
        "from_flags": res.from_flags,
        "preset_overridden": res.conflicts,
        "flags_not_applicable": list(res.not_applicable),
        "device": device,
        "engine": engine,
        # the vectorized engine's full steps as one static function, captured as a CUDA graph there (step_graph)
        "step_graph": resolved_step_graph(args.step_graph, engine, device),
        # the arithmetic of the training: the device's name and the TF32 flags its rounds ran with (precision.use)
        "precision": precision.record(getattr(cfg, "foof_precision", "fp32"), device),
        # what the run actually used, filled in as it goes (the step graph's fallbacks, its graphed share)
        "executed": exp.meta.setdefault("executed", {}),
        "config": {"name": cfg.name, **cfg.hyperparameters()},
        "lr_schedule": exp.lr_schedule.as_dict() if exp.lr_schedule else None,
    }
    if args.model == "resnet18gn":
        desc["gn_groups"] = exp.gn_groups
    if data.source == "jpeg":
        desc["note"] = (
            "CIFAR-10 JPEG copy (lossy re-encoding): accuracies are close to, not identical with, the original"
        )
    return exp, desc
