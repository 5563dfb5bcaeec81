"""The repository's layout: commands write only to the ignored results/, the shipped outputs in reference/ say
where they come from, the measurement scripts in benchmarks/ still import what they use, and the tracked files
speak of the project alone."""

import ast
import csv
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def _in_git_checkout():
    try:
        return shutil.which("git") is not None and _git("rev-parse", "--show-toplevel").strip() == ROOT
    except (OSError, subprocess.CalledProcessError):
        return False


needs_git = pytest.mark.skipif(not _in_git_checkout(), reason="needs the git checkout of the repository")


def _project_files():
    """Tracked files and new ones git does not ignore: what a commit of this working tree would hold."""
    return [f for f in _git("ls-files", "--cached", "--others", "--exclude-standard").splitlines() if os.path.isfile(f)]


@pytest.fixture
def clean_checkout(tmp_path):
    """A fresh repository holding this working tree's project files, committed: its ``git status`` is empty."""
    repo = tmp_path / "checkout"
    for rel in _project_files():
        dst = repo / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), dst)
    ident = ["-c", "user.name=test", "-c", "user.email=test@example.org", "-c", "commit.gpgsign=false"]
    _git("init", "-q", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git(*ident, "commit", "-q", "-m", "checkout", cwd=repo)
    assert _git("status", "--porcelain", cwd=repo) == ""
    return repo


def _run(repo, *argv, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    env.pop("FEDPM_TUNING_CACHE", None)
    return subprocess.run(
        [sys.executable, *argv], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _rows(path, method):
    with open(path) as fh:
        return [r for r in csv.DictReader(fh) if r["method"] == method]


@needs_git
def test_the_main_job_on_a_clean_checkout_changes_no_tracked_file(clean_checkout):
    """Test 1 (two of its methods, a9a) on a fresh checkout: the learning rates come from the shipped
    reference/tuning.json (nothing is tuned, so no cache is written), the output goes to the ignored results/,
    ``git status`` stays empty, and the iterates are the reference run's to round-off."""
    r = _run(clean_checkout, "-m", "validation.superlinear", "--dataset", "a9a", "--methods", "fedavg,fedpm", "--quiet")
    assert r.returncode == 0, r.stderr
    assert _git("status", "--porcelain", cwd=clean_checkout) == ""
    out = clean_checkout / "results" / "superlinear-a9a"
    summary = json.loads((out / "summary.json").read_text())
    head = _git("rev-parse", "--short", "HEAD", cwd=clean_checkout).strip()
    assert summary["commit"] == head and re.fullmatch(r"\d{4}-\d\d-\d\d", summary["date"]), summary["commit"]
    assert summary["cpu"] and summary["gpu"] == "none"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", summary["version"])  # the toolkit's, from its pyproject.toml
    assert not (clean_checkout / "results" / ".cache").exists()  # every lr was found in the shipped cache
    reference = os.path.join(ROOT, "reference", "superlinear-a9a", "history.csv")
    for method in ("fedavg", "fedpm"):
        ours, ref = _rows(out / "history.csv", method), _rows(reference, method)
        assert len(ours) == len(ref) > 1
        for a, b in zip(ours, ref, strict=True):
            assert float(a["dist"]) == pytest.approx(float(b["dist"]), rel=1e-6, abs=1e-13)


@needs_git
@pytest.mark.slow
def test_figures_from_the_shipped_runs_change_no_tracked_file(clean_checkout):
    """``python -m figures --no-compute`` draws the quick profile from reference/quick (copied into results/)
    and writes only ignored paths."""
    r = _run(clean_checkout, "-m", "figures", "--no-compute")
    assert r.returncode == 0, r.stderr
    assert "table3_accuracy.md" in r.stdout
    assert _git("status", "--porcelain", cwd=clean_checkout) == ""


def test_every_shipped_summary_says_where_it_comes_from():
    found = 0
    for folder, _, files in os.walk(os.path.join(ROOT, "reference")):
        if "summary.json" in files:
            with open(os.path.join(folder, "summary.json")) as fh:
                summary = json.load(fh)
            missing = {"command", "commit", "date", "cpu", "gpu"} - set(summary)
            assert not missing, f"{folder}: no {sorted(missing)}"
            assert re.fullmatch(r"[0-9a-f]{7,40}|unknown", summary["commit"]) and re.fullmatch(
                r"\d{4}-\d\d-\d\d|unknown", summary["date"]
            )
            found += 1
    assert found > 0


def _imported_names(path):
    """(module, name or None) of every import of a script."""
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from ((node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names)


def test_every_measurement_script_imports_what_it_uses():
    """A script whose module or name is gone (a reverted design) fails here instead of when someone runs it."""
    folder = os.path.join(ROOT, "benchmarks")
    scripts = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    assert scripts
    for script in scripts:
        for module, name in _imported_names(os.path.join(folder, script)):
            if (
                module.split(".")[0] in ("torch", "scipy", "threadpoolctl", "cupy")
                and importlib.util.find_spec(module.split(".")[0]) is None
            ):
                continue
            mod = importlib.import_module(module)
            if name is not None and not hasattr(mod, name):
                importlib.import_module(f"{module}.{name}")  # a submodule; raises if it is gone


def test_the_benchmarks_readme_lists_every_script():
    text = open(os.path.join(ROOT, "benchmarks", "README.md")).read()
    for f in os.listdir(os.path.join(ROOT, "benchmarks")):
        if f.endswith((".py", ".sh")):
            assert f"benchmarks/{f}" in text, f


# development words and machine paths, spelled so that this file does not match them itself
FORBIDDEN = re.compile(
    "|".join(
        [
            r"\b[Ss]ession[ -]?\d",
            r"\b[Ii]ssue[ #]?\d",
            "when " + "issue",
            "/" + "work/",
            "/" + "tmp/",
            "/" + "home/",
            r"\b[Ww]alkthrough finding",
            r"\b[Rr]eview finding",
        ]
    )
)


@needs_git
def test_tracked_files_speak_of_the_project_alone():
    """No numbered work periods, issue numbers or machine paths in the repository (history is CHANGELOG.md and
    git's); data locations come from arguments and environment variables."""
    offending = []
    for rel in _project_files():
        if rel.endswith((".bz2", ".png", ".pdf", ".gz", ".zip", ".pt")):
            continue
        try:
            text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        for k, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                offending.append(f"{rel}:{k}: {line.strip()[:100]}")
    assert not offending, "\n".join(offending[:20])


@needs_git
def test_results_is_ignored_and_untracked():
    assert not _git("ls-files", "results")
    assert _git("check-ignore", "results/anything").strip() == "results/anything"


def test_shipped_runs_are_copied_only_where_results_lacks_them(tmp_path):
    """validation.experiments copies reference/<profile>/<run> into results/<profile>/ for the runs that are not
    there; a folder already in results/ (a run of the user's, finished or not) is left as it is."""
    from validation.experiments import seed_from_reference

    ref = tmp_path / "reference" / "quick"
    for name in ("a", "b"):
        (ref / name).mkdir(parents=True)
        (ref / name / "summary.json").write_text(json.dumps({"run": name}))
    (ref / "unfinished").mkdir()  # no summary.json: not a run
    mine = tmp_path / "results" / "quick" / "b"
    mine.mkdir(parents=True)
    (mine / "history.csv").write_text("round\n")
    copied = seed_from_reference("quick", str(tmp_path / "results"), str(tmp_path / "reference"))
    assert copied == ["a"]
    assert json.loads((tmp_path / "results" / "quick" / "a" / "summary.json").read_text()) == {"run": "a"}
    assert sorted(os.listdir(mine)) == ["history.csv"]
    assert not (tmp_path / "results" / "quick" / "unfinished").exists()
    assert seed_from_reference("quick", str(tmp_path / "results"), str(tmp_path / "reference")) == []


def test_every_module_using_a_shared_session_fixture_runs_in_its_group(request):
    """tests/conftest.py's SHARED_MODULES holds every module whose tests use an expensive shared session fixture:
    one missing there would build the fixture again on another pytest-xdist worker."""
    from conftest import SHARED_FIXTURES, SHARED_MODULES

    users = {
        os.path.basename(item.nodeid.split("::", 1)[0])
        for item in request.session.items
        if set(SHARED_FIXTURES) & set(getattr(item, "fixturenames", ()))
    }
    assert users <= SHARED_MODULES, users - SHARED_MODULES


def test_the_tests_reading_the_shared_deployment_are_the_listed_ones_and_share_nothing_else(request):
    """tests/conftest.py's DEPLOYMENT_READERS names the tests that go last in a group of their own (the scheduler
    sees node ids, not fixtures): each listed test that was collected reads the deployment's findings, and none
    needs a shared session fixture, which their own group would build a second time."""
    from conftest import DEPLOYMENT_GROUP, DEPLOYMENT_READERS, SHARED_FIXTURES, xdist_group

    for item in request.session.items:
        if xdist_group(item.nodeid) == DEPLOYMENT_GROUP:
            fixtures = set(getattr(item, "fixturenames", ()))
            assert "deployment_runs" in fixtures and not fixtures & set(SHARED_FIXTURES), item.nodeid
    assert all(xdist_group(f"tests/{module}::{test}[x]") == DEPLOYMENT_GROUP for module, test in DEPLOYMENT_READERS)


def test_a_federation_alone_waits_for_the_shared_ones_and_gives_up_after_its_wait(tmp_path, monkeypatch):
    """tests/federations.py: shared holders run together; one that must run alone waits for them, and gives up
    after its wait with a TimeoutError naming the lock rather than hanging the suite."""
    import time

    from federations import LOCK_VARIABLE, federation

    monkeypatch.setenv(LOCK_VARIABLE, str(tmp_path / "lock"))
    with federation():
        with federation(wait=0.5):  # another shared holder: at once
            pass
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="lock"):
            with federation(alone=True, wait=1.5):
                pass
        assert time.monotonic() - start >= 1.5
    with federation(alone=True, wait=0.5):  # no holder left
        pass
