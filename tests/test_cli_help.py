"""Every command's --help comes before its heavy imports: torch, Flower and Ray load after the flags are parsed,
so help and a refused flag answer at once (docs/cli.md)."""

from __future__ import annotations

import json
import os
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
    """fedpm_dnn.names (read by --help without torch) lists the registered methods, in order, with their labels."""
    pytest.importorskip("torch")
    from fedpm_dnn.algorithms import REGISTRY
    from fedpm_dnn.names import METHOD_LABELS, METHOD_NAMES

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
