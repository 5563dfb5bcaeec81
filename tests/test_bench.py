import json

from validation import bench_convex


def test_benchmark_reports_ratios_and_matches_the_naive_loop(capsys):
    assert bench_convex.main(["--dataset", "a9a", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("seconds_per_round", "seconds_to_1e-9", "loop_ratio"):
        assert r[key] > 0
    assert r["naive_vs_ours_relative_difference"] < 1e-10   # same algorithm, same iterates
    assert r["rounds_to_1e-9"] <= 12
