"""The one history format (fedconvex.history): what is written reads back as the same numbers."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from fedconvex.history import histories_csv, history_csv, read_history, read_run

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
