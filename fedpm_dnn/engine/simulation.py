"""The in-process DNN front-end of the round driver (``fedconvex.driver``): all clients in one
process on one device, checkpoint every round.

The driver samples the participants, broadcasts, screens the replies (from the method's
``message_fields``), weights them (uniform, or by samples), applies the method's ``server_update``,
counts bytes and checks for divergence; this module supplies the task (``fedpm_dnn.engine.training_task``: model,
data, engine), the transport (``fedpm_dnn.engine.transport``) and the history row: test accuracy of the
global model, mean train loss, client compute seconds (local training + FOOF statistics), server
seconds, bytes up/down per participating client and peak memory.  ``resume=True`` continues a killed
run from its last checkpoint to the identical result: the checkpoint holds the model, server and
client states and the client-sampling generator (each client's stream derives from seed, round and
client, see ``training_task.client_generator``).
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from fedconvex.algorithms.base import State
from fedconvex.driver import Driver

from ..foof import precision, solve_graph
from ..models import make_model
from . import checkpoint as _ck
from .training_task import DnnTask, client_generator  # noqa: F401  (client_generator: Flower's ClientApp)
from .transport import DnnTransport

HISTORY_COLUMNS = (
    "round",
    "test_acc",
    "train_loss",
    "client_seconds",
    "server_seconds",
    "bytes_up",
    "bytes_down",
    "peak_memory_mb",
    "wall_seconds",
    "rejected",
)


@dataclass
class Experiment:
    cfg: object  # the method: a fedpm_dnn.algorithms object
    model: str
    num_classes: int
    clients: list  # ClientData per client
    x_test: torch.Tensor  # uint8 on the device
    y_test: torch.Tensor
    mean: tuple
    std: tuple
    rounds: int = 100
    participants: int | None = None
    seed: int = 0
    device: str = "cpu"
    in_channels: int = 3
    image_size: int = 32
    meta: dict = field(default_factory=dict)
    engine: str = "sequential"  # or "vectorized": the participants trained together (fedpm_dnn.engine.vectorized)
    max_ratio: float | None = None  # server magnitude guard (fedconvex.screening); None: off, as in the paper
    client_chunk: int | None = None  # vectorized: clients per chunk (None: from the free device memory)
    step_graph: str = (
        "auto"  # vectorized: full local steps as one CUDA graph (fedpm_dnn.engine.step_graph; auto: on CUDA)
    )
    gn_groups: int = 2  # ResNet18-GN's GroupNorm group count
    lr_schedule: object = None  # fedpm_dnn.engine.lr_schedule.LrSchedule, or None: the method's rate in every round


def _reset_peak_memory(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 to clear_refs resets this process's peak RSS (VmHWM)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _peak_memory_mb(device) -> float:
    """Peak memory of the round: CUDA allocator peak, or on CPU the process's peak RSS since the
    round started (where the OS cannot reset it, since the process started)."""
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def server_view(state: State) -> dict:
    """The checkpoint's 'server' entry: parameters, round and the method's server state in one dict."""
    return {"params": state.theta, "round": state.round, **state.server}


def from_server_view(server: dict, clients: list) -> State:
    rest = {k: v for k, v in server.items() if k not in ("params", "round")}
    return State(theta=server["params"], server=rest, clients=clients, round=server["round"])


def make_driver(alg, task, evaluate, participants=None, max_ratio=None, tamper=None) -> Driver:
    """The round driver of a DNN task: its transport, the method's weights, divergence and device checks.
    ``evaluate(state) -> dict``: the metric columns of a history row."""
    dev = task.device

    def finite(state):
        return all(bool(torch.isfinite(p).all()) for p in state.theta.values())

    return Driver(
        alg,
        task,
        DnnTransport(task, tamper),
        lambda sel: alg.client_weights(task.sizes, sel),
        evaluate=evaluate,
        n_clients=task.n_clients,
        participants=participants,
        max_ratio=max_ratio,
        label=f"{alg.name} (lr={alg.lr:g})",
        finite=finite,
        synchronize=(lambda: torch.cuda.synchronize(dev)) if str(dev).startswith("cuda") else None,
    )


# the initial model comes from torch's global generator: runs built in threads (engine.stacked_runs) take turns
_SEEDED = threading.Lock()


def build(exp: Experiment, tamper=None):
    """(task, driver, initial state) of the experiment."""
    alg, dev = exp.cfg, exp.device
    with _SEEDED:
        torch.manual_seed(exp.seed)
        model = make_model(exp.model, exp.num_classes, exp.in_channels, exp.image_size, exp.gn_groups).to(dev)
    task = DnnTask(model, exp.clients, dev, exp.seed, exp.engine, exp.client_chunk, step_graph=exp.step_graph)
    task.lr_schedule = exp.lr_schedule
    if exp.lr_schedule is not None:
        exp.lr_schedule.check_rate(alg.lr)
    driver = make_driver(
        alg,
        task,
        lambda state: {"test_acc": task.accuracy(state.theta, exp.x_test, exp.y_test, exp.mean, exp.std)},
        exp.participants,
        exp.max_ratio,
        tamper,
    )
    return task, driver, alg.init(task, task.initial_params())


def run_experiment(
    exp: Experiment,
    checkpoint: str | None = None,
    resume: bool = False,
    on_round=None,
    tamper=None,
    stop=None,
    engine=None,
):
    """Run (or resume) the experiment; returns the list of per-round history rows (round 1 first).  ``engine``:
    where the vectorized engine's rounds go instead of a private engine (a ``stacked_runs.StackMember``).

    Replies are screened before aggregation (wrong shape, NaN/Inf, non-PSD FOOF matrix: the client is
    rejected with a logged reason, the others' weights renormalised; with none left the round is
    skipped and the model kept).  ``tamper(round, client, reply) -> reply`` injects faults for tests;
    ``stop(row) -> bool`` ends the run after a round (checkpointed first), e.g. at a time budget."""
    task, driver, state = build(exp, tamper)
    if engine is not None:
        if exp.engine != "vectorized":
            raise ValueError("stacked runs train on the vectorized engine")
        task.engine_state = engine
    fp = _ck.fingerprint(exp) if checkpoint else None
    executed = exp.meta.setdefault("executed", {})  # a summary's "executed" entry: this dict, filled as rounds end

    def note(row, history):
        if task.executed is not None and task.executed["chunk_steps"]:
            rec = task.executed
            executed.update(
                step_forms=dict(rec["step_forms"]),
                graphed_share=rec["graphed_steps"] / rec["chunk_steps"],
                static_step_share=rec["static_steps"] / rec["chunk_steps"],
            )
            if rec.get("out_of_memory"):
                executed["out_of_memory"] = list(rec["out_of_memory"])
            for key in ("kept_foof", "kept_foof_resumed"):  # how checkpoints keep the matrices; a resume's doubts
                if rec.get(key):
                    executed[key] = rec[key] if isinstance(rec[key], str) else list(rec[key])
        if precision.fallbacks():
            executed["precision_fallbacks"] = precision.fallbacks()
        if solve_graph.fallbacks:
            executed["solve_graph_fallbacks"] = list(solve_graph.fallbacks)
        if on_round is not None:
            on_round(row, history)

    _, history = drive(task, driver, state, exp.rounds, exp.seed, fp, checkpoint, resume, note, stop)
    if task.last_chunk is not None:
        exp.meta["client_chunk"] = task.last_chunk
    return history


def drive(
    task, driver, state, rounds, seed, fingerprint, checkpoint=None, resume=False, on_round=None, stop=None, extra=None
):
    """Rounds up to ``rounds`` of a built task (``build`` or ``fedpm_dnn.federated``): the history's DNN
    columns, a checkpoint after every round, and resuming from one written with the same ``fingerprint``.
    ``extra``: an object whose ``state() -> dict`` is checkpointed too and given back to ``restore(dict)`` on
    resuming (``fedpm_dnn.federated``'s model buffers).  Returns (final state, history)."""
    alg, device, n = driver.algorithm, task.device, task.n_clients
    rng = np.random.default_rng(seed)
    history = []
    if resume and checkpoint and os.path.isfile(checkpoint):
        ck = _ck.load(checkpoint, map_location=device)  # weights_only: a checkpoint never runs code
        diff = _ck.first_difference(ck["fingerprint"], fingerprint)
        if diff:
            raise ValueError(f"{checkpoint}: written by a different configuration ({diff}); remove it or drop --resume")
        _ck.check_structure(checkpoint, ck, server_view(state), n)
        if len(ck["history"]) > rounds:  # a run is extended, never cut: its later rounds would be lost
            raise ValueError(
                f"--rounds {rounds}: {checkpoint} already holds {len(ck['history'])} rounds; ask for "
                f"{len(ck['history'])} or more to continue it (nothing was changed)"
            )
        state, history = from_server_view(ck["server"], ck["clients"]), ck["history"]
        if extra is not None:
            if not isinstance(ck.get("extra"), dict):
                raise _ck.CheckpointError(f"{checkpoint}: damaged checkpoint (no model buffers); remove it")
            extra.restore(ck["extra"])
        try:
            rng.bit_generator.state = ck["np_rng"]
        except (TypeError, ValueError, KeyError) as exc:
            raise _ck.CheckpointError(
                f"{checkpoint}: damaged checkpoint (random generator state: {exc}); remove it or choose another --out"
            ) from None
    wall0 = time.perf_counter() - (history[-1]["wall_seconds"] if history else 0.0)
    _reset_peak_memory(device)

    def after_round(state, history, rng):
        # the driver's row, completed with the DNN columns, then the checkpoint
        row, prev = history[-1], history[-2] if len(history) > 1 else {"seconds": 0.0}
        row["server_seconds"] = max(row["seconds"] - prev["seconds"] - row["client_seconds"], 0.0)
        row["peak_memory_mb"] = _peak_memory_mb(device)
        row["wall_seconds"] = time.perf_counter() - wall0
        if checkpoint:
            _ck.save(
                checkpoint,
                {
                    "format": _ck.FORMAT,
                    "fingerprint": fingerprint,
                    "config": alg.hyperparameters(),
                    "method": alg.name,
                    "seed": seed,
                    "n_clients": n,
                    "server": server_view(state),
                    "clients": [_ck.compact_client(cs) for cs in state.clients],
                    "history": history,
                    "np_rng": rng.bit_generator.state,
                    **({} if extra is None else {"extra": extra.state()}),
                },
            )
        _reset_peak_memory(device)

    return driver.run(state, rounds, rng, history=history, on_round=on_round, stop=stop, checkpoint=after_round)
