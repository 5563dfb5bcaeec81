"""Hostile flags, hyper-parameters, mixing inputs and client shapes: each case failed before its fix.

A bad value is refused where it enters (the method's constructor, the command line, the library call) with one
line naming the argument; a legal but unusual input (a client without features) gives the same result on every
path.  The command-line cases follow ``test_hostile_inputs``: exit code 2, one stderr line, nothing written."""

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from fedconvex.algorithms import make_algorithm


# ------------------------------------------------------------------ hyper-parameters, one checker for all
@pytest.mark.parametrize(
    "method,params,message",
    [
        ("fedadam", {"server_lr": -0.1}, "fedadam: server_lr must be > 0, got -0.1"),
        ("fedavgm", {"server_lr": 0.0}, "fedavgm: server_lr must be > 0, got 0.0"),
        ("fedavgm", {"momentum": 1.0}, "fedavgm: momentum must be in [0, 1), got 1.0"),
        ("fedavgm", {"momentum": -0.1}, "fedavgm: momentum must be in [0, 1), got -0.1"),
        ("fedadam", {"beta2": 1.5}, "fedadam: beta2 must be in [0, 1), got 1.5"),
        ("fedprox", {"mu": math.nan}, "fedprox: mu must be a finite number, got nan"),
        ("fedprox", {"mu": -1.0}, "fedprox: mu must be >= 0, got -1.0"),
        ("fednl", {"mu": 0.0}, "fednl: mu must be > 0, got 0.0"),
        ("fednl-ls", {"max_backtracks": -1}, "fednl-ls: max_backtracks must be >= 1, got -1"),
        ("fednl-ls", {"c": 1.0}, "fednl-ls: c must be in (0, 1), got 1.0"),
        ("fednl", {"compressor": "topk", "k": "5"}, "fednl: k must be an integer, got '5'"),
        ("fednl", {"compressor": "topk", "k": 5.0}, "fednl: k must be an integer, got 5.0"),
        ("fednl", {"compressor": "topk", "k": True}, "fednl: k must be an integer, got True"),
        ("fednl", {"compressor": "rankr", "rank": 0}, "fednl: rank must be >= 1, got 0"),
        ("fedns", {"sketch_size": 0}, "fedns: sketch_size must be >= 1, got 0"),
        ("fedpm", {"lr": Fraction(1, 2)}, "fedpm: lr must be a number, got Fraction(1, 2)"),
        ("fedpm", {"lr": True}, "fedpm: lr must be a number, got True"),
        ("scaffold", {"global_lr": -1.0}, "scaffold: global_lr must be > 0, got -1.0"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_make_algorithm_checks_every_hyper_parameter(method, params, message):
    with pytest.raises(ValueError) as exc:
        make_algorithm(method, **params)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    "method,params,message",
    [
        ("fedpm", {"refresh_every": 0}, "fedpm: refresh_every must be >= 1, got 0"),
        ("localnewton", {"foof_samples": 0}, "localnewton: foof_samples must be >= 1, got 0"),
        ("fedavgm", {"momentum": 1.0}, "fedavgm: momentum must be in [0, 1), got 1.0"),
        ("fedadam", {"server_lr": -1.0}, "fedadam: server_lr must be > 0, got -1.0"),
        ("fedavg", {"clip": 0.0}, "fedavg: clip must be > 0, got 0.0"),
        ("fedavg", {"weight_decay": -1e-4}, "fedavg: weight_decay must be >= 0, got -0.0001"),
        ("fedpm", {"damping": math.inf}, "fedpm: damping must be a finite number, got inf"),
        ("fedavg", {"batch_size": 64.0}, "fedavg: batch_size must be an integer, got 64.0"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_make_method_checks_every_hyper_parameter(method, params, message):
    from fedpm_dnn.algorithms import make_method

    with pytest.raises(ValueError) as exc:
        make_method(method, **params)
    assert str(exc.value) == message


def test_the_check_holds_for_direct_construction_and_with_params():
    """Not only make_algorithm: the class itself and ``with_params`` (dataclasses.replace) check too."""
    from fedconvex.algorithms import FedAvgM, FedNL

    with pytest.raises(ValueError, match="fedavgm: server_lr must be > 0"):
        FedAvgM(server_lr=-1.0)
    with pytest.raises(ValueError, match="fednl: k must be an integer"):
        FedNL(compressor="topk", k="3")
    with pytest.raises(ValueError, match="fedavgm: momentum must be in"):
        FedAvgM().with_params(momentum=2.0)


def test_zero_d_arrays_are_the_numbers_they_hold_and_every_default_passes():
    from fedconvex.algorithms import REGISTRY
    from fedpm_dnn.algorithms import REGISTRY as DNN

    alg = make_algorithm("fednl", compressor="topk", k=np.int64(3), lr=np.float64(0.5))
    assert type(alg.k) is int and type(alg.lr) is float and (alg.k, alg.lr) == (3, 0.5)
    for registry in (REGISTRY, DNN):
        for name in registry:
            registry.make(name)  # every registered default lies in its range


# ------------------------------------------------------------------ flags: refused, not ignored
def _one_line_error(module, argv, cwd):
    """(exit code, the stderr lines) of ``module.main(argv)`` run in ``cwd``; the folder must not change."""
    from test_hostile_inputs import snapshot

    before = snapshot(cwd)
    try:
        rc = module.main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert snapshot(cwd) == before
    return rc


FLAG_CASES = [
    (
        "sl-max-ratio-half",
        "superlinear",
        ["--dataset", "{W}/tiny.svm", "--max-ratio", "0.5"],
        "--max-ratio 0.5: must be >= 1",
    ),
    ("dnn-max-ratio-half", "dnn", ["--data-dir", "{W}/none", "--max-ratio", "0.5"], "--max-ratio 0.5: must be >= 1"),
    (
        "sl-codec-no-fedpm",
        "superlinear",
        ["--dataset", "{W}/tiny.svm", "--methods", "fedavg,newton", "--precond-codec", "sym"],
        "--precond-codec does not apply: none of fedavg, newton has the hyper-parameter precond_codec",
    ),
    (
        "sl-local-steps-no-taker",
        "superlinear",
        ["--dataset", "{W}/tiny.svm", "--methods", "fednl", "--local-steps", "3"],
        "--local-steps does not apply: fednl has no hyper-parameter local_steps",
    ),
    (
        "dnn-mu-fedavg",
        "dnn",
        ["--data-dir", "{W}/none", "--method", "fedavg", "--mu", "0.1"],
        "--mu does not apply: fedavg has no hyper-parameter mu",
    ),
    (
        "dnn-damping-codec-fedavgm",
        "dnn",
        ["--data-dir", "{W}/none", "--method", "fedavgm", "--damping", "0.1", "--precond-codec", "sym"],
        "--damping, --precond-codec do not apply: fedavgm has no hyper-parameter damping, precond_codec",
    ),
    (
        "fl-codec-scaffold",
        "flower",
        ["--method", "scaffold", "--precond-codec", "sym"],
        "--precond-codec does not apply: scaffold has no hyper-parameter precond_codec",
    ),
    (
        "fl-cnn-codec-fedavg",
        "flower",
        ["--problem", "cnn", "--method", "fedavg", "--precond-codec", "sym"],
        "--precond-codec does not apply: fedavg has no",
    ),
    (
        "fl-dtype-fedavg",
        "flower",
        ["--method", "fedavg", "--precond-dtype", "float32"],
        "--precond-dtype does not apply: fedavg sends no preconditioner",
    ),
    (
        "fl-dtype-fednl",
        "flower",
        ["--method", "fednl", "--precond-dtype", "float16"],
        "--precond-dtype does not apply: fednl sends no preconditioner",
    ),
    (
        "fl-cnn-dtype-fedavg",
        "flower",
        ["--problem", "cnn", "--method", "fedavg", "--precond-dtype", "float16"],
        "--precond-dtype does not apply: fedavg has no hyper-parameter precond_dtype",
    ),
    (
        "fl-cnn-dtype-float64",
        "flower",
        ["--problem", "cnn", "--method", "fedpm", "--precond-dtype", "float64"],
        "--precond-dtype float64: the cnn's preconditioners travel as float32 (its default) or float16",
    ),
]


@pytest.mark.parametrize("name,module,argv,fragment", FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_a_flag_that_cannot_apply_is_one_clear_line(tmp_path, capsys, name, module, argv, fragment):
    import importlib

    from test_hostile_inputs import PROGS

    mod = importlib.import_module(f"validation.{module}")
    (tmp_path / "tiny.svm").write_text(
        "".join(f"{1 if i % 3 else 0} {1 + i % 4}:1 {5 + i % 3}:0.5\n" for i in range(60))
    )
    argv = [a.replace("{W}", str(tmp_path)) for a in argv] + ["--out", str(tmp_path / "out")]
    capsys.readouterr()
    rc = _one_line_error(mod, argv, tmp_path)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{PROGS[mod]}: error: ") and fragment in lines[0], lines[0]


def test_flower_precond_dtype_is_taken_exactly_by_the_methods_whose_reply_carries_preconditioner_blocks():
    """The rule behind the fl-dtype cases, checked against the wire: --precond-dtype casts the blocks of a logreg
    reply (fedpm_flower.wire.flatten), so it is accepted for a method iff its reply template has blocks."""
    from fedconvex.algorithms import REGISTRY, make_algorithm
    from fedpm_flower.logreg import templates
    from validation import flower

    for method in sorted(REGISTRY):
        sends = any(kind == "blocks" for kind, _, _ in templates(make_algorithm(method), 4, 1e-3)["train"].values())
        argv = ["--method", method, "--precond-dtype", "float16", "--out", "unused"]
        try:
            flower.parse_args(argv)
            taken = True
        except SystemExit:
            taken = False
        assert taken == sends, method


def test_the_driver_refuses_a_guard_below_one():
    """The library's boundary too: a guard R < 1 would reject even the median reply every round."""
    from fedconvex.driver import Driver

    with pytest.raises(ValueError, match="max_ratio 0.5: must be >= 1"):
        Driver(None, None, None, None, None, n_clients=2, max_ratio=0.5)
    Driver(None, None, None, None, None, n_clients=2, max_ratio=0.0)  # 0: off


# ------------------------------------------------------------------ mixing and screening inputs
def test_simple_mix_of_integers_averages_them_and_keeps_their_dtype():
    """BatchNorm's num_batches_tracked is an integer buffer: its average, not zeros (the weights were cast
    to the integers' dtype)."""
    torch = pytest.importorskip("torch")
    from fedconvex.mixing import simple_mix

    counts = np.array([[10, 3], [20, 4], [30, 8]], dtype=np.int64)
    got = simple_mix(counts, [1.0, 1.0, 2.0])
    assert got.dtype == np.int64 and got.tolist() == np.round(counts.T @ [0.25, 0.25, 0.5]).tolist()
    t = simple_mix(torch.as_tensor(counts))
    assert t.dtype == torch.int64 and t.tolist() == [20, 5]
    with pytest.raises(ValueError, match="X has dtype bool"):
        simple_mix(np.array([True, False]))


@pytest.mark.parametrize(
    "weights,P,message",
    [
        ([1.0, -0.5], None, "weights must be >= 0, got -0.5"),
        ([1.0, math.nan], None, "weights must sum to a finite positive number"),
        ([1.0, 1j], None, "weights must be real numbers"),
        (None, "complex", "P has dtype complex128, expected a real floating-point array"),
        (None, "nan", "the preconditioners or parameters contain NaN or Inf"),
        (None, "inf", "the preconditioners or parameters contain NaN or Inf"),
    ],
    ids=["negative-weight", "nan-weight", "complex-weight", "complex-P", "nan-P", "inf-P"],
)
def test_precond_mix_refuses_what_is_not_a_weighted_average(weights, P, message):
    from fedconvex.mixing import precond_mix

    stack = np.stack([2 * np.eye(3), np.eye(3)])
    if P == "complex":
        stack = stack.astype(complex)
    elif P in ("nan", "inf"):
        stack[1, 0, 0] = math.nan if P == "nan" else math.inf
    with pytest.raises(ValueError) as exc:
        precond_mix(stack, np.ones((2, 3)), weights)
    assert message in str(exc.value)


def test_in_process_screening_refuses_repeated_features_as_the_wire_does():
    """A block on active features [0, 0] counts feature 0's entries twice; Flower's wire refused it, the
    in-process screening took it.  Both now give the same reason, from one check."""
    from fedconvex.algorithms.base import RoundInfo
    from fedconvex.blocks import ActiveBlocks
    from fedconvex.driver import screen_message
    from fedpm_flower.wire import unflatten

    d, B = 4, np.eye(2)
    good, bad = np.array([0, 2]), np.array([1, 1])
    up = {"theta": np.zeros((2, d)), "P": ActiveBlocks((B, B), (good, bad), d, 0.0)}
    info = RoundInfo(sel=np.array([0, 1]), weights=np.array([0.5, 0.5]), n_clients=2)
    kept, kept_info, rejected = screen_message(up, info, d, 1, fields={"theta": "model", "P": "psd"})
    assert rejected == [1] and kept_info.sel.tolist() == [0]
    template = {"theta": ("array", "f", (d,)), "P": ("blocks", "f", None)}
    _, wire_reason = unflatten({"theta": np.zeros(d), "P/block": B, "P/active": bad}, template, d, 0.0)
    from fedconvex.messages import client_problem

    assert client_problem(up, 1, d, ("P",)) == wire_reason == "P: feature indices has repeated entries"


# ------------------------------------------------------------------ Flower's command line
def _prepared(root, clients=2, test_label=0):
    """A tiny prepared data set as ``validation.flower prepare`` writes it (2 classes, 4x4 images)."""
    from fedpm_flower import prepared

    meta = {"num_classes": 2, "channels": 3, "image_size": 4, "mean": [0.5] * 3, "std": [0.25] * 3, "clients": clients}
    x = np.zeros((4, 3, 4, 4), dtype=np.uint8)
    for i in range(clients):
        prepared.write(prepared.client_folder(str(root), i), "train.npz", x, [0, 1, 0, 1], {**meta, "client": i})
    prepared.write(prepared.server_folder(str(root)), "test.npz", x, [0, 1, 1, test_label], meta)
    (root / "meta.json").write_text(json.dumps({"clients": clients}))
    return str(root)


PARAM_FLAG_CASES = [
    ("lr-twice", ["--lr", "0.5", "--params", '{"lr": 0.1}'], "--params sets 'lr' and so does --lr: give it once"),
    (
        "steps-twice",
        ["--local-steps", "1", "--params", '{"local_steps": 2}'],
        "--params sets 'local_steps' and so does --local-steps",
    ),
    (
        "codec-twice",
        ["--precond-codec", "sym", "--params", '{"precond_codec": "fp16"}'],
        "--params sets 'precond_codec' and so does --precond-codec",
    ),
    (
        "cnn-epochs-twice",
        ["--problem", "cnn", "--method", "fedavg", "--local-steps", "2", "--params", '{"local_epochs": 1}'],
        "--params sets 'local_epochs' and so does --local-steps",
    ),
    ("codec-bad", ["--params", '{"precond_codec": 3}'], "--params 'precond_codec': "),
    ("prepared-too-few", ["--problem", "cnn", "--data-dir", "{P}", "--clients", "3"], "--clients 3 exceeds the 2"),
    ("prepared-label-99", ["--problem", "cnn", "--data-dir", "{Q}"], "server/test.npz: labels outside 0..1"),
]


@pytest.mark.parametrize("name,argv,fragment", PARAM_FLAG_CASES, ids=[c[0] for c in PARAM_FLAG_CASES])
def test_flower_refuses_a_setting_given_twice_or_data_that_cannot_serve(tmp_path, capsys, name, argv, fragment):
    from validation import flower

    prepared_ok = _prepared(tmp_path / "parts", clients=2)
    prepared_99 = _prepared(tmp_path / "parts99", clients=2, test_label=99)
    argv = [a.replace("{P}", prepared_ok).replace("{Q}", prepared_99) for a in argv]
    capsys.readouterr()
    rc = _one_line_error(
        flower, argv + ["--clients", "2"] * ("--clients" not in argv) + ["--out", str(tmp_path / "o")], tmp_path
    )
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("python -m validation.flower: error: ") and fragment in lines[0], lines[0]


def test_a_params_key_with_its_own_flag_is_the_setting_that_runs_and_is_recorded():
    """--params '{"lr": 0.5}' without --lr: the run's (and result.json's) lr is 0.5, not the default beside an
    unused 0.5."""
    from fedpm_flower.logreg import algorithm
    from validation import flower

    args = flower.parse_args(["--method", "fedavg", "--params", '{"lr": 0.5, "local_steps": 3}', "--out", "x"])
    assert (args.lr, args.local_steps, args.params) == (0.5, 3, "")
    from fedpm_flower.config import FlowerRunConfig

    cfg = FlowerRunConfig(method="fedavg", lr=args.lr, local_steps=args.local_steps, params=args.params)
    assert (algorithm(cfg).lr, algorithm(cfg).local_steps) == (0.5, 3)


# ------------------------------------------------------------------ numbers out of float64's reach
def _tiny_problem_data(n=40, big=None):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 3))
    if big is not None:
        X[7, 1] = big
    return X, np.where(rng.random(n) < 0.5, -1.0, 1.0)


def test_values_whose_squares_overflow_are_named_as_such_not_as_a_large_learning_rate():
    from fedconvex.data import DataError
    from fedconvex.problem import FederatedLogReg

    X, y = _tiny_problem_data(big=1e300)
    with pytest.raises(DataError, match=r"X holds a value of 1e\+300 \(row 7\): sums of squares .* rescale"):
        FederatedLogReg(X, y, [np.arange(20), np.arange(20, 40)])
    X[7, 1] = 1e140  # large, but its squares summed over 40 rows stay finite: accepted (a lam of 1e-3 next to
    FederatedLogReg(X, y, [np.arange(20), np.arange(20, 40)], lam=0.0)  # a 1e277 Hessian would be refused)


def test_a_lam_below_float64_resolution_is_refused_and_zero_is_no_regularisation():
    from fedconvex.problem import FederatedLogReg

    X, y = _tiny_problem_data()
    parts = [np.arange(20), np.arange(20, 40)]
    with pytest.raises(ValueError, match="lam 1e-300 is below float64's resolution .* it regularises nothing"):
        FederatedLogReg(X, y, parts, lam=1e-300)
    FederatedLogReg(X, y, parts, lam=0.0)  # no regularisation, as asked
    scale = 0.25 * float((X**2).sum(axis=0).max()) / len(X)  # bound on the data Hessian's diagonal
    eps = np.finfo(np.float64).eps
    FederatedLogReg(X, y, parts, lam=10 * eps * scale)
    with pytest.raises(ValueError, match="it regularises nothing"):
        FederatedLogReg(X, y, parts, lam=0.1 * eps * scale)


@pytest.mark.parametrize("theta0", [np.zeros(3, dtype=complex), np.zeros(3, dtype=bool)], ids=["complex", "bool"])
def test_a_theta0_that_is_not_real_is_one_clear_error(theta0):
    from fedconvex.problem import FederatedLogReg
    from fedconvex.run import run

    X, y = _tiny_problem_data()
    pb = FederatedLogReg(X, y, [np.arange(20), np.arange(20, 40)])
    with pytest.raises(TypeError, match=f"theta0 must be a real array, got dtype {theta0.dtype}"):
        run(pb, make_algorithm("fedpm"), theta0, 1)


NUMERIC_CASES = [
    ("sl-lam-tiny", ["--dataset", "{W}/tiny.svm", "--lam", "1e-300"], "lam 1e-300 is below float64's resolution"),
    ("sl-value-1e300", ["--dataset", "{W}/big.svm"], "X holds a value of 1e+300"),
]


@pytest.mark.parametrize("name,argv,fragment", NUMERIC_CASES, ids=[c[0] for c in NUMERIC_CASES])
def test_numbers_beyond_float64_are_one_clear_line(tmp_path, capsys, name, argv, fragment):
    from validation import superlinear

    rows = "".join(f"{1 if i % 3 else 0} {1 + i % 4}:1 {5 + i % 3}:0.5\n" for i in range(60))
    (tmp_path / "tiny.svm").write_text(rows)
    (tmp_path / "big.svm").write_text(rows + "1 2:1e300\n")
    argv = [a.replace("{W}", str(tmp_path)) for a in argv]
    capsys.readouterr()
    rc = _one_line_error(
        superlinear, argv + ["--methods", "fedpm", "--lr", "1", "--out", str(tmp_path / "o")], tmp_path
    )
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("python -m validation.superlinear: error: ") and fragment in lines[0], lines[0]


# ------------------------------------------------------------------ a client without features
@pytest.mark.parametrize(
    "kw",
    [
        dict(method="fedpm", precond_codec="delta:topk:2"),
        dict(method="fedpm", precond_codec="delta:rankr:1"),
        dict(method="fedpm", precond_codec="lowrank:1"),
        dict(method="fedns", params='{"sketch": "countsketch", "sketch_size": 3}'),
    ],
    ids=["delta-topk", "delta-rankr", "lowrank", "fedns-countsketch"],
)
def test_a_client_without_features_takes_part_alike_in_process_and_on_flower(tmp_path, kw):
    """Client 2's rows have no features: its 0 x 0 block is an empty payload (nothing of a count of one), its
    sketch real zeros.  In-process the run completes, on Flower (loopback grid: the ServerApp, the wire and the
    nodes' state) it is used every round, and both give the same model."""
    pytest.importorskip("flwr")
    from test_flower import config, loopback

    from validation.flower import in_process

    rng = np.random.default_rng(0)
    rows = [
        f"{1 if rng.random() < 0.5 else -1} "
        + ("" if i >= 20 else " ".join(f"{j}:{rng.normal():.3f}" for j in range(1, 5)))
        for i in range(30)
    ]
    (tmp_path / "nofeat.svm").write_text("\n".join(r.strip() for r in rows) + "\n")
    cfg = config(dataset=str(tmp_path / "nofeat.svm"), clients=3, rounds=3, **kw)
    result = loopback(cfg)
    assert [h["used"] for h in result["history"][1:]] == [3, 3, 3]
    np.testing.assert_allclose(np.asarray(result["theta"]), in_process(cfg), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ Flower: signals
@pytest.mark.slow
def test_sigterm_in_a_flower_simulation_round_is_one_line_and_leaves_nothing(tmp_path):
    """Ray, started by the simulation, answered SIGTERM itself: exit 134 through its abort handler, no message,
    sometimes a .partial-* folder left.  Now: the last line is the command's, exit 143, nothing written, no
    process of the simulation (Ray's included) left."""
    import os
    import subprocess
    import sys
    import time

    pytest.importorskip("flwr")
    from fedpm_flower.deploy import _zombie, descendants  # _zombie: gone, or ended and not yet reaped

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "validation.flower", "--method", "fedpm", "--rounds", "500", "--clients", "2"]
    p = subprocess.Popen(
        cmd + ["--out", str(tmp_path / "o")],
        env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"},
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while len(descendants({p.pid})) < 4 and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)  # the simulation's process, Ray's and its actors: the rounds are under way
    time.sleep(3.0)
    tree = descendants({p.pid})
    assert len(tree) >= 4 and p.poll() is None, "the simulation did not start"
    p.terminate()
    err = p.communicate(timeout=120)[1]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 143, err[-2000:]
    assert lines[-1] == "python -m validation.flower: error: terminated (SIGTERM); nothing was written", lines[-5:]
    assert os.listdir(tmp_path) == []
    deadline = time.time() + 15
    while [q for q in tree if not _zombie(q)] and time.time() < deadline:
        time.sleep(0.2)
    assert not [q for q in tree if not _zombie(q)], "a process of the simulation outlived it"


@pytest.mark.slow
def test_the_deployment_timeout_bounds_a_round_and_a_killed_supernode_is_dropped(deployment_runs):
    """--timeout 40 bounded the whole deployment: start-up and two rounds, each waiting 40 s for a killed
    SuperNode, ran past it and the run failed.  Now it bounds each wait: the killed node is left out of every
    round after the timeout and the run completes with the other two (the shared deployment's run with
    SuperNode 2 dead, launched with the round's --timeout: tests/flower_deployment.py)."""
    pytest.importorskip("flwr")
    from flower_deployment import result_of

    result, cfg = result_of(deployment_runs, "dead"), deployment_runs["configs"]["dead"]
    assert result["seconds"] > cfg.timeout  # the run outlasted the launcher's --timeout
    used = [h["used"] for h in result["history"][1:]]
    # the killed node never; the other two once their ClientApps are up (on a loaded machine the first round's
    # replies may come after the timeout, and that round is then skipped, as --timeout says)
    assert len(used) == cfg.rounds and used[-1] == 2, (used, result.get("server_warnings"))
    assert np.all(np.isfinite(result["theta"]))
