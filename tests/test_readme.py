"""README.md is the contract with a new user: its commands must be the ones CI runs."""

import os
import re

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
