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
    """The set-up block's commands, comments removed."""
    block = re.search(r"## Set up\n.*?```(?:bash)?\n(.*?)```", read("README.md"), re.S).group(1)
    lines = [ln.split("  #")[0].strip() for ln in block.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def install_and_test():
    """The set-up block's project install (the one with the extras) and its last command, the tests."""
    cmds = setup_commands()
    (install,) = [c for c in cmds if re.search(r"pip install -e \"\.\[", c)]
    return install, cmds[-1]


def test_readme_sets_up_a_clone_a_venv_cpu_torch_the_project_and_runs_the_tests():
    cmds = setup_commands()
    install, test = install_and_test()
    assert cmds[0].startswith("git clone ") and "python -m venv" in cmds[1]
    (torch,) = [c for c in cmds if "pip install torch" in c]
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch
    assert cmds.index(torch) < cmds.index(install)  # the CPU build first, so that the extras keep it
    assert test == "python -m pytest -q"


def test_ci_runs_the_readme_commands():
    ci = read(".ci", "run")
    install, test = install_and_test()
    assert test in ci
    extras = re.search(r"\[([a-z,]+)\]", install).group(1)
    assert f'-e ".[{extras}]"' in ci and "dev" in extras.split(",")


def test_the_readme_bibtex_is_citation_cff_s():
    """README's BibTeX entry has CITATION.cff's preferred citation: its title, authors in order, venue and year."""
    cff = read("CITATION.cff").split("preferred-citation:", 1)[1]
    bib = re.search(r"```bibtex\n(.*?)```", read("README.md"), re.S).group(1)
    field = dict(re.findall(r"^\s+(\w+)\s*=\s*\{(.*)\},?$", bib, re.M))
    title = re.search(r'^  title: "(.*)"$', cff, re.M).group(1)
    assert field["title"].replace("{", "").replace("}", "") == title
    family = re.findall(r"family-names: (.+)", cff)
    given = re.findall(r"given-names: (.+)", cff)
    assert field["author"] == " and ".join(f"{f}, {g}" for f, g in zip(family, given, strict=True))
    assert field["booktitle"] == re.search(r'collection-title: "(.*)"', cff).group(1)
    assert field["year"] == re.search(r"year: (\d{4})", cff).group(1)


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


def test_the_front_page_stays_short_and_links_the_suites_details():
    """README is a front page (at most 200 lines): how the suite schedules itself and its times are in
    docs/testing.md, which the set-up section links; the test command stays README's last set-up line."""
    text = read("README.md")
    assert len(text.splitlines()) <= 200
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert "(docs/testing.md)" in setup and "xdist" not in setup
    assert install_and_test()[1] == "python -m pytest -q"


def test_quick_start_2s_figures_come_from_runs_of_its_command():
    """The shipped runs behind README's quick-start 2 figures (reference/quick-start/) computed what the command
    computes now (same resolved settings, --method aside; the engine the command picks on a CPU): a change of a
    default that moves the figures shows here, not silently."""
    import json
    import shlex

    pytest.importorskip("torch")
    from validation import sweep

    block = re.search(r"\*\*2\. FedPM on CIFAR-10\*\*.*?```bash\n(.*?)```", read("README.md"), re.S).group(1)
    line = next(ln for ln in block.replace("\\\n", " ").splitlines() if ln.startswith("python -m validation.dnn"))
    readme = shlex.split(line)[3:]
    for method in ("fedpm", "fedavg"):
        folder = os.path.join(ROOT, "reference", "quick-start", f"cifar10-a0.1-{method}-s0")
        summary = json.load(open(os.path.join(folder, "summary.json")))
        argv = [method if i and readme[i - 1] == "--method" else a for i, a in enumerate(readme)]
        want, have = sweep._fingerprint(tuple(argv)), sweep._fingerprint(tuple(sweep.recorded_argv(summary)))
        assert want is not None and sweep.first_difference(want, have) == "", method
        # and as the run resolved them then (a default changed since would move the figures)
        ran = {f"config.{k}": v for k, v in summary["config"].items()} | {"augment": summary["augment"]}
        assert {k: want[k] for k in ran if k in want} == {k: v for k, v in ran.items() if k in want}, method
        assert summary["engine"] == "sequential" and summary["device"] == "cpu"  # the command's pick on a CPU
        assert f"{100 * summary['best_test_acc']:.2f} %" in read("README.md")
