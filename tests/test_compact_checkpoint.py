"""Checkpoints that hold, for each client, the parameters its FOOF matrices were taken at instead of the matrices
(fedpm_dnn.engine.checkpoint.compact_client): the vectorized engine checks once that it remakes them bit for bit,
resuming remakes them and compares their digest, and a damaged stand-in is one CheckpointError."""

import os
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from test_run_stack import RUNS, stacked  # noqa: E402
from test_run_stack import experiment as stack_experiment  # noqa: E402
from test_vectorized import CFG, experiment, make  # noqa: E402

from fedpm_dnn.engine import checkpoint, vectorized  # noqa: E402
from fedpm_dnn.engine.simulation import run_experiment  # noqa: E402


def strip(history):
    return [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in history]


def no_runtime_warnings():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", RuntimeWarning)
    return ctx


def test_a_fedpm_checkpoint_holds_parameters_not_matrices_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Two of four clients a round: the checkpoint's client states hold the parameters, the pass's shape and the
    digest (no matrices), in fewer bytes than the matrices' triangles; resumed after rounds 1 and 2 (clients that
    sat a round out stay compact until they train), the run ends with the uninterrupted run's history and model."""
    cfg = make("fedpm", **CFG)
    full_ck = str(tmp_path / "full.pt")
    full = run_experiment(experiment(cfg, "vectorized", rounds=4, participants=2), checkpoint=full_ck)
    ck = str(tmp_path / "ck.pt")
    ctx = no_runtime_warnings()
    try:
        for rounds in (1, 2, 4):
            exp = experiment(cfg, "vectorized", rounds=rounds, participants=2)
            resumed = run_experiment(exp, checkpoint=ck, resume=rounds > 1)
            states = checkpoint.load(ck)["clients"]
            kept = [cs for cs in states if cs]
            assert kept and all(
                "foof" not in cs and {"foof_at", "foof_made", checkpoint.DIGEST} <= set(cs) for cs in kept
            )
            assert "kept_foof_resumed" not in exp.meta["executed"]
    finally:
        ctx.__exit__(None, None, None)
    assert exp.meta["executed"]["kept_foof"].startswith("remade")
    assert len(kept) == 4  # every client has trained by round 4
    assert strip(resumed) == strip(full)
    got, want = (checkpoint.load(p)["server"]["params"] for p in (ck, full_ck))
    assert all(torch.equal(got[k], v) for k, v in want.items())
    monkeypatch.setattr(checkpoint, "compact_client", lambda cs: {k: v for k, v in cs.items() if k != "foof_at"})
    whole = str(tmp_path / "whole.pt")
    run_experiment(experiment(cfg, "vectorized", rounds=4, participants=2), checkpoint=whole)
    assert os.path.getsize(ck) < os.path.getsize(whole)


def test_the_first_remaking_is_checked_and_a_difference_keeps_the_matrices_whole(tmp_path, monkeypatch):
    """A remaking that is off in one entry: said once, recorded, and the checkpoint keeps the matrices (a resume
    from it is still the uninterrupted run)."""
    real = vectorized.VectorizedEngine.remake_foof

    def off(self, *a):
        out = real(self, *a)
        name = next(iter(out[0]))
        out[0][name] = out[0][name].clone()
        out[0][name][0, 0] += 1e-12
        return out

    monkeypatch.setattr(vectorized.VectorizedEngine, "remake_foof", off)
    cfg = make("fedpm", **CFG)
    exp = experiment(cfg, "vectorized", rounds=1)
    ck = str(tmp_path / "ck.pt")
    with pytest.warns(RuntimeWarning, match="checkpoints keep the FOOF matrices whole on cpu: remaking them") as rec:
        run_experiment(exp, checkpoint=ck)
    assert sum("keep the FOOF matrices whole" in str(w.message) for w in rec) == 1
    assert exp.meta["executed"]["kept_foof"].startswith("stored whole: remaking them from the parameters")
    states = [cs for cs in checkpoint.load(ck)["clients"] if cs]
    assert states and all("foof" in cs and "foof_at" not in cs and checkpoint.DIGEST not in cs for cs in states)
    monkeypatch.undo()
    full = run_experiment(experiment(cfg, "vectorized", rounds=2))
    resumed = run_experiment(experiment(cfg, "vectorized", rounds=2), checkpoint=ck, resume=True)
    assert strip(resumed) == strip(full)


def test_remade_matrices_that_differ_from_the_digest_are_said_and_recorded(tmp_path):
    """A stand-in whose parameters are not those its digest was taken with (one entry moved by 1e-6): resuming
    names the client, records it, and goes on."""
    cfg = make("fedpm", **CFG)
    ck = str(tmp_path / "ck.pt")
    run_experiment(experiment(cfg, "vectorized", rounds=1, participants=None), checkpoint=ck)
    saved = checkpoint.load(ck)
    at = saved["clients"][2]["foof_at"]
    name = next(iter(at))
    at[name] = at[name].clone()
    at[name].view(-1)[0] += 1e-6
    checkpoint.save(ck, saved)
    exp = experiment(cfg, "vectorized", rounds=2, participants=None)
    with pytest.warns(RuntimeWarning, match="client 2's remade FOOF matrices differ from those the checkpoint"):
        run_experiment(exp, checkpoint=ck, resume=True)
    assert exp.meta["executed"]["kept_foof_resumed"] == [
        "client 2's remade FOOF matrices differ from those the checkpoint was written with"
    ]


def _damage(cs, how):
    name = next(iter(cs["foof_at"]))
    if how == "no shape":
        del cs["foof_made"]
    elif how == "matrices too":
        cs["foof"] = {}
    elif how == "digest":
        cs[checkpoint.DIGEST] = "not a digest"
    elif how == "a parameter missing":
        del cs["foof_at"][name]
    elif how == "a wrong shape":
        cs["foof_at"][name] = cs["foof_at"][name][:1]
    elif how == "not finite":
        cs["foof_at"][name] = torch.full_like(cs["foof_at"][name], float("nan"))
    elif how == "rows":
        cs["foof_made"] = {"clients": 2, "rows": 10**8}
    elif how == "clients":
        cs["foof_made"] = {"clients": 0.5, "rows": 3}


@pytest.mark.parametrize(
    "how",
    ["no shape", "matrices too", "digest", "a parameter missing", "a wrong shape", "not finite", "rows", "clients"],
)
def test_a_damaged_stand_in_is_one_checkpoint_error_naming_the_client(tmp_path, how):
    cfg = make("fedpm", **CFG)
    ck = str(tmp_path / "ck.pt")
    run_experiment(experiment(cfg, "vectorized", rounds=1, participants=None), checkpoint=ck)
    saved = checkpoint.load(ck)
    _damage(saved["clients"][1], how)
    checkpoint.save(ck, saved)
    with pytest.raises(checkpoint.CheckpointError, match=r"damaged checkpoint \(client 1: .*\); remove it"):
        run_experiment(experiment(cfg, "vectorized", rounds=2, participants=None), checkpoint=ck, resume=True)


def test_a_stacked_runs_checkpoint_resumes_alone_with_its_matrices_remade_bit_for_bit(tmp_path):
    """A stack's training chunks of 3 span both runs, so run 0's matrices were taken in passes shaped by run 1's
    clients too; resumed alone, run 0 remakes them in passes of that shape (its own clients in the other places)
    and every digest matches."""
    cfg = make("fedpm", **{k: v for k, v in CFG.items() if k in ("lr", "local_epochs", "batch_size", "damping")})
    paths = [str(tmp_path / f"s{r}.pt") for r in range(2)]
    stacked(cfg, paths, rounds=(1, 1), chunk=3)
    shapes = [cs["foof_made"] for cs in checkpoint.load(paths[0])["clients"] if cs]
    assert shapes and any(s["clients"] == 3 for s in shapes)
    exp = stack_experiment(cfg, RUNS[0], rounds=2)
    ctx = no_runtime_warnings()
    try:
        run_experiment(exp, checkpoint=paths[0], resume=True)
    finally:
        ctx.__exit__(None, None, None)
    assert "kept_foof_resumed" not in exp.meta["executed"]


def test_a_three_run_simplecnn_fedpm_stacks_checkpoints_fit_in_14_mib(tmp_path):
    """The paper's SimpleCNN (32x32 images, 10 classes) at 10 clients a run, 3 runs stacked: one round's
    checkpoints take at most 14 MiB (the matrices' triangles alone would take 30 x 848,312 bytes, 24.3 MiB), so a
    GPU job's 16 MiB archive carries them.  A client's images do not change these sizes; 8 each here."""
    import numpy as np

    from fedpm_dnn.engine import stacked_runs
    from fedpm_dnn.engine.sequential import ClientData
    from fedpm_dnn.engine.simulation import Experiment

    cfg = make("fedpm", lr=0.05, local_epochs=1, batch_size=8, damping=1e-3)
    exps = []
    for seed in range(3):
        g = np.random.default_rng(seed)
        clients = [
            ClientData(
                torch.as_tensor(g.integers(0, 256, (8, 3, 32, 32)).astype(np.uint8)),
                torch.as_tensor(g.integers(0, 10, 8)),
                (0.49, 0.48, 0.45),
                (0.25, 0.24, 0.26),
            )
            for _ in range(10)
        ]
        exps.append(
            Experiment(
                cfg=cfg,
                model="cnn",
                num_classes=10,
                clients=clients,
                x_test=clients[0].x,
                y_test=clients[0].y,
                mean=(0.49, 0.48, 0.45),
                std=(0.25, 0.24, 0.26),
                rounds=1,
                seed=seed,
                image_size=32,
                engine="vectorized",
            )
        )
    paths = [str(tmp_path / f"s{r}.pt") for r in range(3)]
    stacked_runs.run_stack(exps, paths, [False] * 3, [None] * 3)
    total = sum(os.path.getsize(p) for p in paths)
    assert total <= 14 * 2**20, total


VALUES = st.one_of(
    st.integers(-3, 2**31), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.none(), st.just([1])
)


@settings(max_examples=200, deadline=None)
@given(made=st.one_of(st.dictionaries(st.sampled_from(["clients", "rows", "other"]), VALUES, max_size=3), VALUES))
def test_a_pass_shape_read_back_is_taken_only_as_two_bounded_integers(made):
    """Any foof_made a file may hold: accepted exactly when it is {'clients': 1..4096, 'rows': 1..10**7} as
    integers (not booleans), else named as the problem; the rest of the stand-in is valid."""
    params = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}
    state = {"foof_at": {k: v.clone() for k, v in params.items()}, "foof_made": made, checkpoint.DIGEST: "a" * 64}
    ok = (
        isinstance(made, dict)
        and set(made) == {"clients", "rows"}
        and all(isinstance(made[k], int) and not isinstance(made[k], bool) for k in made)
        and 1 <= made["clients"] <= 4096
        and 1 <= made["rows"] <= 10**7
    )
    why = checkpoint._origin_problem(state, params)
    assert (why is None) == ok
    if why:
        assert why.startswith("foof_made")
