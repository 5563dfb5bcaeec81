"""One toolkit whether cloned or installed from a wheel: the shipped tuning cache is package data, the version is
recorded in every summary.json, the ``fedpm`` command and the metadata are in the wheel (docs/cli.md)."""

from __future__ import annotations

import email
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from validation import cli, common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fedconvex", "fedpm_dnn", "fedpm_flower", "validation", "figures")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built from a copy of the project's packaging inputs (the checkout itself gets no build/ folder)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(os.path.join(ROOT, name), src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(ROOT, pkg), src / pkg, ignore=ignore)
    (src / "reference").mkdir()
    shutil.copy2(os.path.join(ROOT, "reference", "tuning.json"), src / "reference" / "tuning.json")
    dist = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("pip is not installed")
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = dist.glob("fedpm-*.whl")
    return path


def dist_info(zf, name):
    (found,) = [n for n in zf.namelist() if re.fullmatch(rf"fedpm-[^/]+\.dist-info/{name}", n)]
    return zf.read(found).decode()


def test_the_wheel_ships_the_tuning_cache_and_the_command(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        with open(os.path.join(ROOT, "reference", "tuning.json"), "rb") as fh:
            assert zf.read("validation/shipped/tuning.json") == fh.read()  # the one file, byte for byte
        assert "fedconvex/data/w8a.bz2" in names and "fedconvex/data/a9a.bz2" in names
        assert "validation/cli.py" in names and "fedpm_dnn/method_names.py" in names
        # every module of the source tree ships (a subpackage missing from pyproject's list would not)
        for pkg in PACKAGES:
            for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
                rel = os.path.relpath(folder, ROOT).replace(os.sep, "/")
                missing = [f"{rel}/{f}" for f in files if f.endswith(".py") and f"{rel}/{f}" not in names]
                assert not missing, f"not in the wheel: {missing}"
        scripts = dist_info(zf, "entry_points.txt")
        assert re.search(r"^\[console_scripts\]\nfedpm = validation\.cli:main$", scripts, re.M)
        meta = email.message_from_string(dist_info(zf, "METADATA"))
    assert not [n for n in names if n.startswith(("tests/", "reference/", "benchmarks/"))]
    extras = meta.get_all("Provides-Extra")
    assert {"dev", "dnn", "flower", "all"} <= set(extras)  # CI installs .[dev,dnn,flower]
    requires = meta.get_all("Requires-Dist")
    run_only = [r for r in requires if 'extra == "all"' in r]
    assert run_only and not [r for r in run_only if re.match(r"(pytest|hypothesis|ruff|array-api-strict)\b", r)]
    assert {"fedpm[dnn,flower]"} == {r.split(";")[0].strip().replace(" ", "") for r in run_only}
    assert meta["Keywords"] and meta.get_all("Classifier") and meta.get_all("Project-URL")
    assert meta["Version"] == common.toolkit_version()


def test_an_installed_copy_reads_the_shipped_cache_and_records_its_version(wheel, tmp_path):
    """The wheel's files as an installation lays them out (no clone beside them): the tuning cache resolves to the
    package's copy, and provenance names the version from the package metadata and no commit."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    code = (
        "import json; from validation import tuning, common; "
        "print(json.dumps({'cache': tuning.SHIPPED_CACHE, 'entries': len(tuning.TuningCache('x', "
        "tuning.SHIPPED_CACHE).shipped), 'prov': common.provenance()}))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    seen = json.loads(r.stdout)
    assert seen["cache"] == str(site / "validation" / "shipped" / "tuning.json")
    with open(os.path.join(ROOT, "reference", "tuning.json")) as fh:
        assert seen["entries"] == len(json.load(fh)) > 0
    assert seen["prov"]["version"] == common.toolkit_version() != "unknown"
    assert seen["prov"]["commit"] == "unknown"


def test_a_clone_reads_reference_and_records_the_version():
    from validation import tuning

    assert tuning.SHIPPED_CACHE == os.path.join(ROOT, "reference", "tuning.json")
    assert common.provenance()["version"] == common.toolkit_version()


def test_the_version_is_one_across_pyproject_and_citation():
    with open(os.path.join(ROOT, "CITATION.cff")) as fh:
        cff = re.search(r'^version: "([^"]+)"$', fh.read(), re.M).group(1)
    assert common.toolkit_version() == cff


def test_pyproject_authors_are_citation_s():
    with open(os.path.join(ROOT, "CITATION.cff")) as fh:
        cff = fh.read()
    with open(os.path.join(ROOT, "pyproject.toml")) as fh:
        toml = fh.read()
    first = re.search(r"^authors:\n  - name: \"([^\"]+)\"$", cff, re.M).group(1)
    assert f'authors = [{{ name = "{first}" }}]' in toml


# ------------------------------------------------------------------------------------------------- the fedpm command


def test_fedpm_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for name, (module, _) in cli.COMMANDS.items():
        assert re.search(rf"^  {name} ", text, re.M), name
        assert importlib.util.find_spec(module) is not None, module


@pytest.mark.parametrize("argv", [[], ["nope"], ["--dataset"]])
def test_fedpm_refuses_an_unknown_command_in_one_line(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("fedpm: error: ") and "superlinear" in err[0]


def test_fedpm_subcommand_is_the_python_m_form(tmp_path):
    """The same flags give the same answer, the same exit status and nothing written, in either form."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    argv = ["--rounds", "0", "--out", str(tmp_path / "o")]
    a = subprocess.run(
        [sys.executable, "-m", "validation.cli", "superlinear", *argv], env=env, capture_output=True, text=True
    )
    b = subprocess.run([sys.executable, "-m", "validation.superlinear", *argv], env=env, capture_output=True, text=True)
    assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr) and a.returncode == 2
    assert len(a.stderr.splitlines()) == 1 and not (tmp_path / "o").exists()
