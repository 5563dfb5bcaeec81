"""Presets apply their table's whole setting, explicit flags override it (recorded, and warned about where they
contradict the table), and the split has its own seed (validation.dnn, fedpm_dnn.presets)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fake_cifar import cifar_pickle  # noqa: E402

from fedpm_dnn.algorithms import hyperparameters_of  # noqa: E402
from fedpm_dnn.data import effective_classes  # noqa: E402
from fedpm_dnn.presets import PRESETS, SETTING_KEYS  # noqa: E402
from validation import dnn  # noqa: E402


def parse(tmp_path, *argv):
    return dnn.parse_args([*argv, "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_preset_alone_sets_its_whole_setting_and_every_row(tmp_path, preset):
    table = PRESETS[preset]
    setting = table["setting"]
    assert set(setting) <= set(SETTING_KEYS)
    assert {"dataset", "local_epochs", "participants", "foof_samples"} <= set(setting)
    if setting["dataset"] != "femnist":
        assert {"alpha", "clients"} <= set(setting)
    for method, row in table["methods"].items():
        args = parse(tmp_path, "--preset", preset, "--method", method)
        res = args.resolved
        assert args.dataset == setting["dataset"]
        assert {k: res.settings[k] for k in setting} == setting
        cfg = res.config
        for key, value in row.items():
            assert getattr(cfg, key) == value, (method, key)
        assert cfg.local_epochs == setting["local_epochs"]
        if "foof_samples" in hyperparameters_of(method):
            assert cfg.foof_samples == setting["foof_samples"]
        assert res.from_flags == {} and res.conflicts == {} and dnn.preset_warning(args) is None
        # every preset drops an epoch's last partial batch (the paper's cited code: drop_last=True)
        assert cfg.last_batch == "drop"
        assert res.from_preset == {**setting, **row, "last_batch": "drop"} | (
            {"foof_samples": setting["foof_samples"]} if "foof_samples" in hyperparameters_of(method) else {}
        )


def test_without_a_preset_the_defaults_apply(tmp_path):
    res = parse(tmp_path, "--method", "fedavg").resolved
    assert res.settings["dataset"] == "cifar10" and res.settings["alpha"] == 0.1
    assert res.config.local_epochs == 5 and res.from_preset == {} and res.conflicts == {}


def test_flags_override_the_preset_and_a_contradiction_is_one_warning(tmp_path):
    args = parse(tmp_path, "--preset", "cifar10-a1.0", "--method", "fedavgm", "--alpha", "0.1", "--lr", "0.3")
    res = args.resolved
    assert res.settings["alpha"] == 0.1 and res.config.lr == 0.3 and res.config.momentum == 0.9  # the row's
    assert res.from_flags == {"alpha": 0.1, "lr": 0.3} and res.not_applicable == ()
    assert "alpha" not in res.from_preset and "lr" not in res.from_preset and res.from_preset["local_epochs"] == 5
    # the hyper-parameters are the flags' to tune; the table's setting is what a warning is for
    assert res.conflicts == {"alpha": {"preset": 1.0, "flag": 0.1}}
    warning = dnn.preset_warning(args)
    assert warning.count("\n") == 0 and "--alpha 0.1 overrides preset cifar10-a1.0's alpha 1.0" in warning
    same = parse(tmp_path, "--preset", "cifar10-a1.0", "--alpha", "1.0")
    assert same.resolved.conflicts == {} and same.resolved.from_flags == {"alpha": 1.0}
    # a hyper-parameter the method does not have is refused, not recorded and ignored
    with pytest.raises(SystemExit):
        parse(tmp_path, "--preset", "cifar10-a1.0", "--method", "fedavgm", "--mu", "0.1")


def test_explicit_none_values_override_the_preset(tmp_path):
    """--foof-samples all and --clip 0 stand for None: they must win over the preset's 64 and 1.0."""
    res = parse(tmp_path, "--preset", "cifar10-foof-64", "--foof-samples", "all", "--clip", "0").resolved
    assert res.config.foof_samples is None and res.config.clip is None
    assert res.conflicts == {"foof_samples": {"preset": 64, "flag": None}}
    args = parse(tmp_path, "--preset", "cifar10-sampling-2", "--participants", "5", "--local-epochs", "1")
    assert args.resolved.config.local_epochs == 1 and args.resolved.settings["participants"] == 5
    assert dnn.preset_warning(args).endswith("override preset cifar10-sampling-2's participants 2, local-epochs 5")


# ----------------------------------------------------------------- on (generated) data: summary.json, resume
@pytest.fixture
def data_dir(tmp_path):
    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"), n=40, balanced=True)
    return str(tmp_path / "data")


def small(data_dir, out, *argv):
    return [
        *("--data-dir", data_dir, "--method", "fedavg", "--clients", "3", "--local-epochs", "1"),
        *("--batch-size", "32", "--rounds", "1", "--quiet", "--device", "cpu", "--out", str(out), *argv),
    ]


def test_summary_records_the_sources_and_resume_refuses_a_changed_setting(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    assert dnn.main(small(data_dir, out, "--preset", "cifar10-a1.0", "--alpha", "0.5")) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [
        "python -m validation.dnn: warning: --alpha 0.5, --clients 3, --local-epochs 1 override preset "
        "cifar10-a1.0's alpha 1.0, clients 10, local-epochs 5"
    ]
    s = json.loads((out / "summary.json").read_text())
    assert s["alpha"] == 0.5 and s["preset"] == "cifar10-a1.0"
    assert s["from_flags"] == {"alpha": 0.5, "clients": 3, "local_epochs": 1, "batch_size": 32}
    assert s["from_preset"]["lr"] == 0.1 and s["from_preset"]["participants"] is None
    assert s["preset_overridden"]["alpha"] == {"preset": 1.0, "flag": 0.5}
    assert np.isclose(s["effective_classes_per_client"], effective_classes(s["class_counts"]).mean())
    # resuming under the preset's own alpha is another run: refused, naming it
    with pytest.raises(SystemExit) as exc:
        dnn.main(small(data_dir, out, "--preset", "cifar10-a1.0", "--rounds", "2", "--resume"))
    assert exc.value.code == 2
    assert "--alpha: checkpoint has 0.5, this run 1.0" in capsys.readouterr().err
    assert (
        dnn.main(small(data_dir, out, "--preset", "cifar10-a1.0", "--alpha", "0.5", "--rounds", "2", "--resume")) == 0
    )
    assert json.loads((out / "summary.json").read_text())["rounds_done"] == 2


def test_the_preset_alpha_is_the_split_alpha_and_flag_or_preset_resume_each_other(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    assert dnn.main(small(data_dir, out, "--preset", "cifar10-a1.0")) == 0
    assert json.loads((out / "summary.json").read_text())["alpha"] == 1.0
    # the same setting given by its flag is the same run
    assert dnn.main(small(data_dir, out, "--preset", "cifar10-a1.0", "--alpha", "1", "--rounds", "2", "--resume")) == 0


# ----------------------------------------------------------------- seeds
def test_effective_classes_by_hand():
    counts = [[5, 5, 0], [10, 0, 0], [2, 1, 1], [3, 3, 3]]
    # shares (1/2, 1/2): e^{ln 2} = 2; one class: 1; (1/2, 1/4, 1/4): e^{1.5 ln 2} = 2^1.5; uniform over 3: 3
    np.testing.assert_allclose(effective_classes(counts), [2.0, 1.0, 2**1.5, 3.0], rtol=1e-14)


def built(tmp_path, data_dir, *argv):
    from fedpm_dnn.engine.simulation import build

    exp, desc = dnn.build(dnn.parse_args(small(data_dir, tmp_path / "unused", "--alpha", "0.3", *argv)))
    _, _, state = build(exp)
    return desc, state.theta


def test_split_seed_seeds_the_split_and_seed_the_model(tmp_path, data_dir):
    desc0, theta0 = built(tmp_path, data_dir, "--seed", "0")
    desc1, theta1 = built(tmp_path, data_dir, "--seed", "0", "--split-seed", "1")
    assert desc0["split_seed"] == 0 and desc1["split_seed"] == 1
    assert desc0["class_counts"] != desc1["class_counts"]  # another split ...
    assert all(torch.equal(theta0[k], theta1[k]) for k in theta0)  # ... of the same model
    desc2, theta2 = built(tmp_path, data_dir, "--seed", "2", "--split-seed", "0")
    assert desc2["class_counts"] == desc0["class_counts"] and desc2["client_sizes"] == desc0["client_sizes"]
    assert not all(torch.equal(theta0[k], theta2[k]) for k in theta0)
    for d in (desc0, desc1, desc2):
        assert 1 <= d["effective_classes_per_client"] <= 10
        assert d["effective_classes_per_client"] == pytest.approx(effective_classes(d["class_counts"]).mean())


def test_the_seed_table_gives_the_runs_own_effective_classes(tmp_path, data_dir, capsys):
    from validation import splits

    assert splits.main(["--data-dir", data_dir, "--clients", "3", "--alpha", "0.3", "--seeds", "4-6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {int(ln.split()[0]): (float(ln.split()[1]), int(ln.split()[2].strip("()"))) for ln in lines[2:5]}
    assert sorted(rows) == [4, 5, 6] and lines[-1].startswith("mean +- std over 3 seeds")
    for seed, (value, last) in rows.items():
        desc, _ = built(tmp_path, data_dir, "--split-seed", str(seed))
        assert round(desc["effective_classes_per_client"], 2) == value
        # the smallest last batch at 64 from the run's own client sizes: a remainder, or all of a smaller client
        assert last == min(n % 64 if n % 64 else min(n, 64) for n in desc["client_sizes"])


def test_the_table_of_several_rules_and_alphas_gives_each_runs_own_effective_classes(tmp_path, data_dir, capsys):
    from validation import splits

    argv = ["--data-dir", data_dir, "--clients", "3", "--alpha", "0.3,2", "--split", "all", "--seeds", "4-5"]
    assert splits.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["split", "seed"] and len(lines[1].split()) == 2 + 3 * 6  # "rule a=alpha (last)"
    rows = {int(ln.split()[0]): [float(v) for v in ln.split()[1::2]] for ln in lines[2:4]}
    for seed, values in rows.items():
        col = 0
        for rule in ("relaysum", "relaysum-even", "dirichlet"):
            for alpha in ("0.3", "2"):
                desc, _ = built(tmp_path, data_dir, "--split-seed", str(seed), "--split", rule, "--alpha", alpha)
                assert desc["partition"] == rule and round(desc["effective_classes_per_client"], 2) == values[col]
                col += 1
        even = built(tmp_path, data_dir, "--split-seed", str(seed), "--split", "relaysum-even")[0]["client_sizes"]
        assert max(even) - min(even) <= 1


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--train-subset", "5"], "between the 10 classes"),
        (["--train-subset", "999999"], "between the 10 classes"),
        (["--clients", "500"], "more clients than the"),
        (["--split", "relaysum,nope"], "unknown split 'nope'"),
        (["--alpha", "0.1,0.1"], "named twice"),
    ],
)
def test_the_seed_table_refuses_sizes_a_run_would_refuse_in_one_line(data_dir, capsys, argv, fragment):
    from validation import splits

    with pytest.raises(SystemExit) as exc:
        splits.main(["--data-dir", data_dir, "--seeds", "0-1", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_a_checkpoint_from_before_a_new_flag_resumes_while_the_flag_is_not_given():
    from fedpm_dnn.engine.checkpoint import first_difference

    old = {"run.alpha": 0.1, "run.seed": 0, "model": "cnn"}
    assert first_difference(old, {"run.alpha": 0.1, "run.seed": 0, "run.split_seed": None, "model": "cnn"}) is None
    msg = first_difference(old, {"run.alpha": 0.1, "run.seed": 0, "run.split_seed": 3, "model": "cnn"})
    assert msg == "--split-seed: checkpoint has '(absent)', this run 3"
