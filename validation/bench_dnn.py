"""Benchmark the DNN simulator: both engines' throughput, FedPM / FedAvg round time, projected paper run times.

    python -m validation.bench_dnn                 # both models, sizes chosen for the device
    python -m validation.bench_dnn --json          # one JSON object
    python -m validation.bench_dnn --threads 2     # torch CPU threads (default: all cores)
    python -m validation.bench_dnn --sizes 10,128,2,2 --repeats 1   # smaller: clients,images,epochs,rounds
    python -m validation.bench_dnn --engines vectorized --repeats 3  # one engine (the other's numbers null)
    python -m validation.bench_dnn --models cnn --stack 3 --json      # + 3 runs stacked against one alone
    python -m validation.bench_dnn --method fedpm,scaffold --models cnn  # other methods (default fedavg,fedpm)

Measured in one run on the current device, on synthetic CIFAR-shaped data (the speed does not
depend on pixel values), for SimpleCNN at CIFAR-10 size and ResNet18-GN at CIFAR-100 size:
local-training images/s of FedAvg rounds with the sequential engine (clients one after another)
and the vectorized engine (all participants in one stack), the mean wall time of a FedAvg and
a FedPM round with each engine and their ratio (paper: 1.23x on CIFAR-10, 1.61x on CIFAR-100),
the share of the FedPM round spent in FOOF statistics and factorisations, the peak memory of a
vectorized FedPM round, and the projected time of the paper's 100-round run (50,000 images,
10 clients, 5 local epochs) from the parts of the measured FedPM round (``paper_round_seconds``: local
training scaled by images x epochs, the FOOF statistics by images, the factorisations and the server by
clients; the JSON also keeps the older whole-round-per-image projection, which charges a small benchmark's
fixed per-round costs -- ResNet18-GN's 4,609-wide factorisations -- once per image).

FedPM is measured with each ``--foof-applies`` (default solve and inverse, side by side:
``fedpm_over_fedavg_by_apply``; the plain keys are solve's).  ``--stack S`` adds, measured in the same process on
the vectorized engine, the round time of one run alone and of S runs stacked (``fedpm_dnn.engine.stacked_runs``, seeds
0..S-1): ``runs_stacked``, ``seconds_per_round_single``, ``seconds_per_round_stacked`` and ``stack_speedup``
(S x single / stacked).

``--method`` (a comma list of registered fedpm_dnn methods, default fedavg,fedpm) picks the methods timed; each
one's median round time per engine is in ``round_seconds_by_method`` (FOOF methods once per ``--foof-applies``
value, labelled ``method-apply`` beyond solve).  The keys named after FedAvg (throughput, ``fedavg_*``) or FedPM
(``fedpm_*``, FOOF share, peak memory, projections) are present only when that method is timed, and
``fedpm_over_fedavg*`` only when both are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from validation.progress import Progress

# (clients, samples per client, local epochs, rounds) per device.  Local epochs are the paper's 5:
# FOOF statistics are computed once per round, so the ratio depends on the epochs per round.
# Only rounds after the first are timed (the first also builds each client's initial matrices).
SIZES = {
    ("cnn", "cpu"): (10, 300, 5, 3),
    ("resnet18gn", "cpu"): (2, 32, 1, 2),
    ("cnn", "cuda"): (10, 5000, 5, 3),
    ("resnet18gn", "cuda"): (10, 5000, 5, 3),
}
CLASSES = {"cnn": 10, "resnet18gn": 100}
PAPER = {"cnn": 1.23, "resnet18gn": 1.61}
PAPER_IMAGES, PAPER_EPOCHS, PAPER_ROUNDS = 50000, 5, 100


def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class BenchRun:
    """One measured configuration, the parameters every measuring function shares: the model and method, the
    device, the size (clients, samples per client, local epochs, rounds), the engine and its client chunk, the seed
    of the synthetic data and the model, FOOF's apply and precision, the step form and what an epoch's last partial
    batch does (--last-batch: the benchmark's clients are equal, so a remainder adds one short step per epoch to
    each of them alike).  A function that varies one of them measures ``run.but(...)``."""

    model: str
    device: str
    size: tuple  # (clients, samples per client, local epochs, rounds)
    method: str = "fedpm"
    engine: str = "vectorized"
    chunk: int | None = None
    seed: int = 0
    foof_apply: str = "solve"
    foof_precision: str = "fp32"
    step_graph: str = "auto"
    last_batch: str = "keep"

    def but(self, **changes) -> BenchRun:
        return dataclasses.replace(self, **changes)


def _experiment(run: BenchRun):
    import torch

    from fedpm_dnn.algorithms import make_method, method_class
    from fedpm_dnn.engine.sequential import ClientData
    from fedpm_dnn.engine.simulation import Experiment

    clients, per_client, epochs, rounds = run.size
    device = run.device
    g = torch.Generator().manual_seed(run.seed)
    k = CLASSES[run.model]
    data = [
        ClientData(
            torch.randint(0, 256, (per_client, 3, 32, 32), generator=g, dtype=torch.uint8).to(device),
            torch.randint(0, k, (per_client,), generator=g).to(device),
            (0.5,) * 3,
            (0.25,) * 3,
        )
        for _ in range(clients)
    ]
    xt = torch.randint(0, 256, (256, 3, 32, 32), generator=g, dtype=torch.uint8).to(device)
    yt = torch.randint(0, k, (256,), generator=g).to(device)
    foof_kw = (
        {"damping": 1.0, "foof_apply": run.foof_apply, "foof_precision": run.foof_precision}
        if method_class(run.method).uses_foof
        else {}
    )
    cfg = make_method(run.method, lr=0.05, clip=1.0, local_epochs=epochs, last_batch=run.last_batch, **foof_kw)
    return Experiment(
        cfg=cfg,
        model=run.model,
        num_classes=k,
        clients=data,
        x_test=xt,
        y_test=yt,
        mean=(0.5,) * 3,
        std=(0.25,) * 3,
        rounds=rounds,
        seed=run.seed,
        device=device,
        engine=run.engine,
        client_chunk=run.chunk,
        step_graph=run.step_graph,
    )


class FoofTimer:
    """Wall time spent in FOOF statistics and in factorisations (both engines' entry points wrapped), apart:
    the statistics pass reads every image of a client, a factorisation costs the same whatever the data.  A
    wrapped call inside another counts once."""

    def __init__(self, device):
        self.device, self.saved, self.depth = device, [], 0
        self.seconds = {"statistics": 0.0, "factorisations": 0.0}

    def _wrap(self, owner, name, bucket):
        fn = getattr(owner, name)
        self.saved.append((owner, name, fn))

        def timed(*a, **kw):
            if self.depth:
                return fn(*a, **kw)
            _sync(self.device)
            self.depth += 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync(self.device)
                self.seconds[bucket] += time.perf_counter() - t
                self.depth -= 1

        setattr(owner, name, timed)

    def __enter__(self):
        from fedpm_dnn import foof
        from fedpm_dnn.engine import sequential, vectorized
        from fedpm_dnn.foof import batched

        self._wrap(vectorized.VectorizedEngine, "foof_for", "statistics")
        self._wrap(sequential, "foof_matrices", "statistics")
        self._wrap(batched, "factorize_stacked", "factorisations")
        self._wrap(foof, "factorize", "factorisations")
        self._wrap(foof, "operators", "factorisations")  # the inverse (--foof-apply inverse) is formed there
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)


PHASES = ("local_training", "statistics", "factorisations", "server")


class PhasePeaks:
    """Peak device memory (bytes) of each phase of a run: ``local_training`` (an engine's round, the sequential
    engine's client rounds, outside the two FOOF phases inside them), ``statistics`` (``foof_for``,
    ``foof_matrices``), ``factorisations`` (``factorize_stacked``, ``factorize``, ``operators``) and ``server``
    (the method's ``server_update``: screening, decoding, mixing).  A phase inside another is the inner one's.

    On CUDA from the allocator's peak, reset on entering and on leaving each phase (the peak of the part before is
    credited to the phase it belonged to); the history's per-round ``peak_memory_mb`` stays the round's whole peak
    (``simulation._peak_memory_mb`` answers the larger of the allocator's and the parts' peaks).  Elsewhere every
    phase is None: the host's peak RSS cannot be reset per phase.  ``reset()`` and ``peak()`` replace CUDA's
    (tests).  ``plans``: the vectorized engine's memory plan and statistics chunk after each of its rounds."""

    def __init__(self, device, server_cls, reset=None, peak=None):
        self.device, self.server_cls = device, server_cls
        import torch

        self.on = str(device).startswith("cuda") or peak is not None
        self.reset = reset or (lambda: torch.cuda.reset_peak_memory_stats(device))
        self.peak = peak or (lambda: torch.cuda.max_memory_allocated(device))
        self.bytes = dict.fromkeys(PHASES, 0 if self.on else None)
        self.stack, self.saved, self.plans, self.round_peak = [], [], [], 0

    def _close(self):
        """End the current part: its peak to the innermost open phase (and the round's), then a fresh count."""
        p = self.peak()
        self.round_peak = max(self.round_peak, p)
        if self.stack:
            self.bytes[self.stack[-1]] = max(self.bytes[self.stack[-1]], p)
        self.reset()

    def _wrap(self, owner, name, phase):
        fn = getattr(owner, name)
        # an inherited method is wrapped on the class itself and removed from it again on leaving
        self.saved.append((owner, name, fn if name in vars(owner) else None))

        def measured(*a, **kw):
            if self.on:
                self._close()
            self.stack.append(phase)
            try:
                return fn(*a, **kw)
            finally:
                if self.on:
                    self._close()
                self.stack.pop()
                if name == "round" and not self.stack:  # the engine (a) after its round: what it planned
                    plan = getattr(a[0], "last_plan", None)
                    if plan is not None:
                        self.plans.append({**plan, "stats_chunk": a[0].last_stats_chunk, "chunk": a[0].last_chunk})

        setattr(owner, name, measured)

    def __enter__(self):
        from fedpm_dnn import foof
        from fedpm_dnn.engine import sequential, simulation, training_task, vectorized
        from fedpm_dnn.foof import batched

        self._wrap(vectorized.VectorizedEngine, "round", "local_training")
        self._wrap(training_task, "client_round", "local_training")
        self._wrap(vectorized.VectorizedEngine, "foof_for", "statistics")
        self._wrap(sequential, "foof_matrices", "statistics")
        self._wrap(batched, "factorize_stacked", "factorisations")
        self._wrap(foof, "factorize", "factorisations")
        self._wrap(foof, "operators", "factorisations")
        self._wrap(self.server_cls, "server_update", "server")
        if self.on:  # the round's peak: the largest of its parts' and of the allocator's since the last part
            real_peak, real_reset = simulation._peak_memory_mb, simulation._reset_peak_memory
            self.saved += [(simulation, "_peak_memory_mb", real_peak), (simulation, "_reset_peak_memory", real_reset)]

            def round_peak_mb(device):
                return max(real_peak(device), self.round_peak / 2**20)

            def reset_round(device):
                real_reset(device)
                self.round_peak = 0

            simulation._peak_memory_mb, simulation._reset_peak_memory = round_peak_mb, reset_round
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self.saved):
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)

    def mb(self) -> dict:
        return {k: None if v is None else v / 2**20 for k, v in self.bytes.items()}


def _rounds(run: BenchRun):
    """Per round (rounds after the first) its parts {seconds, statistics, factorisations, server}, peak MB, chunk
    used, and the run's memory: peak MB per phase (``PhasePeaks``) and the vectorized engine's last memory plan.
    ``server`` is the round's time outside the clients (screening, decoding, mixing)."""
    from fedpm_dnn.engine.simulation import run_experiment

    exp = _experiment(run)
    marks = []
    with FoofTimer(run.device) as timer, PhasePeaks(run.device, type(exp.cfg)) as peaks:

        def on_round(row, history):
            marks.append(dict(timer.seconds))

        hist = run_experiment(exp, on_round=on_round)
    parts = []
    for i, r in enumerate(hist):
        before = marks[i - 1] if i else {k: 0.0 for k in marks[i]}
        parts.append(
            {
                "seconds": r["client_seconds"] + r["server_seconds"],
                "server": r["server_seconds"],
                **{k: marks[i][k] - before[k] for k in marks[i]},
            }
        )
    keep = slice(1, None) if len(hist) > 1 else slice(None)
    memory = {"peak_memory_mb_by_phase": peaks.mb(), "memory_plan": memory_plan(peaks.plans)}
    return parts[keep], max(r["peak_memory_mb"] for r in hist), exp.meta.get("client_chunk"), memory


def memory_plan(plans: list) -> dict | None:
    """The vectorized engine's last round's plan in the JSON's words (None for the sequential engine): the training
    chunk it chose, the fewest clients a statistics pass took, the model's bytes per client of each phase, and the
    free bytes it sized them from (cached allocator memory counted; fedpm_dnn.engine.vectorized.client_plan)."""
    if not plans:
        return None
    p = plans[-1]
    return {
        "client_chunk": p["chunk"],
        "stats_client_chunk": p["stats_chunk"],
        "predicted_train_bytes_per_client": p["train_bytes_per_client"],
        "predicted_stats_bytes_per_client": p["stats_bytes_per_client"],
        "free_bytes": p["free_bytes"],
    }


STEP_RANGE = "fedpm::static_step"  # the profiler range around the static step function (_profiled_run)


def _profiled_run(run: BenchRun, epochs: int) -> dict:
    """A two-round run of ``run`` on the vectorized engine with ``epochs`` local epochs, its second round under
    torch.profiler: {wall: round 1's client seconds (unprofiled), ops: top-level operators, kernels: CUDA kernel
    launches, host_ms: the operators' own CPU time (ms), in_step_ops: the top-level operators issued inside the
    static step function (``step_graph.FullStep``, run eagerly: those a CUDA graph replays as one launch)} -- the
    last four of round 2 -- and replays: the step's CUDA graph replays in both rounds."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from fedpm_dnn.engine import step_graph as sg
    from fedpm_dnn.engine.simulation import run_experiment

    clients, per_client, _, _ = run.size
    device = run.device
    exp = _experiment(run.but(size=(clients, per_client, epochs, 2), engine="vectorized", chunk=None))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(device).startswith("cuda") else [])
    prof = profile(activities=acts)

    def on_round(row, history):
        if row["round"] == 1:
            _sync(device)
            prof.__enter__()

    call, release, replays = sg.FullStep.__call__, sg.Runner.release, []

    def marked(step):  # the step function's operators under one range, so that they can be told apart
        with record_function(STEP_RANGE):
            return call(step)

    def counted(runner):  # the graph replays of each chunk and round (0 where nothing was captured)
        replays.append(runner.replays)
        release(runner)

    sg.FullStep.__call__, sg.Runner.release = marked, counted
    try:
        hist = run_experiment(exp, on_round=on_round)
        _sync(device)
    finally:
        prof.__exit__(None, None, None)
        sg.FullStep.__call__, sg.Runner.release = call, release
    events = prof.events()
    top = [
        e
        for e in events
        if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]
    launch = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")

    def in_step(e):
        while e is not None:
            if e.name == STEP_RANGE:
                return True
            e = e.cpu_parent
        return False

    del torch
    return {
        "wall": hist[0]["client_seconds"],
        "ops": len(top),
        "in_step_ops": sum(1 for e in top if in_step(e)),
        "replays": sum(replays),
        # the shares of the local steps the graph replayed, and the static step function ran (graphed or eagerly)
        "graphed_share": exp.meta.get("executed", {}).get("graphed_share", 0.0),
        "static_step_share": exp.meta.get("executed", {}).get("static_step_share", 0.0),
        "kernels": sum(1 for e in events if e.name in launch),
        "host_ms": sum(e.self_cpu_time_total for e in events if e.name.startswith("aten::")) / 1000,
    }


STEP_FORMS = {"loop": "off", "static": "on"}  # the proxies' two forms of the local step: --step-graph off / on


def launch_proxies(run: BenchRun, methods=("fedavg", "fedpm")) -> dict:
    """What a CPU can measure of a round's overhead, per method on the vectorized engine: runs with one and with two
    local epochs (``_profiled_run``), whose differences are one epoch's local steps (the per-round costs --
    statistics, factorisations, server, evaluation -- cancel): operators (and CUDA kernel launches) per local
    step, the operators' own host ms per local step, wall ms per local step (on a CPU the host does the work too),
    and operators per round at ``size``'s local epochs.  Each for both forms of the step (``step_forms``: 'loop',
    the eager loop, --step-graph off; 'static', the static-buffer step, --step-graph on: eager on a CPU, one graph
    replay on CUDA); the plain keys are those of the form ``run.step_graph`` resolves to on ``run.device``.  The
    synthetic data of seed 0, as the proxies have always been measured."""
    from fedpm_dnn.algorithms import make_method
    from fedpm_dnn.engine import step_graph as sg

    clients, per_client, epochs, _ = run.size
    from fedpm_dnn.engine.sequential import epoch_batches

    steps = epoch_batches(per_client, make_method("fedavg").batch_size, run.last_batch)  # the engine's steps an epoch
    plain = "static" if sg.resolve(run.step_graph, run.device) else "loop"
    out = {}
    for method in methods:
        forms = {}
        for form, flag in STEP_FORMS.items():
            form_run = run.but(method=method, step_graph=flag, seed=0)
            one, two = (_profiled_run(form_run, e) for e in (1, 2))
            per_step = {k: (two[k] - one[k]) / steps for k in ("ops", "kernels", "host_ms", "in_step_ops", "replays")}
            forms[form] = {
                "operators_per_local_step": per_step["ops"],
                # what the host issues a full step once the static function is one graph replay: the operators
                # outside it, and the replay (on a CPU, where it runs eagerly, the count a GPU's graph would leave)
                "operators_per_local_step_graphed": per_step["ops"] - per_step["in_step_ops"] + 1
                if form == "static"
                else per_step["ops"],
                "kernel_launches_per_local_step": per_step["kernels"] if str(run.device).startswith("cuda") else None,
                "host_operator_ms_per_local_step": per_step["host_ms"],
                "wall_ms_per_local_step": 1000 * (two["wall"] - one["wall"]) / steps,
                "operators_per_round": one["ops"] + (epochs - 1) * (two["ops"] - one["ops"]),
                # ~1 where the static step ran as a graph (CUDA), 0 where it ran eagerly (a CPU, a failed capture)
                "graph_replays_per_local_step": per_step["replays"] / 2,  # both rounds of each run
                "graphed_share": two["graphed_share"],
                "static_step_share": two["static_step_share"],
            }
        out[method] = {"local_steps_per_epoch": steps, "step_form": plain, **forms[plain], "step_forms": forms}
    return out


PAPER_CLIENTS = 10


def paper_round_seconds(parts: dict, clients: int, per_client: int, epochs: int) -> float:
    """A FedPM round of the paper's setting (10 clients, 5,000 images each, 5 local epochs) from the parts of a
    measured round at ``clients`` x ``per_client`` images x ``epochs``: local training (the round less the FOOF
    statistics, the factorisations and the server) scales with the images times the epochs, the statistics pass
    with the images (it reads each image once), the factorisations and the server's work with the clients
    (their sizes are the model's, not the data's).  At the paper's own size it is the measured round."""
    train = parts["seconds"] - parts["statistics"] - parts["factorisations"] - parts["server"]
    return (
        train * PAPER_IMAGES * PAPER_EPOCHS / (clients * per_client * epochs)
        + parts["statistics"] * PAPER_IMAGES / (clients * per_client)
        + (parts["factorisations"] + parts["server"]) * PAPER_CLIENTS / clients
    )


ENGINES = ("sequential", "vectorized")
PRECISIONS = ("fp32", "split-tf32", "tf32", "bf16")  # fedpm_dnn.foof.precision.MODES (not imported: --help stays fast)


def cost_model(model: str, size, apply: str, mode: str, device: str = "cpu") -> dict:
    """fedpm_dnn.foof.cost's totals for FedPM at the measured size and at the paper's (10 x 5,000 x 5 epochs), with
    the statistics Gram in the forms ``device`` takes (``gram_form``: 'half' on CUDA, 'full' elsewhere)."""
    from fedpm_dnn.foof.cost import paper_cost

    clients, per_client, epochs, _ = size
    form = "half" if device.startswith("cuda") else "full"
    kw = {"gram_form": form}
    return {
        "gram_form": form,
        "measured_size": paper_cost(model, apply, mode, clients=clients, per_client=per_client, epochs=epochs, **kw)[
            "total"
        ],
        "paper_size": paper_cost(model, apply, mode, **kw)["total"],
    }


METHODS = ("fedavg", "fedpm")  # timed by default: the paper's ratio is FedPM's round over FedAvg's


def variants(methods, applies) -> list:
    """(label, method, foof_apply) of every timed configuration: a FOOF method once per apply (the first apply's
    label is the method's name, the others' method-apply), any other method once."""
    from fedpm_dnn.algorithms import method_class

    return [
        (m if a == applies[0] else f"{m}-{a}", m, a)
        for m in methods
        for a in (applies if method_class(m).uses_foof else applies[:1])
    ]


def measure(
    run: BenchRun,
    repeats=None,
    engines=ENGINES,
    quiet=True,
    applies=("solve", "inverse"),
    methods=METHODS,
):
    """The benchmark's numbers for the model of ``run``; an engine left out of ``engines`` gets null numbers (a GPU
    run short of time measures the vectorized engine's FedPM/FedAvg over more rounds instead).  Each of ``methods``
    runs on each engine, a FOOF method with each of ``applies`` (its first gives the plain keys) in
    ``run.foof_precision``.  Keys named after FedAvg or FedPM are left out when that method is not among
    ``methods``."""
    model, device, size = run.model, run.device, run.size
    if repeats is None:  # ResNet rounds on a CPU take minutes: one repeat there
        repeats = 1 if (model == "resnet18gn" and not device.startswith("cuda")) else 2
    clients, per_client, epochs, _ = size
    runs = variants(methods, applies)
    times = {(e, label): [] for e in engines for label, _, _ in runs}
    fedpm_parts = {e: [] for e in engines}
    foof_share, peak, used, memory = [], {}, {}, []
    reported = "vectorized" if "vectorized" in engines else "sequential"  # FOOF share and peak memory of its runs
    bar = Progress(repeats * len(engines) * len(runs), model, enabled=not quiet, unit="run")
    for _ in range(repeats):  # alternate engines and methods so machine drift hits all alike
        for engine in engines:
            for label, method, apply in runs:
                parts, mb, ch, mem = _rounds(run.but(method=method, engine=engine, foof_apply=apply))
                memory.append({"engine": engine, "method": label, "peak_memory_mb": mb, **mem})
                bar.update(1, f"{engine} {label}")
                times[(engine, label)] += [p["seconds"] for p in parts]
                if label == "fedpm":
                    fedpm_parts[engine] += parts
                if engine == reported:
                    if label == "fedpm":
                        foof_share += [(p["statistics"] + p["factorisations"]) / p["seconds"] for p in parts]
                    peak[label] = max(peak.get(label, 0.0), mb)
                    used[label] = ch if engine == "vectorized" else None
    med = {k: float(np.median(v)) for k, v in times.items()}
    med.update({(e, label): None for e in ENGINES if e not in engines for label, _, _ in runs})

    images = clients * per_client * epochs
    # each part's median over the FedPM rounds (reported; the projection projects every round, then takes the median)
    part_med = {e: {k: float(np.median([p[k] for p in ps])) for k in ps[0]} for e, ps in fedpm_parts.items() if ps}

    def ratio(a, b):
        return None if a is None or b is None else a / b

    def by_apply(engine):  # FedPM / FedAvg with each apply, side by side
        return {a: ratio(med[(engine, label)], med[(engine, "fedavg")]) for label, m, a in runs if m == "fedpm"}

    def projected(engine):  # 100 rounds of the paper's setting, FedPM: each measured round projected, then the median
        if engine not in part_med:
            return None
        rounds = [paper_round_seconds(p, clients, per_client, epochs) for p in fedpm_parts[engine]]
        return PAPER_ROUNDS * float(np.median(rounds)) / 60

    out = {
        "model": model,
        "dataset_size_of": "cifar10" if model == "cnn" else "cifar100",
        "clients": clients,
        "samples_per_client": per_client,
        "local_epochs": epochs,
        # the vectorized engine's clients per chunk (of FedPM's runs where timed: it sizes the chunk by memory)
        "client_chunk": used.get("fedpm", next(iter(used.values()))),
        "engines": list(engines),
        "methods": list(methods),
        "timed_rounds_per_method": repeats * max(size[3] - 1, 1),
        "round_seconds_by_method": {e: {label: med[(e, label)] for label, _, _ in runs} for e in ENGINES},
        "peak_memory_mb_by_method": peak,
        # per measured run: peak MB per phase (CUDA; null elsewhere) and the vectorized engine's memory plan
        "memory_by_run": memory,
        "paper_ratio": PAPER[model],
        "plain_apply": applies[0],  # the apply of the plain FedPM keys
        "foof_precision": run.foof_precision,
        "step_graph": step_graph_used(run.step_graph, device) if "vectorized" in engines else None,
        "foof_cost_model": cost_model(model, size, applies[0], run.foof_precision, device),
    }
    if "fedavg" in methods:
        out.update(
            {
                "images_per_second_sequential": ratio(images, med[("sequential", "fedavg")]),
                "images_per_second_vectorized": ratio(images, med[("vectorized", "fedavg")]),
                "vectorized_speedup": ratio(med[("sequential", "fedavg")], med[("vectorized", "fedavg")]),
                "fedavg_round_seconds_sequential": med[("sequential", "fedavg")],
                "fedavg_round_seconds_vectorized": med[("vectorized", "fedavg")],
            }
        )
    if "fedpm" in methods:
        out.update(
            {
                "fedpm_round_seconds_sequential": med[("sequential", "fedpm")],
                "fedpm_round_seconds_vectorized": med[("vectorized", "fedpm")],
                "fedpm_round_seconds_vectorized_by_apply": {
                    a: med[("vectorized", label)] for label, m, a in runs if m == "fedpm"
                },
                "foof_seconds_share": float(np.median(foof_share)),
                "peak_memory_mb": peak["fedpm"],
                "projected_100_round_minutes": projected("vectorized"),
                "projected_100_round_minutes_sequential": projected("sequential"),
                "fedpm_round_parts_seconds": {e: part_med.get(e) for e in ENGINES},
                # the earlier rule: the whole round scaled by images x epochs
                "projected_100_round_minutes_per_image": {
                    e: PAPER_ROUNDS * part_med[e]["seconds"] * PAPER_IMAGES * PAPER_EPOCHS / images / 60
                    if e in part_med
                    else None
                    for e in ENGINES
                },
            }
        )
    if "fedavg" in methods and "fedpm" in methods:
        out.update(
            {
                "fedpm_over_fedavg": ratio(med[("vectorized", "fedpm")], med[("vectorized", "fedavg")]),
                "fedpm_over_fedavg_sequential": ratio(med[("sequential", "fedpm")], med[("sequential", "fedavg")]),
                "fedpm_over_fedavg_by_apply": by_apply("vectorized"),
                "fedpm_over_fedavg_sequential_by_apply": by_apply("sequential"),
            }
        )
    return out


def step_graph_used(mode: str, device) -> str:
    """--step-graph as the vectorized engine uses it on ``device``: 'on' or 'off'."""
    from fedpm_dnn.engine import step_graph

    return "on" if step_graph.resolve(mode, device) else "off"


def _stack_round_seconds(run: BenchRun, runs: int) -> list:
    """Seconds per round (after the first) of ``runs`` runs of ``run`` (seeds 0..runs-1) trained as one stack on the
    vectorized engine: the time between the ends of consecutive rounds (the last run's end)."""
    from fedpm_dnn.engine.stacked_runs import run_stack

    exps = [_experiment(run.but(engine="vectorized", seed=s)) for s in range(runs)]
    ends = {}

    def on_round(row, history):
        _sync(run.device)
        ends[row["round"]] = time.perf_counter()  # each run's end of the round; the last one stays

    out = run_stack(exps, [None] * runs, [False] * runs, [on_round] * runs)
    for o in out:
        if isinstance(o, BaseException):
            raise o
    marks = [ends[t] for t in sorted(ends)]
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def measure_stack(run: BenchRun, runs: int, repeats: int) -> dict:
    """One run of ``run`` alone and ``runs`` of them stacked, alternated ``repeats`` times in this process
    (medians)."""
    single, stacked = [], []
    for _ in range(repeats):
        single += _stack_round_seconds(run, 1)
        stacked += _stack_round_seconds(run, runs)
    one, many = float(np.median(single)), float(np.median(stacked))
    return {
        "stack_method": run.method,
        "stack_foof_apply": run.foof_apply,
        "runs_stacked": runs,
        "seconds_per_round_single": one,
        "seconds_per_round_stacked": many,
        "stack_speedup": runs * one / many,
    }


def parse_args(argv=None):
    """The flags, checked; ``args.models``, ``engines``, ``applies``, ``methods`` and ``sizes`` parsed."""
    from fedpm_dnn.method_names import METHOD_NAMES as REGISTERED
    from validation.common import (
        OneLineParser,
        add_client_chunk_arg,
        add_device_arg,
        add_last_batch_arg,
        add_quiet_arg,
        add_seed_arg,
        add_step_graph_arg,
        add_threads_arg,
        positive_int,
    )

    p = OneLineParser(prog="python -m validation.bench_dnn", doc=__doc__)
    p.add_argument("--models", default="cnn,resnet18gn", help=f"comma-separated, from {', '.join(CLASSES)}")
    p.add_argument(
        "--method",
        "--methods",
        dest="methods",
        default=",".join(METHODS),
        help=f"comma-separated methods to time, from {', '.join(REGISTERED)} (FedPM/FedAvg needs both)",
    )
    add_device_arg(p)
    add_threads_arg(p)
    add_client_chunk_arg(p)
    p.add_argument(
        "--sizes",
        default=None,
        help="clients,samples_per_client,local_epochs,rounds for every model (default: per model and device)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=None, help="runs per engine and method (default: 2; ResNet on CPU 1)"
    )
    p.add_argument(
        "--engine",
        dest="engines",
        default=None,
        help="comma-separated engines to measure (default: both; the other's numbers are null)",
    )
    p.add_argument(
        "--engines", dest="engines_old", default=None, help="the earlier spelling of --engine (default: none)"
    )
    p.add_argument(
        "--foof-apply",
        dest="applies",
        default=None,
        help="FedPM's --foof-apply values to measure side by side; the first one's numbers are the plain keys "
        "(default: solve,inverse)",
    )
    p.add_argument(
        "--foof-applies", dest="applies_old", default=None, help="the earlier spelling of --foof-apply (default: none)"
    )
    p.add_argument(
        "--foof-precision",
        choices=("auto", *PRECISIONS),
        default="auto",
        help="FedPM's --foof-precision (fedpm_dnn.foof.precision; auto: per model, fedpm_dnn.foof.cost.auto_mode) "
        "(default: auto)",
    )
    add_step_graph_arg(p)
    add_last_batch_arg(p, default="keep")
    p.add_argument(
        "--stack", type=positive_int, default=None, help="also time S runs stacked against one alone (default: off)"
    )
    p.add_argument(
        "--stack-method", default=None, help="the method of the --stack runs; needs --stack (default: fedpm)"
    )
    p.add_argument(
        "--proxies",
        action="store_true",
        help="also measure what a CPU can: host ms per local step and operator launches per step and round "
        "(torch.profiler), for FedAvg and FedPM on the vectorized engine",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_seed_arg(p)
    add_quiet_arg(p)
    args = p.parse_args(argv)

    def listed(flag, what, value, allowed):
        """The comma-separated names of ``value``, each one of ``allowed``, or one error line."""
        names = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [v for v in names if v not in allowed]
        if unknown or not names:
            p.error(
                f"{flag}: unknown {what}(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(allowed)}"
            )
        return names

    args.models = listed("--models", "model", args.models, CLASSES)
    old = []  # earlier spellings used: one warning after the checks (an error stays one line)
    for new_flag, dest, old_flag, default in (
        ("--engine", "engines", "--engines", ",".join(ENGINES)),
        ("--foof-apply", "applies", "--foof-applies", "solve,inverse"),
    ):
        earlier = getattr(args, dest + "_old")
        if earlier is not None and getattr(args, dest) is not None:
            p.error(f"{old_flag} is the earlier spelling of {new_flag}: give one of them")
        if earlier is not None:
            old.append((old_flag, new_flag))
        setattr(args, dest, earlier if earlier is not None else (getattr(args, dest) or default))
    engine_flag = "--engines" if ("--engines", "--engine") in old else "--engine"
    apply_flag = "--foof-applies" if ("--foof-applies", "--foof-apply") in old else "--foof-apply"
    chosen = listed(engine_flag, "engine", args.engines, ENGINES)
    args.applies = list(dict.fromkeys(listed(apply_flag, "apply", args.applies, ("solve", "inverse"))))
    args.methods = list(dict.fromkeys(listed("--method", "method", args.methods, REGISTERED)))  # once each
    if args.stack_method is not None and args.stack is None:
        p.error("--stack-method applies to the runs of --stack S; give --stack too")
    args.stack_method = args.stack_method or "fedpm"
    listed("--stack-method", "method", args.stack_method, REGISTERED)
    args.engines = tuple(e for e in ENGINES if e in chosen)  # sequential first, as the alternation runs them
    if args.client_chunk is not None and "vectorized" not in args.engines:
        p.error(f"--client-chunk applies to the vectorized engine, not to {engine_flag} sequential")
    if args.step_graph != "auto" and "vectorized" not in args.engines:
        p.error(f"--step-graph {args.step_graph} applies to the vectorized engine, not to {engine_flag} sequential")
    if args.stack is not None and "vectorized" not in args.engines:
        p.error(f"--stack times runs stacked on the vectorized engine, not on {engine_flag} sequential")
    try:
        sizes = tuple(int(v) for v in args.sizes.split(",")) if args.sizes else None
    except ValueError:
        sizes = ()
    if sizes is not None and (len(sizes) != 4 or min(sizes) < 1):
        p.error("--sizes takes four positive integers: clients,samples_per_client,local_epochs,rounds")
    if args.stack is not None and sizes is not None and sizes[3] < 2:
        p.error(f"--stack times the rounds after the first: --sizes {args.sizes} gives 1 round, give at least 2")
    if sizes is not None:  # the synthetic images alone (uint8, 3 x 32 x 32), before any training copy
        from validation.common import memory_bytes

        need, have = sizes[0] * sizes[1] * 3 * 32 * 32, memory_bytes()
        if need > have // 2:
            p.error(
                f"--sizes {args.sizes}: {sizes[0]} clients x {sizes[1]} images need {need / 2**30:.3g} GiB, "
                f"more than half of this machine's {have / 2**30:.3g} GiB"
            )
    for flag, v in (
        ("--threads", args.threads),
        ("--client-chunk", args.client_chunk),
        ("--repeats", args.repeats),
        ("--stack", args.stack),
    ):
        if v is not None and v < 1:
            p.error(f"{flag} must be a positive integer, got {v}")
    try:
        import torch
    except ImportError:
        from fedconvex.extras import install_hint

        p.error(install_hint("torch", "dnn"))
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch")
    args.sizes = sizes
    for old_flag, new_flag in old:
        print(f"{p.prog}: warning: {old_flag} is spelled {new_flag} now (a comma list, as before)", file=sys.stderr)
    return args


def finite(v):
    """``v`` with every non-finite float as None (JSON has no NaN; a measurement that could not be made is null)."""
    if isinstance(v, float) and not np.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    models, engines, sizes = args.models, args.engines, args.sizes
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    device = (
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    from fedpm_dnn.foof import precision
    from fedpm_dnn.foof.cost import auto_mode

    # per model: auto is the rule validation.dnn applies (split-tf32 on CUDA only where it pays for the model)
    modes = {m: auto_mode(device, m) if args.foof_precision == "auto" else args.foof_precision for m in models}
    # each model's configuration, every measuring function's parameters (the engine, method and apply vary)
    runs = {
        m: BenchRun(
            model=m,
            device=device,
            size=sizes or SIZES[(m, "cuda" if device.startswith("cuda") else "cpu")],
            chunk=args.client_chunk,
            seed=args.seed,
            foof_apply=args.applies[0],
            foof_precision=modes[m],
            step_graph=args.step_graph,
            last_batch=args.last_batch,
        )
        for m in models
    }
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    out = {
        "command": "python -m validation.bench_dnn " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": device,
        "device_name": name,
        "torch_threads": torch.get_num_threads(),
        "last_batch": args.last_batch,
        "foof_precision": modes,
        "torch": torch.__version__,
        "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        # every method of a model's comparison with FedPM's convolutions (TF32 unless its mode is fp32)
        "cudnn_allow_tf32": {m: modes[m] != "fp32" for m in models},
        "results": [],
    }
    for m in models:
        with precision.convolutions(modes[m] != "fp32"):
            out["results"].append(measure(runs[m], args.repeats, engines, args.quiet, args.applies, args.methods))
    for r, m in zip(out["results"], models, strict=True):
        with precision.convolutions(modes[m] != "fp32"):
            if args.stack:
                reps = args.repeats or (1 if (m == "resnet18gn" and device == "cpu") else 2)
                r.update(measure_stack(runs[m].but(method=args.stack_method), args.stack, reps))
            if args.proxies:
                r["proxies"] = launch_proxies(runs[m])
    cnn = next((r for r in out["results"] if r["model"] == "cnn"), None)
    if cnn:  # the headline keys: SimpleCNN, CIFAR-10 setting
        out.update(
            {
                k: cnn[k]
                for k in (
                    "images_per_second_sequential",
                    "images_per_second_vectorized",
                    "fedpm_over_fedavg",
                    "foof_seconds_share",
                    "peak_memory_mb",
                    "projected_100_round_minutes",
                    "fedpm_over_fedavg_by_apply",
                    *(
                        ("runs_stacked", "seconds_per_round_single", "seconds_per_round_stacked", "stack_speedup")
                        if args.stack
                        else ()
                    ),
                )
                if k in cnn  # a key of a method that was not timed stays absent
            }
        )
    if args.json:
        print(json.dumps(finite(out), allow_nan=False))
        return 0

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"device: {name}, torch threads pinned to {out['torch_threads']}")
    for r in out["results"]:
        said = []  # each clause only where its methods were timed
        if "images_per_second_sequential" in r:
            said.append(
                f"local training sequential {f(r['images_per_second_sequential'], '.0f')} img/s, vectorized "
                f"{f(r['images_per_second_vectorized'], '.0f')} img/s ({f(r['vectorized_speedup'], '.2f')}x)"
            )
        if "fedpm_over_fedavg" in r:
            said.append(
                f"FedPM/FedAvg vectorized {f(r['fedpm_over_fedavg'], '.2f')}x, sequential "
                f"{f(r['fedpm_over_fedavg_sequential'], '.2f')}x (paper {r['paper_ratio']:.2f}x)"
            )
        if "foof_seconds_share" in r:
            said.append(
                f"FOOF share {r['foof_seconds_share']:.0%}; peak {r['peak_memory_mb']:.0f} MB; projected 100-round "
                f"{r['dataset_size_of']} run {f(r['projected_100_round_minutes'], '.0f')} min vectorized, "
                f"{f(r['projected_100_round_minutes_sequential'], '.0f')} min sequential"
            )
        print(
            f"{r['model']:<11} {r['clients']} clients x {r['samples_per_client']} images x {r['local_epochs']} epochs "
            f"(client chunk {r['client_chunk']}): " + "; ".join(said)
        )
        if "fedpm_over_fedavg_by_apply" in r:
            print(
                "  FedPM/FedAvg vectorized by --foof-apply: "
                + ", ".join(f"{a} {f(v, '.2f')}x" for a, v in r["fedpm_over_fedavg_by_apply"].items())
            )
        for e in r["engines"]:
            times = r["round_seconds_by_method"][e]
            print(f"  round seconds, {e}: " + ", ".join(f"{label} {v:.3f}" for label, v in times.items()))
        print(
            f"  peak MB, {r['engines'][-1]}: "
            + ", ".join(f"{label} {v:.0f}" for label, v in r["peak_memory_mb_by_method"].items())
        )
        if "runs_stacked" in r:
            print(
                f"  {r['runs_stacked']} {r['stack_method']} runs stacked: "
                f"{r['seconds_per_round_stacked']:.2f} s a round "
                f"against {r['seconds_per_round_single']:.2f} s alone (stack speed-up {r['stack_speedup']:.2f}x)"
            )
        for e, pm in r.get("fedpm_round_parts_seconds", {}).items():
            if pm is not None:
                print(
                    f"  FedPM round, {e}: {pm['seconds']:.2f} s = FOOF statistics {pm['statistics']:.2f} + "
                    f"factorisations {pm['factorisations']:.2f} + server {pm['server']:.2f} + local training "
                    f"(the rest; medians of each part)"
                )
    print("reproduce: python -m validation.bench_dnn " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    from validation.common import run_command

    sys.exit(run_command("python -m validation.bench_dnn", main))
