"""Count the catalogue of hostile cases (docs/robustness.md): every collected case of the hostile test files, by
what it asserts.

    python tests/hostile_catalogue.py            # counts from pytest's collection (seconds)
    python tests/hostile_catalogue.py --run      # and run the cases: the failure counts must all be 0 (minutes)

A case is a *clear error* when its test asserts a refusal naming the cause (one stderr line and exit 2, or a
ValueError/OSError... with its message), else a *correct result* (the right output, a rejected reply with the round
completing, a cache rebuilt, the healthy counterpart of an error case).  Each case asserts the absence of the
defects it guards (no traceback, nothing left behind, nothing of someone else's changed, a bounded wait), so with
``--run`` every failing case counts as one defect found and the catalogue's defect count is the number failing.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = sorted(f for f in os.listdir(HERE) if re.fullmatch(r"test_hostile_\w+\.py", f) or f == "test_flower_timeout.py")
# what a test that asserts a refusal calls or checks (test_hostile_files.one_line, test_hostile_params._one_line_error)
ERROR_SIGNS = ("one_line(", "_one_line_error(", "pytest.raises(", "rc == 2", "== 2 and")
# where those signs mislead: a refusal asserted otherwise (exit 130/143, a stack's exit 1 with its run's line), a
# result with an incidental pytest.raises, and the one check of the catalogue itself, which is no case
OVERRIDES = {
    "test_the_catalogue_is_large_enough": "meta",
    "test_sigterm_while_writing_leaves_no_partial_folder": "error",
    "test_ctrl_c_is_one_line_and_leaves_nothing": "error",
    "test_ctrl_c_in_dnn_says_what_is_kept_and_leaves_an_empty_out_as_it_was": "error",
    "test_sigterm_in_a_flower_simulation_round_is_one_line_and_leaves_nothing": "error",
    "test_a_stacked_run_whose_folder_is_swapped_stops_alone": "error",
    "test_flower_precond_dtype_is_taken_exactly_by_the_methods_whose_reply_carries_preconditioner_blocks": "error",
    "test_a_huge_preconditioner_cannot_set_the_model": "result",
    "test_flower_logreg_server_dtype_checks": "result",
    "test_a_previous_result_is_replaced_only_when_the_new_one_is_complete": "result",
    "test_simple_mix_of_integers_averages_them_and_keeps_their_dtype": "result",
    "test_the_deployment_timeout_bounds_a_round_and_a_killed_supernode_is_dropped": "result",
    "test_sigterm_during_keys_is_one_line_and_leaves_no_private_keys": "error",
}


def categories(path: str) -> dict:
    """test function name -> 'error' | 'result' (| 'meta': no case), from its source and OVERRIDES."""
    src = open(path).read()
    out = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            body = ast.get_source_segment(src, node) or ""
            guess = "error" if any(s in body for s in ERROR_SIGNS) else "result"
            out[node.name] = OVERRIDES.get(node.name, guess)
    return out


def collected(files: list) -> list:
    """The node ids pytest collects from ``files``."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", *files]
    text = subprocess.run(cmd, cwd=os.path.dirname(HERE), capture_output=True, text=True, check=True).stdout
    return [ln.strip() for ln in text.splitlines() if "::" in ln]


def failing(files: list) -> list:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *files]
    text = subprocess.run(cmd, cwd=os.path.dirname(HERE), capture_output=True, text=True).stdout
    return [ln.split()[1] for ln in text.splitlines() if ln.startswith("FAILED ")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="store_true", help="also run the cases and count the failing ones")
    args = p.parse_args(argv)
    paths = [os.path.join("tests", f) for f in FILES]
    kinds = {f: categories(os.path.join(HERE, f)) for f in FILES}
    table = {f: {"cases": 0, "error": 0, "result": 0} for f in FILES}
    for node in collected(paths):
        f, name = node.split("::")[0].split("/")[-1], node.split("::")[1].split("[")[0]
        kind = kinds[f][name]
        if kind != "meta":
            table[f]["cases"] += 1
            table[f][kind] += 1
    print(f"{'file':32} {'cases':>6} {'clear errors':>13} {'correct results':>16}")
    for f, row in table.items():
        print(f"{f:32} {row['cases']:>6} {row['error']:>13} {row['result']:>16}")
    total = {k: sum(row[k] for row in table.values()) for k in ("cases", "error", "result")}
    print(f"{'total':32} {total['cases']:>6} {total['error']:>13} {total['result']:>16}")
    if args.run:
        bad = failing(paths)
        print(f"failing cases (tracebacks, silent results, hangs, leftovers, data loss): {len(bad)}")
        for node in bad:
            print("  " + node)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
