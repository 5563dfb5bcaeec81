"""The experiment a parsed ``python -m validation.dnn`` command describes (``build``): the data set loaded, its
class-balanced subsets, its split into clients, and the method and model on the device and engine that run them."""

from __future__ import annotations

import numpy as np

from validation.run_settings import DEFAULT_CLIENTS, RunSettings


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


def flag_subset(flag: str, n, labels, num_classes, seed, images: str):
    """``balanced_subset`` for a flag (--train-subset, --test-subset), or one ValueError naming the flag and why,
    the set's ``images`` named in it."""
    why = subset_problem(n, labels, num_classes)
    if why:
        raise ValueError(f"{flag} {n}: {why.replace('images', images)}")
    return balanced_subset(labels, n, num_classes, seed)


def build(s: RunSettings):
    """(Experiment, description dict) for a run's settings (made concrete at the command's boundary:
    validation.dnn_cli.parse_args); raises on any user error the data reveals."""
    import torch

    from fedpm_dnn.data import effective_classes, load_image_dataset, partition_table
    from fedpm_dnn.data.partition import make_partition
    from fedpm_dnn.engine.sequential import ClientData
    from fedpm_dnn.engine.simulation import Experiment
    from fedpm_dnn.foof import precision
    from fedpm_dnn.presets import PRESETS

    if "auto" in (s.device, s.engine, s.step_graph):
        raise TypeError("build() takes settings made concrete for a device (validation.run_settings.on_device)")
    res, cfg, device, split_seed = s.resolved, s.config, s.device, s.split_seed
    data, natural = load_image_dataset(s.dataset, s.data_dir, s.cache_dir)
    x, y = data.x_train, data.y_train
    n_clients = s.clients
    if natural is not None:
        # FEMNIST (paper appendix): every writer is a client; --clients N keeps the first N writers
        if s.train_subset:
            raise ValueError("--train-subset does not apply to FEMNIST's writer partition; use --clients")
        if n_clients and n_clients > len(natural):
            raise ValueError(f"--clients {n_clients} exceeds the {len(natural)} writers of this FEMNIST folder")
        parts = natural[:n_clients] if n_clients else natural
    else:
        if s.train_subset:
            keep = flag_subset("--train-subset", s.train_subset, y, data.num_classes, split_seed, "training images")
            x, y = x[keep], y[keep]
        parts = make_partition(s.split, y, n_clients or DEFAULT_CLIENTS, s.alpha, seed=split_seed)
    participants = s.participants
    if participants and participants >= len(parts) and "participants" not in res.from_flags:
        participants = None  # the preset samples more clients than this run has: everyone takes part
    xt, yt = data.x_test, data.y_test
    if s.test_subset:
        keep = flag_subset("--test-subset", s.test_subset, yt, data.num_classes, split_seed, "test images")
        xt, yt = xt[keep], yt[keep]
    if participants and participants > len(parts):
        raise ValueError(f"--participants {participants} exceeds the {len(parts)} clients")
    to = lambda a: torch.as_tensor(a).to(device)  # noqa: E731
    augment = s.augment == "crop-flip"
    clients = [ClientData(to(x[p]), to(y[p]), data.mean, data.std, augment=augment) for p in parts]
    exp = Experiment(
        cfg=cfg,
        model=s.model,
        num_classes=data.num_classes,
        clients=clients,
        x_test=to(xt),
        y_test=to(yt),
        mean=data.mean,
        std=data.std,
        rounds=s.rounds,
        participants=participants,
        seed=s.seed,
        device=device,
        in_channels=x.shape[1],
        image_size=x.shape[2],
        engine=s.engine,
        client_chunk=s.client_chunk,
        step_graph=s.step_graph,
        max_ratio=s.max_ratio or None,
        gn_groups=s.gn_groups,
        lr_schedule=s.lr_schedule,
    )
    counts = partition_table(y, parts, data.num_classes)
    desc = {
        "dataset": data.name,
        "train_samples": int(len(y)),
        "test_samples": int(len(yt)),
        "num_classes": data.num_classes,
        "clients": len(parts),
        "alpha": s.alpha if natural is None else None,
        "partition": s.split if natural is None else "natural (writers)",
        "seed": s.seed,
        "split_seed": split_seed if natural is None else None,
        # exp of the entropy of each client's class shares, averaged: 1 = one class per client, C = all alike
        "effective_classes_per_client": float(effective_classes(counts).mean()),
        "participants": participants or len(parts),
        "augment": s.augment,
        "client_sizes": [int(len(p)) for p in parts],
        "class_counts": counts.tolist(),
        "preset": s.preset,
        "preset_table": PRESETS[s.preset]["table"] if s.preset else None,
        # where each setting and hyper-parameter came from; the rest are the defaults
        "from_preset": res.from_preset,
        "from_flags": res.from_flags,
        "preset_overridden": res.conflicts,
        "flags_not_applicable": list(res.not_applicable),
        "device": device,
        "engine": s.engine,
        # the vectorized engine's full steps as one static function, captured as a CUDA graph there (step_graph)
        "step_graph": s.step_graph if s.engine == "vectorized" else None,
        # the arithmetic of the training: the device's name and the TF32 flags its rounds ran with (precision.use)
        "precision": precision.record(getattr(cfg, "foof_precision", "fp32"), device),
        # what the run actually used, filled in as it goes (the step graph's fallbacks, its graphed share)
        "executed": exp.meta.setdefault("executed", {}),
        "config": {"name": cfg.name, **cfg.hyperparameters()},
        "lr_schedule": exp.lr_schedule.as_dict() if exp.lr_schedule else None,
    }
    if s.model == "resnet18gn":
        desc["gn_groups"] = exp.gn_groups
    if data.source == "jpeg":
        desc["note"] = (
            "CIFAR-10 JPEG copy (lossy re-encoding): accuracies are close to, not identical with, the original"
        )
    return exp, desc
