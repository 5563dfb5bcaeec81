"""The DNN command's settings are resolved once, at its boundary (validation.dnn_cli.parse_args), into one frozen
RunSettings, and only that object travels down: nothing below the boundary reads an argparse namespace, every
``auto`` is concrete, and a setting's spellings are one value (docs/architecture.md, "The DNN command")."""

import argparse
import ast
import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")


from validation import dnn, dnn_cli, run_settings  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BELOW = ("dnn_stack.py", "dnn_experiment.py", "dnn_output.py", "run_settings.py")
PRESET = ["--preset", "cifar10-a0.1", "--method", "fedpm"]


def tiny(data, out, *extra):
    return [
        *("--data-dir", data, "--method", "fedpm", "--clients", "2", "--local-epochs", "1", "--batch-size", "8"),
        *("--train-subset", "40", "--test-subset", "20", "--foof-samples", "64", "--rounds", "1", "--quiet"),
        *("--device", "cpu", "--threads", "1", "--out", str(out), *extra),
    ]


READS = []  # the attributes read of a sealed namespace


class Sealed(argparse.Namespace):
    """A namespace the boundary has made: once it has returned its settings, any read of it is recorded and raises."""

    def __getattribute__(self, name):
        READS.append(name)
        raise AssertionError(f"argparse namespace read below the boundary: .{name}")


@pytest.fixture
def sealed(monkeypatch):
    """validation.dnn.main with every argparse namespace its boundary made (the parsed flags, a stack's per-run
    copies, those of the fingerprints the default --out compares) sealed once the boundary returns."""
    READS.clear()
    real, real_init = dnn.parse_args, argparse.Namespace.__init__

    def boundary(argv=None):
        made = []

        def recording(self, **kwargs):
            made.append(self)
            real_init(self, **kwargs)

        monkeypatch.setattr(argparse.Namespace, "__init__", recording)
        try:
            settings = real(argv)
        finally:
            monkeypatch.setattr(argparse.Namespace, "__init__", real_init)
        assert isinstance(settings, run_settings.RunSettings) and made
        for namespace in made:
            namespace.__class__ = Sealed
        return settings

    monkeypatch.setattr(dnn, "parse_args", boundary)
    return READS


def test_a_run_resumed_and_a_stack_read_no_namespace_below_the_boundary(cifar_dir, tmp_path, sealed):
    assert dnn.main(tiny(cifar_dir, tmp_path / "run")) == 0
    assert dnn.main(tiny(cifar_dir, tmp_path / "run", "--resume", "--rounds", "2")) == 0
    assert dnn.main(tiny(cifar_dir, tmp_path / "stack", "--seeds", "0,1")) == 0
    assert sealed == []
    runs = {"main-cifar10-a0.1-fedpm-s0", "main-cifar10-a0.1-fedpm-s1"}
    assert runs <= set(os.listdir(tmp_path / "stack"))
    assert all((tmp_path / "stack" / r / "history.csv").is_file() for r in runs)


def test_the_modules_below_the_boundary_take_no_args():
    """No function of the modules below the boundary (nor validation.dnn's run) takes a parameter named args,
    and none of them reads an attribute of a name ``args``."""
    found = []
    for name in (*BELOW, "dnn.py"):
        path = os.path.join(ROOT, "validation", name)
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
                if "args" in params:
                    found.append(f"{name}: {node.name}(args)")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
                found.append(f"{name}:{node.lineno}: args.{node.attr}")
    assert found == []


def test_the_settings_are_frozen_and_every_auto_is_concrete(tmp_path):
    s = dnn.parse_args(PRESET + ["--out", str(tmp_path / "o")])
    assert s.device in ("cpu", "cuda") and s.engine == run_settings.AUTO_ENGINE[s.device]
    assert s.augment == "crop-flip" and s.split_seed == s.seed == 0 and s.alpha == 0.1
    assert s.step_graph == ("on" if s.device == "cuda" else "off")
    assert s.config.foof_apply == run_settings.AUTO_FOOF_APPLY[s.device]
    assert s.config.foof_precision in ("fp32", "split-tf32") and s.foof_auto == ("foof_apply", "foof_precision")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.rounds = 3
    stack = dnn.parse_args(PRESET + ["--seeds", "0,1", "--alpha", "0.1,1", "--out", str(tmp_path / "s")])
    assert stack.stacked and [(r.seed, r.alpha) for r in stack.runs] == [(0, 0.1), (0, 1.0), (1, 0.1), (1, 1.0)]
    assert {r.engine for r in stack.runs} == {"vectorized"} and {r.runs_parent for r in stack.runs} == {stack.out}


def test_every_flag_either_shapes_the_fingerprint_or_is_named_as_not():
    """A new flag is placed: in the fingerprint (FINGERPRINT_FIELDS, a RunSettings field) or in
    NOT_IN_FINGERPRINT, never in both, never in neither."""
    dests = {a.dest for a in dnn_cli.build_parser()._actions if a.dest != "help"}
    shaping = set(run_settings.FINGERPRINT_FIELDS) - {"lr_schedule"}  # the schedule: from two flags, resolved
    assert shaping & dnn_cli.NOT_IN_FINGERPRINT == set()
    assert dests == shaping | dnn_cli.NOT_IN_FINGERPRINT
    fields = {f.name for f in dataclasses.fields(run_settings.RunSettings)}
    assert set(run_settings.FINGERPRINT_FIELDS) <= fields


@pytest.mark.parametrize("spellings", [("1", "1.0", "1e0", "1.00"), ("0.1", "0.10", "1e-1")])
def test_one_alpha_in_any_spelling_is_one_settings_object(tmp_path, spellings):
    """Not only the fingerprint: the whole resolved settings (but the command line recorded as typed) are equal."""
    made = [
        dataclasses.replace(dnn.parse_args(PRESET + ["--alpha", a, "--out", str(tmp_path / "o")]), command="")
        for a in spellings
    ]
    assert all(m == made[0] for m in made[1:])
    assert made[0].alpha == float(spellings[0]) and made[0].alpha_text == repr(float(spellings[0]))


def test_a_resumed_checkpoints_choice_is_a_new_settings_object(tmp_path):
    """--resume with FOOF's apply left to auto: the checkpoint's recorded choice, in a new object (the one given is
    unchanged); a checkpoint from before the option ran FOOF_AUTO; an apply given explicitly is not overruled."""
    from fedpm_dnn.engine import checkpoint
    from validation import outputs

    out = tmp_path / "o"
    out.mkdir()
    outputs.mark(str(out), dnn_cli.PROG)
    recorded = "inverse" if run_settings.AUTO_FOOF_APPLY["cpu"] == "solve" else "solve"
    checkpoint.save(
        str(out / "checkpoint.pt"), {"format": checkpoint.FORMAT, "fingerprint": {"config.foof_apply": recorded}}
    )
    fresh = dnn.parse_args(PRESET + ["--out", str(out), "--overwrite", "--device", "cpu"])
    assert fresh.config.foof_apply == run_settings.AUTO_FOOF_APPLY["cpu"]
    resumed = dataclasses.replace(fresh, resume=True, overwrite=False)
    chosen = run_settings.recorded_choices(resumed)
    assert chosen is not resumed and resumed.config.foof_apply == run_settings.AUTO_FOOF_APPLY["cpu"]
    assert chosen.config.foof_apply == recorded and chosen.config.foof_precision == "fp32"  # FOOF_AUTO's
    assert dataclasses.replace(chosen, config=resumed.config) == resumed  # nothing else changed
    given = dnn.parse_args(PRESET + ["--out", str(out), "--resume", "--device", "cpu", "--foof-apply", "solve"])
    assert given.config.foof_apply == "solve" and given.foof_auto == ("foof_precision",)


def test_build_refuses_settings_not_made_concrete(tmp_path):
    p = dnn_cli.build_parser()
    args = p.parse_args(PRESET)
    dnn_cli.settle(p, args)
    with pytest.raises(TypeError, match="made concrete for a device"):
        dnn.build(args.settings)


def test_the_device_autos_follow_the_stated_rule_on_either_device(tmp_path):
    """--help's rules, made concrete at the boundary for a CUDA device as for a CPU (no GPU needed: the rule
    reads the device's name only): the vectorized engine and the step graph on CUDA, the sequential engine and
    no graph on a CPU; FOOF's inverse on CUDA, its solves on a CPU; a stack on the vectorized engine on either."""
    p = dnn_cli.build_parser()
    args = p.parse_args(PRESET + ["--out", str(tmp_path / "o")])
    dnn_cli.settle(p, args)
    rules = (("cuda", "vectorized", "on", "inverse"), ("cpu", "sequential", "off", "solve"))
    for device, engine, graph, apply in rules:
        s = run_settings.on_device(dataclasses.replace(args.settings, device=device))
        assert (s.device, s.engine, s.step_graph, s.config.foof_apply) == (device, engine, graph, apply)
        assert run_settings.engine_tag(s) is None  # auto's own engine: the folder name does not carry it
        stacked = run_settings.on_device(dataclasses.replace(args.settings, device=device), stacked=True)
        assert stacked.engine == "vectorized"
    # settled alone (what the sweep's fingerprint reads) nothing depends on this machine
    assert (args.settings.device, args.settings.engine, args.settings.step_graph) == ("auto", "auto", "auto")
