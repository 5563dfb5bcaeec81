"""README.md is the contract with a new user: its commands must be the ones CI runs."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as fh:
        return fh.read()


def setup_commands():
    block = re.search(r"## Set up\n.*?```(?:bash)?\n(.*?)```", read("README.md"), re.S).group(1)
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


def test_readme_has_exactly_install_and_test_commands():
    cmds = setup_commands()
    assert len(cmds) == 2 and "pip install" in cmds[0] and "pytest" in cmds[1]


def test_ci_runs_the_readme_commands():
    ci = read(".ci", "run")
    install, test = setup_commands()
    assert test in ci
    extras = re.search(r"\[([a-z,]+)\]", install).group(1)
    assert f'-e ".[{extras}]"' in ci and "dev" in extras.split(",")


def test_readme_names_the_main_job():
    assert "python -m validation.superlinear --dataset w8a" in read("README.md")


# ---------------------------------------------------------------------------------------- the docs' Python snippets

SNIPPET = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def snippets():
    """(id, info string, code) of every ```python block in README.md and docs/*.md."""
    files = ["README.md"] + sorted(
        os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
    )
    for rel in files:
        text, before = read(rel), ""
        for m in SNIPPET.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            info, code = m.group(1).strip(), m.group(2)
            # ```python continued: the page's earlier snippets run first, as a reader pastes them in order
            yield pytest.param(info, before + code if "continued" in info.split() else code, id=f"{rel}:{line}")
            before += code


@pytest.mark.parametrize("info,code", list(snippets()))
def test_the_python_snippets_of_the_docs_run(info, code, tmp_path):
    """Each snippet runs as written in a fresh interpreter (from an empty folder, this checkout's packages); one
    that needs data or a long run says so in its info string (```python no-run) and is skipped here; one that
    goes on from the page's earlier snippets says ```python continued."""
    if "no-run" in info.split():
        pytest.skip("marked no-run in its info string")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_snippet_finder_sees_marked_blocks():
    found = {p.id: p.values[0] for p in snippets()}
    assert any(info == "no-run" for info in found.values())
    assert any(info == "" for info in found.values())
