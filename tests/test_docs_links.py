"""The user documentation holds together: docs/README.md indexes exactly the pages of docs/, every relative link
and #anchor resolves, the pages speak of the toolkit (not of how it was written), and a profile's time is stated
once, from measured files."""

from __future__ import annotations

import csv
import glob
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "REPRODUCTION.md", "CHANGELOG.md", "reference/README.md", "benchmarks/README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
        return fh.read()


def prose(text):
    """The text outside fenced code blocks and inline code (where a bracket is not a link)."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))


def anchors(text):
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens, repeats -1, -2."""
    seen, found = {}, set()
    for heading in re.findall(r"^#{1,6} (.+?)#*$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(rel):
    for target in LINK.findall(prose(read(rel))):
        if not re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check here
            yield target


@pytest.mark.parametrize("rel", PAGES)
def test_every_relative_link_and_anchor_resolves(rel):
    broken = []
    for target in links(rel):
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(os.path.join(ROOT, rel)), path)) if path else None
        if dest and not os.path.exists(dest):
            broken.append(f"{target}: no such file")
        elif anchor and (dest is None or dest.endswith(".md")):
            page = os.path.relpath(dest, ROOT) if dest else rel
            if anchor not in anchors(read(page)):
                broken.append(f"{target}: no heading #{anchor} in {page}")
    assert not broken, f"{rel}: " + "; ".join(broken)


def test_the_anchor_rule_is_github_s():
    text = "# A title\n## Set up\n## `--max-ratio`: the guard (R × median)\n## Set up\n```\n# not a heading\n```\n"
    assert anchors(text) == {"a-title", "set-up", "--max-ratio-the-guard-r--median", "set-up-1"}


def test_the_docs_index_lists_exactly_the_pages_of_docs():
    listed = {t for t in links("docs/README.md") if "/" not in t and t.endswith(".md")}
    pages = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))} - {"README.md"}
    table = set(re.findall(r"^\| \[([\w.-]+\.md)\]\(\1\) \|", read("docs/README.md"), re.M))
    assert table == pages, f"index lacks {sorted(pages - table)}, lists missing {sorted(table - pages)}"
    assert listed >= pages


# words about how the toolkit was written, not about the toolkit: which hardware there was while writing, the
# history of the test catalogue; in the changelog, entries about the tests themselves
WRITING = re.compile(
    r"\bGPU was lent\b|\blent GPU\b|\bno GPU was\b|\bfor this change\b|\bat the time\b(?! limit)|\bwhile writing\b"
    r"|\b\d{3}(?:st|nd|rd|th)\b|\b(?:first|second|third|last|earlier) (?:hostile )?sweep\b|[Hh]ostile sweep"
    r"|\bA first run\b"
)
CHANGELOG_TESTS = re.compile(r"[Tt]est suite|hostile cases|hostile_catalogue|\bin CI\b|snippets of README")


@pytest.mark.parametrize("rel", PAGES)
def test_user_docs_speak_of_the_toolkit_not_of_how_it_was_written(rel):
    rule = re.compile(f"{WRITING.pattern}|{CHANGELOG_TESTS.pattern}") if rel == "CHANGELOG.md" else WRITING
    lines = enumerate(read(rel).splitlines(), 1)
    found = [f"{rel}:{k}: {line.strip()[:100]}" for k, line in lines if rule.search(line)]
    assert not found, "\n".join(found)


def test_the_rule_catches_what_it_names():
    assert WRITING.search("Not measured: no GPU was lent.") and WRITING.search("## On a lent GPU")
    assert WRITING.search("the 359th passes alone") and not WRITING.search("stopped at the time limit")
    assert CHANGELOG_TESTS.search("- **Test suite time.** The deployment tests share")


def run_seconds(folder):
    """A run's recorded wall time: its summary's (convex runs) or its history's last row's (DNN runs, cumulative)."""
    with open(os.path.join(folder, "summary.json")) as fh:
        summary = json.load(fh)
    if "wall_seconds" in summary:
        return summary["wall_seconds"]
    with open(os.path.join(folder, "history.csv")) as fh:
        rows = list(csv.DictReader(fh))
    return float(rows[-1]["wall_seconds"])


def test_the_quick_profile_s_time_is_stated_once_from_the_shipped_runs():
    """docs/sweeps.md states the runs reference/quick ships and their measured minutes (summary.json's
    wall_seconds, or their histories'); no other page restates a quick-profile time in minutes."""
    summaries = glob.glob(os.path.join(ROOT, "reference", "quick", "*", "summary.json"))
    minutes = sum(run_seconds(os.path.dirname(p)) for p in summaries) / 60
    text = " ".join(read("docs/sweeps.md").split())
    assert f"ships {len(summaries)} of them" in text and f"took {minutes:.1f} minutes together" in text
    restated = re.compile(r"(≈|~|about) ?\d+ ?min")
    for rel in PAGES + ["validation/experiments.py", "figures/__main__.py", "Makefile"]:
        for line in read(rel).splitlines():
            if "quick" in line and "make figures" in line or "--profile quick" in line:
                assert not restated.search(line), f"{rel}: {line.strip()}"


def test_readme_tells_this_fedpm_from_flowers_baseline_of_the_same_name():
    """Flower's repository has an unrelated ``baselines/fedpm`` (Isik et al.): README says so, pointing at the page
    that names both methods."""
    readme = read("README.md")
    line = next((ln for ln in readme.splitlines() if "baselines/fedpm" in ln), "")
    assert "unrelated" in line and "(docs/flower.md)" in line, line
    flower = prose(read("docs/flower.md").split("\n## ", 1)[0])
    assert "Preconditioned Mixing" in flower and "Isik et al." in flower and "unrelated" in flower


def test_every_retired_benchmark_is_gone_and_keeps_its_finding_in_decisions():
    """A script retired from benchmarks/ leaves one line in docs/decisions.md: its name, no longer in benchmarks/,
    and what it measured (a number), runnable at the commit the section names."""
    text = read("docs/decisions.md")
    head, _, section = text.partition("## Settled measurements")
    assert section, "docs/decisions.md has no 'Settled measurements' section"
    commit = re.search(r"run at ([0-9a-f]{7,40})", section.splitlines()[0])
    assert commit, section.splitlines()[0]
    body = section.split("\n## ", 1)[0]
    # a bullet runs on over its indented continuation lines
    retired = re.findall(r"^\* `([\w.]+\.py)`: (.+(?:\n  .+)*)", body, flags=re.M)
    assert retired
    present = set(os.listdir(os.path.join(ROOT, "benchmarks")))
    for name, finding in retired:
        assert name not in present, f"{name} is still in benchmarks/"
        assert re.search(r"\d", finding), (name, finding)
