"""validation.timing.best_seconds: one untimed warm-up call, then the minimum over the timed calls."""

from validation import timing


def test_best_seconds_warms_up_once_and_keeps_the_fastest_call(monkeypatch):
    durations = iter([9.0, 3.0, 1.0, 2.0])  # the warm-up call is the slowest and must not count
    clock = [0.0]
    calls = []

    def f():
        calls.append(1)
        clock[0] += next(durations)

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    assert timing.best_seconds(f, 3) == 1.0
    assert len(calls) == 4
