"""A DNN run's settings, resolved once at the command's boundary (``validation.dnn_cli.parse_args``) into one frozen
``RunSettings``: the preset applied under the flags, every ``auto`` made concrete (the data set's augmentation,
the device, the engine, FOOF's apply and precision -- on ``--resume`` as the checkpoint recorded them), each value
in its one canonical form.  Everything below the boundary (``validation.dnn``, ``dnn_stack``, ``dnn_experiment``,
``dnn_output``) takes this object and nothing else; the fingerprint the checkpoint and the sweep compare, the
default --out and summary.json read it.  No torch import at module level: ``--help`` stays fast."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types alone: importing them needs torch
    from fedpm_dnn.algorithms import DnnAlgorithm
    from fedpm_dnn.engine.lr_schedule import LrSchedule
    from fedpm_dnn.presets import Resolved

DEFAULT_CLIENTS = 10  # --clients of a Dirichlet split (FEMNIST: every writer)

# auto: on a GPU the vectorized engine (5-6x the sequential one for SimpleCNN on an H100/H200); on a CPU the
# sequential one.  With per-client convolutions the vectorized engine is level there (SimpleCNN, 10 clients:
# 0.96-1.22x at two torch threads, 0.90-1.02x at one; ResNet18-GN 0.43x), within the
# runs' noise -- not enough to change what a default CPU run computes (float32 round-off differs between the
# engines) or to stop older checkpoints from resuming under the default.
AUTO_ENGINE = {"cuda": "vectorized", "cpu": "sequential"}
# --foof-apply auto (the default) on each device: the whole run's apply, decided once and recorded in the checkpoint
AUTO_FOOF_APPLY = {"cuda": "inverse", "cpu": "solve"}
# --foof-precision auto (the default): fedpm_dnn.foof.cost.auto_mode; a checkpoint from before it: fp32
FOOF_AUTO = {"foof_apply": "solve", "foof_precision": "fp32"}  # what a checkpoint without the entry ran

# the settings that shape what a run computes, as the checkpoint's run.* entries record them (run_fingerprint);
# the method's hyper-parameters, the client counts and the engine are the checkpoint's own entries
# (fedpm_dnn.engine.checkpoint.fingerprint), compared resolved
FINGERPRINT_FIELDS = (
    *("alpha", "augment", "client_chunk", "dataset", "lr_schedule", "max_ratio", "method", "model", "preset"),
    *("seed", "split", "split_seed", "test_subset", "threads", "train_subset"),
)


@dataclass(frozen=True)
class RunSettings:
    """Every setting a run of ``python -m validation.dnn`` reads after its flags are parsed, resolved once.

    ``resolved`` is the preset under the flags (``fedpm_dnn.presets.Resolved``: the method as the flags give it,
    the same on every machine, and where each setting came from); ``config`` is the method as this run trains it,
    its FOOF ``auto``s (``foof_auto``) made concrete for the device, or as a resumed checkpoint recorded them.  A
    stack (--seeds / --alpha lists) is the command's settings with one ``RunSettings`` per run in ``runs``."""

    # the data
    dataset: str
    data_dir: str | None
    cache_dir: str | None
    split: str  # relaysum, relaysum-even, dirichlet (FEMNIST: its writers, whatever this says)
    alpha: float  # the Dirichlet concentration, resolved (FEMNIST: the default's, unused by its writers' split)
    clients: int | None  # resolved; None: DEFAULT_CLIENTS (FEMNIST: every writer)
    participants: int | None  # resolved; None: every client
    train_subset: int | None
    test_subset: int | None
    split_seed: int  # --split-seed, else --seed
    augment: str  # --augment auto made concrete for the data set
    # the model and the method
    model: str
    gn_groups: int  # ResNet18-GN's GroupNorm groups (2 unless given)
    method: str
    preset: str | None
    resolved: Resolved  # the preset under the flags: the method as they give it, where each setting came from
    config: DnnAlgorithm  # the method as trained (FOOF's autos concrete)
    foof_auto: tuple  # the keys of FOOF_AUTO left to auto (made concrete in ``config``)
    # the schedule
    rounds: int
    seed: int
    lr_schedule: LrSchedule | None  # milestones as rounds of --rounds; None: the method's lr throughout
    # how and where it runs
    device: str  # cpu or cuda ("auto" only before on_device)
    engine: str  # sequential or vectorized ("auto" only before on_device)
    step_graph: str  # on or off: the vectorized engine's full steps as one static function ("auto" before on_device)
    client_chunk: int | None
    max_ratio: float  # the server's magnitude guard; 0: off
    threads: int | None  # torch CPU threads (None: torch's)
    # where it writes and when it stops
    out: str | None
    out_given: bool  # --out given (a default --out names the rounds: advice to extend a run names the folder)
    runs_parent: str | None  # a stacked run: the stack's --out
    resume: bool
    overwrite: bool
    deadline: float | None  # seconds since the epoch (--budget-minutes made absolute)
    quiet: bool
    command: str  # the line summary.json and ``reproduce:`` record (recorded_command)
    runs: tuple = ()  # a stack: its runs' settings, in the order seeds x alphas

    @property
    def alpha_text(self) -> str:
        return canonical_alpha(self.alpha)

    @property
    def stacked(self) -> bool:
        return bool(self.runs)


def canonical_alpha(value) -> str:
    """An alpha's one written form, as run folders, default --out names and the sweep's profiles write it: the
    shortest text that reads back as the same float (1, 1.0 and 1.00 are all 1.0; 0.10 is 0.1)."""
    return repr(float(value))


def resolved_augment(augment: str, dataset: str) -> str:
    """``--augment auto`` made concrete for the data set (fedpm_dnn.data.augment.default_augment)."""
    if augment != "auto":
        return augment
    from fedpm_dnn.data.augment import default_augment

    return default_augment(dataset)


def torch_device_type(device: str) -> str:
    return str(device).split(":")[0]


def visible_device() -> str:
    """What --device auto stands for here: cuda where torch sees one, else cpu (also without torch)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def on_device(s: RunSettings, stacked: bool = False) -> RunSettings:
    """``s`` with its device-dependent ``auto``s made concrete: --device (cuda where one is visible), --engine
    (AUTO_ENGINE for the device; the vectorized engine for a run of a stack, ``stacked``), --step-graph
    (fedpm_dnn.engine.step_graph.resolve: on CUDA) and FOOF's apply and precision left to auto (AUTO_FOOF_APPLY,
    fedpm_dnn.foof.cost.auto_mode for the device and model)."""
    from fedpm_dnn.engine import step_graph

    device = visible_device() if s.device == "auto" else s.device
    engine = s.engine if s.engine != "auto" else ("vectorized" if stacked else AUTO_ENGINE[device])
    graph = "on" if step_graph.resolve(s.step_graph, device) else "off"
    concrete = {}
    if getattr(s.config, "uses_foof", False) and s.foof_auto:
        from fedpm_dnn.foof.cost import auto_mode

        rule = {
            "foof_apply": lambda: AUTO_FOOF_APPLY.get(torch_device_type(device), "solve"),
            "foof_precision": lambda: auto_mode(device, s.model),
        }
        concrete = {k: rule[k]() for k in s.foof_auto}
    config = dataclasses.replace(s.config, **concrete)
    return dataclasses.replace(s, device=device, engine=engine, step_graph=graph, config=config)


def recorded_choices(s: RunSettings) -> RunSettings:
    """``s`` resuming its checkpoint (--resume): FOOF's apply and precision left to auto as the checkpoint recorded
    them, so that a run started under an earlier default (or on another device) continues as it began; a
    checkpoint from before an option ran FOOF_AUTO.  ``s`` itself where nothing is left to the checkpoint.
    Raises fedpm_dnn.engine.checkpoint.CheckpointError (a ValueError) for an unreadable checkpoint."""
    path = os.path.join(s.out, "checkpoint.pt")
    if not (s.resume and s.foof_auto and getattr(s.config, "uses_foof", False) and os.path.isfile(path)):
        return s
    from fedpm_dnn.engine import checkpoint

    recorded = checkpoint.load(path, map_location="cpu")["fingerprint"]
    chosen = {k: recorded.get(f"config.{k}", FOOF_AUTO[k]) for k in s.foof_auto}
    return dataclasses.replace(s, config=dataclasses.replace(s.config, **chosen))


def run_fingerprint(s: RunSettings) -> dict:
    """The settings that shape the run, for the checkpoint's fingerprint (fedpm_dnn.engine.checkpoint, its run.*
    entries), as the run uses them: the data set and alpha resolved (their flags once defaulted to cifar10 and 0.1,
    a preset now supplies them), the augmentation concrete ("auto" and the name it stands for are one run, and
    checkpoints written before "auto" existed record the name), --split-seed None where it is the --seed it
    defaults to (as checkpoints have always recorded it), the learning-rate schedule with its milestones as rounds
    (--rounds is not in the fingerprint: a run can be extended; None, no schedule, is how checkpoints from before
    the flags read).  The method's hyper-parameters and the client counts are the checkpoint's own entries."""
    fp = {k: getattr(s, k) for k in FINGERPRINT_FIELDS}
    fp["split_seed"] = None if s.split_seed == s.seed else s.split_seed
    fp["lr_schedule"] = s.lr_schedule.as_dict() if s.lr_schedule else None
    return dict(sorted(fp.items()))


def resolved_fingerprint(s: RunSettings) -> dict:
    """The run's settings (``run_fingerprint``) with the client counts the experiment uses (DEFAULT_CLIENTS, the
    preset's participants) and the method's configuration as the flags give it (the same on every machine), so
    that a flag repeating a default or a preset's value changes nothing: what the sweep compares and the default
    --out is named from."""
    fp = run_fingerprint(s)
    fp["clients"] = s.clients
    if fp["clients"] is None and s.dataset != "femnist":
        fp["clients"] = DEFAULT_CLIENTS
    participants = s.participants
    if participants and fp["clients"] and participants >= fp["clients"] and "participants" not in s.resolved.from_flags:
        participants = None  # as build(): everyone takes part
    fp["participants"] = participants
    cfg = s.resolved.config
    fp.update({f"config.{k}": v for k, v in {"name": cfg.name, **cfg.hyperparameters()}.items()})
    return fp


def engine_tag(s: RunSettings) -> str | None:
    """The engine of ``s`` (made concrete: ``on_device``) where it is not the one --engine auto gives on its
    device, else None (that engine's runs are named without it, as they always were)."""
    return None if AUTO_ENGINE.get(torch_device_type(s.device)) == s.engine else s.engine
