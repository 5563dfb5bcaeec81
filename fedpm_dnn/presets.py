"""Hyper-parameters of the paper's appendix tables, as named presets.

Each preset names its table and the setting the table fixes (data set, Dirichlet alpha, participants per
round, local epochs, FOOF samples); its rows are (lr, grad clip or None, weight decay -- or mu for FedProx --,
FedAvgM momentum, damping, FedAdam server lr).  ``method_config`` turns a preset row into a method object
(``fedpm_dnn.algorithms``); explicit command-line flags override it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .algorithms import DnnAlgorithm

N = None  # "No" clipping


# The setting of the CIFAR tables (paper section Test 2): N = 10 clients, no client sampling (participants None:
# every client), the FOOF matrices on the full local dataset (foof_samples None); each table adds its own alpha and
# local epochs, the appendix studies their participants or FOOF sample count.
CIFAR_SETTING = {"clients": 10, "participants": None, "foof_samples": None}
# what a table's setting may fix: each is also a command-line flag (validation.dnn), which overrides it
SETTING_KEYS = ("dataset", "alpha", "clients", "participants", "local_epochs", "foof_samples")
# The paper does not say what a client does with the last partial batch of an epoch; the code bases it cites for
# the CIFAR setting (RelaySum's tasks/cifar.py, MOON, the model's source) load with DataLoader(drop_last=True), so
# every preset drops it.  Keeping it lets a client whose size is one past a multiple of the batch size take a
# full-rate step on a single image every epoch, which collapses FedAvg at alpha 1.0 (REPRODUCTION.md section 3a).
PRESET_LAST_BATCH = "drop"
# a run setting that neither a flag nor a preset gives (the others' None: the loader's or the method's default)
DEFAULT_SETTING = {"dataset": "cifar10", "alpha": 0.1}


def _table(caption, rows, **setting):
    if setting["dataset"].startswith("cifar"):
        setting = {**CIFAR_SETTING, **setting}
    return {"table": caption, "setting": setting, "methods": rows}


def _row(lr, clip, wd, momentum=None, damping=None, server_lr=None, mu=None):
    return {
        k: v
        for k, v in dict(
            lr=lr, clip=clip, weight_decay=wd, momentum=momentum, damping=damping, server_lr=server_lr, mu=mu
        ).items()
        if v is not None or k == "clip"
    }


def _main(fedavg, fedavgm, fedprox, scaffold, fedadam, localnewton, fedpm):
    return {
        "fedavg": _row(*fedavg),
        "fedavgm": _row(*fedavgm[:3], momentum=fedavgm[3]),
        "fedprox": _row(fedprox[0], fedprox[1], 0.0, mu=fedprox[2]),
        "scaffold": _row(*scaffold),
        "fedadam": _row(*fedadam[:3], server_lr=fedadam[3]),
        "localnewton": _row(*localnewton[:3], damping=localnewton[3]),
        "fedpm": _row(*fedpm[:3], damping=fedpm[3]),
    }


PRESETS = {
    "cifar10-a1.0": _table(
        "Table: final hyperparameters for CIFAR10, alpha=1.0 (tab:hp_cifar10_a1_0)",
        _main(
            (0.1, N, 1e-4),
            (0.1, 1.0, 1e-4, 0.9),
            (0.3, 1.0, 1e-3),
            (0.1, N, 1e-4),
            (0.05, N, 1e-4, 0.03),
            (0.3, N, 1e-4, 1.0),
            (0.3, N, 1e-4, 1.0),
        ),
        dataset="cifar10",
        alpha=1.0,
        local_epochs=5,
    ),
    "cifar10-a0.1": _table(
        "Table: final hyperparameters for CIFAR10, alpha=0.1 (tab:hp_cifar10_a0_1)",
        _main(
            (0.1, N, 0.0),
            (0.1, 1.0, 1e-4, 0.9),
            (0.05, N, 1e-3),
            (0.1, N, 1e-4),
            (0.05, N, 1e-4, 0.03),
            (0.3, 1.0, 0.0, 1e-4),
            (0.5, 1.0, 1e-4, 1.0),
        ),
        dataset="cifar10",
        alpha=0.1,
        local_epochs=5,
    ),
    "cifar100-a1.0": _table(
        "Table: final hyperparameters for CIFAR100, alpha=1.0 (tab:hp_cifar100_a1_0)",
        _main(
            (0.3, 1.0, 1e-4),
            (0.1, 1.0, 1e-4, 0.9),
            (0.3, 1.0, 1e-2),
            (0.3, 1.0, 1e-4),
            (0.03, N, 1e-4, 0.01),
            (0.3, N, 1e-4, 1.0),
            (0.3, N, 1e-4, 1.0),
        ),
        dataset="cifar100",
        alpha=1.0,
        local_epochs=5,
    ),
    "cifar100-a0.1": _table(
        "Table: final hyperparameters for CIFAR100, alpha=0.1 (tab:hp_cifar100_a0_1)",
        _main(
            (0.3, N, 1e-4),
            (0.1, 1.0, 1e-4, 0.9),
            (0.3, N, 1e-3),
            (0.3, N, 1e-4),
            (0.01, N, 1e-4, 0.03),
            (0.5, 1.0, 0.0, 1.0),
            (0.5, 1.0, 1e-4, 1.0),
        ),
        dataset="cifar100",
        alpha=0.1,
        local_epochs=5,
    ),
    "cifar10-e1": _table(
        "Table: CIFAR10 (alpha=0.1) with 1 local epoch (tab:hp_cifar10_e1)",
        _main(
            (0.05, N, 1e-4),
            (0.1, 1.0, 1e-4, 0.99),
            (0.1, N, 1e-3),
            (0.3, 1.0, 1e-4),
            (0.05, N, 1e-4, 0.05),
            (0.3, 1.0, 1e-4, 1.0),
            (0.3, 1.0, 1e-4, 0.01),
        ),
        dataset="cifar10",
        alpha=0.1,
        local_epochs=1,
    ),
    "cifar10-e10": _table(
        "Table: CIFAR10 (alpha=0.1) with 10 local epochs (tab:hp_cifar10_e10)",
        _main(
            (0.05, N, 1e-4),
            (0.1, 1.0, 1e-4, 0.9),
            (0.1, 1.0, 1e-3),
            (0.1, N, 1e-4),
            (0.03, N, 1e-4, 0.05),
            (0.3, 1.0, 0.0, 0.01),
            (0.3, N, 1e-4, 1.0),
        ),
        dataset="cifar10",
        alpha=0.1,
        local_epochs=10,
    ),
    "femnist": _table(
        "Table: final hyperparameters for FEMNIST (tab:hp_femnist)",
        _main(
            (0.1, N, 1e-4),
            (0.5, 1.0, 1e-4, 0.7),
            (0.1, N, 1e-2),
            (0.5, 1.0, 1e-4),
            (0.05, N, 1e-4, 0.03),
            (0.5, 1.0, 1e-4, 1.0),
            (0.5, 1.0, 1e-4, 1.0),
        ),
        dataset="femnist",
        participants=10,
        local_epochs=5,
        foof_samples=None,
    ),
}

# client sampling tables (tab:hp_clientsamp_cifar10 / _cifar100): (lr, clip, wd or mu[, momentum or damping])
_SAMPLING = {
    "cifar10": {
        2: dict(
            fedavg=(0.05, N, 1e-4),
            fedavgm=(0.1, 1.0, 1e-4, 0.7),
            fedprox=(0.1, N, 1e-2),
            scaffold=(0.1, 1.0, 1e-4),
            localnewton=(0.1, N, 1e-4, 1.0),
            fedpm=(0.3, 1.0, 1e-4, 1.0),
        ),
        5: dict(
            fedavg=(0.05, N, 0.0),
            fedavgm=(0.1, 1.0, 1e-4, 0.7),
            fedprox=(0.1, N, 1e-3),
            scaffold=(0.1, N, 1e-4),
            localnewton=(0.5, N, 0.0, 1.0),
            fedpm=(0.3, 1.0, 1e-4, 1.0),
        ),
        8: dict(
            fedavg=(0.05, N, 1e-4),
            fedavgm=(0.1, 1.0, 1e-4, 0.9),
            fedprox=(0.1, N, 1e-3),
            scaffold=(0.1, N, 1e-4),
            localnewton=(0.5, 1.0, 0.0, 0.01),
            fedpm=(0.3, 1.0, 1e-4, 1.0),
        ),
        10: dict(
            fedavg=(0.1, N, 0.0),
            fedavgm=(0.1, 1.0, 1e-4, 0.9),
            fedprox=(0.05, N, 1e-3),
            scaffold=(0.1, N, 1e-4),
            localnewton=(0.3, 1.0, 0.0, 1e-4),
            fedpm=(0.5, 1.0, 1e-4, 1.0),
        ),
    },
    "cifar100": {
        2: dict(
            fedavg=(0.3, N, 1e-4),
            fedavgm=(0.1, N, 0.0, 0.7),
            fedprox=(0.3, N, 1e-3),
            scaffold=(0.5, N, 1e-4),
            localnewton=(0.5, 1.0, 0.0, 1.0),
            fedpm=(0.5, 1.0, 0.0, 1.0),
        ),
        5: dict(
            fedavg=(0.3, N, 1e-4),
            fedavgm=(0.1, 1.0, 0.0, 0.7),
            fedprox=(0.3, N, 1e-3),
            scaffold=(0.5, N, 1e-4),
            localnewton=(0.5, 1.0, 0.0, 1.0),
            fedpm=(0.5, 1.0, 0.0, 1.0),
        ),
        8: dict(
            fedavg=(0.5, N, 1e-4),
            fedavgm=(0.1, 1.0, 1e-4, 0.9),
            fedprox=(0.3, N, 1e-3),
            scaffold=(0.3, N, 1e-4),
            localnewton=(0.5, 1.0, 0.0, 1.0),
            fedpm=(0.5, 1.0, 0.0, 1.0),
        ),
        10: dict(
            fedavg=(0.3, N, 1e-4),
            fedavgm=(0.1, 1.0, 1e-4, 0.9),
            fedprox=(0.3, N, 1e-3),
            scaffold=(0.3, N, 1e-4),
            localnewton=(0.5, 1.0, 0.0, 1.0),
            fedpm=(0.5, 1.0, 1e-4, 1.0),
        ),
    },
}
for _ds, _by_p in _SAMPLING.items():
    for _p, _rows in _by_p.items():
        rows = {}
        for m, v in _rows.items():
            if m == "fedavgm":
                rows[m] = _row(*v[:3], momentum=v[3])
            elif m == "fedprox":
                rows[m] = _row(v[0], v[1], 0.0, mu=v[2])
            elif m in ("localnewton", "fedpm"):
                rows[m] = _row(*v[:3], damping=v[3])
            else:
                rows[m] = _row(*v)
        PRESETS[f"{_ds}-sampling-{_p}"] = _table(
            f"Table: client sampling on {_ds.upper()}, {_p} participants (tab:hp_clientsamp_{_ds}); "
            "FedAdam is not in this table",
            rows,
            dataset=_ds,
            alpha=0.1,
            participants=_p,
            local_epochs=5,
        )

# FOOF sample counts (tab:hp_foof_samples): FedPM only
for _ds, _vals in {
    "cifar10": {64: (0.5, 1.0, 1e-4), 256: (0.5, N, 1e-4), 1024: (0.5, N, 0.0), "all": (0.5, 1.0, 1e-4)},
    "cifar100": {64: (0.3, 1.0, 1e-4), 256: (0.3, 1.0, 1e-4), 1024: (0.3, 1.0, 1e-4), "all": (0.5, 1.0, 1e-4)},
}.items():
    for _k, v in _vals.items():
        PRESETS[f"{_ds}-foof-{_k}"] = _table(
            f"Table: FedPM with {_k} samples for the FOOF matrices on {_ds.upper()} (tab:hp_foof_samples)",
            {"fedpm": _row(*v, damping=1.0)},
            dataset=_ds,
            alpha=0.1,
            local_epochs=5,
            foof_samples=None if _k == "all" else _k,
        )


def preset_row(preset: str, method: str) -> dict:
    """What ``preset`` fixes for ``method``: the method's row of the table plus the table's setting that the
    method takes as a hyper-parameter (local epochs, FOOF samples)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(sorted(PRESETS))}")
    rows = PRESETS[preset]["methods"]
    if method not in rows:
        raise ValueError(f"preset {preset!r} ({PRESETS[preset]['table']}) has no row for {method!r}")
    from .algorithms import hyperparameters_of  # torch: not needed for the tables (a command's --help)

    setting = PRESETS[preset]["setting"]
    takes = hyperparameters_of(method)
    return {
        **rows[method],
        "last_batch": PRESET_LAST_BATCH,
        **{k: setting[k] for k in ("local_epochs", "foof_samples") if k in setting and k in takes},
    }


def method_config(preset: str | None, method: str, **given):
    """The method ``method`` from a preset row (if given), then the explicitly ``given`` values, which win; a
    given None is a value (no clip, every sample), not "not given": leave out what was not given."""
    from .algorithms import REGISTRY, hyperparameters_of, make_method

    base = preset_row(preset, method) if preset is not None else {}
    # a hyper-parameter the method does not have (--mu for FedAvg) is refused, not ignored; the run's settings
    # (SETTING_KEYS: data set, alpha, clients, ..., FOOF samples, given to every method of a run alike) are not
    # hyper-parameters of every method
    foreign = [k for k in REGISTRY.foreign([method], given) if k not in SETTING_KEYS]
    if foreign:
        flags = ", ".join("--" + k.replace("_", "-") for k in foreign)
        verb = "does" if len(foreign) == 1 else "do"
        raise ValueError(f"{flags} {verb} not apply: {method} has no hyper-parameter {', '.join(foreign)}")
    given = {k: v for k, v in given.items() if k in hyperparameters_of(method)}
    return make_method(method, **{**base, **given})


@dataclass(frozen=True)
class Resolved:
    """A run's settings and method, each value from an explicit flag, else the preset, else the default."""

    settings: dict  # SETTING_KEYS -> value (None: the default of the loader or method)
    config: DnnAlgorithm
    from_preset: dict  # what the preset supplied and no flag overrode: setting entries and row hyper-parameters
    from_flags: dict  # the flags given that apply to this run
    conflicts: dict  # setting -> {"preset": its value, "flag": the flag's}, where a flag contradicts the table
    not_applicable: tuple  # flags given that this method does not take (--mu for FedAvg)


def resolve(preset: str | None, method: str, given: dict) -> Resolved:
    """Apply ``preset`` (its whole setting and ``method``'s row) under the explicitly ``given`` flag values
    (name -> value; a given None is a value: no clip, every sample)."""
    from .algorithms import hyperparameters_of

    setting = PRESETS[preset]["setting"] if preset is not None else {}
    row = preset_row(preset, method) if preset is not None else {}
    takes = hyperparameters_of(method)
    settings = {k: given[k] if k in given else setting.get(k, DEFAULT_SETTING.get(k)) for k in SETTING_KEYS}
    return Resolved(
        settings=settings,
        config=method_config(preset, method, **given),
        from_preset={k: v for k, v in {**setting, **row}.items() if k not in given},
        from_flags={k: v for k, v in given.items() if k in takes or k in SETTING_KEYS},
        conflicts={
            k: {"preset": setting[k], "flag": given[k]}
            for k in SETTING_KEYS
            if k in given and k in setting and given[k] != setting[k]
        },
        not_applicable=tuple(sorted(k for k in given if k not in takes and k not in SETTING_KEYS)),
    )
