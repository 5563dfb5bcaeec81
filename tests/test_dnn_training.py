"""End-to-end DNN federated training on a synthetic image task (CPU, seconds)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fake_cifar import cifar_pickle  # noqa: E402

from fedpm_dnn.algorithms import METHODS, applicable, make_method  # noqa: E402
from fedpm_dnn.engine.sequential import ClientData  # noqa: E402
from fedpm_dnn.engine.simulation import Experiment, run_experiment  # noqa: E402


def make(name, **kw):
    """The method with those of the common settings ``kw`` that it takes."""
    return make_method(name, **applicable(name, kw))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic(n_clients=3, per_client=48, classes=3, seed=0, skew=True):
    """Class c = a bright patch at a class-specific place on noise; clients see skewed label mixes."""
    g = np.random.default_rng(seed)

    def images(labels):
        x = g.integers(0, 60, (len(labels), 3, 16, 16))
        for k, c in enumerate(labels):
            r, col = divmod(int(c), 2)
            x[k, :, 2 + 6 * r : 8 + 6 * r, 2 + 6 * col : 8 + 6 * col] += 180
        return torch.as_tensor(x.clip(0, 255).astype(np.uint8))

    clients = []
    for i in range(n_clients):
        p = np.full(classes, 0.1) + (0.9 * np.eye(classes)[i % classes] if skew else 0.3)
        y = g.choice(classes, per_client, p=p / p.sum())
        clients.append(ClientData(images(y), torch.as_tensor(y), (0.2, 0.2, 0.2), (0.3, 0.3, 0.3), augment=False))
    yt = np.repeat(np.arange(classes), 40)
    return clients, images(yt), torch.as_tensor(yt)


def experiment(cfg, rounds=4, participants=None, seed=0):
    clients, xt, yt = synthetic(seed=seed)
    return Experiment(
        cfg=cfg,
        model="cnn",
        num_classes=3,
        clients=clients,
        x_test=xt,
        y_test=yt,
        mean=(0.2, 0.2, 0.2),
        std=(0.3, 0.3, 0.3),
        rounds=rounds,
        participants=participants,
        seed=seed,
        image_size=16,
    )


@pytest.mark.parametrize("method", ["fedpm", "localnewton", "fedavg"])
def test_three_clients_learn_a_synthetic_task(method):
    cfg = make(method, lr=0.3 if method != "fedavg" else 0.1, local_epochs=2, batch_size=16, damping=1.0, clip=1.0)
    hist = run_experiment(experiment(cfg, rounds=5))
    assert max(r["test_acc"] for r in hist) > 0.75  # chance is 1/3


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_and_counts_its_messages(method):
    cfg = make(method, lr=0.05, local_epochs=1, batch_size=16, mu=0.01, server_lr=0.03, clip=1.0, foof_samples=20)
    exp = experiment(cfg, rounds=2, participants=2)
    hist = run_experiment(exp)
    assert len(hist) == 2 and all(np.isfinite(r["train_loss"]) for r in hist)
    import fedpm_dnn.models as models

    n_params = sum(p.numel() for p in models.make_model("cnn", 3, image_size=16).parameters())
    per_round_up = hist[0]["bytes_up"]
    if method == "fedpm":
        blocks = [76, 151, 16 * 1 * 1 + 1, 121, 85]  # conv1, conv2, fc1 (16x16 inputs: 16*1*1+1), fc2, fc3
        assert per_round_up == 4 * n_params + 4 * sum(b * b for b in blocks)
    elif method == "scaffold":
        assert per_round_up == 2 * 4 * n_params and hist[0]["bytes_down"] == 2 * 4 * n_params
    else:
        assert per_round_up == 4 * n_params
    assert hist[1]["bytes_up"] == 2 * per_round_up
    assert all(r["client_seconds"] > 0 and r["server_seconds"] >= 0 and r["peak_memory_mb"] > 0 for r in hist)


def test_float16_preconditioners_halve_their_bytes():
    base = dict(lr=0.1, local_epochs=1, batch_size=16, foof_samples=20)
    h32 = run_experiment(experiment(make("fedpm", **base), rounds=1))
    h16 = run_experiment(experiment(make("fedpm", precond_dtype="float16", **base), rounds=1))
    import fedpm_dnn.models as models

    params = 4 * sum(p.numel() for p in models.make_model("cnn", 3, image_size=16).parameters())
    assert h16[0]["bytes_up"] - params == (h32[0]["bytes_up"] - params) // 2


def _strip(hist):
    return [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in hist]


@pytest.mark.parametrize("method", ["fedpm", "scaffold", "fedadam"])
def test_kill_and_resume_gives_the_identical_history(tmp_path, method):
    cfg = make(method, lr=0.1, local_epochs=1, batch_size=16, foof_samples=30, server_lr=0.03)
    full = run_experiment(experiment(cfg, rounds=4, participants=2))
    ck = str(tmp_path / "ck.pt")
    run_experiment(experiment(cfg, rounds=2, participants=2), checkpoint=ck)  # "killed" after round 2
    resumed = run_experiment(experiment(cfg, rounds=4, participants=2), checkpoint=ck, resume=True)
    assert _strip(resumed) == _strip(full)
    other = run_experiment(experiment(make(method, lr=0.2, local_epochs=1, batch_size=16), rounds=2))
    with pytest.raises(ValueError, match="different configuration"):
        run_experiment(
            experiment(make(method, lr=0.2, local_epochs=1, batch_size=16), rounds=3), checkpoint=ck, resume=True
        )
    assert other


def test_divergence_is_one_clear_error():
    cfg = make("fedavg", lr=1e6, local_epochs=1, batch_size=16, weight_decay=0.0)
    with pytest.raises(ArithmeticError, match="diverged at round"):
        run_experiment(experiment(cfg, rounds=3))


def test_runner_cli_writes_results_and_resumes(tmp_path):
    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"))
    out = tmp_path / "out"
    base = [
        sys.executable,
        "-m",
        "validation.dnn",
        "--dataset",
        "cifar10",
        "--data-dir",
        str(tmp_path / "data"),
        "--method",
        "fedpm",
        "--preset",
        "cifar10-a0.1",
        "--clients",
        "3",
        "--local-epochs",
        "1",
        "--foof-samples",
        "64",
        "--quiet",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run(base + ["--rounds", "2"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds_done"] == 2 and s["preset_table"].startswith("Table") and len(s["class_counts"]) == 3
    assert s["config"]["lr"] == 0.5 and s["config"]["damping"] == 1.0 and s["config"]["foof_samples"] == 64
    # the arithmetic said: "fp32" is float32 in the convolutions too, on the device named
    assert s["precision"] == {
        "device_name": "CPU",
        "foof_precision": "fp32",
        "cudnn_allow_tf32": False,
        "cuda_matmul_allow_tf32": False,
    }
    assert (out / "history.csv").read_text().splitlines()[0].startswith("round,test_acc,train_loss")
    again = subprocess.run(base + ["--rounds", "3"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert again.returncode == 2 and "pass --resume" in again.stderr
    other = subprocess.run(
        base + ["--rounds", "3", "--resume", "--engine", "vectorized"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )  # the run was made by the engine auto chose: sequential
    assert other.returncode == 2 and "resume with --engine sequential" in other.stderr, other.stderr
    # --engine auto (the first run) and the engine it stood for resume each other
    r = subprocess.run(
        base + ["--rounds", "3", "--resume", "--engine", "sequential"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0 and json.loads((out / "summary.json").read_text())["rounds_done"] == 3


def test_a_checkpoint_from_before_the_resolved_engine_compares_its_engine_flag():
    from fedpm_dnn.engine.checkpoint import first_difference

    old = {"model": "cnn", "run.engine": "vectorized", "run.lr": 0.5}
    assert first_difference(old, {"model": "cnn", "run.lr": 0.5, "engine": "vectorized"}) is None
    msg = first_difference(old, {"model": "cnn", "run.lr": 0.5, "engine": "sequential"})
    assert msg == "engine: checkpoint has 'vectorized', this run 'sequential' (resume with --engine vectorized)"


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--data-dir", "/nonexistent"], "/nonexistent: no such folder"),
        (["--preset", "cifar10-foof-64", "--method", "fedavg"], "has no row for 'fedavg'"),
        (["--device", "cuda"], "cuda"),
        (["--lr", "-1"], "--lr: must be a number > 0"),
    ],
)
def test_runner_errors_are_one_line(tmp_path, args, fragment):
    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"))
    cmd = [
        sys.executable,
        "-m",
        "validation.dnn",
        "--data-dir",
        str(tmp_path / "data"),
        "--rounds",
        "1",
        "--quiet",
        "--out",
        str(tmp_path / "o"),
    ] + args
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    if fragment == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and fragment in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


def test_refreshing_the_matrices_during_local_training_changes_the_steps():
    base = dict(lr=0.3, local_epochs=2, batch_size=16, damping=0.1)
    once = run_experiment(experiment(make("fedpm", **base), rounds=2))
    refreshed = run_experiment(experiment(make("fedpm", refresh_every=2, **base), rounds=2))
    assert _strip(once) != _strip(refreshed)
    assert all(np.isfinite(r["train_loss"]) for r in refreshed)


def test_clip_stage_update_bounds_the_preconditioned_step():
    from fedpm_dnn import foof
    from fedpm_dnn.engine.sequential import local_train
    from fedpm_dnn.models import make_model

    clients, _, _ = synthetic()
    data = clients[0]
    for stage, bounded in (("update", True), ("gradient", False)):
        torch.manual_seed(0)
        model = make_model("cnn", 3, image_size=16)
        blocks = foof.foof_blocks(model)
        g = torch.Generator().manual_seed(0)
        A = foof.compute_foof(model, blocks, data.plain_batches(torch.arange(len(data))))
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        cfg = make(
            "localnewton",
            lr=0.5,
            clip=0.01,
            damping=1e-4,
            local_epochs=1,
            batch_size=len(data),
            weight_decay=0.0,
            clip_stage=stage,
        )
        local_train(model, cfg, data, g, foof_A=A, blocks=blocks)
        step = torch.linalg.norm(torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before)
        assert (step <= 0.5 * 0.01 * (1 + 1e-4)) == bounded, (stage, float(step))


def test_bad_replies_are_rejected_and_the_round_goes_on(caplog, tmp_path):
    import logging

    def tamper(round_, client, reply):
        if client == 1:
            reply = {**reply, "foof": {k: -torch.eye(v.shape[0]) for k, v in reply["foof"].items()}}
        if client == 2:
            reply = {**reply, "params": {**reply["params"], "fc3.bias": torch.full((4,), float("nan"))}}
        return reply

    cfg = make("fedpm", lr=0.1, local_epochs=1, batch_size=16, foof_samples=20)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        hist = run_experiment(experiment(cfg, rounds=2), tamper=tamper)
    assert "client 1 rejected: preconditioner foof[conv1] is not positive semidefinite" in caplog.text
    assert "client 2 rejected: params[fc3.bias] has shape (4,), expected (3,)" in caplog.text
    assert [r["rejected"] for r in hist] == [2, 2] and np.isfinite(hist[-1]["train_loss"])

    # everybody unusable: the round is skipped and the global model stays the initial one
    def everyone_bad(r, c, reply):
        return {**reply, "foof": {k: -torch.eye(v.shape[0]) for k, v in reply["foof"].items()}}

    ck = str(tmp_path / "ck.pt")
    skipped = run_experiment(experiment(cfg, rounds=1), checkpoint=ck, tamper=everyone_bad)
    assert "round skipped, model unchanged" in caplog.text and skipped[0]["rejected"] == 3
    from fedpm_dnn.models import make_model

    torch.manual_seed(0)
    initial = make_model("cnn", 3, image_size=16).state_dict()
    params = torch.load(ck, weights_only=True)["server"]["params"]
    assert all(torch.equal(params[k], initial[k]) for k in params)


def test_a_first_reply_in_float64_is_rejected_not_the_honest_ones_after_it(caplog):
    """In process, as on Flower, replies are checked against the server's template (the method's shapes and
    dtypes), never against the first reply of the round: a float64 reply sent first is the one rejected."""
    import logging

    first = {}

    def tamper(round_, client, reply):
        if first.setdefault(round_, client) == client:
            reply = {**reply, "params": {k: v.double() for k, v in reply["params"].items()}}
        return reply

    cfg = make("fedavg", lr=0.1, local_epochs=1, batch_size=16)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        hist = run_experiment(experiment(cfg, rounds=2), tamper=tamper)
    assert [r["rejected"] for r in hist] == [1, 1] and np.isfinite(hist[-1]["train_loss"])
    assert "has dtype float64, expected float32" in caplog.text and "expected float64" not in caplog.text


def _one_full_batch_step(cfg, data, seed=0):
    """(theta before, theta after, gradients of the first step, model, blocks, FOOF matrices):
    one local step on the whole client's data, so the step can be recomputed by hand."""
    import torch.nn.functional as F

    from fedpm_dnn import foof
    from fedpm_dnn.engine.sequential import local_train
    from fedpm_dnn.models import make_model

    torch.manual_seed(seed)
    model = make_model("cnn", 3, image_size=16)
    blocks = foof.foof_blocks(model)
    A = foof.compute_foof(model, blocks, data.plain_batches(torch.arange(len(data))))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    # the gradient the step will see: same model, same (un-augmented, unshuffled-equivalent) full batch
    x, y = data.batch(torch.arange(len(data)), None)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    local_train(model, cfg, data, torch.Generator().manual_seed(0), foof_A=A, blocks=blocks)
    after = {k: v.detach().clone() for k, v in model.named_parameters()}
    return before, after, grads, model, blocks, A


def _precondition(model, blocks, A, damping, grads):
    """(A + damping I)^{-1} applied to ``grads`` through the library's own block code."""
    from fedpm_dnn import foof

    with torch.no_grad():
        for k, p in model.named_parameters():
            p.grad = grads[k].clone()
        foof.precondition_grads(model, blocks, foof.with_uppers(foof.factorize(A, damping, torch.float32)))
        return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _flat(d):
    return torch.cat([v.reshape(-1) for v in d.values()])


@pytest.mark.parametrize("stage", ["update", "gradient"])
def test_clip_acts_exactly_where_the_stage_says(stage):
    """The preconditioned step is larger than the clip: with stage 'update' the step is that
    direction scaled to norm lr*clip exactly; with 'gradient' it is the preconditioned clipped gradient."""
    clients, _, _ = synthetic()
    data = clients[0]
    lr, clip, damping = 0.5, 0.05, 1e-2
    cfg = make(
        "localnewton",
        lr=lr,
        clip=clip,
        damping=damping,
        local_epochs=1,
        batch_size=len(data),
        weight_decay=0.0,
        clip_stage=stage,
    )
    before, after, grads, model, blocks, A = _one_full_batch_step(cfg, data)
    step = _flat(before) - _flat(after)
    if stage == "update":
        direction = _flat(_precondition(model, blocks, A, damping, grads))
        assert float(direction.norm()) > 10 * clip  # the preconditioned step really exceeds the clip
        expected = lr * clip * direction / direction.norm()
        assert float(step.norm()) == pytest.approx(lr * clip, rel=1e-5)
    else:
        g = _flat(grads)
        assert float(g.norm()) > clip
        scaled = {k: v * (clip / float(g.norm())) for k, v in grads.items()}
        expected = lr * _flat(_precondition(model, blocks, A, damping, scaled))
    # float32 parameters: theta_before - theta_after carries ~eps32 * |theta| of rounding
    atol = 8 * 1.2e-7 * float(_flat(before).abs().max())
    assert torch.allclose(step, expected, rtol=1e-4, atol=atol)


def test_decoupled_weight_decay_shrinks_after_the_step():
    clients, _, _ = synthetic()
    data = clients[0]
    lr, wd, damping = 0.1, 0.05, 1.0
    kw = dict(lr=lr, clip=None, damping=damping, local_epochs=1, batch_size=len(data), weight_decay=wd)
    before, after, grads, model, blocks, A = _one_full_batch_step(
        make("localnewton", weight_decay_mode="decoupled", **kw), data
    )
    direction = _precondition(model, blocks, A, damping, grads)
    expected = {k: (before[k] - lr * direction[k]) * (1 - lr * wd) for k in before}
    assert torch.allclose(_flat(after), _flat(expected), rtol=1e-5, atol=1e-7)
    # coupled: the decay term goes through the preconditioner with the gradient
    before, after, grads, model, blocks, A = _one_full_batch_step(make("localnewton", **kw), data)
    direction = _precondition(model, blocks, A, damping, {k: grads[k] + wd * before[k] for k in grads})
    assert torch.allclose(_flat(after), _flat({k: before[k] - lr * direction[k] for k in before}), rtol=1e-5, atol=1e-7)


def test_the_dnn_server_magnitude_guard_is_off_by_default_and_rejects_when_on(caplog):
    import dataclasses
    import logging

    def inflate(round_, client, reply):
        if client == 1:
            reply = {**reply, "foof": {k: v * 1e12 for k, v in reply["foof"].items()}}
        return reply

    cfg = make("fedpm", lr=0.1, local_epochs=1, batch_size=16, foof_samples=20)
    open_hist = run_experiment(experiment(cfg, rounds=1), tamper=inflate)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        guarded = run_experiment(dataclasses.replace(experiment(cfg, rounds=1), max_ratio=100.0), tamper=inflate)
    assert open_hist[0]["rejected"] == 0 and guarded[0]["rejected"] == 1
    assert "client 1 rejected: preconditioner trace" in caplog.text


# --- --param-dtype: the model parameters on the wire --------------------------------------------------------


def _n_params():
    import fedpm_dnn.models as models

    return sum(p.numel() for p in models.make_model("cnn", 3, image_size=16).parameters())


def _final_params(cfg, tmp_path, tag, tamper=None, rounds=2):
    from fedpm_dnn.engine.simulation import run_experiment as run

    ck = str(tmp_path / f"{tag}.pt")
    hist = run(experiment(cfg, rounds=rounds, participants=2), checkpoint=ck, tamper=tamper)
    return hist, torch.load(ck, weights_only=False)["server"]["params"]


PD = dict(lr=0.1, local_epochs=1, batch_size=16, foof_samples=20, clip=1.0, mu=0.01)


@pytest.mark.parametrize("method", ["fedavg", "fedpm", "scaffold"])
def test_param_dtype_float32_default_sends_the_trained_parameters_untouched(method):
    cfg = make(method, **PD)
    assert cfg.param_dtype == "float32"
    seen = []
    hist = run_experiment(experiment(cfg, rounds=1, participants=2), tamper=lambda t, i, r: seen.append(r) or r)
    assert all(v.dtype == torch.float32 for r in seen for v in r["params"].values())
    # the server's receive is the identity on float32 parameters: the same message object back
    from fedconvex.algorithms.base import RoundInfo, State

    up = {"params": {k: torch.stack([r["params"][k] for r in seen]) for k in seen[0]["params"]}}
    state = State(theta=seen[0]["params"])
    if method != "fedpm":
        assert cfg.receive(None, state, up, RoundInfo(np.arange(2), None, 3))[0] is up
    assert hist[0]["bytes_up"] == (2 if method == "scaffold" else 1) * 4 * _n_params() + (
        4 * sum(b * b for b in [76, 151, 17, 121, 85]) if method == "fedpm" else 0
    )


@pytest.mark.parametrize("method", ["fedavg", "fedpm", "scaffold"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_param_dtype_halves_the_parameter_bytes_exactly(method, dtype):
    h32 = run_experiment(experiment(make(method, **PD), rounds=2, participants=2))
    h16 = run_experiment(experiment(make(method, param_dtype=dtype, **PD), rounds=2, participants=2))
    half = 2 * _n_params()  # float32 -> 16 bits: 2 bytes per parameter and round saved, nothing else changes
    assert [r["bytes_up"] for r in h16] == [r["bytes_up"] - (t + 1) * half for t, r in enumerate(h32)]  # cumulative
    assert [r["bytes_down"] for r in h16] == [r["bytes_down"] for r in h32]


@pytest.mark.parametrize("method", ["fedavg", "fedpm", "scaffold"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_param_dtype_server_model_equals_rounding_the_replies_independently(method, dtype, tmp_path):
    """Reference: float32 replies rounded to ``dtype`` and back by a fault-injection hook (outside the
    method): the server's model must be bit-identical to the one the wire dtype gives."""
    wire = getattr(torch, dtype)
    sent = []

    def spy(t, i, r):
        sent.append({k: v.dtype for k, v in r["params"].items()})
        return r

    def round_trip(t, i, r):
        return {**r, "params": {k: v.to(wire).to(v.dtype) for k, v in r["params"].items()}}

    h_ref, m_ref = _final_params(make(method, **PD), tmp_path, "ref", round_trip)
    h_lo, m_lo = _final_params(make(method, param_dtype=dtype, **PD), tmp_path, "lo", spy)
    h_32, m_32 = _final_params(make(method, **PD), tmp_path, "32")
    assert sent and all(d == wire for s in sent for d in s.values())
    for name, v in m_ref.items():
        assert m_lo[name].dtype == torch.float32 and torch.equal(m_lo[name], v), name
    assert any(not torch.equal(m_32[n], m_lo[n]) for n in m_32)  # the rounding is real
    assert [r["test_acc"] for r in h_lo] == [r["test_acc"] for r in h_ref]
    assert [r["train_loss"] for r in h_lo] == [r["train_loss"] for r in h_ref]


def test_param_dtype_is_checked_and_reaches_the_cli():
    with pytest.raises(ValueError, match="param_dtype"):
        make("fedavg", param_dtype="float64")
    from validation import dnn

    plain = dnn.parse_args([])  # not given: the method's default (float32)
    assert plain.config.param_dtype == "float32" and "param_dtype" not in plain.resolved.from_flags
    assert dnn.parse_args(["--param-dtype", "bfloat16"]).config.param_dtype == "bfloat16"
