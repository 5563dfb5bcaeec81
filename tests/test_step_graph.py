"""The vectorized engine's full local step as one function of static buffers (fedpm_dnn.engine.step_graph): run
eagerly on the CPU -- the function a CUDA graph captures, with the buffers it replays on -- it gives the eager loop's
models bit for bit; on CUDA the graph replays give the eager step's."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedpm_dnn.algorithms import applicable, make_method  # noqa: E402
from fedpm_dnn.engine import step_graph  # noqa: E402
from fedpm_dnn.engine.sequential import ClientData  # noqa: E402
from fedpm_dnn.engine.simulation import Experiment, run_experiment  # noqa: E402
from fedpm_dnn.engine.training_task import DnnTask  # noqa: E402

# unequal clients: 7 is smaller than one batch of 16 and finishes first, so every round has full steps (all four
# clients) and then partial ones (the eager loop's); 23 ends in a partial batch (a mask inside the full steps)
SIZES = (40, 23, 7, 30)
CFG = dict(lr=0.05, local_epochs=2, batch_size=16, mu=0.01, clip=1.0, damping=0.5)


def make(name, **kw):
    return make_method(name, **applicable(name, kw))


def experiment(cfg, step_graph_mode, sizes=SIZES, device="cpu", rounds=2, chunk=None):
    g = np.random.default_rng(0)
    clients = [
        ClientData(
            torch.as_tensor(g.integers(0, 256, (n, 3, 16, 16)).astype(np.uint8)).to(device),
            torch.as_tensor(g.integers(0, 3, n)).to(device),
            (0.4, 0.5, 0.45),
            (0.25, 0.3, 0.2),
            augment=i != 1,  # one client un-augmented: its crops are the identity
        )
        for i, n in enumerate(sizes)
    ]
    xt = torch.as_tensor(g.integers(0, 256, (30, 3, 16, 16)).astype(np.uint8)).to(device)
    return Experiment(
        cfg=cfg,
        model="cnn",
        num_classes=3,
        clients=clients,
        x_test=xt,
        y_test=torch.as_tensor(g.integers(0, 3, 30)).to(device),
        mean=(0.4, 0.5, 0.45),
        std=(0.25, 0.3, 0.2),
        rounds=rounds,
        seed=3,
        image_size=16,
        engine="vectorized",
        client_chunk=chunk,
        device=device,
        step_graph=step_graph_mode,
    )


def train(cfg, mode, **kw):
    """(history, every reply, the full steps and replays of the last chunk)."""
    replies, engines = {}, []

    def tamper(t, i, reply):
        replies[(t, i)] = reply
        return reply

    exp = experiment(cfg, mode, **kw)
    original = DnnTask.train

    def spy(task, *a):
        out = original(task, *a)
        engines.append(task.engine_state)
        return out

    DnnTask.train = spy
    try:
        hist = run_experiment(exp, tamper=tamper)
    finally:
        DnnTask.train = original
    return hist, replies, engines[-1].last_step_graph


def strip(history):
    return [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in history]


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for key, reply in b.items():
        for part, values in reply.items():
            for name, v in values.items():
                assert torch.equal(a[key][part][name], v), (key, part, name)


VARIANTS = {  # (method, settings, rounds)
    "fedavg": ("fedavg", {}, 1),
    "scaffold": ("scaffold", {}, 2),  # the gradient hook reads per-client stacks (zero in the first round)
    "fedpm-solve": ("fedpm", dict(foof_apply="solve"), 1),
    "fedpm-inverse": ("fedpm", dict(foof_apply="inverse"), 1),
    "fedpm-gradient-clip-decoupled": (
        "fedpm",
        dict(clip_stage="gradient", weight_decay_mode="decoupled", weight_decay=0.01),
        1,
    ),
    "fedpm-refresh-subsets": ("fedpm", dict(refresh_every=1, foof_samples=20, foof_apply="inverse"), 1),
    "localnewton-no-clip": ("localnewton", dict(clip=None, weight_decay=0.01), 1),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_static_step_gives_the_eager_loops_models_bit_for_bit(variant):
    """--step-graph on, eagerly on the CPU: the same replies (parameters, FOOF matrices, SCAFFOLD's control) and
    losses as the loop, exactly; the full steps went through the static function and the partial ones did not."""
    name, extra, rounds = VARIANTS[variant]
    cfg = make(name, **{**CFG, **extra})
    h_loop, r_loop, none = train(cfg, "off", rounds=rounds)
    h_static, r_static, seen = train(cfg, "on", rounds=rounds)
    # 7 images, batch 16, 2 epochs: 2 full steps, run eagerly (no graph on the CPU)
    assert none is None and seen == {"full_steps": 2, "replays": 0, "used": "eager"}
    assert_identical(r_static, r_loop)
    assert strip(h_static) == strip(h_loop)


def test_every_step_full_and_chunks():
    """Equal clients in chunks of two: every step is a full one, the refresh between them reads the parameters the
    static step updated in place and writes the factors it reads."""
    cfg = make("fedpm", **CFG, refresh_every=3, foof_apply="inverse")
    kw = dict(sizes=(32, 32, 32), chunk=2, rounds=1)
    _, r_loop, _ = train(cfg, "off", **kw)
    _, r_static, seen = train(cfg, "on", **kw)
    assert seen["full_steps"] == 4
    assert_identical(r_static, r_loop)


def test_auto_is_the_loop_on_a_cpu_and_the_static_step_on_cuda():
    assert step_graph.resolve("auto", "cpu") is False and step_graph.resolve("auto", "cuda") is True
    assert step_graph.resolve("on", "cpu") is True and step_graph.resolve("off", "cuda") is False
    assert not step_graph.capturable("cpu")


@pytest.fixture(scope="module")
def one_step():
    """(a FullStep over a tiny stacked FedPM chunk, built by the engine's own round; a function that puts back the
    parameters and losses it had before its first step and its index at 0)."""
    cfg = make("fedpm", **CFG)
    built = []
    original = step_graph.Runner.__init__

    def keep(self, step, capture, graph_factory=None):
        built.append((step, {n: v.clone() for n, v in step.P.items()}, step.loss_sum.clone()))
        original(self, step, capture, graph_factory)

    step_graph.Runner.__init__ = keep
    try:
        run_experiment(experiment(cfg, "on", rounds=1))
    finally:
        step_graph.Runner.__init__ = original
    step, P0, loss0 = built[0]

    def reset():
        for n, v in P0.items():
            step.P[n].copy_(v)
        step.loss_sum.copy_(loss0)
        step.t.zero_()

    return step, reset


def test_the_static_step_reads_nothing_back_to_the_host(one_step):
    """What a capture forbids: no host read (item, nonzero, a copy to the CPU) among the step's operators, and its
    inputs as they were (the schedule and data buffers), its outputs in place (parameters, losses, the index)."""
    from torch.profiler import profile

    step, reset = one_step
    reset()
    before = {n: v.clone() for n, v in step.P.items()}
    loss = step.loss_sum.clone()
    ints, x = step.ints.clone(), step.x_all.clone()
    with profile() as prof:
        step()
    names = {e.name for e in prof.events()}
    assert not names & {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"}, names
    assert int(step.t) == 1 and not torch.equal(step.loss_sum, loss)
    assert all(not torch.equal(step.P[n], before[n]) for n in before)
    assert torch.equal(step.ints, ints) and torch.equal(step.x_all, x)


def _eager_result(step, reset, steps=1):
    reset()
    for _ in range(steps):
        step()
    return {n: v.clone() for n, v in step.P.items()}, step.loss_sum.clone()


def _failing_capture(step, device):
    step()  # a failing capture may have run part of the step before it fails
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_restores_the_state_runs_the_step_eagerly_and_records_why(one_step):
    """An injected capture failure (after the step ran part-way): the state is put back, the call is the eager step
    (the same parameters and loss), the runner says so once and records it; the next runner tries again (no flag
    of the process turns capture off)."""
    step, reset = one_step
    expect, loss = _eager_result(step, reset)
    reset()
    step_graph._said.clear()
    runner = step_graph.Runner(step, capture=True, graph_factory=_failing_capture)
    runner.calls = step_graph.WARMUP  # past the warm-up: this call captures
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed .*operation not permitted"):
        runner()
    assert runner.graph is None and not runner.capture and int(step.t) == 1
    assert all(torch.equal(step.P[n], expect[n]) for n in expect) and torch.equal(step.loss_sum, loss)
    assert runner.used.startswith("eager: CUDA graph capture failed")
    tried = []
    later = step_graph.Runner(step, capture=True, graph_factory=lambda s, d: tried.append(1) or _failing_capture(s, d))
    later.calls = step_graph.WARMUP
    later()  # said once per process: no second warning, but a second try
    assert tried == [1] and later.used.startswith("eager: CUDA graph capture failed")


class _Replay:
    """A stand-in for a captured graph: ``replay`` runs the step eagerly, optionally off by ``scale`` afterwards."""

    def __init__(self, step, scale=None):
        self.step, self.scale = step, scale

    def replay(self):
        self.step()
        if self.scale is not None:
            with torch.no_grad():
                next(iter(self.step.P.values())).mul_(self.scale)


def test_a_graph_whose_first_replay_agrees_is_kept_and_replayed(one_step):
    step, reset = one_step
    expect, loss = _eager_result(step, reset, steps=2)
    reset()
    runner = step_graph.Runner(step, capture=True, graph_factory=lambda s, d: _Replay(s))
    runner.calls = step_graph.WARMUP
    runner()
    runner()
    assert runner.replays == 2 and runner.used == "graph" and int(step.t) == 2
    assert all(torch.equal(step.P[n], expect[n]) for n in expect) and torch.equal(step.loss_sum, loss)


def test_a_graph_whose_first_replay_disagrees_is_dropped_for_the_eager_step(one_step):
    """A graph that replays wrongly (injected: one tensor scaled after the step) fails its first-replay check: the
    eager step's result stands, the runner stays eager and records why."""
    step, reset = one_step
    expect, loss = _eager_result(step, reset, steps=2)
    reset()
    step_graph._said.clear()
    runner = step_graph.Runner(step, capture=True, graph_factory=lambda s, d: _Replay(s, scale=1.5))
    runner.calls = step_graph.WARMUP
    with pytest.warns(RuntimeWarning, match="first graphed step differs from the eager one"):
        runner()
    runner()
    assert runner.replays == 0 and runner.graph is None and runner.used.startswith("eager: the first graphed step")
    assert all(torch.equal(step.P[n], expect[n]) for n in expect) and torch.equal(step.loss_sum, loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("variant", ["fedavg", "fedpm-inverse", "fedpm-solve", "scaffold"])
def test_cuda_graph_replays_give_the_eager_steps_models(variant, monkeypatch):
    """On CUDA the full steps after the warm-up replay one captured graph: the same replies as the eager static
    step (graphs switched off) and the loop within float32 round-off."""
    from fedpm_dnn.foof import solve_graph

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    name, extra, _ = VARIANTS[variant]
    cfg = make(name, **{**CFG, **extra, "local_epochs": 4})
    _, r_graph, seen = train(cfg, "on", device="cuda")
    assert seen["replays"] == seen["full_steps"] - step_graph.WARMUP > 0
    monkeypatch.setenv(solve_graph.ENV, "0")
    _, r_eager, seen = train(cfg, "on", device="cuda")
    assert seen["replays"] == 0
    _, r_loop, _ = train(cfg, "off", device="cuda")
    for a in (r_eager, r_loop):
        for key, reply in a.items():
            for part, values in reply.items():
                for n, v in values.items():
                    # SCAFFOLD's dcontrol divides a difference of nearby parameters by steps * lr (test_vectorized)
                    tol = dict(rtol=1e-4, atol=1e-5) if part == "dcontrol" else dict(rtol=1e-5, atol=1e-6)
                    torch.testing.assert_close(r_graph[key][part][n], v, **tol)


def test_the_command_line_passes_the_mode_and_the_summary_records_what_the_engine_does(tmp_path):
    """validation.dnn --step-graph reaches the experiment; the summary says 'on'/'off' as the vectorized engine
    resolves it (None on the sequential engine), and the fingerprint leaves it out: the same kernels replayed or
    not, so a run resumes, and a sweep matches it, under either."""
    from fake_cifar import cifar_pickle

    from validation import dnn

    cifar_pickle(str(tmp_path / "cifar-10-batches-py"), n=20, balanced=True)
    base = ["--dataset", "cifar10", "--data-dir", str(tmp_path), "--method", "fedavg", "--device", "cpu"]
    for extra, want in (
        ([], None),
        (["--engine", "vectorized"], "off"),
        (["--engine", "vectorized", "--step-graph", "on"], "on"),
        (["--engine", "vectorized", "--step-graph", "off"], "off"),
    ):
        exp, desc = dnn.build(dnn.parse_args(base + extra))
        # the mode made concrete at the command's boundary, as the engine would resolve it on this device
        assert desc["step_graph"] == want and exp.step_graph == (want or "off")
    vec = base + ["--engine", "vectorized"]
    assert dnn.command_fingerprint(vec + ["--step-graph", "on"]) == dnn.command_fingerprint(vec)


def test_the_schedule_tensors_hold_each_step_of_each_client():
    """vectorized.schedule_tensors (one write per client) against the definition, step by step: a step's drawn rows
    first (offset into the engine's data, mask set), the rest of the batch the client's first image, masked out, no
    crop shift and no flip; a finished client's later steps all zero rows and masked out."""
    from fedpm_dnn.engine.vectorized import PAD, schedule_tensors

    g = torch.Generator().manual_seed(0)
    B, sizes, offsets = 5, (12, 3, 7), (0, 12, 15)
    steps = []
    for n in sizes:
        own = []
        for _ in range(2):  # epochs
            order = torch.randperm(n, generator=g)
            for s in range(0, n, B):
                ix = order[s : s + B]
                oy = torch.randint(0, 9, (len(ix),), generator=g)
                ox = torch.randint(0, 9, (len(ix),), generator=g)
                own.append((ix, oy, ox, torch.rand(len(ix), generator=g) < 0.5))
        steps.append(own)
    T = max(len(s) for s in steps)
    gidx, mask, oy, ox, flip = schedule_tensors(steps, list(offsets), T, B)
    assert gidx.shape == mask.shape == oy.shape == ox.shape == flip.shape == (T, 3, B)
    for j, own in enumerate(steps):
        for t in range(T):
            if t >= len(own):
                assert not mask[t, j].any() and not gidx[t, j].any() and not flip[t, j].any()
                assert (oy[t, j] == PAD).all() and (ox[t, j] == PAD).all()
                continue
            ix, a, b, f = own[t]
            m = len(ix)
            assert torch.equal(gidx[t, j, :m], ix + offsets[j]) and (gidx[t, j, m:] == offsets[j]).all()
            assert mask[t, j, :m].all() and not mask[t, j, m:].any()
            assert torch.equal(oy[t, j, :m], a) and torch.equal(ox[t, j, :m], b) and torch.equal(flip[t, j, :m], f)
            assert (oy[t, j, m:] == PAD).all() and (ox[t, j, m:] == PAD).all() and not flip[t, j, m:].any()
    assert len(steps[1]) < T  # a finished client's padding is checked


@pytest.mark.parametrize("method", ["scaffold", "fedpm"])
def test_stacked_runs_take_the_static_step_to_the_loops_models(method, tmp_path, monkeypatch):
    """Two runs trained as one stack (fedpm_dnn.engine.stacked_runs), in chunks that span both: each participant's
    broadcast stacked (SCAFFOLD's hook reads both runs' controls), the static step gives the loop's replies bit
    for bit."""
    from test_run_stack import CFG as STACK_CFG
    from test_run_stack import stacked

    cfg = make(method, **STACK_CFG)
    paths = [str(tmp_path / f"loop{r}.pt") for r in range(2)]
    _, loop = stacked(cfg, paths, chunk=3)
    calls, step = [], step_graph.FullStep.__call__
    monkeypatch.setattr(step_graph, "resolve", lambda mode, device: True)
    monkeypatch.setattr(step_graph.FullStep, "__call__", lambda self: calls.append(1) or step(self))
    paths = [str(tmp_path / f"static{r}.pt") for r in range(2)]
    _, static = stacked(cfg, paths, chunk=3)
    assert len(calls) >= 4  # every chunk of both rounds took its first step in the static function
    for a, b in zip(static, loop, strict=True):
        assert_identical(a, b)


def test_what_each_round_used_is_recorded_for_the_summary(monkeypatch):
    """A run whose captures fail (injected) records that its rounds ran eagerly and why, with a graphed share of 0;
    the TF32 flags follow --foof-precision inside a round and are put back after it."""
    from fedpm_dnn.foof import precision

    cfg = make("fedpm", **CFG)
    monkeypatch.setattr(step_graph, "capturable", lambda device: True)
    monkeypatch.setattr(step_graph, "WARMUP", 0)
    monkeypatch.setattr(step_graph, "_cuda_graph", _failing_capture)
    step_graph._said.clear()
    exp = experiment(cfg, "on", rounds=1)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed"):
        run_experiment(exp)
    forms = exp.meta["executed"]["step_forms"]
    assert any(f.startswith("eager: CUDA graph capture failed") for f in forms), forms
    assert "graph" not in forms and exp.meta["executed"]["graphed_share"] == 0.0
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    for mode, conv in (("fp32", False), ("split-tf32", True), ("bf16", True)):
        with precision.use(mode):
            assert torch.backends.cudnn.allow_tf32 is conv and torch.backends.cuda.matmul.allow_tf32 is False
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == old
    with precision.convolutions(True), precision.use("fp32"):  # a comparison's one setting for every method
        assert torch.backends.cudnn.allow_tf32 is True and precision.backend_flags("fp32")["cudnn_allow_tf32"]
    assert precision.backend_flags("fp32")["cudnn_allow_tf32"] is False


def _alpha_split_sizes(alpha: float, clients: int = 4, n: int = 240) -> list:
    from fedpm_dnn.data.partition import make_partition

    labels = np.arange(n) % 10
    return [len(p) for p in make_partition("relaysum", labels, clients, alpha, seed=0)]


@pytest.mark.parametrize("method", ["fedavg", "fedpm"])
def test_an_unequal_alpha_split_is_graphed_as_fully_as_an_equal_one(monkeypatch, method):
    """Captured (a stand-in graph that replays the step eagerly, on the CPU), every local step of a round on the
    paper's alpha = 0.1 split goes through the graph, the finished clients' steps masked: a graphed share of 1, as
    on an equal split; the replies agree with the loop's within float32 round-off (the finished clients ride in
    the stacked products, which changes their summation order)."""
    from test_vectorized import assert_same

    sizes = _alpha_split_sizes(0.1)
    assert len(set(sizes)) == len(sizes), sizes  # unequal clients
    cfg = make(method, **{**CFG, "weight_decay": 0.01, "weight_decay_mode": "decoupled"})
    _, loop, _ = train(cfg, "off", sizes=sizes, rounds=1)
    monkeypatch.setattr(step_graph, "capturable", lambda device: True)
    monkeypatch.setattr(step_graph, "WARMUP", 0)
    monkeypatch.setattr(step_graph, "_cuda_graph", lambda step, device: _Replay(step))
    shares = {}
    for name, split in (("alpha=0.1", sizes), ("equal", [sum(sizes) // len(sizes)] * len(sizes))):
        exp = experiment(cfg, "on", sizes=split, rounds=1)
        replies = {}
        run_experiment(exp, tamper=lambda t, i, r, replies=replies: replies.setdefault((t, i), r))
        shares[name] = exp.meta["executed"]["graphed_share"]
        if name == "alpha=0.1":
            assert_same(replies, loop, tol=1e-5)
    assert shares == {"alpha=0.1": 1.0, "equal": 1.0}, shares
