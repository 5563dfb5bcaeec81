"""--last-batch: an epoch's last partial batch kept (a step on the remainder) or dropped (full batches only), the same
in the sequential engine, the vectorized engine's schedule, a DataLoader client, presets, checkpoints and the sweep."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from fedpm_dnn.algorithms import make_method  # noqa: E402
from fedpm_dnn.engine.sequential import ClientData, LoaderData, batch_starts_end, epoch_batches  # noqa: E402
from fedpm_dnn.engine.vectorized import client_schedule  # noqa: E402

B = 16


def client(n, seed=0, augment=True):
    g = np.random.default_rng(seed)
    x = torch.as_tensor(g.integers(0, 256, (n, 3, 8, 8)).astype(np.uint8))
    y = torch.as_tensor(g.integers(0, 3, n))
    return ClientData(x, y, (0.5,) * 3, (0.25,) * 3, augment=augment)


def sequential_draws(data, cfg, gen):
    """The sample indices of every batch the sequential engine trains on in one round, and the generator after."""
    seen = []
    batch = data.batch

    def recording(idx, generator):
        seen.append(idx.clone())
        return batch(idx, generator)

    data.batch = recording
    for _ in range(cfg.local_epochs):
        for _ in data.train_batches(cfg.batch_size, gen, cfg.last_batch):
            pass
    return seen


@pytest.mark.parametrize("last_batch", ["keep", "drop"])
@pytest.mark.parametrize("n", [2 * B + 1, B + 2, B - 9, 3 * B])  # a 1-image remainder, 2, a client below one batch
@pytest.mark.parametrize("augment", [True, False])
def test_both_engines_draw_the_same_batches_bit_for_bit(last_batch, n, augment):
    """The vectorized engine's schedule is every draw the sequential client makes: the same sample indices, batch by
    batch, and the generator left in the same state (so the crop offsets and flips were drawn alike too)."""
    cfg = make_method("fedavg", batch_size=B, local_epochs=3, last_batch=last_batch)
    g_seq, g_vec = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    seq = sequential_draws(client(n, augment=augment), cfg, g_seq)
    sched = client_schedule(cfg, client(n, augment=augment), g_vec, first_foof=False)
    vec = [step[0] for step in sched["steps"]]
    assert len(seq) == len(vec) == cfg.local_epochs * epoch_batches(n, B, last_batch)
    assert all(torch.equal(a, b) for a, b in zip(seq, vec, strict=True))
    assert torch.equal(g_seq.get_state(), g_vec.get_state())


@pytest.mark.parametrize("n", [2 * B + 1, 5 * B + 15, B - 1])
def test_drop_never_steps_on_a_partial_batch(n):
    cfg = make_method("fedpm", batch_size=B, local_epochs=4, last_batch="drop", damping=1.0)
    gen = torch.Generator().manual_seed(1)
    sizes = [len(idx) for idx in sequential_draws(client(n), cfg, gen)]
    sched = client_schedule(cfg, client(n), torch.Generator().manual_seed(1), first_foof=True)
    for got in (sizes, [len(step[0]) for step in sched["steps"]]):
        if n >= B:
            assert set(got) == {B} and len(got) == cfg.local_epochs * (n // B)
        else:  # a client smaller than one batch trains on all it has, one step an epoch
            assert got == [n] * cfg.local_epochs
    keep = make_method("fedpm", batch_size=B, local_epochs=4, last_batch="keep", damping=1.0)
    kept = [len(idx) for idx in sequential_draws(client(n), keep, torch.Generator().manual_seed(1))]
    if n % B and n > B:
        assert n % B in kept  # the same client under keep does step on its remainder


@given(n=st.integers(1, 500), b=st.integers(1, 130), drop=st.booleans())
@settings(max_examples=200, deadline=None, derandomize=True)
def test_an_epoch_covers_its_batches_as_the_rule_says(n, b, drop):
    """keep: every sample once; drop: floor(n/b) full batches (a client below one batch: all of it), and the samples
    left out are the last ones of the epoch's own shuffle, fewer than one batch."""
    end = batch_starts_end(n, b, "drop" if drop else "keep")
    covered = list(range(0, end, b))
    sizes = [min(b, n - s) for s in covered]
    assert len(covered) == epoch_batches(n, b, "drop" if drop else "keep")
    if not drop or n < b:
        assert sum(sizes) == n
    else:
        assert sizes == [b] * (n // b) and 0 <= n - sum(sizes) < b


def test_a_dataloader_client_drops_its_short_batch_unless_it_has_no_other():
    ds = torch.utils.data.TensorDataset(torch.randn(2 * B + 1, 3), torch.zeros(2 * B + 1, dtype=torch.long))
    loader = torch.utils.data.DataLoader(ds, batch_size=B, shuffle=True)
    g = torch.Generator().manual_seed(0)
    assert [len(y) for _, y in LoaderData(loader).train_batches(B, g, "keep")] == [B, B, 1]
    assert [len(y) for _, y in LoaderData(loader).train_batches(B, g, "drop")] == [B, B]
    small = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(5, 3), torch.zeros(5)), batch_size=B)
    assert [len(y) for _, y in LoaderData(small).train_batches(B, g, "drop")] == [5]


def test_the_engines_train_alike_with_a_one_image_remainder_and_the_setting_changes_the_result():
    """Replies of both engines on clients of 33 (= 2 x 16 + 1), 17, 7 and 30 images: within the float32 tolerance of
    every other engine test (the engines sum in another order: never bit for bit), for keep and drop; and drop is a
    different computation from keep."""
    import test_vectorized as tv

    sizes = tv.SIZES
    tv.SIZES = (2 * B + 1, B + 1, 7, 30)
    try:
        replies = {}
        for last_batch in ("keep", "drop"):
            cfg = tv.make("fedpm", **{**tv.CFG, "last_batch": last_batch})
            _, r_seq = tv.run(cfg, "sequential", participants=None)
            _, r_vec = tv.run(cfg, "vectorized", participants=None)
            tv.assert_same(r_vec, r_seq)
            replies[last_batch] = r_seq
    finally:
        tv.SIZES = sizes
    first = (1, 0)  # round 1, client 0 (33 images): two steps an epoch under drop, three under keep
    assert not torch.equal(
        replies["keep"][first]["params"]["fc3.weight"], replies["drop"][first]["params"]["fc3.weight"]
    )


def test_a_checkpoint_from_before_the_setting_resumes_as_keep():
    from fedpm_dnn.engine.checkpoint import first_difference

    old = {"seed": 0, "config.lr": 0.1}  # written before config.last_batch existed
    assert first_difference(old, {"seed": 0, "config.lr": 0.1, "config.last_batch": "keep"}) is None
    why = first_difference(old, {"seed": 0, "config.lr": 0.1, "config.last_batch": "drop"})
    assert why == "last batch: checkpoint has 'keep', this run 'drop'"


def test_the_command_records_the_resolved_setting_in_its_fingerprint():
    from validation.dnn_cli import command_fingerprint

    preset = ["--method", "fedavg", "--preset", "cifar10-a1.0"]
    assert command_fingerprint(preset)["config.last_batch"] == "drop"
    assert command_fingerprint([*preset, "--last-batch", "keep"])["config.last_batch"] == "keep"
    assert command_fingerprint(["--method", "fedavg"])["config.last_batch"] == "keep"  # no preset: the default
    # the preset's own value given as a flag is the same run
    assert command_fingerprint([*preset, "--last-batch", "drop"]) == command_fingerprint(preset)


def test_the_sweep_reads_a_summary_without_the_setting_as_keep_and_a_profile_pins_what_it_ships(tmp_path):
    from validation.experiments import PROFILES, plan
    from validation.sweep import trained_last_batch

    assert trained_last_batch({"config": {"lr": 0.1}}) == "keep"
    assert trained_last_batch({"config": {"last_batch": "drop"}}) == "drop"
    assert trained_last_batch({"config": "damaged"}) == "keep"
    for profile in PROFILES:
        for run in plan(profile):
            if run.kind != "dnn":
                continue
            pinned = "--last-batch" in run.argv
            assert pinned == ("last_batch" in PROFILES[profile]), (profile, run.name)


def test_flower_takes_the_setting_from_the_flag_or_the_preset(tmp_path):
    import json

    from validation import flower

    def params(*argv):
        args = flower.parse_args(["--problem", "cnn", "--method", "fedavg", "--out", str(tmp_path / "o"), *argv])
        return json.loads(flower.run_config(args).params or "{}")

    assert "last_batch" not in params()
    assert params("--last-batch", "drop")["last_batch"] == "drop"
    assert params("--preset", "cifar10-a1.0")["last_batch"] == "drop"
    assert params("--preset", "cifar10-a1.0", "--last-batch", "keep")["last_batch"] == "keep"
    with pytest.raises(SystemExit):
        flower.parse_args(["--problem", "logreg", "--last-batch", "drop", "--out", str(tmp_path / "p")])
    with pytest.raises(SystemExit):
        flower.parse_args(
            ["--problem", "cnn", "--last-batch", "drop", "--params", '{"last_batch": "keep"}', "--out", str(tmp_path)]
        )


def test_the_static_step_form_drops_the_same_batches():
    """--step-graph on (the static-buffer step; a CUDA graph on a GPU, eager here) with drop gives the sequential
    engine's replies on a split with a 1-image remainder, within the engines' float32 tolerance."""
    import dataclasses

    import test_vectorized as tv

    from fedpm_dnn.engine.simulation import run_experiment

    sizes = tv.SIZES
    tv.SIZES = (2 * B + 1, B + 1, 7, 30)
    try:
        cfg = tv.make("fedavg", **{**tv.CFG, "last_batch": "drop"})
        _, r_seq = tv.run(cfg, "sequential", participants=None)
        r_static = {}

        def keep(t, i, reply):
            r_static[(t, i)] = reply
            return reply

        exp = dataclasses.replace(tv.experiment(cfg, "vectorized", participants=None), step_graph="on")
        run_experiment(exp, tamper=keep)
    finally:
        tv.SIZES = sizes
    tv.assert_same(r_static, r_seq)
