"""Preconditioner codecs: sym is lossless, round trips, delta(identity) == FedPM, PSD of what is
mixed, K = 1 Newton under sym, byte formulas, malformed payloads rejected (not crashes)."""

import logging

import numpy as np
import pytest
from naive import NaiveLogReg, random_data

from fedconvex import codecs, precond_wire
from fedconvex.algorithms import make_algorithm
from fedconvex.algorithms.base import RoundInfo
from fedconvex.problem import FederatedLogReg
from fedconvex.run import run, screen_message


def spd(rng, n, m=None):
    X = rng.standard_normal((m or 3 * n, n))
    M = X.T @ X / len(X)
    return 0.5 * (M + M.T)


@pytest.fixture(scope="module")
def logreg():
    rng = np.random.default_rng(3)
    X, y, parts = random_data(rng, 5, 12)  # unequal clients, unused features
    return FederatedLogReg(X, y, parts, lam=1e-3), rng.normal(size=12) * 0.1


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---------------------------------------------------------------- codecs alone
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_sym_round_trip_is_bit_exact_and_half_the_bytes(lib):
    rng = np.random.default_rng(0)
    M = spd(rng, 9)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        M = torch.as_tensor(M, dtype=torch.float32)
        M = 0.5 * (M + M.T)
    c = codecs.parse("sym")
    p = c.encode(M)
    out, _ = c.decode(p, 9)
    assert (out == M).all() and out.dtype == M.dtype
    item = 8 if lib == "numpy" else 4
    assert codecs.payload_nbytes(p) == 9 * 10 // 2 * item == c.payload_bytes(9, item)


@pytest.mark.parametrize(
    "spec,tol",
    [
        ("fp16", 2e-3),
        ("bf16", 1.6e-2),
        ("lowrank:9", 1e-10),
        ("delta:identity", 1e-12),
        ("delta:topk:45", 1e-12),
        ("delta:rankr:9", 1e-10),
    ],
)
def test_round_trips(spec, tol):
    rng = np.random.default_rng(1)
    M, M2 = spd(rng, 9), spd(rng, 9)
    c = codecs.parse(spec)
    state = None
    if c.stateful:  # first upload is the matrix itself, then a correction towards M2
        est, state = c.decode(c.encode(M, None), 9, None)
        assert np.allclose(est, M, atol=1e-15)
    est, _ = c.decode(c.encode(M2, state), 9, state)
    assert np.abs(est - M2).max() <= tol * np.abs(M2).max()


def test_lowrank_is_top_eigenpairs_plus_residual_diagonal():
    rng = np.random.default_rng(2)
    M = spd(rng, 10)
    c = codecs.parse("lowrank:0.3")
    assert c.r(10) == 3
    p = c.encode(M)
    w, V = np.linalg.eigh(M)
    np.testing.assert_allclose(np.sort(p["eigvals"]), w[-3:], rtol=1e-12)
    L = (V[:, -3:] * w[-3:]) @ V[:, -3:].T
    np.testing.assert_allclose(p["diag"], np.diag(M - L), atol=1e-12)
    est, _ = c.decode(p, 10)
    np.testing.assert_allclose(est, L + np.diag(np.diag(M - L)), atol=1e-12)
    assert np.linalg.eigvalsh(est).min() >= -1e-12


@pytest.mark.parametrize("n", [1, 7, 40])
def test_byte_formulas(n):
    """Bytes derived by hand, against the arrays actually produced."""
    rng = np.random.default_rng(n)
    M, M2 = spd(rng, n), spd(rng, n)
    m = n * (n + 1) // 2
    expect = {
        "sym": 8 * m,
        "fp16": 2 * m,
        "bf16": 2 * m,
        "lowrank:2": 8 * (min(2, n) * (n + 1) + n),
        "delta:topk:5": 12 * min(5, m),  # float64 values + int32 indices
        "delta:rankr:2": 8 * min(2, n) * (n + 1),
    }
    for spec, nb in expect.items():
        c = codecs.parse(spec)
        state = c.decode(c.encode(M, None), n, None)[1] if c.stateful else None
        p = c.encode(M2, state)
        assert codecs.payload_nbytes(p) == nb == c.payload_bytes(n, 8), spec


def test_bf16_matches_torch_bit_for_bit():
    torch = pytest.importorskip("torch")
    M = spd(np.random.default_rng(4), 16).astype(np.float32)
    a = codecs.parse("bf16").encode(M)["upper"]
    b = codecs.parse("bf16").encode(torch.as_tensor(M))["upper"].numpy()
    assert a.dtype == np.int16 and (a == b).all()


@pytest.mark.parametrize(
    "spec,payload,why",
    [
        ("sym", {"upper": np.zeros(5)}, "shape"),
        ("sym", {"upper": np.zeros(6, dtype=np.int64)}, "dtype"),
        ("sym", {"upper": np.full(6, np.nan)}, "NaN"),
        ("sym", {"values": np.zeros(6)}, "keys"),
        ("sym", [np.zeros(6)], "dict"),
        ("fp16", {"upper": np.zeros(6)}, "dtype"),
        ("lowrank:1", {"eigvals": -np.ones(1), "eigvecs": np.zeros((3, 1)), "diag": np.zeros(3)}, "negative"),
    ],
)
def test_malformed_payloads_raise_codec_error(spec, payload, why):
    with pytest.raises(codecs.CodecError, match=why):
        codecs.parse(spec).decode(payload, 3)


def test_delta_topk_index_checks():
    c = codecs.parse("delta:topk:2")
    state = np.eye(3)
    with pytest.raises(codecs.CodecError, match="outside"):
        c.decode({"values": np.ones(2), "index": np.array([0, 6], dtype=np.int32)}, 3, state)
    with pytest.raises(codecs.CodecError, match="repeated"):
        c.decode({"values": np.ones(2), "index": np.array([1, 1], dtype=np.int32)}, 3, state)


@pytest.mark.parametrize("spec", ["nope", "lowrank", "lowrank:0", "lowrank:1.5", "delta:topk", "delta:foo:3"])
def test_bad_specs(spec):
    with pytest.raises(ValueError):
        codecs.parse(spec)


# ---------------------------------------------------------------- FedPM in fedconvex
def test_sym_fedpm_is_bit_identical_and_counts_the_upper_triangle(logreg):
    pb, theta0 = logreg
    s0, h0 = run(pb, make_algorithm("fedpm", lr=1.0, local_steps=2), theta0, 3)
    s1, h1 = run(pb, make_algorithm("fedpm", lr=1.0, local_steps=2, precond_codec="sym"), theta0, 3)
    assert bits_equal(s0.theta, s1.theta)
    a = [len(x) for x in pb.active]
    theta_b = 8 * pb.d
    per_client = lambda f: sum(theta_b + 8 * n + f(n) for n in a) // len(a)  # noqa: E731  (int64 indices)
    assert h0[1]["bytes_up"] == per_client(lambda n: 8 * n * n)
    assert h1[1]["bytes_up"] == per_client(lambda n: 8 * n * (n + 1) // 2)


def test_sym_k1_is_a_global_newton_step(logreg):
    pb, theta0 = logreg
    X, y = pb.X, pb.y_host
    parts = [np.arange(pb.row_offsets[c], pb.row_offsets[c + 1]) for c in range(pb.n_clients)]
    ref = NaiveLogReg(X.toarray() if hasattr(X, "toarray") else X, y, parts, pb.lam, "uniform")
    s, _ = run(pb, make_algorithm("fedpm", lr=1.0, local_steps=1, precond_codec="sym"), theta0, 1)
    np.testing.assert_allclose(s.theta, ref.newton_step(theta0, 1.0), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("participants", [None, 3])
def test_delta_identity_equals_uncompressed_fedpm(logreg, participants):
    pb, theta0 = logreg
    kw = dict(participants=participants, seed=5)
    s0, h0 = run(pb, make_algorithm("fedpm", lr=0.7, local_steps=2), theta0, 4, **kw)
    s1, h1 = run(pb, make_algorithm("fedpm", lr=0.7, local_steps=2, precond_codec="delta:identity"), theta0, 4, **kw)
    np.testing.assert_allclose(s1.theta, s0.theta, rtol=1e-11, atol=1e-14)
    # the estimates are those matrices: the server's copy and the client's (after reading its
    # acknowledgement) agree
    for c in range(pb.n_clients):
        a, b = s1.server["precond_hat"][c], precond_wire.client_estimate(s1.clients, c)
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "lowrank:0.25", "delta:topk:0.1", "delta:rankr:1"])
def test_what_the_server_mixes_is_psd_and_lossy_codecs_still_converge(logreg, spec):
    pb, theta0 = logreg
    alg = make_algorithm("fedpm", lr=1.0, precond_codec=spec)
    state = alg.init(pb, theta0)
    sel = np.arange(pb.n_clients)
    for _ in range(3):
        up, cs = alg.client_update(pb, alg.broadcast(state), state.clients, sel, None)
        state = state.__class__(theta=state.theta, server=state.server, clients=cs, round=state.round)
        info = RoundInfo(sel=sel, weights=pb.client_weights / pb.client_weights.sum(), n_clients=pb.n_clients)
        dec, state = alg.receive(pb, state, up, info)
        assert all(p is None for p in dec["decode"])
        for B in dec["P"].blocks:
            assert np.linalg.eigvalsh(B).min() >= -1e-12 * max(1.0, np.abs(B).max())
        state = alg.server_update(pb, state, dec, info)
    theta_star = run(pb, make_algorithm("fedpm", lr=1.0), theta0, 12)[0].theta
    s, _ = run(pb, alg, theta0, 40)  # exact gradients: the fixed point is theta*, whatever the codec
    assert np.linalg.norm(s.theta - theta_star) < 1e-8 * np.linalg.norm(theta0 - theta_star)


def test_undecodable_payload_is_a_rejection_not_a_crash(logreg, caplog):
    pb, theta0 = logreg
    alg = make_algorithm("fedpm", lr=1.0, precond_codec="sym")
    state = alg.init(pb, theta0)
    sel = np.arange(pb.n_clients)
    up, _ = alg.client_update(pb, alg.broadcast(state), {}, sel, None)
    enc = up["P"]
    bad = list(enc.payloads)
    bad[1] = {"upper": bad[1]["upper"][:-1]}  # truncated
    bad[3] = {"upper": bad[3]["upper"].astype(np.float16)}  # wrong dtype
    up = {**up, "P": enc.__class__(tuple(bad), enc.active, enc.d)}
    info = RoundInfo(sel=sel, weights=np.full(len(sel), 1 / len(sel)), n_clients=len(sel))
    dec, state = alg.receive(pb, state, up, info)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        kept, info2, rejected = screen_message(dec, info, pb.d, 1)
    assert rejected == [1, 3] and "undecodable preconditioner payload" in caplog.text
    new = alg.server_update(pb, state, kept, info2)
    assert np.all(np.isfinite(new.theta))


def test_fednl_compressor_used_by_delta_is_fedconvex_s():
    """delta:topk sends exactly fedconvex's TopK of A - A_hat on the upper triangle."""
    from fedconvex.algorithms.compressors import TopK

    rng = np.random.default_rng(7)
    M, M2 = spd(rng, 6), spd(rng, 6)
    c = codecs.parse("delta:topk:4")
    hat = c.decode(c.encode(M), 6)[1]
    p = c.encode(M2, hat)
    ref = TopK(4).encode(np, (M2 - hat)[None], None)
    assert np.array_equal(p["values"], ref["values"][0]) and np.array_equal(p["index"], ref["index"][0])


# ---------------------------------------------------------------- fedpm_dnn
def test_dnn_sym_is_bit_identical_and_payloads_are_screened():
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from fedconvex.algorithms.base import RoundInfo
    from fedconvex.driver import Delivery, Driver
    from fedpm_dnn import foof
    from fedpm_dnn.algorithms import make_method
    from fedpm_dnn.algorithms.base import stack_replies
    from fedpm_dnn.data.synthetic import MEAN, STD, synthetic_task
    from fedpm_dnn.engine.sequential import ClientData, client_round
    from fedpm_dnn.engine.training_task import client_generator
    from fedpm_dnn.engine.transport import check_and_stack, reply_template
    from fedpm_dnn.models import make_model

    def server_round(alg, task, state, replies):
        """One driver round whose transport delivers ``replies`` (checked and stacked as Flower's are):
        (new state, replies used, replies rejected)."""

        def transport(alg, down, cstate, sel, rng, t):
            up, kept, rejected = check_and_stack(reply_template(alg, state.theta, task.blocks), replies, sel, t)
            return Delivery(up=up, cstate=None, sel=sel[kept], rejected=rejected)

        driver = Driver(
            alg, task, transport, weights=lambda sel: np.ones(len(sel)), evaluate=lambda s: {}, n_clients=task.n_clients
        )
        new, row = driver.round(state, 1, np.random.default_rng(0))
        return new, len(replies) - row["rejected"], row["rejected"]

    parts, _ = synthetic_task(2, seed=0, classes=3, image_size=16)
    data = [ClientData(torch.as_tensor(x[:24]), torch.as_tensor(y[:24]), MEAN, STD) for x, y in parts]
    out = {}
    for codec in ("none", "sym", "fp16", "delta:topk:0.05"):
        cfg = make_method("fedpm", lr=0.05, local_epochs=1, batch_size=16, clip=1.0, precond_codec=codec)
        torch.manual_seed(0)
        model = make_model("cnn", 3, image_size=16)
        blocks = foof.foof_blocks(model)
        task = SimpleNamespace(blocks=blocks, n_clients=2)
        state = cfg.init(task, dict(model.named_parameters()))
        replies = [
            client_round(cfg, model, blocks, data[i], {}, {"params": state.theta}, client_generator(0, 1, i))[0]
            for i in range(2)
        ]
        if codec == "fp16":  # a malformed payload: rejected, the other client used
            replies[1]["foof"]["fc1"] = {"upper": replies[1]["foof"]["fc1"]["upper"][:-1]}
        # what the server decodes: plain matrices of the blocks' shapes, PSD to round-off
        info = RoundInfo(sel=np.arange(2), weights=np.full(2, 0.5), n_clients=2)
        dec, _ = cfg.receive(task, state, stack_replies(replies), info)
        for name, A in dec["foof"].items():
            d = blocks[name].module.weight[0].numel() + 1
            assert A.shape == (2, d, d)
            for k in range(2):
                if dec.get("decode") is None or dec["decode"][k] is None:
                    assert torch.linalg.eigvalsh(A[k].double()).min() >= -1e-5 * float(A[k].abs().max())
        new, used, rejected = server_round(cfg, task, state, replies)
        if codec == "fp16":
            assert (used, rejected) == (1, 1)
            continue
        assert (used, rejected) == (2, 0)
        out[codec] = torch.cat([v.reshape(-1) for v in new.theta.values()])
    assert torch.equal(out["none"], out["sym"])
