"""Several runs trained as one stack (fedpm_dnn.engine.stacked_runs) give each run what it gets trained alone on the
vectorized engine: replies every round, the global model, the history; a killed stack resumes every run."""

import csv
import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedpm_dnn.algorithms import METHODS, applicable, make_method  # noqa: E402
from fedpm_dnn.engine import stacked_runs as rs  # noqa: E402
from fedpm_dnn.engine.sequential import ClientData  # noqa: E402
from fedpm_dnn.engine.simulation import Experiment, run_experiment  # noqa: E402

# two runs with unequal client counts and sizes (5 is below one batch of 8, 9 and 12 end in partial batches)
RUNS = (dict(sizes=(20, 9, 5), seed=3, participants=2), dict(sizes=(12, 7), seed=5, participants=None))
CFG = dict(lr=0.05, local_epochs=1, batch_size=8, mu=0.01, server_lr=0.03, clip=1.0, damping=0.5)


def experiment(cfg, run, rounds=2, chunk=None):
    g = np.random.default_rng(run["seed"])
    clients = [
        ClientData(
            torch.as_tensor(g.integers(0, 256, (n, 3, 16, 16)).astype(np.uint8)),
            torch.as_tensor(g.integers(0, 3, n)),
            (0.4, 0.5, 0.45),
            (0.25, 0.3, 0.2),
            augment=i != 1,
        )
        for i, n in enumerate(run["sizes"])
    ]
    return Experiment(
        cfg=cfg,
        model="cnn",
        num_classes=3,
        clients=clients,
        x_test=torch.as_tensor(g.integers(0, 256, (20, 3, 16, 16)).astype(np.uint8)),
        y_test=torch.as_tensor(g.integers(0, 3, 20)),
        mean=(0.4, 0.5, 0.45),
        std=(0.25, 0.3, 0.2),
        rounds=rounds,
        participants=run["participants"],
        seed=run["seed"],
        image_size=16,
        engine="vectorized",
        client_chunk=chunk,
    )


def recorder():
    seen = {}

    def tamper(t, i, reply):
        seen[(t, i)] = reply
        return reply

    return seen, tamper


def alone(cfg, run, path, **kw):
    seen, tamper = recorder()
    return run_experiment(experiment(cfg, run, **kw), checkpoint=path, tamper=tamper), seen


def stacked(cfg, paths, resume=(False, False), rounds=(2, 2), chunk=None):
    exps, seen = [], []
    for run, n in zip(RUNS, rounds, strict=True):
        exps.append(experiment(cfg, run, rounds=n, chunk=chunk))
    # replies recorded through each run's transport (the tamper hook), as run_experiment's own test does
    from fedpm_dnn.engine import simulation

    real = simulation.build
    records = [recorder() for _ in exps]

    def build(exp, tamper=None):
        return real(exp, records[[id(e) for e in exps].index(id(exp))][1])

    simulation.build = build
    try:
        out = rs.run_stack(exps, list(paths), list(resume), [None] * len(exps))
    finally:
        simulation.build = real
    seen = [r[0] for r in records]
    return out, seen


def rel(a, b):
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-12))


def assert_close_replies(got, ref, tol=1e-5):
    """Every reply of every round within ``tol`` relative (SCAFFOLD's dcontrol, a difference of nearby parameters
    over steps * lr, within 1e-4, as tests/test_vectorized.py allows)."""
    assert got.keys() == ref.keys()
    for key, reply in ref.items():
        for part, vals in reply.items():
            for name, v in vals.items():
                assert rel(got[key][part][name], v) <= (1e-4 if part == "dcontrol" else tol), (key, part, name)


def strip(history):
    return [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in history]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_stacked_equals_each_run_alone(method, tmp_path):
    """Two runs (3 clients, 2 sampled, and 2 clients, all taking part) in one stack, in chunks of 3 clients (the
    first spans both runs): every round's replies, the final model and the history equal each run trained alone."""
    cfg = make_method(method, **applicable(method, CFG))
    paths = [str(tmp_path / f"stack{r}.pt") for r in range(2)]
    hists, seen = stacked(cfg, paths, chunk=3)
    for r, run in enumerate(RUNS):
        ref_hist, ref_seen = alone(cfg, run, str(tmp_path / f"alone{r}.pt"))
        assert_close_replies(seen[r], ref_seen)
        got_m, ref_m = (
            torch.load(p, weights_only=True)["server"]["params"] for p in (paths[r], tmp_path / f"alone{r}.pt")
        )
        for name, v in ref_m.items():
            assert rel(got_m[name], v) <= 1e-5, (r, name)
        for a, b in zip(hists[r], ref_hist, strict=True):
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
            assert a["bytes_up"] == b["bytes_up"] and a["test_acc"] == pytest.approx(b["test_acc"], abs=0.051)


def test_a_killed_stack_resumes_every_run_identically(tmp_path):
    """Run 0 checkpointed two rounds, run 1 one round (killed in between): the resumed stack finishes both to
    the histories of an uninterrupted stack (run 0 leaves the stack a round before run 1)."""
    cfg = make_method("fedpm", **applicable("fedpm", CFG))
    full, _ = stacked(cfg, [str(tmp_path / "f0.pt"), str(tmp_path / "f1.pt")], rounds=(3, 3))
    paths = [str(tmp_path / "k0.pt"), str(tmp_path / "k1.pt")]
    stacked(cfg, paths, rounds=(2, 1))
    resumed, _ = stacked(cfg, paths, resume=(True, True), rounds=(3, 3))
    for r in range(2):
        assert strip(resumed[r]) == strip(full[r])


def test_a_run_failing_in_the_shared_call_fails_alone(tmp_path, monkeypatch):
    """A stacked call that raises is retried run by run with the generators as submitted: the error reaches only
    the run whose clients raise it; the other run finishes with the results it gets alone."""
    cfg = make_method("fedpm", **applicable("fedpm", CFG))
    real = rs.VectorizedEngine.round
    bad = set()

    def round_(self, cfg, sel, states, down, gens):
        if any(i in bad for i in sel):
            raise ArithmeticError("FOOF matrix of fc1 contains NaN or Inf: local training diverged")
        return real(self, cfg, sel, states, down, gens)

    monkeypatch.setattr(rs.VectorizedEngine, "round", round_)
    bad.update({3, 4})  # run 1's clients in the stack's engine (after run 0's three)
    out, seen = stacked(cfg, [str(tmp_path / "s0.pt"), str(tmp_path / "s1.pt")])
    assert isinstance(out[1], ArithmeticError)
    bad.clear()
    ref, ref_seen = alone(cfg, RUNS[0], str(tmp_path / "a0.pt"))
    assert strip(out[0]) == strip(ref)
    assert_close_replies(seen[0], ref_seen, tol=0)


def test_experiments_group_a_profiles_runs_into_stacks():
    """validation.experiments: runs equal but for seed and alpha form one stack, ordered seeds x alphas as
    validation.dnn orders them; a group that is not a full seeds x alphas product stacks per alpha; the
    ablations (no --alpha) stack over seeds; --no-stack runs each alone."""
    from validation import experiments as ex

    plan = ex.plan("quick")
    groups = ex.stacks(plan)
    assert sorted(r.name for g in groups for r in g) == sorted(r.name for r in plan)
    main = [g for g in groups if g[0].name.startswith("main-cifar10-a0.1-fedpm")]
    assert [r.name for r in main[0]] == ["main-cifar10-a0.1-fedpm-s0", "main-cifar10-a0.1-fedpm-s1"]
    argv = ex.stack_argv(main[0])
    assert argv[argv.index("--seeds") + 1] == "0,1" and argv[argv.index("--alpha") + 1] == "0.1"
    assert (
        "--seed" not in argv
        and argv[argv.index("--run-names") + 1] == "main-cifar10-a0.1-fedpm-s0,main-cifar10-a0.1-fedpm-s1"
    )
    epochs = [g for g in groups if g[0].name.startswith("epochs-1-fedpm")][0]
    assert [r.name for r in epochs] == ["epochs-1-fedpm-s0", "epochs-1-fedpm-s1"]
    assert all(len(g) == 1 for g in groups if g[0].kind == "superlinear")
    # one preset for both alphas: a seeds x alphas stack; a missing pair splits it per alpha
    runs = [ex.Run(f"r-s{s}-a{a}", "dnn", ("--x", "--alpha", a, "--seed", s), 2) for s in "01" for a in ("0.1", "1.0")]
    assert [[r.name for r in g] for g in ex.stacks(runs)] == [[r.name for r in runs]]
    assert [[r.name for r in g] for g in ex.stacks(runs[1:])] == [["r-s0-a1.0", "r-s1-a1.0"], ["r-s1-a0.1"]]


def test_the_cli_trains_a_stack_into_one_folder_per_run_and_resumes_it(tmp_path, capsys):
    """validation.dnn --seeds 0,1: one folder per run (validation.experiments' names) whose history equals the run
    made alone by --seed --engine vectorized; --resume with more rounds continues every run."""
    from fake_cifar import cifar_pickle

    from validation import dnn

    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"), n=24)
    base = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--method", "fedpm", "--clients", "2"]
    base += ["--local-epochs", "1", "--batch-size", "16", "--foof-samples", "64", "--quiet", "--threads", "1"]
    assert dnn.main(base + ["--seeds", "0,1", "--rounds", "1", "--out", str(tmp_path / "stack")]) == 0
    names = ["main-cifar10-a0.1-fedpm-s0", "main-cifar10-a0.1-fedpm-s1"]
    assert sorted(os.listdir(tmp_path / "stack")) == names
    assert dnn.main(base + ["--seeds", "0,1", "--rounds", "2", "--resume", "--out", str(tmp_path / "stack")]) == 0
    alone = str(tmp_path / "alone")
    assert dnn.main(base + ["--seed", "1", "--rounds", "2", "--engine", "vectorized", "--out", alone]) == 0
    got, ref = (json.load(open(os.path.join(d, "summary.json"))) for d in (tmp_path / "stack" / names[1], alone))
    assert got["rounds_done"] == 2 and got["stack"]["runs"] == names
    cols = [c for c in ("round", "test_acc", "train_loss", "bytes_up", "bytes_down")]
    rows = [list(csv.DictReader(open(os.path.join(d, "history.csv")))) for d in (tmp_path / "stack" / names[1], alone)]
    for a, b in zip(*rows, strict=True):
        for c in cols:
            assert float(a[c]) == pytest.approx(float(b[c]), rel=1e-5), c


def test_ensure_trains_a_group_as_one_stack_on_a_gpu_and_alone_on_a_cpu(tmp_path, monkeypatch):
    """ensure() gives a stack one validation.dnn call (--seeds, --run-names, --out the profile's folder, --resume
    where a run has a checkpoint) where the engine is the vectorized one (a GPU); on a CPU, or with stack=False,
    one call per run."""
    import validation.dnn as dnn
    import validation.experiments as ex

    runs = [ex.Run(f"r-s{s}", "dnn", ("--x", "--seed", s), 1) for s in "01"]
    monkeypatch.setattr(ex, "plan", lambda profile: runs)
    monkeypatch.setattr(ex, "data_available", lambda ds, d: True)
    calls = []
    monkeypatch.setattr(dnn, "main", lambda argv: calls.append(argv) or 0)
    os.makedirs(tmp_path / "quick" / "r-s1")
    (tmp_path / "quick" / "r-s1" / "checkpoint.pt").write_bytes(b"")
    monkeypatch.setattr(ex, "_cuda", lambda: True)
    ex.ensure("quick", "data", str(tmp_path), log=lambda m: None)
    assert len(calls) == 1
    argv = calls[0]
    assert argv[argv.index("--seeds") + 1] == "0,1" and argv[argv.index("--run-names") + 1] == "r-s0,r-s1"
    assert argv[argv.index("--out") + 1] == str(tmp_path / "quick") and "--resume" in argv
    calls.clear()
    ex.ensure("quick", "data", str(tmp_path), log=lambda m: None, stack=False)
    assert [a[a.index("--out") + 1] for a in calls] == [str(tmp_path / "quick" / r.name) for r in runs]
    calls.clear()
    monkeypatch.setattr(ex, "_cuda", lambda: False)
    ex.ensure("quick", "data", str(tmp_path), log=lambda m: None)
    assert len(calls) == 2 and all("--seeds" not in a for a in calls)


def test_a_client_joining_late_behind_another_runs_clients_starts_from_its_own_model(tmp_path, monkeypatch):
    """The run whose clients all take part first, then the run sampling 2 of 3: in rounds 2 and 3 a client of the
    second run takes part for the first time behind the first run's clients in one chunk; its first FOOF matrices
    are computed at its own run's model (not at the first participant's of the chunk), as alone."""
    monkeypatch.setattr(sys.modules[__name__], "RUNS", (RUNS[1], RUNS[0]))
    cfg = make_method("fedpm", **applicable("fedpm", CFG))
    _, seen = stacked(cfg, [str(tmp_path / f"stack{r}.pt") for r in range(2)], rounds=(3, 3))
    assert {i for t, i in seen[1] if t > 1} - {i for t, i in seen[1] if t == 1}  # someone joins late
    for r, run in enumerate(RUNS):
        assert_close_replies(seen[r], alone(cfg, run, str(tmp_path / f"alone{r}.pt"), rounds=3)[1])
