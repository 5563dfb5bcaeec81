"""The command-line fuzzer (tests/argv_fuzz.py): generated command lines for every command, from its own argparse
definition, each ending in an allowed exit status with one error line, no traceback and nothing left behind;
and the fuzzer's own checks, shown to catch each kind of failure."""

import os
import sys

import pytest

pytest.importorskip("torch")

import argv_fuzz  # noqa: E402

CASES = 2000  # about a minute on two cores; seeded: the same command lines every time
SEED = 20261206


@pytest.mark.slow
def test_generated_command_lines_end_cleanly_for_every_command(tmp_path):
    outcomes = argv_fuzz.fuzz(str(tmp_path / "sandbox"), CASES, SEED)
    failing = [o for o in outcomes if o.problem]
    assert not failing, argv_fuzz.report(outcomes)
    # every command was reached both ways: refused at its boundary, and let through to its work
    for command in argv_fuzz.COMMANDS:
        codes = {o.code for o in outcomes if o.command == command.name}
        assert 2 in codes and codes & {0, "reached"}, (command.name, codes)


def test_the_same_seed_gives_the_same_command_lines(tmp_path):
    root = str(tmp_path)
    argv_fuzz.sandbox(root)
    command = argv_fuzz.COMMANDS[0]
    argv_fuzz.definition(command)
    draws = [argv_fuzz.argv_for(command, argv_fuzz.random.Random(i), root) for i in (5, 5, 6)]
    assert draws[0] == draws[1] != draws[2]


def broken(body):
    return argv_fuzz.Command("broken", lambda: body)


@pytest.mark.parametrize(
    "body, problem",
    [
        (lambda argv: 1 / 0, "ZeroDivisionError"),
        (lambda argv: 3, "exit 3"),
        (lambda argv: print("prog: error: bad", file=sys.stderr) or 0, "exit 0 after an error"),
        (lambda argv: sys.exit(2), "exit 2 without an error line last"),
        (lambda argv: print("usage: prog\nprog: error: x", file=sys.stderr) or sys.exit(2), "more than one line"),
        (lambda argv: print("Traceback (most recent call last):", file=sys.stderr) or 0, "a traceback"),
    ],
)
def test_the_fuzzer_reports_each_kind_of_failure(tmp_path, body, problem):
    root = str(tmp_path)
    argv_fuzz.sandbox(root)
    os.makedirs(os.path.join(root, "cwd"))
    outcome = argv_fuzz.run_case(broken(body), [], root, argv_fuzz.snapshot(root))
    assert problem in outcome.problem


def test_the_fuzzer_reports_leftovers_and_hangs(tmp_path, monkeypatch):
    root = str(tmp_path)
    argv_fuzz.sandbox(root)
    os.makedirs(os.path.join(root, "cwd"))
    before = argv_fuzz.snapshot(root)

    def leaves(argv):
        open(os.path.join(root, "folder", "left"), "w").close()
        return 0

    assert argv_fuzz.run_case(broken(leaves), [], root, before).problem.startswith("left folder/left")
    argv_fuzz.restore(root, before)
    assert argv_fuzz.snapshot(root) == before
    monkeypatch.setattr(argv_fuzz, "CASE_SECONDS", 0.2)

    def hangs(argv):
        while True:
            pass

    assert argv_fuzz.run_case(broken(hangs), [], root, before).code == "hung"
