"""Conformance table of the DNN methods: every registered method, on the synthetic image task, with
its per-method expectations (fedconvex's protocol: deterministic, pure, stateful where it says so;
FedPM-FOOF at K=1 on a linear least-squares model is a global Newton step)."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedpm_dnn.algorithms import METHODS, REGISTRY, applicable, make_method  # noqa: E402
from fedpm_dnn.engine.simulation import build  # noqa: E402

# which state each method must carry from one round to the next: server-state entries and client-state entries
STATEFUL = {
    "fedavg": ((), ()),
    "fedprox": ((), ()),
    "fedavgm": (("opt",), ()),
    "fedadam": (("opt",), ()),
    "scaffold": (("control",), ("control",)),
    "localnewton": ((), ("foof",)),
    "fedpm": ((), ("foof",)),
}
SETTINGS = dict(lr=0.05, local_epochs=1, batch_size=16, clip=1.0, mu=0.01, server_lr=0.03, foof_samples=20)


def _experiment(name, engine="sequential"):
    from tests.test_dnn_training import experiment

    exp = experiment(make_method(name, **applicable(name, SETTINGS)), rounds=2, participants=2)
    exp.engine = engine
    return exp


def _run(name, rounds=2, engine="sequential"):
    task, driver, state = build(_experiment(name, engine))
    return driver.run(state, rounds, np.random.default_rng(0), history=[])


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=False))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def test_the_table_covers_every_registered_method():
    assert set(STATEFUL) == set(REGISTRY) and METHODS[0] == "fedavg"
    with pytest.raises(ValueError, match="fedavg has no hyper-parameter 'mu'"):
        make_method("fedavg", mu=0.1)


@pytest.mark.parametrize("name", METHODS)
def test_deterministic_given_the_seed(name):
    (s1, h1), (s2, h2) = _run(name), _run(name)
    assert _equal(s1.theta, s2.theta) and _equal(s1.server, s2.server) and _equal(s1.clients, s2.clients)
    strip = lambda h: [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in h]  # noqa
    assert strip(h1) == strip(h2)


@pytest.mark.parametrize("name", METHODS)
def test_inputs_are_not_mutated_and_state_is_kept(name):
    task, driver, state = build(_experiment(name))
    alg = driver.algorithm
    state, _ = driver.run(state, 1, np.random.default_rng(0), history=[])  # round 1: client states exist
    sel = np.array([0, 2])
    down = alg.broadcast(state)
    cstate = [state.clients[i] for i in sel]
    before = copy.deepcopy((down, cstate))
    up, new_cstate = alg.client_update(task, down, cstate, sel, np.random.default_rng(1))
    assert _equal((down, cstate), before)  # client_update: inputs untouched
    from fedconvex.algorithms.base import RoundInfo

    info = RoundInfo(sel=sel, weights=np.full(2, 0.5), n_clients=task.n_clients)
    kept = copy.deepcopy((state.theta, state.server, up))
    new = alg.server_update(task, state, up, info)
    assert _equal((state.theta, state.server, up), kept)  # server_update: inputs untouched
    assert new.round == state.round + 1 and not _equal(new.theta, state.theta)
    server_keys, client_keys = STATEFUL[name]
    for k in server_keys:  # server state moves from round to round
        assert not _equal(new.server[k], state.server[k]), k
    for k in client_keys:  # per-client state is returned and changes
        assert all(k in cs for cs in new_cstate)
        assert any(k in old for old in cstate)  # round 1 left some, round 2 updates them
        assert all(k not in old or not _equal(cs[k], old[k]) for cs, old in zip(new_cstate, cstate, strict=False)), k
    if not server_keys:
        assert _equal(new.server, state.server)
    if not client_keys:
        assert all(set(cs) <= {"foof_static"} for cs in new_cstate)


@pytest.mark.parametrize("name", METHODS)
def test_the_vectorized_engine_behind_client_update_gives_the_same_replies(name):
    from tests.test_vectorized import assert_same

    out = {}
    for engine in ("sequential", "vectorized"):
        task, driver, state = build(_experiment(name, engine))
        alg = driver.algorithm
        up, _ = alg.client_update(
            task, alg.broadcast(state), [state.clients[i] for i in (0, 1)], np.array([0, 1]), None
        )
        out[engine] = {(1, k): {f: {n: v[k] for n, v in up[f].items()} for f in up} for k in range(2)}
    assert_same(out["vectorized"], out["sequential"])


@pytest.mark.parametrize("damping", [0.0, 0.7])
def test_fedpm_at_one_full_batch_step_is_a_global_newton_step(damping):
    # the identity test of tests/test_foof.py, on the registered FedPM's server_update
    from tests.test_foof import test_one_full_batch_foof_step_plus_fedpm_mixing_is_a_global_newton_step as identity

    assert REGISTRY["fedpm"].message_fields["foof"] == "psd"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as in test_foof (its autouse fixture): the identity is exact there
    try:
        identity(damping)
    finally:
        torch.set_default_dtype(old)
