"""Generated hostile inputs to every library entry point: ``fedpm_dnn.FOOF``, ``fedpm_dnn.mix``,
``fedpm_dnn.federated``, the Flower strategy ``fedpm_flower.strategy.FedPM``, and the mixing kernels
``fedconvex.mixing.simple_mix`` and ``precond_mix``.

Each case ends in success or in a ValueError/TypeError whose message names the argument it refuses; an accepted
case gives finite results (or, for a rate that large, the documented divergence), never another exception and
never a silent non-finite result.  Seeded (``derandomize``): the same cases on every run; the counts are in
docs/robustness.md."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedconvex.driver import Diverged  # noqa: E402
from fedconvex.mixing import precond_mix, simple_mix  # noqa: E402
from fedpm_dnn import FOOF, federated, mix  # noqa: E402

torch.set_num_threads(1)


def fuzz(examples: int):
    """Seeded settings: the same ``examples`` cases on every run, no example database."""
    return settings(
        derandomize=True, deadline=None, database=None, max_examples=examples, suppress_health_check=list(HealthCheck)
    )


NAN, INF = float("nan"), float("inf")
# hostile numbers: huge, tiny, NaN, inf, negative, zero, wrong kinds
NUMBERS = st.sampled_from([NAN, INF, -INF, 1e300, 3.5e38, 1e38, 1e-300, 1e-45, -1.0, -1e-9, 0.0, 0.5, 1.0, 2.0, 1e3])
WRONG = st.sampled_from(["1", "", "nan", None, True, False, [1.0], {"a": 1}, b"1", 1 + 2j, object()])
HOSTILE = st.one_of(NUMBERS, WRONG, st.integers(-(2**70), 2**70), st.sampled_from([10**400, -(2**2000)]))


def names(exc: BaseException, *words) -> bool:
    text = str(exc)
    return "\n" not in text and any(w in text for w in words)


def moderate(*values) -> bool:
    """Every number given is of a size an optimizer's result stays finite under (no huge rate or decay)."""
    return all(not isinstance(v, (int, float)) or isinstance(v, bool) or abs(v) <= 1e3 for v in values)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.ln = nn.LayerNorm(5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.ln(self.fc1(x))))


def data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


# --- FOOF ---------------------------------------------------------------------------------------------------------
FOOF_ARGS = ("lr", "damping", "momentum", "weight_decay", "clip", "stats_every", "inverse_every", "stats_decay")


@fuzz(200)
@given(kw=st.dictionaries(st.sampled_from(FOOF_ARGS + ("clip_stage",)), HOSTILE, max_size=2), lr=NUMBERS)
def test_foof_generated_arguments(kw, lr):
    torch.manual_seed(0)
    model = Net()
    if "clip_stage" in kw and not isinstance(kw["clip_stage"], str):
        kw["clip_stage"] = str(kw["clip_stage"])
    try:
        opt = FOOF(model, lr=lr, **kw)
    except (TypeError, ValueError) as exc:
        assert names(exc, "lr", *kw), (kw, lr, exc)
        return
    x, y = data()
    if opt.stats_every is None:
        opt.update_statistics([x])
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if moderate(lr, *kw.values()):
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), (kw, lr)


TENSORS = st.sampled_from(["nan", "inf", "huge", "neg-definite", "non-symmetric", "complex", "int", "bool", "shape",
                           "empty", "ok"])  # fmt: skip


def hostile_matrix(kind: str, d: int):
    g = torch.Generator().manual_seed(d)
    a = torch.randn(3 * d, d, generator=g, dtype=torch.float64)
    A = a.T @ a / (3 * d)
    if kind == "nan":
        A[0, 0] = NAN
    elif kind == "inf":
        A[-1, 0] = A[0, -1] = INF
    elif kind == "huge":
        A = A * 1e300
    elif kind == "neg-definite":
        A = -5 * torch.eye(d, dtype=torch.float64)
    elif kind == "non-symmetric":
        A[0, 1] += 1.0
    elif kind == "complex":
        A = A.to(torch.complex128)
    elif kind == "int":
        A = torch.eye(d, dtype=torch.int64)
    elif kind == "bool":
        A = torch.eye(d, dtype=torch.bool)
    elif kind == "shape":
        A = A[:-1]
    elif kind == "empty":
        A = torch.empty(0, 0, dtype=torch.float64)
    return A


@fuzz(60)
@given(kind=TENSORS, block=st.sampled_from(["fc1", "fc2"]), via=st.sampled_from(["set_matrices", "state"]))
def test_foof_generated_matrices(kind, block, via):
    model = Net()
    opt = FOOF(model, lr=0.1)
    x, y = data()
    opt.update_statistics([x])
    given_ = opt.matrices()
    given_[block] = hostile_matrix(kind, given_[block].shape[0])
    try:
        if via == "set_matrices":
            opt.set_matrices(given_)
        else:
            state = opt.state_dict()
            state["foof"]["matrices"] = state["foof"]["inverted"] = given_
            opt.load_state_dict(state)
    except (TypeError, ValueError) as exc:
        assert kind not in ("ok", "int") and names(exc, repr(block), "matri"), (kind, exc)
        return
    assert kind in ("ok", "int"), kind  # an integer second moment is a number like any other
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# --- mix ----------------------------------------------------------------------------------------------------------
STATE_HARM = st.sampled_from(["nan", "inf", "-inf", "huge", "complex", "dtype", "shape", "missing", "extra",
                              "not-tensor", "ok"])  # fmt: skip
MIX_ENTRIES = ("fc1.weight", "fc1.bias", "ln.weight", "ln.bias", "fc2.weight", "fc2.bias")


def harmed_state(state: dict, harm: str, entry: str) -> dict:
    s = {k: v.clone() for k, v in state.items()}
    v = s[entry]
    if harm in ("nan", "inf", "-inf", "huge"):
        v.view(-1)[0] = {"nan": NAN, "inf": INF, "-inf": -INF, "huge": 1e38}[harm]
    elif harm == "complex":
        s[entry] = v.to(torch.complex64)
    elif harm == "dtype":
        s[entry] = v.double()
    elif harm == "shape":
        s[entry] = v[..., :-1]
    elif harm == "missing":
        del s[entry]
    elif harm == "extra":
        s["extra.weight"] = torch.zeros(2)
    elif harm == "not-tensor":
        s[entry] = v.tolist()
    return s


@fuzz(200)
@given(
    clients=st.integers(1, 3),
    harm=STATE_HARM,
    entry=st.sampled_from(MIX_ENTRIES),
    victim=st.integers(0, 2),
    matrix=TENSORS,
    weights=st.one_of(st.none(), st.lists(st.one_of(NUMBERS, WRONG), min_size=0, max_size=4)),
    damping=st.one_of(NUMBERS, WRONG),
)
def test_mix_generated_states_matrices_weights_and_damping(clients, harm, entry, victim, matrix, weights, damping):
    states, mats = [], []
    for i in range(clients):
        torch.manual_seed(i)
        model = Net()
        opt = FOOF(model, lr=0.1)
        opt.update_statistics([data(seed=i)[0]])
        states.append({k: v.detach() for k, v in model.state_dict().items()})
        mats.append(opt.matrices())
    victim %= clients
    states[victim] = harmed_state(states[victim], harm, entry)
    block = "fc1" if entry.startswith("fc1") else "fc2"
    mats[victim] = {**mats[victim], block: hostile_matrix(matrix, mats[victim][block].shape[0])}
    try:
        out = mix(states, mats, weights=weights, damping=damping)
    except (TypeError, ValueError) as exc:
        assert names(exc, "client", "entry", "matri", "weights", "damping", "state", "mix"), exc
        return
    alone = ("dtype", "shape", "missing", "extra")  # differences from client 0's: none with one client
    assert (harm in ("ok", "huge") or (clients == 1 and harm in alone)) and matrix in ("ok", "int"), (harm, matrix)
    if harm == "ok" and moderate(damping):
        assert all(bool(torch.isfinite(v).all()) for v in out.values())
        assert set(out) == set(states[0])


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("entry", ["ln.weight", "ln.bias", "fc2.bias"])
def test_mix_refuses_a_non_finite_value_in_any_floating_entry(entry, value):
    """Not only a FOOF block's: a LayerNorm weight with NaN was averaged into the result."""
    states, mats = [], []
    for i in range(2):
        torch.manual_seed(i)
        model = Net()
        opt = FOOF(model, lr=0.1)
        opt.update_statistics([data(seed=i)[0]])
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        mats.append(opt.matrices())
    healthy = mix(states, mats)  # the healthy counterpart: the LayerNorm's mean
    torch.testing.assert_close(healthy["ln.weight"], (states[0]["ln.weight"] + states[1]["ln.weight"]) / 2)
    states[1][entry].view(-1)[0] = value
    with pytest.raises(ValueError, match=f"client 1's entry '{entry}' contains NaN or Inf"):
        mix(states, mats)


# --- federated ----------------------------------------------------------------------------------------------------
FED_ARGS = {
    "rounds": st.one_of(st.sampled_from([0, -1, 1.5, "1", True, None, NAN]), st.just(1)),
    "participants": st.sampled_from([None, 0, 3, -1, 1.0, "1", True, 1, 2]),
    "seed": st.sampled_from([0, -1, 2**64, 1.5, "0", None, True]),
    "engine": st.sampled_from(["sequential", "vectorized", "auto", "", None, 1]),
    "device": st.sampled_from(["cpu", "cuda", "cuda:7", "tpu", "", "cpu:0", None, 3]),
    "max_ratio": st.sampled_from([None, 0, 0.5, 1.0, 1e3, NAN, INF, -1.0, "5", True]),
    "method": st.sampled_from(["fedpm", "fedavg", "localnewton", "nope", "", None, 3]),
    "lr": NUMBERS,
    "damping": st.one_of(NUMBERS, WRONG),
    "local_epochs": st.sampled_from([1, 0, -1, 1.5, "1", True, 2**40]),
    "batch_size": st.sampled_from([4, 0, -4, 2.5, None]),
}


def _fed_clients():
    return [[data(4, seed=s)] for s in range(2)]


def some_of(args: dict, most: int):
    """Up to ``most`` of ``args``, each with a generated value: one or two hostile arguments beside valid ones,
    so that each is reached rather than hidden behind another's error."""
    keys = st.lists(st.sampled_from(sorted(args)), max_size=most, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({k: args[k] for k in ks}))


@fuzz(80)
@given(kw=some_of(FED_ARGS, 2))
def test_federated_generated_arguments(kw):
    kw = dict(kw)
    kw.setdefault("rounds", 1)
    if kw.get("local_epochs") == 2**40:  # a valid count, but hours of training
        del kw["local_epochs"]
    try:
        run = federated(Net, _fed_clients(), **kw)
    except (TypeError, ValueError) as exc:
        assert names(exc, *kw, "hyper-parameter", "method", "client"), (kw, exc)
        return
    except Diverged as exc:  # the documented end of a rate too large (an ArithmeticError)
        assert not moderate(kw.get("lr", 0.1)) or kw.get("damping") == 0.0, (kw, exc)
        return
    if moderate(*kw.values()) and kw.get("damping") not in (0, 0.0):
        assert all(bool(torch.isfinite(p).all()) for p in run.model.parameters()), kw


# --- the Flower strategy ------------------------------------------------------------------------------------------
STRATEGY_ARGS = {
    "damping": st.one_of(NUMBERS, WRONG),
    "weighting": st.sampled_from(["uniform", "samples", "", "Uniform", None, 1]),
    "max_ratio": st.one_of(NUMBERS, WRONG),
    "blocks": st.sampled_from([None, {"fc1": 5}, {"fc1": 0}, {"fc1": 2.5}, {"": True}, {1: 5}, [("fc1", 5)], "fc1"]),
    "fraction_train": st.one_of(NUMBERS, WRONG),
    "fraction_evaluate": st.one_of(NUMBERS, WRONG),
    "min_train_nodes": st.sampled_from([0, 1, 2, -1, 1.5, "2", None, True, 2**70]),
    "min_available_nodes": st.sampled_from([0, 1, 2, -1, 1.5, "2", None, True]),
}


@fuzz(150)
@given(kw=some_of(STRATEGY_ARGS, 2))
def test_flower_strategy_generated_arguments(kw):
    strategy = pytest.importorskip("fedpm_flower.strategy")
    try:
        s = strategy.FedPM(**kw)
    except (TypeError, ValueError) as exc:
        assert names(exc, *kw), (kw, exc)
        return
    assert math.isfinite(s.damping) and s.damping >= 0
    assert 0 <= s.fraction_train <= 1 and 0 <= s.fraction_evaluate <= 1
    for key in ("min_train_nodes", "min_available_nodes"):
        assert isinstance(getattr(s, key), int) and getattr(s, key) >= 0, key


# --- the mixing kernels -------------------------------------------------------------------------------------------
ARRAY_HARM = st.sampled_from(["nan", "inf", "huge", "tiny", "negative", "empty", "int", "bool", "complex", "float16",
                              "0-d", "list", "ok"])  # fmt: skip


def harmed_array(harm: str, shape: tuple, lib: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape)
    if harm == "nan":
        a.flat[0] = NAN
    elif harm == "inf":
        a.flat[-1] = INF
    elif harm == "huge":
        a = a * 1e300
    elif harm == "tiny":
        a = a * 1e-300
    elif harm == "negative":
        a = -np.abs(a)
    elif harm == "empty":
        a = a[:0]
    elif harm == "int":
        a = np.round(a).astype(np.int64)
    elif harm == "bool":
        a = a > 0
    elif harm == "complex":
        a = a + 1j
    elif harm == "float16":
        a = a.astype(np.float16)
    elif harm == "0-d":
        a = np.float64(1.0)
    if harm == "list":
        return a.tolist()
    return torch.as_tensor(a) if lib == "torch" else a


def _finite(x) -> bool:
    return bool(np.isfinite(np.asarray(x.detach() if torch.is_tensor(x) else x, dtype=np.complex128)).all())


@fuzz(200)
@given(
    harm=ARRAY_HARM,
    lib=st.sampled_from(["numpy", "torch"]),
    n=st.integers(1, 3),
    weights=st.one_of(st.none(), st.lists(st.one_of(NUMBERS, WRONG), max_size=4)),
)
def test_simple_mix_generated_arrays_and_weights(harm, lib, n, weights):
    X = harmed_array(harm, (n, 3, 2), lib)
    try:
        out = simple_mix(X, weights)
    except (TypeError, ValueError) as exc:
        assert names(exc, "X", "weights", "simple_mix"), exc
        return
    assert harm in ("ok", "negative", "tiny", "int", "float16", "huge"), harm
    if harm != "huge":
        assert _finite(out) and tuple(out.shape) == (3, 2)


@fuzz(250)
@given(
    p_harm=st.sampled_from(
        ["nan", "inf", "huge", "tiny", "empty", "int", "bool", "complex", "shape", "list", "neg-definite", "ok"]
    ),  # fmt: skip
    x_harm=ARRAY_HARM,
    lib=st.sampled_from(["numpy", "torch"]),
    n=st.integers(1, 3),
    weights=st.one_of(st.none(), st.lists(st.one_of(NUMBERS, WRONG), max_size=4)),
    damping=st.one_of(NUMBERS, WRONG),
)
def test_precond_mix_generated_arrays_weights_and_damping(p_harm, x_harm, lib, n, weights, damping):
    d = 3
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, 2 * d, d))
    P = np.einsum("kij,kil->kjl", a, a) / (2 * d)
    if p_harm == "neg-definite":
        P = np.stack([-5 * np.eye(d)] * n)
    elif p_harm == "shape":
        P = P[:, :, :-1]
    elif p_harm != "ok":
        P = harmed_array(p_harm, (n, d, d), "numpy") if p_harm not in ("nan", "inf", "huge", "tiny") else P
        if p_harm == "nan":
            P[0, 0, 0] = NAN
        elif p_harm == "inf":
            P[0, 0, 0] = INF
        elif p_harm == "huge":
            P = P * 1e300
        elif p_harm == "tiny":
            P = P * 1e-300
    if lib == "torch" and not isinstance(P, list):
        P = torch.as_tensor(P)
    X = harmed_array(x_harm, (n, d, 2), lib, seed=2)
    try:
        out = precond_mix(P, X, weights, damping)
    except (TypeError, ValueError) as exc:
        assert names(exc, "P", "X", "weights", "damping", "precond_mix"), exc
        return
    except np.linalg.LinAlgError:  # pragma: no cover - a failure of the rule
        raise
    # the kernel's contract leaves P's definiteness to its callers (a check per block and round would cost a
    # factorisation): -5 I is mixed by the formula as given
    assert p_harm in ("ok", "int", "tiny", "huge", "neg-definite"), p_harm
    assert x_harm in ("ok", "negative", "tiny", "int", "huge", "float16"), x_harm
    if p_harm in ("ok", "tiny") and x_harm in ("ok", "negative", "tiny", "int") and moderate(damping):
        assert _finite(out)
