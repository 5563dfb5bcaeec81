"""The vectorized engine (clients as a batch axis) trains every method to the sequential engine's models."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedpm_dnn.algorithms import METHODS, applicable, make_method  # noqa: E402
from fedpm_dnn.engine import checkpoint  # noqa: E402
from fedpm_dnn.engine.sequential import ClientData  # noqa: E402
from fedpm_dnn.engine.simulation import Experiment, run_experiment  # noqa: E402


def make(name, **kw):
    """The method with those of the common settings ``kw`` that it takes."""
    return make_method(name, **applicable(name, kw))


SIZES = (40, 23, 7, 30)  # unequal clients; 7 is smaller than one batch of 16; 23 ends in a partial batch


def experiment(cfg, engine, rounds=2, participants=3, augment=True, chunk=None, device="cpu"):
    g = np.random.default_rng(0)
    clients = []
    for i, n in enumerate(SIZES):
        y = g.integers(0, 3, n)
        x = g.integers(0, 256, (n, 3, 16, 16)).astype(np.uint8)
        clients.append(
            ClientData(
                torch.as_tensor(x).to(device),
                torch.as_tensor(y).to(device),
                (0.4, 0.5, 0.45),
                (0.25, 0.3, 0.2),
                augment=augment and i != 1,
            )
        )
    xt = torch.as_tensor(g.integers(0, 256, (30, 3, 16, 16)).astype(np.uint8)).to(device)
    yt = torch.as_tensor(g.integers(0, 3, 30)).to(device)
    return Experiment(
        cfg=cfg,
        model="cnn",
        num_classes=3,
        clients=clients,
        x_test=xt,
        y_test=yt,
        mean=(0.4, 0.5, 0.45),
        std=(0.25, 0.3, 0.2),
        rounds=rounds,
        participants=participants,
        seed=3,
        image_size=16,
        engine=engine,
        client_chunk=chunk,
        device=device,
    )


def run(cfg, engine, tmp=None, **kw):
    replies = {}

    def tamper(t, i, reply):
        replies[(t, i)] = reply
        return reply

    hist = run_experiment(experiment(cfg, engine, **kw), checkpoint=tmp, tamper=tamper)
    return hist, replies


def rel(a, b):
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def assert_same(r_vec, r_seq, tol=1e-5):
    """Parameters and FOOF matrices within ``tol``; SCAFFOLD's dcontrol, a difference of nearby
    parameters divided by steps * lr, loses digits to cancellation: within 1e-4."""
    assert r_vec.keys() == r_seq.keys()
    for key, rs in r_seq.items():
        assert rs.keys() == r_vec[key].keys()
        for part, vals in rs.items():
            for name, v in vals.items():
                assert rel(r_vec[key][part][name].double(), v.double()) <= (1e-4 if part == "dcontrol" else tol), (
                    key,
                    part,
                    name,
                )


CFG = dict(lr=0.05, local_epochs=2, batch_size=16, mu=0.01, server_lr=0.03, clip=1.0, damping=0.5)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_the_sequential_replies(method, tmp_path):
    cfg = make(method, **CFG)
    h_seq, r_seq = run(cfg, "sequential", str(tmp_path / "seq.pt"))
    h_vec, r_vec = run(cfg, "vectorized", str(tmp_path / "vec.pt"), chunk=2)  # two chunks: 2 + 1 participants
    assert_same(r_vec, r_seq)
    m_seq, m_vec = (torch.load(tmp_path / f, weights_only=False)["server"]["params"] for f in ("seq.pt", "vec.pt"))
    for name, v in m_seq.items():  # the global model after two rounds
        assert rel(m_vec[name].double(), v.double()) <= 1e-5, name
    for a, b in zip(h_vec, h_seq, strict=False):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["bytes_up"] == b["bytes_up"]


@pytest.mark.parametrize(
    "variant",
    [
        dict(clip_stage="gradient", weight_decay_mode="decoupled", weight_decay=0.01),
        dict(foof_samples=20, refresh_every=2),
        dict(refresh_every=3, clip=None),
    ],
)
def test_foof_variants_match(variant):
    cfg = make("fedpm", **{**CFG, **variant})
    _, r_seq = run(cfg, "sequential", participants=None)
    _, r_vec = run(cfg, "vectorized", participants=None)
    assert_same(r_vec, r_seq)


def test_resume_identity_holds_for_the_vectorized_engine(tmp_path):
    cfg = make("fedpm", **CFG)
    full, _ = run(cfg, "vectorized", rounds=3)
    ck = str(tmp_path / "ck.pt")
    run_experiment(experiment(cfg, "vectorized", rounds=2), checkpoint=ck)
    resumed = run_experiment(experiment(cfg, "vectorized", rounds=3), checkpoint=ck, resume=True)
    strip = lambda h: [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in h]  # noqa
    assert strip(resumed) == strip(full)


@pytest.mark.parametrize("method", ["fedavg", "fedpm", "scaffold"])
def test_float16_parameters_on_the_wire_match_across_engines(method, tmp_path):
    """--param-dtype float16: both engines send float16 parameters (within one float16 rounding step of
    each other: nearby float32 values may round to neighbouring float16 ones) and count the same bytes."""
    cfg = make(method, param_dtype="float16", **CFG)
    h_seq, r_seq = run(cfg, "sequential", str(tmp_path / "seq.pt"))
    h_vec, r_vec = run(cfg, "vectorized", str(tmp_path / "vec.pt"), chunk=2)
    assert all(v.dtype == torch.float16 for r in (*r_seq.values(), *r_vec.values()) for v in r["params"].values())
    assert_same(r_vec, r_seq, tol=1e-3)
    m_seq, m_vec = (torch.load(tmp_path / f, weights_only=False)["server"]["params"] for f in ("seq.pt", "vec.pt"))
    for name, v in m_seq.items():
        assert m_vec[name].dtype == torch.float32 and rel(m_vec[name].double(), v.double()) <= 1e-3, name
    assert [a["bytes_up"] for a in h_vec] == [b["bytes_up"] for b in h_seq]


def test_cuda_graph_capture_falls_back_to_eager_solves_where_it_cannot_run(monkeypatch):
    """Graphs are CUDA-only; a failed capture returns None, warns and is recorded (the engine then solves
    eagerly); so is a graph whose first replay disagrees with the eager solves (injected: its outputs scaled), while
    one that agrees is kept."""
    from fedpm_dnn.foof import solve_graph

    assert not solve_graph.enabled("cpu")
    L = torch.linalg.cholesky(torch.eye(3).expand(2, 3, 3) * 2.0)
    factors, shapes = {"b": (L, L.mT.contiguous())}, {"b": (2, 4, 3)}
    monkeypatch.setattr(solve_graph, "fallbacks", [])
    with pytest.warns(RuntimeWarning, match="CUDA graph capture"):
        assert solve_graph.capture(factors, shapes, torch.float32, "cpu") is None
    assert len(solve_graph.fallbacks) == 1

    class Replay:  # a stand-in graph: replay runs the solves eagerly into the captured outputs, times ``scale``
        def __init__(self, fn, scale):
            self.fn, self.scale, self.out = fn, scale, fn()

        def replay(self):
            for k, v in self.fn().items():
                self.out[k].copy_(v * self.scale)

    def factory(scale):
        def make(fn, device, warmup):
            g = Replay(fn, scale)
            return g, g.out

        return make

    good = solve_graph.capture(factors, shapes, torch.float32, "cpu", graph_factory=factory(1.0))
    assert good is not None and all(not T.any() for T in good.inputs.values())
    with pytest.warns(RuntimeWarning, match="first replay differs from the eager solves"):
        assert solve_graph.capture(factors, shapes, torch.float32, "cpu", graph_factory=factory(1.01)) is None
    assert len(solve_graph.fallbacks) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", ["fedpm", "localnewton"])
def test_cuda_graph_solves_give_the_eager_and_sequential_replies(method, monkeypatch):
    """On CUDA the loop's full steps replay the captured solves (steps where a client has dropped out solve
    eagerly): the same replies as eager solves, and as the sequential engine within float32 tolerance.  The loop
    is --step-graph off (on CUDA 'auto' replays the whole step instead: tests/test_step_graph.py)."""
    from fedpm_dnn.engine import step_graph
    from fedpm_dnn.foof import solve_graph

    monkeypatch.setattr(step_graph, "resolve", lambda mode, device: False)

    replays = []
    real = solve_graph.GraphedDirections.replay
    monkeypatch.setattr(solve_graph.GraphedDirections, "replay", lambda self: replays.append(1) or real(self))
    # TF32 off: the engines' convolutions (grouped vs per client) would round differently in TF32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cfg = make(method, **CFG)
    monkeypatch.setenv(solve_graph.ENV, "1")
    _, r_graph = run(cfg, "vectorized", device="cuda")
    assert replays, "the graph was never replayed"
    monkeypatch.setenv(solve_graph.ENV, "0")
    n = len(replays)
    _, r_eager = run(cfg, "vectorized", device="cuda")
    assert len(replays) == n
    assert_same(r_graph, r_eager, tol=1e-6)
    _, r_seq = run(cfg, "sequential", device="cuda")
    assert_same(r_graph, r_seq)


@pytest.mark.parametrize("model_name", ["cnn", "resnet18gn"])
def test_grouped_and_per_client_convolutions_agree(model_name):
    """CUDA runs every stacked convolution grouped, the CPU one per client: both forms compute each client's
    own convolution (outputs and every parameter's gradient; in float64, where round-off cannot hide a
    difference -- ResNet18-GN's float32 gradients differ by 1e-3 between the forms through 18 layers), so the
    CPU tests cover the GPU's form too."""
    from torch.func import functional_call

    from fedpm_dnn.engine.stacked_model import StackedModel, _conv_grouped, _conv_loop
    from fedpm_dnn.models import make_model

    torch.manual_seed(0)
    K, B = 3, 4
    model = make_model(model_name, 5, 3, 16).double()
    P = {
        n: torch.stack([p.detach() + 0.01 * torch.randn_like(p) for _ in range(K)]) for n, p in model.named_parameters()
    }
    x = torch.randn(K, B, 3, 16, 16, dtype=torch.float64)
    results = []
    for form in (_conv_loop, _conv_grouped):
        stacked = StackedModel(model)
        stacked.conv_mode = {name: form for name, m in stacked.mods.items() if isinstance(m, torch.nn.Conv2d)}
        Pk = {n: v.clone().requires_grad_(True) for n, v in P.items()}
        out = stacked(Pk, x)
        results.append((out.detach(), torch.autograd.grad((out**2).sum(), list(Pk.values()))))
    (o1, g1), (o2, g2) = results
    assert rel(o2, o1) <= 1e-12
    for a, b in zip(g2, g1, strict=False):
        assert rel(a, b) <= 1e-10
    for k in range(K):  # and the per-client form is client k's own model
        ref = functional_call(model, {n: v[k] for n, v in P.items()}, (x[k],))
        assert rel(o1[k], ref) <= 1e-12


@pytest.mark.parametrize("model_name", ["cnn", "resnet18gn"])
def test_the_cpu_training_form_client_by_client_agrees_with_the_stacked_form(model_name):
    """StackedModel.per_client (the CPU's training forward) gives the stacked form's outputs and every stacked
    parameter's gradient (float64), each client's own model run on its own batch."""
    from torch.func import functional_call

    from fedpm_dnn.engine.stacked_model import StackedModel
    from fedpm_dnn.models import make_model

    torch.manual_seed(1)
    K, B = 3, 4
    model = make_model(model_name, 5, 3, 16).double()
    P = {
        n: torch.stack([p.detach() + 0.01 * torch.randn_like(p) for _ in range(K)]) for n, p in model.named_parameters()
    }
    x = torch.randn(K, B, 3, 16, 16, dtype=torch.float64)
    stacked = StackedModel(model)
    results = []
    for fwd in (stacked, stacked.per_client):
        Pk = {n: v.clone().requires_grad_(True) for n, v in P.items()}
        out = fwd(Pk, x)
        results.append((out.detach(), torch.autograd.grad((out**3).sum(), list(Pk.values()))))
    (o1, g1), (o2, g2) = results
    assert o2.shape == o1.shape and rel(o2, o1) <= 1e-12
    for a, b in zip(g2, g1, strict=False):
        assert a.shape == b.shape and rel(a, b) <= 1e-10
    for k in range(K):
        assert rel(o2[k], functional_call(model, {n: v[k] for n, v in P.items()}, (x[k],))) <= 1e-12
    assert all("forward" not in m.__dict__ for m in model.modules())  # the layers are restored


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 100.0])
def test_stacked_clipping_is_clip_grad_norm_client_by_client(max_norm):
    """vectorized._clip_ on (K, ...) gradient stacks equals torch.nn.utils.clip_grad_norm_ on each client's own
    gradients: one client's norm never scales another's (here the clients' norms straddle the threshold)."""
    from fedpm_dnn.engine.vectorized import _clip_

    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.001, 0.1, 1.0, 30.0])
    shapes = [(6, 5), (6,), (2, 3, 3, 3)]
    stacks = [torch.randn(4, *s, generator=g) * scales.view(4, *([1] * len(s))) for s in shapes]
    expect = []
    for k in range(4):
        own = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p, st in zip(own, stacks, strict=False):
            p.grad = st[k].clone()
        torch.nn.utils.clip_grad_norm_(own, max_norm)
        expect.append([p.grad for p in own])
    got = [st.clone() for st in stacks]
    _clip_(got, max_norm)
    for k in range(4):
        for a, b in zip(got, expect[k], strict=False):
            torch.testing.assert_close(a[k], b, rtol=1e-6, atol=0)


# --- memory: what a chunk is sized from ----------------------------------------------------------------------------
def test_free_memory_counts_the_allocators_cached_bytes():
    """CUDA's free memory is the driver's free plus what the caching allocator holds reserved but unallocated (it
    hands that out again first); the arithmetic through an injected query, as CUDA's would answer."""
    from fedpm_dnn.engine import vectorized

    assert vectorized.free_bytes("cuda", lambda dev: (10_000, 7_000, 3_000)) == 14_000
    assert vectorized.free_bytes("cuda", lambda dev: (10_000, 3_000, 3_000)) == 10_000  # nothing cached
    assert vectorized.free_bytes("cuda", lambda dev: None) is None
    assert vectorized.free_bytes("cpu") > 0  # MemAvailable


def _cnn_plan_inputs(method="fedpm"):
    from fedpm_dnn import foof
    from fedpm_dnn.models import make_model

    model = make_model("cnn", 10, 3, 32)
    return model, make(method, **CFG), torch.zeros(1, 3, 32, 32), foof.foof_blocks(model)


def test_the_training_chunk_is_sized_without_the_statistics_pass():
    """client_plan: as many clients as fit in 70 % of the free memory (cached allocator bytes counted) after the
    round's kept matrices, ONE client's statistics pass and the pass's shared patches -- the statistics pass is
    sized on its own, so it is no longer charged once per training client."""
    from fedpm_dnn.engine import vectorized

    model, cfg, sample, blocks = _cnn_plan_inputs()
    per = vectorized.memory_model(model, cfg, sample, blocks)
    assert per["train"] > 0 and per["stats"] > 0 and per["state"] == 2 * per["reply"] > 0
    k, new = 10, 4
    fixed = new * per["state"] + k * per["reply"] + per["stats"] + vectorized.STATS_SHARED_BYTES
    free = int((fixed + 7 * per["train"]) / vectorized.FREE_SHARE) + 1  # room for 7 training clients exactly
    plan = vectorized.client_plan(model, cfg, sample, blocks, "cuda", k, new, lambda d: (free // 2, free, free // 2))
    assert plan["free_bytes"] == free and plan["chunk"] == 7
    assert plan["train_bytes_per_client"] == per["train"] and plan["stats_bytes_per_client"] == per["stats"]
    # charging every client its statistics pass as well (the former model) would have fitted fewer
    assert (vectorized.FREE_SHARE * free - fixed + per["stats"]) // (per["train"] + per["stats"]) < 7
    assert vectorized.client_plan(model, cfg, sample, blocks, "cuda", k, new, lambda d: (1, 0, 0))["chunk"] == 1
    assert vectorized.client_plan(model, cfg, sample, blocks, "cuda", k, new, lambda d: None)["chunk"] == k
    fedavg = vectorized.memory_model(*_cnn_plan_inputs("fedavg"))
    assert fedavg["stats"] == 0 and fedavg["state"] == 0 and fedavg["train"] < per["train"]


def test_the_statistics_pass_is_sized_from_what_is_free_when_it_starts():
    from fedpm_dnn.engine import vectorized

    shared = vectorized.STATS_SHARED_BYTES
    free = int((shared + 3 * 1000) / vectorized.FREE_SHARE) + 1
    assert vectorized.stats_client_chunk(1000, "cuda", 10, lambda d: (free, 0, 0)) == 3
    assert vectorized.stats_client_chunk(1000, "cuda", 10, lambda d: (0, free, 0)) == 3  # all of it cached
    assert vectorized.stats_client_chunk(1000, "cuda", 2, lambda d: (free, 0, 0)) == 2
    assert vectorized.stats_client_chunk(1000, "cuda", 10, lambda d: (1, 0, 0)) == 1
    assert vectorized.stats_client_chunk(1000, "cuda", 10, lambda d: None) == 10
    assert vectorized.stats_client_chunk(0, "cuda", 10, lambda d: (1, 0, 0)) == 10  # no statistics at all


@pytest.mark.parametrize("variant", [{}, dict(foof_samples=20, refresh_every=2)])
def test_a_statistics_pass_in_chunks_gives_the_same_replies(variant, monkeypatch):
    """The statistics pass one client at a time (first participations, refreshes, end of round; cached first-layer
    matrices for some clients of a chunk and not others in round 2) gives the replies of the pass over every
    client at once, to float32 round-off."""
    from fedpm_dnn.engine import vectorized

    cfg = make("fedpm", **{**CFG, **variant})
    chunks = []
    real = vectorized.VectorizedEngine._foof_pass

    def counted(self, sel, *a):
        chunks.append(len(sel))
        return real(self, sel, *a)

    monkeypatch.setattr(vectorized.VectorizedEngine, "_foof_pass", counted)
    _, whole = run(cfg, "vectorized")
    assert max(chunks) == 3  # every participant in one pass
    chunks.clear()
    monkeypatch.setattr(vectorized, "stats_client_chunk", lambda *a: 1)
    _, one = run(cfg, "vectorized")
    assert chunks and set(chunks) == {1}
    assert_same(one, whole, tol=1e-6)


def test_foof_matrices_kept_in_float32_are_an_opt_in_both_engines_honour(tmp_path, monkeypatch):
    """foof_state_dtype='float32': every client keeps its FOOF matrices in float32 (half the memory) on both engines,
    which still agree to 1e-5 and resume identically; the default keeps float64, and the opt-in's replies stay
    within 1e-5 of the default's here (damping 0.5; a smaller damping amplifies the rounding of A more).  The
    checkpoints are written with the clients' states whole, to show the matrices as the clients keep them."""
    monkeypatch.setattr(checkpoint, "compact_client", lambda cs: cs)
    cfg = make("fedpm", **CFG, foof_state_dtype="float32")
    _, r_seq = run(cfg, "sequential", str(tmp_path / "seq.pt"))
    _, r_vec = run(cfg, "vectorized", str(tmp_path / "vec.pt"), chunk=2)
    assert_same(r_vec, r_seq)
    for f in ("seq.pt", "vec.pt"):
        kept = [m for cs in checkpoint.load(str(tmp_path / f))["clients"] if cs for m in cs["foof"].values()]
        assert kept and all(m.dtype == torch.float32 for m in kept)
    _, r_default = run(make("fedpm", **CFG), "vectorized", str(tmp_path / "d.pt"), chunk=2)
    kept = [m for cs in checkpoint.load(str(tmp_path / "d.pt"))["clients"] if cs for m in cs["foof"].values()]
    assert all(m.dtype == torch.float64 for m in kept)
    assert_same(r_vec, r_default)  # measured: 1.3e-7 relative, as the engines differ (1.1e-7)
    monkeypatch.undo()  # the resume below from a compact checkpoint, as written by default
    full, _ = run(cfg, "vectorized", rounds=3)
    ck = str(tmp_path / "ck.pt")
    run_experiment(experiment(cfg, "vectorized", rounds=2), checkpoint=ck)
    resumed = run_experiment(experiment(cfg, "vectorized", rounds=3), checkpoint=ck, resume=True)
    strip = lambda h: [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in h]  # noqa
    assert strip(resumed) == strip(full)


def test_a_checkpoint_from_before_foof_state_dtype_resumes_as_float64():
    """Written before the setting (no config.foof_state_dtype): the same run as float64 now, not as float32."""
    from fedpm_dnn.engine.checkpoint import first_difference

    old = {"run.lr": 0.5, "config.damping": 1.0, "config.foof_apply": "solve", "config.foof_precision": "fp32"}
    now = {**old, "config.foof_state_dtype": "float64"}
    assert first_difference(old, now) is None
    assert "foof state dtype" in first_difference(old, {**now, "config.foof_state_dtype": "float32"})
    assert "foof_state_dtype" in make("fedpm", **CFG).hyperparameters()


def _oom_once(monkeypatch, name, exc, always=False):
    """``VectorizedEngine.<name>`` raising ``exc`` on its first call (``always``: every call) with more than one
    client (after running part of the work, as a real allocation failure mid-chunk would), then as it is."""
    from fedpm_dnn.engine import vectorized

    real, raised = getattr(vectorized.VectorizedEngine, name), []

    def flaky(self, cfg_or_sel, *a):
        sel = a[0] if name == "_chunk" else cfg_or_sel
        if (always or not raised) and len(sel) > 1:
            raised.append(len(sel))
            real(self, cfg_or_sel, *a)  # the work done before the failure: its draws and state changes undone
            raise exc
        return real(self, cfg_or_sel, *a)

    monkeypatch.setattr(vectorized.VectorizedEngine, name, flaky)
    return raised


def _same_bits(a, b):
    assert a.keys() == b.keys()
    for key in a:
        for part, vals in a[key].items():
            assert all(torch.equal(v, b[key][part][n]) for n, v in vals.items()), (key, part)


@pytest.mark.parametrize(
    "exc", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError("boom")]
)
def test_an_out_of_memory_chunk_is_halved_and_retried_as_a_smaller_chunk_would_run(monkeypatch, exc):
    """An injected out-of-memory error in a training chunk of 3 clients: the chunk is retried as chunks of 1 (its
    generators and client states as they were), giving bit for bit the replies of a run with --client-chunk 1,
    said once and recorded; any other error is raised as it is."""
    cfg = make("fedpm", **CFG)
    _, one = run(cfg, "vectorized", chunk=1, rounds=1)
    raised = _oom_once(monkeypatch, "_chunk", exc)
    exp = experiment(cfg, "vectorized", rounds=1)
    if not isinstance(exc, torch.OutOfMemoryError):
        with pytest.raises(RuntimeError, match="boom"):
            run_experiment(exp)
        return
    replies = {}
    with pytest.warns(RuntimeWarning, match="out of memory on cpu: training chunk 3 -> 1 clients"):
        run_experiment(exp, tamper=lambda t, i, r: replies.setdefault((t, i), r))
    assert raised == [3] and exp.meta["executed"]["out_of_memory"] == ["training chunk 3 -> 1 clients"]
    _same_bits(replies, one)


def test_an_out_of_memory_statistics_pass_is_halved_and_retried(monkeypatch):
    """An injected out-of-memory error in every statistics pass over more than one client: each is retried one
    client at a time, giving bit for bit the replies of passes sized to one client, recorded."""
    from fedpm_dnn.engine import vectorized

    cfg = make("fedpm", **CFG)
    monkeypatch.setattr(vectorized, "stats_client_chunk", lambda *a: 1)
    _, one = run(cfg, "vectorized", rounds=1)
    monkeypatch.undo()
    raised = _oom_once(monkeypatch, "_foof_pass", torch.OutOfMemoryError("CUDA out of memory"), always=True)
    exp = experiment(cfg, "vectorized", rounds=1)
    replies = {}
    with pytest.warns(RuntimeWarning, match="statistics chunk 3 -> 1 clients"):
        run_experiment(exp, tamper=lambda t, i, r: replies.setdefault((t, i), r))
    # every pass over 3 clients (the first participations', the end of round's) fails and runs one client at a time
    assert raised == [3, 3] and exp.meta["executed"]["out_of_memory"] == ["statistics chunk 3 -> 1 clients"] * 2
    _same_bits(replies, one)
