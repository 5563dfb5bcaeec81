"""docs/use-in-your-code.md: every Python block runs, in order, in one namespace (as a reader would paste them)."""

import inspect
import os
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("flwr")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "use-in-your-code.md")


def blocks(lang):
    with open(DOC) as fh:
        return re.findall(rf"```{lang}(?: [^\n]*)?\n(.*?)```", fh.read(), re.S)


def test_every_python_block_of_the_guide_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, *code = blocks("python")
    # the first-run block at the top stands alone: a reader starts there, in a fresh interpreter
    alone = {"__name__": "first_run"}
    exec(compile(first, DOC, "exec"), alone)
    assert [h["round"] for h in alone["run"].history] == [1, 2, 3]
    assert len(code) == 5
    # section 1's first example is the plain loop with FOOF's defaults: no statistics call before the steps
    assert "opt = FOOF(model, lr=0.1)" in code[0] and "update_statistics" not in code[0]
    namespace = {"__name__": "guide"}
    for block in code:
        exec(compile(block, DOC, "exec"), namespace)
    assert namespace["more"].history[-1]["round"] == 4


def test_the_guide_lists_every_parameter_of_the_three_apis():
    from fedpm_dnn import FOOF, cost, federated, mix
    from fedpm_flower.client import fedpm_fit
    from fedpm_flower.strategy import FedPM

    with open(DOC) as fh:
        text = fh.read()
    for fn in (FOOF.__init__, mix, federated, FedPM.__init__, fedpm_fit, cost):
        names = [p for p in inspect.signature(fn).parameters if p != "self"]
        owner = fn.__qualname__.split(".")[0]
        listed = re.search(rf"^{owner}\((.*?)\)\s*(?:->|#)", text, re.S | re.M).group(1)
        assert [re.sub(r"[*\s]|=.*", "", p) for p in listed.split(",") if p.strip() != "*"] == names, owner
