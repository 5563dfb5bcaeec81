"""RelaySum's even re-cut of the Dirichlet draw (``--split relaysum-even``) and the learning-rate schedule
(``--lr-warmup-rounds``, ``--lr-milestones``): hand-computed cases, RelaySum's rules, the identity between a
scheduled round and a run at the scaled rate, and resuming mid-schedule."""

import dataclasses
import json
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedconvex.data import splits
from fedpm_dnn.engine.lr_schedule import LrSchedule, parse_milestones, schedule_for


def test_the_even_split_cuts_the_concatenated_draw_into_equal_consecutive_pieces(monkeypatch):
    # a draw by hand: client 0 was dealt [5, 1], client 1 [0, 6, 2], client 2 [3, 4] (in dealing order);
    # concatenated 5 1 0 6 2 3 4, cut 3 + 2 + 2 (np.array_split: the first n mod K pieces one larger)
    drawn = [np.array([5, 1]), np.array([0, 6, 2]), np.array([3, 4])]
    monkeypatch.setattr(splits, "_relaysum_draw", lambda *a: drawn)
    got = splits.relaysum_even_split(np.zeros(7, int), 3, 0.1, seed=0)
    assert [p.tolist() for p in got] == [[0, 1, 5], [2, 6], [3, 4]]
    assert [p.tolist() for p in splits.relaysum_split(np.zeros(7, int), 3, 0.1)] == [[1, 5], [0, 2, 6], [3, 4]]


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_the_even_split_keeps_the_draw_and_evens_the_sizes(alpha):
    labels = np.random.default_rng(3).integers(0, 10, 1003)
    drawn = splits.relaysum_split(labels, 10, alpha, seed=4)
    even = splits.relaysum_even_split(labels, 10, alpha, seed=4)
    assert sorted(len(p) for p in even) == [100] * 7 + [101] * 3
    assert sorted(np.concatenate(even).tolist()) == list(range(1003))  # every sample once
    # the same draw: the clients' samples in dealing order, cut at other places
    assert sorted(np.concatenate(drawn).tolist()) == list(range(1003))
    assert [p.tolist() for p in drawn] != [p.tolist() for p in even]


def test_the_even_split_mixes_classes_at_small_alpha():
    """At alpha = 0.1 a drawn client holds few classes; cutting at other places joins two drawn clients' ends, so
    the even split's clients hold more classes, on average over seeds (the reason it is tabulated)."""
    labels = np.repeat(np.arange(10), 200)
    diff = []
    for seed in range(8):
        eff = [
            splits.effective_classes(splits.client_class_counts(labels, f(labels, 10, 0.1, seed=seed))).mean()
            for f in (splits.relaysum_split, splits.relaysum_even_split)
        ]
        diff.append(eff[1] - eff[0])
    assert np.mean(diff) > 0


@given(rounds=st.integers(1, 500), pct=st.fractions(min_value=0, max_value=100).filter(lambda p: 0 < p < 100))
def test_a_milestone_starts_when_its_per_cent_of_rounds_is_done(rounds, pct):
    """RelaySum's rule epoch >= milestone with a round as the unit: round t starts with t - 1 rounds done."""
    ((first, _),) = schedule_for(0, f"{pct.numerator}/{pct.denominator}:0.5", rounds).milestones
    assert (first - 1) * 100 >= pct * rounds and (first - 2) * 100 < pct * rounds


def test_warm_up_and_milestones_multiply():
    s = schedule_for(4, "50:0.1,75:0.5", 8)
    assert s.milestones == ((5, 0.1), (7, 0.5))
    assert [s.factor(t) for t in range(1, 9)] == pytest.approx([0.25, 0.5, 0.75, 1, 0.1, 0.1, 0.05, 0.05])
    assert schedule_for(None, None, 10) is None and schedule_for(0, None, 10) is None


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("75", "PERCENT:FACTOR"),
        ("75:x", "PERCENT:FACTOR"),
        ("0:0.1", "between 0 and 100"),
        ("100:0.1", "between"),
        ("50:0", "finite number > 0"),
        ("50:nan", "finite"),
        ("50:inf", "finite"),
        ("90:0.1,75:0.1", "increase"),
        ("50:0.1,50:0.1", "increase"),
    ],
)
def test_bad_milestones_are_named(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_milestones(text)


def test_a_schedule_refuses_what_it_cannot_mean():
    for bad in (
        {"warmup_rounds": -1},
        {"warmup_rounds": 1.5},
        {"milestones": ((0, 0.1),)},
        {"milestones": ((3, -1.0),)},
    ):
        with pytest.raises(ValueError):
            LrSchedule(**bad)


# ---- the schedule in training ------------------------------------------------------------------------------


def _run(cfg, rounds, schedule=None, checkpoint=None, resume=False):
    from test_dnn_training import experiment

    from fedpm_dnn.engine.simulation import run_experiment

    exp = dataclasses.replace(experiment(cfg, rounds=rounds, participants=2), lr_schedule=schedule)
    exp.meta["fingerprint"] = {"lr_schedule": schedule.as_dict() if schedule else None}
    return run_experiment(exp, checkpoint=checkpoint, resume=resume)


def _strip(hist):
    return [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in hist]


@pytest.mark.parametrize("method", ["fedavg", "fedpm", "scaffold"])
def test_a_scheduled_round_trains_as_the_method_at_the_scaled_rate(method):
    """Round 1 of a 2-round warm-up trains at half the rate: the same model as a run whose rate is half."""
    from test_dnn_training import make

    kw = dict(local_epochs=1, batch_size=16, foof_samples=30)
    scheduled = _run(make(method, lr=0.1, **kw), 1, LrSchedule(warmup_rounds=2))
    halved = _run(make(method, lr=0.05, **kw), 1)
    constant = _run(make(method, lr=0.1, **kw), 1)
    assert _strip(scheduled) == _strip(halved)
    assert _strip(scheduled) != _strip(constant)


def test_a_run_resumed_mid_schedule_continues_it_exactly(tmp_path):
    from test_dnn_training import make

    cfg = make("fedpm", lr=0.1, local_epochs=1, batch_size=16, foof_samples=30)
    schedule = schedule_for(2, "50:0.1", 4)
    full = _run(cfg, 4, schedule)
    ck = str(tmp_path / "ck.pt")
    _run(cfg, 2, schedule, checkpoint=ck)  # "killed" after round 2, before the milestone
    assert _strip(_run(cfg, 4, schedule, checkpoint=ck, resume=True)) == _strip(full)
    with pytest.raises(ValueError, match="learning-rate schedule"):  # the milestone would move: another run
        _run(cfg, 4, schedule_for(2, "50:0.1", 6), checkpoint=ck, resume=True)


def test_the_command_records_the_split_and_schedule_and_refuses_a_moved_milestone(tmp_path, capsys):
    from fake_cifar import cifar_pickle

    from validation import dnn

    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"), n=40, balanced=True)
    base = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--method", "fedavg", "--clients", "2"]
    base += ["--local-epochs", "1", "--batch-size", "16", "--quiet", "--threads", "1", "--split", "relaysum-even"]
    out = str(tmp_path / "run")
    sched = ["--lr-warmup-rounds", "2", "--lr-milestones", "50:0.1"]
    assert dnn.main(base + sched + ["--rounds", "2", "--out", out]) == 0
    summary = json.load(open(os.path.join(out, "summary.json")))
    desc = summary.get("setup", summary)
    found = json.dumps(summary)
    assert '"relaysum-even"' in found and '"warmup_rounds": 2' in found and "[2, 0.1]" in found, desc
    sizes = [s for s in _find(summary, "client_sizes")][0]
    assert max(sizes) - min(sizes) <= 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # 3 rounds move the 50 % milestone from round 2 to round 3
        dnn.main(base + sched + ["--rounds", "3", "--resume", "--out", out])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "learning-rate schedule" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def _find(obj, key):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            yield from _find(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _find(v, key)


def test_a_milestone_after_the_last_round_is_refused(capsys):
    from validation import dnn

    with pytest.raises(SystemExit):
        dnn.main(["--rounds", "10", "--lr-milestones", "99:0.1", "--out", "unused-folder-never-written"])
    err = capsys.readouterr().err
    assert "round 11" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists("unused-folder-never-written")


def test_a_stack_with_a_schedule_trains_each_run_as_alone(tmp_path):
    import csv

    from fake_cifar import cifar_pickle

    from validation import dnn

    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"), n=24)
    base = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--method", "fedavg", "--clients", "2"]
    base += ["--local-epochs", "1", "--batch-size", "16", "--quiet", "--threads", "1", "--rounds", "2"]
    base += ["--lr-warmup-rounds", "2", "--lr-milestones", "50:0.1"]
    assert dnn.main(base + ["--seeds", "0,1", "--out", str(tmp_path / "stack")]) == 0
    alone = str(tmp_path / "alone")
    assert dnn.main(base + ["--seed", "1", "--engine", "vectorized", "--out", alone]) == 0
    rows = [
        list(csv.DictReader(open(os.path.join(d, "history.csv"))))
        for d in (str(tmp_path / "stack" / "main-cifar10-a0.1-fedavg-s1"), alone)
    ]
    for a, b in zip(*rows, strict=True):
        for c in ("round", "test_acc", "train_loss"):
            assert float(a[c]) == pytest.approx(float(b[c]), rel=1e-5), c


def test_flower_prepare_writes_the_even_split_and_records_it(tmp_path):
    """validation.flower prepare --split relaysum-even: equal client folders, the rule and its effective classes in
    meta.json, the same partition validation.dnn trains on."""
    from fake_cifar import cifar_pickle

    from fedpm_dnn.data.partition import make_partition
    from validation import flower

    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"), n=40, balanced=True)
    out = tmp_path / "parts"
    argv = ["prepare", "--data-dir", str(tmp_path / "data"), "--clients", "3", "--split", "relaysum-even"]
    assert flower.main(argv + ["--out", str(out)]) == 0
    meta = json.load(open(out / "meta.json"))
    assert meta["split"] == "relaysum-even" and max(meta["client_sizes"]) - min(meta["client_sizes"]) <= 1
    labels = np.concatenate([np.arange(40) % 10] * 5)
    want = make_partition("relaysum-even", labels, 3, 0.1, seed=0)
    assert meta["client_sizes"] == [len(p) for p in want]
    assert 1 <= meta["effective_classes_per_client"] <= 10
