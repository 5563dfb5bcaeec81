"""A newcomer's first commands: `fedpm --version`, one line naming what to install where an extra is missing
(right for a clone and an installed copy), and a `dnn --help` that lists the presets once."""

import os
import re
import subprocess
import sys

from fedconvex.extras import install_hint, requirements
from validation import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# imports of these packages fail in the child, as where the extra was never installed
BLOCKER = """import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Missing())
"""


def without(packages, argv, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(BLOCKED=set(packages)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    return subprocess.run([sys.executable, "-m", "validation.cli", *argv], capture_output=True, text=True, env=env)


def test_version_is_the_toolkits(capsys):
    from validation.common import toolkit_version

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"fedpm {toolkit_version()}\n" and toolkit_version() != "unknown"


def test_the_hint_pins_each_extra_as_pyproject_does():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    for extra in ("dnn", "flower", "gpu"):
        listed = re.findall(r'"([^"]+)"', re.search(rf"^{extra} = \[(.*)\]$", text, re.M).group(1))
        # metadata writes a requirement's specifiers in its own order: compare them as sets
        norm = {r.split("<")[0].split(">")[0].split("=")[0]: set(re.findall(r"[<>=!]=?[\w.]+", r)) for r in listed}
        got = {
            r.split("<")[0].split(">")[0].split("=")[0]: set(re.findall(r"[<>=!]=?[\w.]+", r))
            for r in requirements(extra)
        }
        assert got == norm, extra
        hint = install_hint("X", extra)
        assert f"pip install -e '.[{extra}]'" in hint and "pip install '" in hint


def test_dnn_without_torch_is_one_line_naming_what_to_install(tmp_path):
    r = without({"torch"}, ["dnn", "--dataset", "cifar10", "--rounds", "1"], tmp_path)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "torch is not installed" in lines[0] and "pip install 'torch" in lines[0] and ".[dnn]" in lines[0]


def test_flower_without_flwr_is_one_line_naming_what_to_install(tmp_path):
    r = without({"flwr", "ray"}, ["flower", "--problem", "logreg", "--rounds", "1"], tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert (
        "pip install 'flwr[simulation]==" in lines[0]
        and "in a clone of the toolkit, pip install -e '.[flower]'" in lines[0]
    )


def test_dnn_help_lists_the_presets_once(capsys):
    import pytest

    pytest.importorskip("torch")
    from fedpm_dnn.presets import PRESETS
    from validation import dnn

    with pytest.raises(SystemExit):
        dnn.parse_args(["--help"])
    text = capsys.readouterr().out
    assert all(text.count(name + ",") + text.count(name + "\n") + text.endswith(name) <= 1 for name in PRESETS)
    assert text.count("cifar100-sampling-8") == 1
    assert text.splitlines()[0].startswith("usage: python -m validation.dnn [FLAGS]")


def test_a_clone_without_metadata_reads_the_pins_from_pyproject(monkeypatch):
    import importlib.metadata

    from fedconvex import extras

    installed = {x: extras.requirements(x) for x in ("dnn", "flower", "gpu")}

    def no_metadata(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", no_metadata)
    extras.requirements.cache_clear()
    try:
        for extra, reqs in installed.items():
            from_pyproject = extras.requirements(extra)
            assert (
                len(from_pyproject) == len(reqs) == 1
                and from_pyproject[0].split("=")[0].split("<")[0].split(">")[0]
                == reqs[0].split("=")[0].split("<")[0].split(">")[0]
            )
        assert extras.requirements("flower")[0].startswith("flwr[simulation]")  # the brackets inside kept
    finally:
        extras.requirements.cache_clear()
