"""The delta codec after a rejected or altered reply: client and server estimates A_hat advance
on acknowledged rounds only, agree again after the round, and delta:identity still equals FedPM."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from naive import random_data

from fedconvex import codecs, precond_wire
from fedconvex.algorithms.fedpm import FedPM
from fedconvex.problem import FederatedLogReg
from fedconvex.run import run

DELTAS = ["delta:identity", "delta:topk:0.3", "delta:rankr:2"]


@pytest.fixture(scope="module")
def logreg():
    rng = np.random.default_rng(11)
    X, y, parts = random_data(rng, 4, 10)
    return FederatedLogReg(X, y, parts, lam=1e-3), rng.normal(size=10) * 0.1


def nan_payload(p):
    return {k: (np.full_like(v, np.nan) if v.dtype.kind == "f" else v) for k, v in p.items()}


def scaled_payload(p):  # still decodes: a payload altered in transit
    return {k: (1.5 * v if v.dtype.kind == "f" else v) for k, v in p.items()}


@dataclass(frozen=True)
class Transit(FedPM):
    """FedPM whose upload of participant ``who`` is altered by ``alter`` in round ``when`` on its way to
    the server (the client's own state is untouched)."""

    alter: Callable = None
    when: int = 2
    who: int = 1

    def broadcast(self, state):  # the round number travels too, so the client knows when to misbehave
        return {**super().broadcast(state), "round": np.int64(state.round + 1)}

    def client_update(self, problem, down, cstate, sel, rng):
        up, cs = super().client_update(problem, down, cstate, sel, rng)
        if self.alter is not None and int(down["round"]) == self.when:
            enc = up["P"]
            pl = list(enc.payloads)
            pl[self.who] = self.alter(pl[self.who])
            up = {**up, "P": enc.__class__(tuple(pl), enc.active, enc.d)}
        return up, cs


def estimates_agree(state, c):
    a, b = state.server["precond_hat"][c], precond_wire.client_estimate(state.clients, c)
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


def nan_theta(who, when):
    def tamper(t, up):
        if t != when:
            return up
        th = up["theta"].copy()
        th[who] = np.nan
        return {**up, "theta": th}

    return tamper


# ---------------------------------------------------------------- codec helpers
def test_digest_tells_estimates_apart():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((4, 4))
    B = A.copy()
    B[2, 3] = np.nextafter(B[2, 3], np.inf)  # one ulp
    assert codecs.digest(A) == codecs.digest(A.copy())
    assert codecs.digest(A) != codecs.digest(B)
    assert codecs.digest(A) != codecs.digest(A.astype(np.float32))
    assert codecs.digest(None) == codecs.digest({}) == codecs.NO_ESTIMATE
    assert codecs.digest({"a": A, "b": B}) == codecs.digest({"b": B, "a": A})
    assert codecs.digest({"a": A, "b": B}) != codecs.digest({"a": B, "b": A})


def test_resync_rule():
    rng = np.random.default_rng(1)
    old, new, other = (rng.standard_normal((3, 3)) for _ in range(3))
    assert codecs.resync(old, new, codecs.digest(new)) is new  # accepted
    assert codecs.resync(old, new, codecs.digest(old)) is old  # rejected: back where both were
    assert codecs.resync(old, new, codecs.digest(other)) is None  # diverged: resend in full
    assert codecs.resync(None, new, None) is None  # first upload, nothing acknowledged
    assert codecs.resync(None, new, codecs.digest(new)) is new


@pytest.mark.parametrize("spec", DELTAS)
def test_full_payload_resets_an_existing_estimate(spec):
    rng = np.random.default_rng(2)
    X = rng.standard_normal((20, 5))
    A, junk = X.T @ X, 7 * np.eye(5)
    c = codecs.parse(spec)
    _, hat = c.decode(c.encode(A, None), 5, junk)
    assert np.array_equal(hat, A)


# ---------------------------------------------------------------- fedconvex
@pytest.mark.parametrize("spec", DELTAS)
@pytest.mark.parametrize("fault", ["screened", "undecodable"])
def test_rejected_round_leaves_both_estimates_where_they_were(logreg, spec, fault):
    pb, theta0 = logreg
    if fault == "screened":  # decodes, then screening rejects the client (NaN parameters)
        alg, kw = FedPM(lr=0.8, local_steps=2, precond_codec=spec), {"tamper": nan_theta(1, 2)}
    else:  # the payload itself is unusable
        alg, kw = Transit(lr=0.8, local_steps=2, precond_codec=spec, alter=nan_payload), {}
    for rounds in (1, 2, 3, 5):
        s, h = run(pb, alg, theta0, rounds, **kw)
        if rounds >= 2:
            assert h[2]["rejected"] == 1
        for c in range(pb.n_clients):
            assert estimates_agree(s, c), (rounds, c)
    s1, _ = run(pb, alg, theta0, 1, **kw)
    s2, _ = run(pb, alg, theta0, 2, **kw)
    # the rejected client's estimate is the one of round 1 on both sides; the others moved on
    assert np.array_equal(s2.server["precond_hat"][1], s1.server["precond_hat"][1])
    assert not np.array_equal(s2.server["precond_hat"][0], s1.server["precond_hat"][0])


@pytest.mark.parametrize("spec", DELTAS)
def test_altered_payload_is_detected_and_resynchronised_by_a_full_upload(logreg, spec):
    pb, theta0 = logreg
    alg = Transit(lr=0.8, local_steps=2, precond_codec=spec, alter=scaled_payload)
    s2, h2 = run(pb, alg, theta0, 2)
    assert h2[2]["rejected"] == 0  # the server cannot tell it was altered...
    assert precond_wire.client_estimate(s2.clients, 1) is None  # ...the client can: it will resend in full
    assert all(estimates_agree(s2, c) for c in range(pb.n_clients) if c != 1)
    s3, h3 = run(pb, alg, theta0, 3)
    assert all(estimates_agree(s3, c) for c in range(pb.n_clients))
    # the resync costs one full (sym) upload of client 1
    plain, hp = run(pb, FedPM(lr=0.8, local_steps=2, precond_codec=spec), theta0, 3)
    extra = (h3[3]["bytes_up"] - h3[2]["bytes_up"]) - (hp[3]["bytes_up"] - hp[2]["bytes_up"])
    if spec != "delta:identity":
        assert extra > 0
    else:
        assert extra == 0  # identity deltas are as large as the full upper triangle


@pytest.mark.parametrize("fault", ["screened", "undecodable"])
def test_delta_identity_with_a_rejected_round_equals_uncompressed_fedpm(logreg, fault):
    """The same client rejected in round 2 in both runs: FedPM(delta:identity) still equals FedPM(none).
    (Had the client advanced its estimate while the server did not, round 3's delta would be taken
    against the wrong matrix.)"""
    pb, theta0 = logreg
    s0, h0 = run(pb, FedPM(lr=0.8, local_steps=2), theta0, 5, tamper=nan_theta(1, 2))
    if fault == "screened":
        s1, h1 = run(
            pb, FedPM(lr=0.8, local_steps=2, precond_codec="delta:identity"), theta0, 5, tamper=nan_theta(1, 2)
        )
    else:
        alg = Transit(lr=0.8, local_steps=2, precond_codec="delta:identity", alter=nan_payload)
        s1, h1 = run(pb, alg, theta0, 5)
    assert [r["rejected"] for r in h0] == [r["rejected"] for r in h1] == [0, 0, 1, 0, 0, 0]
    np.testing.assert_allclose(s1.theta, s0.theta, rtol=1e-11, atol=1e-14)


# ---------------------------------------------------------------- fedpm_dnn
def dnn_fedpm(codec):
    from fedpm_dnn.algorithms import make_method

    return make_method("fedpm", lr=0.3, local_epochs=1, batch_size=16, damping=1.0, clip=1.0, precond_codec=codec)


def _dnn_run(tmp_path, codec, tamper, rounds=4, engine="sequential"):
    torch = pytest.importorskip("torch")
    from test_dnn_training import experiment

    from fedpm_dnn.algorithms.fedpm_wire import client_estimate
    from fedpm_dnn.engine import checkpoint as ck
    from fedpm_dnn.engine.simulation import run_experiment

    cfg = dnn_fedpm(codec)
    exp = experiment(cfg, rounds=rounds)
    exp.engine = engine
    path = str(tmp_path / f"{codec.replace(':', '-')}-{engine}.pt")
    seen = []

    def on_round(row, history):  # the checkpoint of this round is written before on_round
        c = ck.load(path)
        server, clients = c["server"].get("foof_hat", {}), c["clients"]
        seen.append(
            {i: (codecs.digest(server.get(i)), codecs.digest(client_estimate(cs))) for i, cs in enumerate(clients)}
        )

    hist = run_experiment(exp, checkpoint=path, on_round=on_round, tamper=tamper)
    final = ck.load(path)["server"]["params"]
    del torch
    return hist, seen, torch_cat(final)


def torch_cat(params):
    import torch

    return torch.cat([v.reshape(-1) for v in params.values()])


def _dnn_tamper(kind, who=1, when=2):
    import torch

    def tamper(t, client, reply):
        if t != when or client != who:
            return reply
        if kind == "nan-params":
            return {**reply, "params": {k: torch.full_like(v, float("nan")) for k, v in reply["params"].items()}}
        alter = (lambda v: torch.full_like(v, float("nan"))) if kind == "nan-payload" else (lambda v: 1.5 * v)
        foof = {
            b: {k: (alter(v) if v.is_floating_point() else v) for k, v in p.items()} for b, p in reply["foof"].items()
        }
        return {**reply, "foof": foof}

    return tamper


@pytest.mark.parametrize("spec", ["delta:identity", "delta:topk:0.05", "delta:rankr:2"])
@pytest.mark.parametrize("kind", ["nan-params", "nan-payload", "scaled-payload"])
def test_dnn_estimates_agree_after_a_rejected_or_altered_reply(tmp_path, spec, kind):
    hist, seen, _ = _dnn_run(tmp_path, spec, _dnn_tamper(kind))
    assert [r["rejected"] for r in hist] == [0, 0 if kind == "scaled-payload" else 1, 0, 0]
    none = codecs.NO_ESTIMATE
    for t, row in enumerate(seen, start=1):
        for i, (server, client) in row.items():
            if kind == "scaled-payload" and t == 2 and i == 1:
                # the altered upload was accepted; the client sees the digest differ and starts over
                assert client == none and server != none
            else:
                assert server == client != none, (t, i)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_dnn_delta_identity_with_a_rejected_round_equals_uncompressed(tmp_path, engine):
    torch = pytest.importorskip("torch")
    h0, _, p0 = _dnn_run(tmp_path, "none", _dnn_tamper("nan-params"), engine=engine)
    h1, _, p1 = _dnn_run(tmp_path, "delta:identity", _dnn_tamper("nan-payload"), engine=engine)
    assert [r["rejected"] for r in h0] == [r["rejected"] for r in h1] == [0, 1, 0, 0]
    # float32 estimates: A_hat + (A - A_hat) equals A to round-off, not bit for bit
    assert torch.allclose(p1, p0, rtol=1e-4, atol=1e-5), float((p1 - p0).abs().max())


def test_server_that_lost_its_estimates_gets_full_uploads_again(logreg):
    """The server forgets every A_hat after round 2: round 3's deltas are undecodable (rejected), the
    acknowledgement says 'no estimate', round 4's uploads are full, and both copies agree again."""
    from fedconvex.algorithms.base import RoundInfo
    from fedconvex.run import screen_message

    pb, theta0 = logreg
    alg = FedPM(lr=0.8, local_steps=2, precond_codec="delta:topk:0.3")
    state = alg.init(pb, theta0)
    sel = np.arange(pb.n_clients)
    w = pb.client_weights / pb.client_weights.sum()
    for t in (1, 2, 3, 4):
        if t == 3:
            state = state.__class__(
                theta=state.theta,
                clients=state.clients,
                round=state.round,
                server={**state.server, "precond_hat": np.empty(pb.n_clients, dtype=object)},
            )
        up, cs = alg.client_update(pb, alg.broadcast(state), state.clients, sel, None)
        state = state.__class__(theta=state.theta, server=state.server, clients=cs, round=state.round)
        info = RoundInfo(sel=sel, weights=w, n_clients=pb.n_clients)
        full = ["full" in p for p in up["P"].payloads]
        assert all(full) == (t in (1, 4)) and any(full) == (t in (1, 4))
        dec, state = alg.receive(pb, state, up, info)
        kept, info2, rejected = screen_message(dec, info, pb.d, t)
        assert rejected == ([] if t != 3 else list(sel))
        if kept is not None:
            state = alg.server_update(pb, state, kept, info2)
        if t == 3:
            assert all(precond_wire.client_estimate(state.clients, c) is None for c in sel)
    assert all(estimates_agree(state, c) and state.server["precond_hat"][c] is not None for c in sel)


def test_dnn_server_that_lost_its_estimates_gets_full_uploads_again():
    torch = pytest.importorskip("torch")
    from dataclasses import replace

    from test_dnn_training import experiment

    from fedpm_dnn.algorithms.fedpm_wire import client_estimate
    from fedpm_dnn.engine.simulation import build

    seen = {}

    def tamper(t, client, reply):  # only watches: were this round's uploads full matrices?
        seen.setdefault(t, []).append(all("full" in p for p in reply["foof"].values()))
        return reply

    task, driver, state = build(experiment(dnn_fedpm("delta:topk:0.05"), rounds=4), tamper)
    rng = np.random.default_rng(0)
    for t in (1, 2, 3, 4):
        if t == 3:  # the server forgot every A_hat
            state = replace(state, server={**state.server, "foof_hat": {}})
        state, row = driver.round(state, t, rng)
        assert all(seen[t]) == (t in (1, 4)) and any(seen[t]) == (t in (1, 4))
        assert row["rejected"] == (task.n_clients if t == 3 else 0)
    for i in range(task.n_clients):
        assert (
            codecs.digest(state.server["foof_hat"][i])
            == codecs.digest(client_estimate(state.clients[i]))
            != codecs.NO_ESTIMATE
        )
    del torch


def test_dnn_delta_run_resumes_to_the_uninterrupted_history(tmp_path):
    """The estimates, pending estimates and acknowledgements live in the checkpoint: a delta run killed
    after round 2 and resumed has the uninterrupted run's history."""
    pytest.importorskip("torch")
    from test_dnn_training import _strip, experiment

    from fedpm_dnn.engine.simulation import run_experiment

    cfg = dnn_fedpm("delta:topk:0.05")
    tamper = _dnn_tamper("nan-payload", who=1, when=2)  # round 2 rejects client 1: its state matters
    full = run_experiment(experiment(cfg, rounds=4), tamper=tamper)
    ck = str(tmp_path / "ck.pt")
    run_experiment(experiment(cfg, rounds=2), checkpoint=ck, tamper=tamper)
    resumed = run_experiment(experiment(cfg, rounds=4), checkpoint=ck, resume=True, tamper=tamper)
    assert _strip(resumed) == _strip(full)
