"""The one history format (fedconvex.history): what is written reads back as the same numbers."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedconvex.history import histories_csv, history_csv, read_history, read_run, round_seconds

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(finite, finite, st.integers(0, 2**40)), min_size=1, max_size=6))
def test_rows_read_back_bit_for_bit(tmp_path_factory, values):
    rows = [{"round": t, "test_acc": a, "seconds": s, "bytes_up": b} for t, (a, s, b) in enumerate(values)]
    path = tmp_path_factory.mktemp("h") / "history.csv"
    path.write_text(history_csv(rows))
    back = read_run(path)
    assert back == rows and all(type(r["round"]) is int and type(r["bytes_up"]) is int for r in back)


def test_several_methods_in_one_file_and_a_column_one_run_lacks(tmp_path):
    path = tmp_path / "history.csv"
    path.write_text(
        histories_csv(
            {
                "fedpm": [{"round": 0, "dist": 0.5}, {"round": 1, "dist": 1e-12}],
                "fednl": [{"round": 0, "dist": 0.5, "rejected": 2}],
            }
        )
    )
    runs = read_history(path)
    assert list(runs) == ["fedpm", "fednl"] and runs["fedpm"][1]["dist"] == 1e-12
    assert math.isnan(runs["fedpm"][0]["rejected"]) and runs["fednl"][0]["rejected"] == 2
    try:
        read_run(path)
    except ValueError as exc:
        assert "holds 2 runs" in str(exc)
    else:
        raise AssertionError("a file of two runs read as one")


@pytest.mark.parametrize("round0", [True, False])
def test_round_seconds_are_the_steps_of_the_cumulative_column(round0):
    """With or without a round-0 row (the DNN front-end records none): adding the rounds' own seconds up again gives
    the cumulative column of the training rounds."""
    g = np.random.default_rng(3)
    seconds = np.cumsum(g.uniform(0.1, 5.0, 6))
    rows = [{"round": 0, "seconds": 0.0}] * round0 + [
        {"round": t + 1, "seconds": float(s)} for t, s in enumerate(seconds)
    ]
    per_round = round_seconds(rows)
    assert len(per_round) == 6 and min(per_round) > 0
    np.testing.assert_allclose(np.cumsum(per_round), seconds, rtol=1e-12)
