"""Hostile inputs to the Flower strategy ``fedpm_flower.strategy.FedPM``, the client helper ``fedpm_fit``, the CNN
app's reply check and the Flower commands: every reply is checked against the server's own template, never against
another reply; bad settings are one clear error."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedpm_dnn import mix  # noqa: E402
from fedpm_dnn.engine.transport import reply_problem  # noqa: E402
from fedpm_flower.client import fedpm_fit  # noqa: E402
from fedpm_flower.strategy import FedPM  # noqa: E402

NODES = (100, 101, 102)
LR, EPOCHS, DAMPING = 0.1, 2, 0.1


def _net():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.fixture(scope="module")
def honest():
    """Each node's honest reply content to the first round (fedpm_fit on its own data), and the data."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(20 + 5 * i, 5, generator=g) + i, torch.randint(0, 3, (20 + 5 * i,), generator=g)) for i in
            range(len(NODES))]  # fmt: skip
    config = {"lr": LR, "local-epochs": EPOCHS, "damping": DAMPING}
    return {node: fedpm_fit(_net(), [d], config) for node, d in zip(NODES, data, strict=True)}, data


class StoredGrid:
    """A Grid whose node n answers every message with ``contents[n]`` (a RecordDict), as it is; node ``first``'s
    reply comes back first (the reply an earlier strategy took as its reference)."""

    def __init__(self, contents: dict, first=None):
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
        self.contents, self.first = contents, first

    def get_node_ids(self):
        return list(self.contents)

    def send_and_receive(self, messages, timeout=None):
        replies = [Message(self.contents[m.metadata.dst_node_id], reply_to=m) for m in messages]
        return sorted(replies, key=lambda r: r.metadata.src_node_id != self.first)


def run_round(contents: dict, first=None, **strategy_kw):
    """One FedPM round over the stored replies, node ``first``'s first: (final model, the strategy)."""
    strategy = FedPM(damping=DAMPING, **{"fraction_evaluate": 0.0, **strategy_kw})
    result = strategy.start(
        grid=StoredGrid(contents, first),
        initial_arrays=ArrayRecord(_net().state_dict()),
        num_rounds=1,
        train_config=ConfigRecord({"lr": LR, "local-epochs": EPOCHS}),
    )
    return result.arrays.to_torch_state_dict(), strategy


def content(arrays: dict, foof: dict, num_examples=20, **metrics) -> RecordDict:
    rec = {"arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})}
    rec["foof"] = ArrayRecord({k: Array(np.asarray(v)) for k, v in foof.items()})
    rec["metrics"] = MetricRecord({"train_loss": 1.0, "num-examples": num_examples, **metrics})
    return RecordDict(rec)


def parts(c: RecordDict):
    return {k: v.numpy() for k, v in c["arrays"].items()}, {k: v.numpy() for k, v in c["foof"].items()}


def assert_same_model(got, expect):
    assert list(got) == list(expect)
    for k in expect:
        torch.testing.assert_close(got[k], expect[k], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def honest_pair(honest):
    """The model mixed from nodes 101 and 102 alone (uniform and by samples)."""
    replies, _ = honest
    return {w: run_round({n: replies[n] for n in NODES[1:]}, weighting=w)[0] for w in ("uniform", "samples")}


def test_the_honest_round_is_fedpm_dnn_mix_of_the_replies(honest):
    replies, data = honest
    got, strategy = run_round(replies, weighting="samples")
    assert strategy.rejected == {1: []}
    states = [replies[n]["arrays"].to_torch_state_dict() for n in NODES]
    mats = [replies[n]["foof"].to_torch_state_dict() for n in NODES]
    assert_same_model(got, mix(states, mats, weights=[len(y) for _, y in data], damping=DAMPING))


# ------------------------------------------------------------------------------------------ the reference
@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda a, f: ({k: v.astype(np.float64) for k, v in a.items()}, f), "dtype float64, expected float32"),
        (lambda a, f: (a, {"0": f["0"]}), "foof has entries ['0'], expected ['0', '3']"),
        (lambda a, f: (a, {k: v.astype(np.float64) for k, v in f.items()}), "dtype float64, expected float32"),
    ],
)
def test_a_first_reply_that_differs_from_the_template_is_rejected_and_the_honest_nodes_mixed(honest, honest_pair, edit,
                                                                                               reason):  # fmt: skip
    replies, _ = honest
    bad = content(*edit(*parts(replies[100])), num_examples=20)  # node 100: the round's first reply
    got, strategy = run_round({**replies, 100: bad}, first=100)
    assert [n for n, _ in strategy.rejected[1]] == [100] and reason in strategy.rejected[1][0][1]
    assert_same_model(got, honest_pair["uniform"])


@pytest.mark.parametrize("count", [math.inf, -math.inf, math.nan, -1, 2**60, [20, 20]])
def test_a_bogus_sample_count_is_rejected_and_the_others_weighted_by_theirs(honest, honest_pair, count):
    replies, _ = honest
    arrays, foof = parts(replies[100])
    got, strategy = run_round({**replies, 100: content(arrays, foof, num_examples=count)}, 100, weighting="samples")
    assert [n for n, _ in strategy.rejected[1]] == [100] and "num-examples" in strategy.rejected[1][0][1]
    assert_same_model(got, honest_pair["samples"])


def test_every_node_claiming_zero_samples_keeps_the_model_with_samples_weighting(honest):
    replies, _ = honest
    zero = {n: content(*parts(replies[n]), num_examples=0) for n in NODES}
    got, strategy = run_round(zero, weighting="samples")
    assert sorted(n for n, _ in strategy.rejected[1]) == list(NODES)
    assert all("is 0" in why for _, why in strategy.rejected[1])
    assert got == {}  # no round aggregated: Flower's result holds no new arrays (the global model was kept)


def test_every_node_claiming_zero_samples_with_uniform_weights_still_mixes(honest):
    replies, _ = honest
    zero = {n: content(*parts(replies[n]), num_examples=0) for n in NODES}
    got, strategy = run_round(zero)
    assert strategy.rejected == {1: []}
    assert_same_model(got, run_round(replies)[0])


@pytest.mark.parametrize(
    "metrics, expect",
    [
        ({"num-examples": -1}, {"loss": pytest.approx(101.5)}),
        ({"num-examples": math.inf}, {"loss": pytest.approx(101.5)}),
        ({"num-examples": 20, "loss": [0.5, 0.5]}, {}),
    ],
)
def test_an_evaluation_reply_with_bogus_metrics_is_left_out_and_the_run_completes(honest, metrics, expect):
    """Every node answers the evaluation too (FedAvg's configure_evaluate): node 100's sample count, negative or
    infinite, leaves it out and the metrics are the other two nodes'; a list where the others send a number cannot
    be aggregated and leaves the round's evaluation metrics empty -- the run completes either way."""
    replies, _ = honest
    evaluated = {n: RecordDict({"metrics": MetricRecord({"loss": float(n), "num-examples": 10})}) for n in NODES}
    evaluated[100] = RecordDict({"metrics": MetricRecord({"loss": 100.0, **metrics})})  # 101.5: nodes 101, 102

    class Grid(StoredGrid):
        def send_and_receive(self, messages, timeout=None):
            kind = messages[0].metadata.message_type if messages else ""
            store = evaluated if kind.startswith("evaluate") else self.contents
            return [Message(store[m.metadata.dst_node_id], reply_to=m) for m in messages]

    strategy = FedPM(damping=DAMPING, fraction_evaluate=1.0)
    result = strategy.start(
        grid=Grid(replies),
        initial_arrays=ArrayRecord(_net().state_dict()),
        num_rounds=1,
        train_config=ConfigRecord({"lr": LR, "local-epochs": EPOCHS}),
    )
    assert dict(result.evaluate_metrics_clientapp.get(1, {})) == expect


# ------------------------------------------------------------------------------ generated hostile replies
FLOAT_DTYPES = [np.float64, np.float16]
BAD_COUNTS = [math.inf, -math.inf, math.nan, -3, 0, 2**54, [1, 2]]


@st.composite
def hostile_edits(draw):
    """A function editing (arrays, foof, num-examples) of an honest reply into one the template refuses."""
    kind = draw(st.sampled_from(["dtype", "int", "shape", "missing", "extra", "nonfinite", "count"]))
    field = draw(st.sampled_from(["arrays", "foof"]))
    pick = draw(st.integers(0, 10**6))
    value = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    count = draw(st.sampled_from(BAD_COUNTS))
    grow = draw(st.integers(1, 3))

    def edit(arrays, foof, n):
        a, f = dict(arrays), dict(foof)
        target = a if field == "arrays" else f
        name = sorted(target)[pick % len(target)]
        if kind == "dtype":
            target[name] = target[name].astype(dtype)
        elif kind == "int":
            target[name] = target[name].astype(np.int64)
        elif kind == "shape":
            target[name] = np.zeros(tuple(s + grow for s in target[name].shape) or (grow,), np.float32)
        elif kind == "missing":
            del target[name]
        elif kind == "extra":
            target[name + "x"] = target[name]
        elif kind == "nonfinite":
            flat = target[name].copy().reshape(-1)
            flat[pick % flat.size] = value
            target[name] = flat.reshape(target[name].shape)
        else:
            n = count
        return a, f, n

    edit.kind = (kind, field)
    return edit


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=hostile_edits(), first=st.sampled_from(NODES))
def test_generated_hostile_replies_are_rejected_and_never_set_the_model(honest, edit, first):
    """Whichever node sends it, and first, a reply the template refuses is the only one rejected: the model is the
    mix of the two honest replies (by samples)."""
    replies, _ = honest
    arrays, foof = parts(replies[first])
    bad = content(*edit(arrays, foof, int(replies[first]["metrics"]["num-examples"])))
    got, strategy = run_round({**replies, first: bad}, first, weighting="samples")
    assert [n for n, _ in strategy.rejected[1]] == [first], (edit.kind, strategy.rejected)
    expect, _ = run_round({n: replies[n] for n in NODES if n != first}, weighting="samples")
    assert_same_model(got, expect)


@settings(max_examples=60, deadline=None)
@given(edit=hostile_edits())
def test_the_validator_refuses_every_generated_structure_fault(edit):
    """``reply_problem`` alone: every dtype, shape or entry fault is named (content faults are screening's)."""
    if edit.kind[0] in ("nonfinite", "count"):
        return
    model = _net().state_dict()
    strategy = FedPM()
    template = strategy.template(model)
    foof = {b: np.eye(d, dtype=np.float32) for b, ((d, _), _) in template["foof"].items()}
    arrays, mats, _ = edit({k: v.numpy() for k, v in model.items()}, foof, 1)
    reply = {"params": {k: torch.as_tensor(v) for k, v in arrays.items()},
             "foof": {k: torch.as_tensor(v) for k, v in mats.items()}}  # fmt: skip
    assert reply_problem({"params": dict(model), "foof": {k: torch.as_tensor(v) for k, v in foof.items()}},
                         template) is None  # fmt: skip
    assert reply_problem(reply, template) is not None


# ------------------------------------------------------------------------------------ the strategy's settings
@pytest.mark.parametrize(
    "kw, error, fragment",
    [
        ({"max_ratio": 0.5}, ValueError, "max_ratio must be >= 1"),
        ({"max_ratio": -1}, ValueError, "max_ratio must be >= 1"),
        ({"max_ratio": math.nan}, ValueError, "max_ratio must be a finite number"),
        ({"max_ratio": math.inf}, ValueError, "max_ratio must be a finite number"),
        ({"max_ratio": "5"}, TypeError, "max_ratio must be a finite number"),
        ({"max_ratio": True}, TypeError, "max_ratio must be a finite number"),
        ({"damping": math.inf}, ValueError, "damping must be a finite number >= 0"),
        ({"damping": math.nan}, ValueError, "damping must be a finite number >= 0"),
        ({"damping": -1.0}, ValueError, "damping must be a finite number >= 0"),
        ({"damping": "0.1"}, TypeError, "damping must be a number"),
        ({"weighting": "size"}, ValueError, "weighting must be uniform or samples"),
        ({"blocks": "0"}, TypeError, "blocks must be a torch.nn.Module"),
        ({"blocks": {"0": 0}}, ValueError, "blocks must map block names to matrix sides >= 1"),
    ],
)
def test_a_bad_strategy_setting_is_refused_when_it_is_built(kw, error, fragment):
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace("[", r"\[")) as info:
        FedPM(**kw)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("max_ratio", [None, 0, 1, 1000.0])
def test_the_usable_guards_are_accepted(max_ratio):
    assert FedPM(max_ratio=max_ratio).max_ratio == (float(max_ratio) if max_ratio else None)


def test_blocks_given_as_the_model_or_a_mapping_are_the_derived_ones():
    derived = FedPM().template(_net().state_dict())
    assert FedPM(blocks=_net()).template(_net().state_dict()) == derived
    assert FedPM(blocks={"0": 6, "3": 9}).template(_net().state_dict()) == derived
    assert derived["foof"] == {"0": ((6, 6), torch.float32), "3": ((9, 9), torch.float32)}


def test_an_embedding_is_no_block_when_the_model_is_given(honest):
    model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 2))
    assert set(FedPM(blocks=model).template(model.state_dict())["foof"]) == {"1"}
    assert set(FedPM().template(model.state_dict())["foof"]) == {"0", "1"}  # why the docstring says: pass it


# ------------------------------------------------------------------------------------------ the client
@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"local-epochs": 0}, "'local-epochs' must be an integer >= 1, got 0"),
        ({"local-epochs": -3}, "'local-epochs' must be an integer >= 1, got -3"),
        ({"local-epochs": 1.7}, "'local-epochs' must be an integer >= 1, got 1.7"),
        ({"local-epochs": True}, "'local-epochs' must be an integer >= 1, got True"),
        ({"clip": -1.0}, "'clip' must be a finite number >= 0 (0: no clipping), got -1.0"),
        ({"clip": math.nan}, "'clip' must be a finite number >= 0 (0: no clipping), got nan"),
        ({"clip": math.inf}, "'clip' must be a finite number >= 0 (0: no clipping), got inf"),
        ({"lr": math.nan}, "'lr' must be a finite number > 0, got nan"),
        ({"lr": 0.0}, "'lr' must be a finite number > 0, got 0.0"),
        ({"damping": math.inf}, "'damping' must be a finite number >= 0, got inf"),
        ({"weight-decay": -1.0}, "'weight-decay' must be a finite number >= 0, got -1.0"),
        ({"lr": "0.1"}, "'lr' must be a finite number > 0, got '0.1'"),
    ],
)
def test_fedpm_fit_refuses_a_bad_train_config_before_training(config, fragment):
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError) as info:
        fedpm_fit(model, [(x, y)], {"lr": 0.1, **config})
    assert str(info.value) == f"train config {fragment}"
    assert_same_model(model.state_dict(), before)  # nothing trained


def test_fedpm_fit_takes_a_whole_float_epoch_count_and_clip_zero():
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    a = fedpm_fit(_net(), [(x, y)], {"lr": 0.1, "local-epochs": 2.0, "clip": 0.0})
    b = fedpm_fit(_net(), [(x, y)], {"lr": 0.1, "local-epochs": 2})
    assert_same_model(a["arrays"].to_torch_state_dict(), b["arrays"].to_torch_state_dict())


# --------------------------------------------------------------------------------------- the CNN app's replies
def test_cnn_a_first_reply_in_float64_is_rejected_and_the_next_one_used(caplog):
    """The CNN app's transport checks replies against the method's template too: node 100 (client 0) answers first;
    its float64 parameters are refused and client 1's float32 reply is used."""
    import logging

    from flower_loopback import LoopbackGrid

    from fedpm_flower.apps import serve
    from fedpm_flower.config import FlowerRunConfig
    from fedpm_flower.transport import numpy, records

    def tamper(dst, reply):
        if dst == 100 and not reply.has_error() and reply.metadata.message_type == "train":
            arrays = numpy(reply.content["arrays"])
            reply.content["arrays"] = records({k: v.astype(np.float64) if v.dtype == np.float32 else v
                                               for k, v in arrays.items()})  # fmt: skip
        return reply

    cfg = FlowerRunConfig(problem="cnn", method="fedpm", clients=2, rounds=1, lr=0.1)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = serve(LoopbackGrid(cfg, tamper=tamper), cfg)
    assert result["history"][1]["rejected"] == 1 and result["history"][1]["used"] == 1
    assert any("client 0 rejected: " in r.getMessage() and "expected float32" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_cnn_parameters_sent_in_float16_are_the_template_of_param_dtype_float16():
    from flower_loopback import LoopbackGrid

    from fedpm_flower.apps import serve
    from fedpm_flower.config import FlowerRunConfig

    cfg = FlowerRunConfig(problem="cnn", method="fedavg", clients=2, rounds=1, lr=0.1,
                          params='{"param_dtype": "float16"}')  # fmt: skip
    result = serve(LoopbackGrid(cfg), cfg)
    assert result["history"][1]["rejected"] == 0 and result["history"][1]["used"] == 2


# ------------------------------------------------------------------------------------------ the commands
def one_line(main, argv, capsys, prog):
    """Run a command in-process: exit 2 and one stderr line naming the cause, no traceback; that line."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--out", "{W}/missing/keys", "--nodes", "1"], "its parent {W}/missing is not an existing folder"),
        (["--out", "{W}/file.txt/keys", "--nodes", "1"], "is not an existing folder"),
        (["--out", "{W}/keys", "--nodes", "1", "--days", "3000000"], "at most 36500"),
    ],
)
def test_keys_refuses_a_missing_parent_and_a_day_count_beyond_its_dates(tmp_path, capsys, argv, fragment):
    from validation import flower_keys

    (tmp_path / "file.txt").write_text("x")
    before = sorted(os.listdir(tmp_path))
    line = one_line(flower_keys.main, [a.replace("{W}", str(tmp_path)) for a in argv], capsys, flower_keys.PROG)
    assert fragment.replace("{W}", str(tmp_path)) in line
    assert sorted(os.listdir(tmp_path)) == before  # nothing left, no .keys-* folder


@pytest.mark.parametrize("days", [0, 36501, True, 1.5])
def test_write_credentials_refuses_a_day_count_out_of_range(tmp_path, days):
    from fedpm_flower.credentials import write_credentials

    with pytest.raises(ValueError, match="days must be an integer in 1..36500"):
        write_credentials(str(tmp_path / "c"), 1, days=days)
    assert not (tmp_path / "c").exists()


def test_sigterm_during_keys_is_one_line_and_leaves_no_private_keys(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "validation.flower", "keys", "--out", str(tmp_path / "keys"), "--nodes", "10000"]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not any(n.startswith(".keys-") for n in os.listdir(tmp_path)) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # inside the writing of the key pairs
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    assert proc.returncode == 143 and len(lines) == 1 and "terminated (SIGTERM)" in lines[0], err
    assert os.listdir(tmp_path) == []  # no .keys-* folder of private keys, no --out


def _written_config(app):
    import tomllib

    with open(os.path.join(app, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["tool"]["flwr"]["app"]["config"]


def test_write_app_carries_the_run_settings_given_with_it(tmp_path, capsys):
    from validation import flower

    app = str(tmp_path / "app")
    argv = ["--write-app", app, "--method", "scaffold", "--clients", "5", "--rounds", "7", "--lr", "0.5"]
    assert flower.main(argv + ["--participants", "2", "--seed", "3", "--timeout", "40"]) == 0
    cfg = _written_config(app)
    want = {"method": "scaffold", "clients": 5, "rounds": 7, "lr": 0.5, "participants": 2, "seed": 3, "timeout": 40.0}
    assert {k: cfg[k] for k in want} == want


def test_write_app_carries_a_preset_as_a_run_would(tmp_path):
    from validation import flower

    app = str(tmp_path / "app")
    assert flower.main(["--write-app", app, "--problem", "cnn", "--preset", "cifar10-a0.1"]) == 0
    cfg = _written_config(app)
    args = flower.parse_args(["--problem", "cnn", "--preset", "cifar10-a0.1", "--out", str(tmp_path / "o")])
    ran = flower.run_config(args).to_run_config()
    assert {k: cfg[k] for k in ("problem", "lr", "local_steps", "params")} == {
        k: ran[k] for k in ("problem", "lr", "local_steps", "params")
    }


@pytest.mark.parametrize("flag", [["--mode", "deployment"], ["--check"], ["--out", "X"], ["--quiet"]])
def test_write_app_refuses_a_flag_it_cannot_carry(tmp_path, capsys, flag):
    from validation import flower

    app = tmp_path / "app"
    line = one_line(flower.main, ["--write-app", str(app)] + flag, capsys, flower.PROG)
    assert f"{flag[0]} does not apply to --write-app" in line
    assert not app.exists()


# --------------------------------------------------------------------------------- prepared data, its preset
@pytest.fixture(scope="module")
def prepared_femnist(tmp_path_factory):
    from test_flower_femnist import leaf

    from validation import flower

    root = tmp_path_factory.mktemp("femnist")
    leaf(str(root / "leaf"), writers=4)
    argv = ["prepare", "--dataset", "femnist", "--data-dir", str(root / "leaf"), "--out", str(root / "p")]
    assert flower.main(argv) == 0
    return str(root / "p")


def test_the_cnn_on_prepared_femnist_takes_its_preset_by_default_and_records_the_data_set(prepared_femnist, tmp_path):
    from validation import flower

    base = ["--problem", "cnn", "--data-dir", prepared_femnist, "--clients", "4", "--out", str(tmp_path / "o")]
    default = flower.run_config(flower.parse_args(base))
    given = flower.run_config(flower.parse_args(base + ["--preset", "femnist"]))
    assert default == given and default.dataset == "femnist"
    assert default.local_steps == 5 and default.lr == 0.5 and json.loads(default.params)["clip"] == 1.0
    bare = flower.run_config(flower.parse_args(base + ["--preset", "none"]))
    assert bare.local_steps == 1 and bare.params == "" and bare.dataset == "femnist"
    assert flower.run_config(flower.parse_args(["--problem", "cnn", "--out", str(tmp_path / "s")])).dataset == (
        "synthetic"
    )


# ------------------------------------------------------------------------------------- the simulation's output
def test_a_failed_simulation_names_the_first_error_of_its_log(tmp_path):
    """The log goes with the unfinished output: the command's one line carries the cause the log gave first."""
    from fedpm_flower.config import FlowerRunConfig
    from validation.flower import simulation_log_problem

    cfg = FlowerRunConfig(out=str(tmp_path / "result.json"))
    assert simulation_log_problem(cfg) is None  # no log yet
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "flower.log").write_text(
        "\x1b[92mINFO \x1b[0m:      Starting\n\x1b[91mERROR \x1b[0m:     An exception occured!!\n"
        "Traceback (most recent call last):\n    raise Exception(\nException: The node timed out during startup.\n"
        "RuntimeError: Simulation Runtime crashed.\n"
    )
    assert simulation_log_problem(cfg) == "Exception: The node timed out during startup."
    (tmp_path / "logs" / "flower.log").write_text("\x1b[91mERROR \x1b[0m:     first\n\x1b[91mERROR \x1b[0m: second\n")
    assert simulation_log_problem(cfg) == "ERROR :     first"
