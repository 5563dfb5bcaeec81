"""Every command's --help comes before its heavy imports: torch, Flower and Ray load after the flags are parsed,
so help and a refused flag answer at once (docs/cli.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# every command (python -m MODULE [SUBCOMMAND]) and the heavy modules its --help must not import
COMMANDS = {
    "superlinear": ["validation.superlinear"],
    "dnn": ["validation.dnn"],
    "flower": ["validation.flower"],
    "flower keys": ["validation.flower", "keys"],
    "flower prepare": ["validation.flower", "prepare"],
    "experiments": ["validation.experiments"],
    "bench_convex": ["validation.bench_convex"],
    "bench_dnn": ["validation.bench_dnn"],
    "figures": ["figures"],
    "splits": ["validation.splits"],
    "fedpm": ["validation.cli"],
}
HEAVY = ("torch", "flwr", "ray", "cupy")

# runs ``python -m MODULE ARGS --help`` as the interpreter would, then reports the heavy modules it loaded
PROBE = """
import json, runpy, sys
module, argv = sys.argv[1], sys.argv[2:]
sys.argv = [module, *argv]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
heavy = [m for m in HEAVY if m in sys.modules]
sys.stderr.write("\\nPROBE " + json.dumps({"code": code, "heavy": heavy}) + "\\n")
""".replace("HEAVY", repr(HEAVY))


@pytest.fixture(scope="module")
def helps():
    """{command: (exit code, heavy modules loaded, help text)}, the probes run side by side."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", PROBE, argv[0], *argv[1:], "--help"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in COMMANDS.items()
    }
    found = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        probe = json.loads(err.rsplit("PROBE ", 1)[1])
        found[name] = (probe["code"], probe["heavy"], out)
    return found


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_loads_no_heavy_module(name, helps):
    code, heavy, text = helps[name]
    assert code == 0 and "usage:" in text
    assert heavy == [], f"python -m {' '.join(COMMANDS[name])} --help imported {heavy}"


def test_the_light_method_names_are_the_registry():
    """fedpm_dnn.method_names (read by --help without torch) lists the registered methods, in order, with their
    labels."""
    pytest.importorskip("torch")
    from fedpm_dnn.algorithms import REGISTRY
    from fedpm_dnn.method_names import METHOD_LABELS, METHOD_NAMES

    assert METHOD_NAMES == tuple(REGISTRY)
    assert METHOD_LABELS == {name: cls.label for name, cls in REGISTRY.items()}


def test_the_package_exports_load_on_first_use():
    """``from fedpm_dnn import FOOF`` and friends still work (they load torch when first asked for)."""
    pytest.importorskip("torch")
    import fedpm_dnn

    for name in fedpm_dnn.__all__:
        assert getattr(fedpm_dnn, name) is not None and name in dir(fedpm_dnn)
    with pytest.raises(AttributeError):
        fedpm_dnn.no_such_name  # noqa: B018


def test_an_export_named_as_its_submodule_stays_the_export():
    """``fedpm_dnn.federated`` is the function, also after the submodule of that name was imported."""
    code = (
        "import fedpm_dnn.engine.simulation, fedpm_dnn.federated, types\n"
        "from fedpm_dnn import federated\n"
        "import fedpm_dnn\n"
        "assert callable(federated) and not isinstance(federated, types.ModuleType), federated\n"
        "assert fedpm_dnn.federated is federated and fedpm_dnn.federated.__module__ == 'fedpm_dnn.federated'\n"
    )
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]


# ------------------------------------------------------------------------------- every flag described, one style

PARSED = {  # command: (module whose main builds the parser, argv before the flags)
    "superlinear": ("validation.superlinear", []),
    "dnn": ("validation.dnn", []),
    "flower": ("validation.flower", []),
    "flower keys": ("validation.flower", ["keys"]),
    "flower prepare": ("validation.flower", ["prepare"]),
    "experiments": ("validation.experiments", []),
    "bench_convex": ("validation.bench_convex", []),
    "bench_dnn": ("validation.bench_dnn", []),
    "figures": ("figures.__main__", []),
    "splits": ("validation.splits", []),
}


class Built(Exception):
    """Raised at the first parse: the parser the command built, before anything runs."""


def parser_of(name, monkeypatch):
    import argparse
    import importlib

    from validation import common

    module, argv = PARSED[name]
    built = []

    def capture(self, args=None, namespace=None):
        built.append(self)
        raise Built

    monkeypatch.setattr(common.OneLineParser, "parse_known_args", capture)
    with pytest.raises(Built):
        importlib.import_module(module).main(argv)
    monkeypatch.undo()
    assert isinstance(built[0], argparse.ArgumentParser)
    return built[0]


def shown_help(parser, action) -> str:
    """The help line --help prints for ``action``, whitespace collapsed."""
    return " ".join(parser._get_formatter()._format_action(action).split())


@pytest.mark.parametrize("name", sorted(PARSED))
def test_every_flag_is_described_and_names_its_default_in_one_style(name, monkeypatch):
    """Each flag has help; a flag taking a value names its default once, as "(default: X)" (appended by
    validation.common.HelpFormatter from the value, or in words where the value is None); no other spelling of
    "default" (a required flag has none; a switch needs none)."""
    import argparse

    parser = parser_of(name, monkeypatch)
    bad = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        text = shown_help(parser, action)
        flag = action.option_strings[-1]
        if not action.help:
            bad.append(f"{flag}: no help")
        styled, words = text.count("(default: "), len(re.findall(r"default", text, re.I))
        if action.nargs != 0 and not action.required and styled != 1:
            bad.append(f"{flag}: {styled} '(default: X)' in {text!r}")
        if words != styled:
            bad.append(f"{flag}: 'default' spelled another way in {text!r}")
    assert not bad, f"{name}: " + "; ".join(bad)
