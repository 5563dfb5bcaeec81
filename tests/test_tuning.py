"""Speed-ups of Test 1 that must not change a single number: the run's reuse of the last oracle point."""

import math

import numpy as np
import pytest

import fedconvex.run as fr
from fedconvex.algorithms import applicable, make_algorithm
from fedconvex.data import sequential_split
from fedconvex.problem import FederatedLogReg
from fedconvex.reference import initial_point, solve_optimum
from validation import tuning


@pytest.fixture(scope="module")
def small(a9a):
    pb = FederatedLogReg(a9a.X[:1200], a9a.y[:1200], sequential_split(1200, 6, 200), lam=1e-3)
    theta_star, f_star, _ = solve_optimum(pb)
    return pb, theta_star, f_star, initial_point(pb, theta_star, "paper", seed=0)


def _history(small, method, lr, rounds=8, **kw):
    pb, theta_star, f_star, theta0 = small
    alg = make_algorithm(method, **applicable(method, {"local_steps": 1, "lr": lr}))
    _, hist = fr.run(pb, alg, theta0, rounds, seed=0, theta_star=theta_star, f_star=f_star, **kw)
    return [{k: v for k, v in row.items() if k != "seconds"} for row in hist]


@pytest.mark.parametrize(
    "method,lr",
    [
        ("fedavg", 1.0),
        ("scaffold", 1.0),
        ("fedadam", 10.0),
        ("fedns", 1.0),
        ("fednl", 1.0),
        ("fedpm", 1.0),
        ("localnewton", 0.5),
    ],
)
def test_reusing_the_last_point_changes_no_number(small, monkeypatch, method, lr):
    reused = _history(small, method, lr)
    monkeypatch.setattr(fr, "reusing_last_point", lambda problem: problem)
    assert _history(small, method, lr) == reused  # bit for bit, every column but wall time


def test_the_clients_first_gradients_come_from_the_previous_rounds_metrics(small, monkeypatch):
    calls = []
    real = FederatedLogReg.values_and_gradients

    def counting(self, thetas, sel=None):
        calls.append(len(thetas))
        return real(self, thetas, sel)

    monkeypatch.setattr(FederatedLogReg, "values_and_gradients", counting)
    _history(small, "fedavg", 1.0, rounds=5)
    assert len(calls) == 6  # metrics of rounds 0..5; the five rounds' client gradients were answered
    calls.clear()
    _history(small, "fedavg", 1.0, rounds=5, participants=3)
    assert len(calls) == 11  # a sample of the clients asks another question: computed


def test_the_view_leaves_the_problem_alone(small):
    pb = small[0]
    view = fr.reusing_last_point(pb)
    assert isinstance(view, FederatedLogReg) and view is not pb and "_last" not in vars(pb)
    thetas = np.zeros((pb.n_clients, pb.d))
    v1, g1 = view.values_and_gradients(thetas)
    g1 += 1.0  # a caller that writes into its answer does not change the next one
    v2, g2 = view.values_and_gradients(thetas, np.arange(pb.n_clients))
    np.testing.assert_array_equal(g2, pb.values_and_gradients(thetas)[1])
    other = object()
    assert fr.reusing_last_point(other) is other  # only the logistic problem, whose oracles are pure


# ------------------------------------------------------------------ the race, run in any order


def _tune(small, method, rounds=12, **kw):
    pb, theta_star, f_star, theta0 = small
    return tuning.tune(pb, method, {"local_steps": 1}, theta0, theta_star, f_star, rounds, seed=0, **kw)


def _records(small, method, order, rounds=12, against="earlier"):
    """Candidate runs made in ``order``, each raced as a parallel worker races it: against the finished
    scores of the candidates before it in the grid (+ slack), or against nothing at all."""
    pb, theta_star, f_star, theta0 = small
    cands = list(tuning.candidates(method, {"local_steps": 1}))
    scores = [float("inf")] * len(cands)
    records = {}
    for i in order(len(cands)):
        best = (
            (lambda i=i: min(scores[:i], default=float("inf")) + tuning.PARALLEL_SLACK)
            if against == "earlier"
            else float("inf")
        )
        rec = tuning.race_candidate(pb, method, cands[i], theta0, theta_star, f_star, rounds, best, seed=0)
        if rec["hist"] is not None:
            scores[i] = tuning.run_score(rec["hist"], tuning.score_floor(f_star))
        records[i] = rec
    return records


def _same(a, b):
    (pa, ha, ta), (pb_, hb, tb) = a, b
    strip = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h]  # noqa: E731
    assert pa == pb_ and ta == tb and strip(ha) == strip(hb)


@pytest.mark.parametrize("method", ["fedavgm", "fedadam", "fedpm", "localnewton", "fedns"])
@pytest.mark.parametrize(
    "order",
    [lambda n: range(n), lambda n: reversed(range(n)), lambda n: sorted(range(n), key=lambda i: (i % 3, -i))],
    ids=["grid", "reverse", "mixed"],
)
def test_a_race_run_in_any_order_settles_as_the_sequential_race(small, method, order, monkeypatch):
    sequential = _tune(small, method)
    assert any(t["score"] is None for t in sequential[2]) or method == "localnewton"  # the race did stop some
    ran = []
    real = tuning.race_candidate
    monkeypatch.setattr(tuning, "race_candidate", lambda *a, **k: ran.append(a[2]) or real(*a, **k))
    _same(_tune(small, method, records=_records(small, method, order)), sequential)
    assert len(ran) == len(sequential[2])  # the records decided every candidate: nothing was run again


def test_records_that_stop_early_or_are_missing_are_run_again(small):
    sequential = _tune(small, "fedavg")
    records = _records(small, "fedavg", lambda n: range(n), against="nothing")
    assert all(r["hist"] is not None for r in records.values())  # raced against nothing: every run ends
    _same(_tune(small, "fedavg", records=records), sequential)
    # a record cut short where the sequential race goes on (a wrong stop), and one lost: both re-run
    winner = [t["lr"] for t in sequential[2]].index(sequential[0]["lr"])
    records[winner] = {"rows": records[winner]["rows"][:2], "hist": None, "error": None}
    del records[len(records) - 1]
    _same(_tune(small, "fedavg", records=records), sequential)


def test_superlinear_tunes_in_two_workers_exactly_as_in_one(tmp_path):
    import csv
    import json

    from validation import superlinear

    args = [
        "--dataset",
        "a9a",
        "--clients",
        "8",
        "--per-client",
        "200",
        "--rounds",
        "8",
        "--quiet",
        "--no-cache",
        "--methods",
        "fedavgm,fedns,fedpm,localnewton,fedavg",
    ]
    out = {}
    for jobs in ("1", "2"):
        assert superlinear.main(args + ["--jobs", jobs, "--out", str(tmp_path / jobs)]) == 0
        summary = json.loads((tmp_path / jobs / "summary.json").read_text())["methods"]
        with open(tmp_path / jobs / "history.csv") as fh:
            rows = [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(fh)]
        out[jobs] = ({m: (s["params"], s["trials"], s["final_dist"]) for m, s in summary.items()}, rows)
    assert out["1"] == out["2"]
    assert len(out["1"][0]["fedavgm"][1]) == 33  # the whole grid was raced, trial by trial the same


def test_the_problem_built_for_test1_has_its_hessian_plan_as_if_built_at_once(a9a):
    from types import SimpleNamespace

    from validation import common

    args = SimpleNamespace(
        backend="numpy",
        dataset="a9a",
        n_features=None,
        clients=8,
        per_client=150,
        split="sequential",
        seed=0,
        lam=1e-3,
        weighting="uniform",
        init="paper",
    )
    pb = common.build_problem(args)[0]  # plan built in a thread while the optimum was solved
    direct = FederatedLogReg(a9a.X, a9a.y, common.build_split(args, a9a), lam=1e-3)
    assert pb._plan is not None
    for key in ("Q", "gather"):
        a, b = pb._plan[key], direct._plan[key]
        assert (a != b).nnz == 0 if hasattr(a, "nnz") else np.array_equal(a, b)
    thetas = np.random.default_rng(1).normal(size=(pb.n_clients, pb.d))
    for x, y in zip(pb.hessians(thetas).blocks, direct.hessians(thetas).blocks, strict=True):
        np.testing.assert_array_equal(x, y)


def test_the_figure_files_written_side_by_side_are_complete_and_a_failure_is_raised_here(tmp_path):
    from validation import report

    plt = report.import_pyplot()
    fig, ax = plt.subplots()
    ax.semilogy([1, 2, 3], [1.0, 1e-3, 1e-9])
    report._save_each(fig, [str(tmp_path / "a.png"), str(tmp_path / "a.pdf")])
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "a.pdf").read_bytes()[:5] == b"%PDF-" and b"%%EOF" in (tmp_path / "a.pdf").read_bytes()[-32:]
    with pytest.raises(FileNotFoundError):  # the child's path could not be written: this process says why
        report._save_each(fig, [str(tmp_path / "missing" / "b.png"), str(tmp_path / "b.pdf")])
    assert (tmp_path / "b.pdf").stat().st_size > 1000
    plt.close(fig)


# ------------------------------------------------------------------ work the candidates of a search share
def test_kept_gaussian_draws_give_the_runs_numbers_and_generator_state_without_drawing(small, monkeypatch):
    """FedNS's candidates draw the same sketches from the same seed: with the memo on, a second run recalls
    the first run's draws (draws nothing), and its history is, bit for bit, the one drawn afresh."""
    from fedconvex.algorithms import fedns
    from fedconvex.algorithms.normal_memo import NORMALS, remembering_normals

    pb, theta_star, f_star, theta0 = small
    strip = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h]  # noqa: E731
    NORMALS.clear()
    fresh = _history(small, "fedns", 0.5, rounds=4)
    _, fresh7 = fr.run(pb, make_algorithm("fedns", lr=0.5), theta0, 4, seed=7, theta_star=theta_star, f_star=f_star)
    draws = []

    class Counting(fedns._DrawnAhead):
        def __init__(self, *a, **k):
            draws.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(fedns, "_DrawnAhead", Counting)
    with remembering_normals(64 * 2**20):
        first = _history(small, "fedns", 1.0, rounds=4)
        assert NORMALS.used > 0 and len(draws) == 4
        again = _history(small, "fedns", 0.5, rounds=4)
        assert again == fresh and len(draws) == 4  # every round recalled, and the very same numbers
        assert first != fresh  # (another lr: another run, from the same sketches)
        # a draw from another state is not answered from the memo: a run from another seed draws its own
        _, h7 = fr.run(pb, make_algorithm("fedns", lr=0.5), theta0, 4, seed=7, theta_star=theta_star, f_star=f_star)
        assert len(draws) == 8 and strip(h7) == strip(fresh7)
    NORMALS.clear()


def test_the_memo_keeps_no_more_than_its_budget_and_nothing_when_off(small):
    from fedconvex.algorithms.normal_memo import NORMALS, remembering_normals

    NORMALS.clear()
    _history(small, "fedns", 1.0, rounds=3)
    assert NORMALS.used == 0  # off outside a search
    pb = small[0]
    one_round = 8 * pb.d * int(sum(m for m in pb.counts if m > pb.d))
    with remembering_normals(2 * one_round):
        _history(small, "fedns", 1.0, rounds=5)
    assert NORMALS.used == 2 * one_round  # the first two rounds' draws, then no room
    NORMALS.clear()
    with remembering_normals(100 * one_round, entries=3):
        _history(small, "fedns", 1.0, rounds=5)
    assert NORMALS.used == 3 * one_round  # the first three draws: no more than asked for
    NORMALS.clear()


def test_each_candidate_starts_knowing_the_first_point_and_the_search_is_unchanged(small, monkeypatch):
    """Every candidate's round-0 metrics are f and grad f at theta0: computed once per process, not once a
    candidate, and the search (trials, winner, history) is the same as when every run computes them."""
    calls = []
    real = FederatedLogReg.values_and_gradients

    def counting(self, thetas, sel=None):
        calls.append(1)
        return real(self, thetas, sel)

    monkeypatch.setattr(FederatedLogReg, "values_and_gradients", counting)
    tuning._STARTS.clear()
    shared = _tune(small, "fedavg")
    n_shared = len(calls)
    monkeypatch.setattr(tuning, "_starting_view", lambda problem, theta0: problem)
    calls.clear()
    alone = _tune(small, "fedavg")
    assert n_shared == len(calls) - len(alone[2]) + 1  # one start computed instead of one a candidate
    _same(shared, alone)


def test_a_worker_frees_the_kept_draws_when_it_moves_on_to_another_method(small):
    """The memo serves one method's candidates: racing a candidate of another method empties it."""
    from fedconvex.algorithms.normal_memo import NORMALS

    pb, theta_star, f_star, theta0 = small
    NORMALS.clear()
    tuning.race_candidate(pb, "fedns", {"lr": 1.0}, theta0, theta_star, f_star, 4, math.inf)
    assert NORMALS.used > 0
    tuning.race_candidate(pb, "fedns", {"lr": 0.5}, theta0, theta_star, f_star, 4, math.inf)
    assert NORMALS.used > 0  # the same method's next candidate recalls them
    tuning.race_candidate(pb, "fedpm", {"lr": 1.0}, theta0, theta_star, f_star, 4, math.inf)
    assert NORMALS.used == 0


@pytest.mark.parametrize("bit_generator", [np.random.PCG64, np.random.MT19937, np.random.Philox, np.random.SFC64])
def test_the_memo_keys_every_numpy_bit_generator_exactly(bit_generator):
    from fedconvex.algorithms.normal_memo import NormalMemo

    memo, shapes = NormalMemo(), [(3, 2), None, (1, 4)]
    memo.budget, memo.entries = 2**20, 4
    rng = np.random.Generator(bit_generator(5))
    key = memo.key(rng, shapes)
    drawn = [None if s is None else rng.standard_normal(s) for s in shapes]
    memo.keep(key, drawn, rng.bit_generator.state)
    again = np.random.Generator(bit_generator(5))
    got = memo.recall(again, shapes)
    assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(got, drawn, strict=False))
    assert again.random() == rng.random()  # moved on exactly as drawing would
    assert memo.recall(np.random.Generator(bit_generator(6)), shapes) is None


def test_a_damaged_cache_is_re_tuned_and_a_foreign_file_refused(tmp_path):
    """A cache of ours cut short (text opening a JSON object) is only a cache: accepted, read as empty, rewritten
    whole; a file that is not ours is refused before anything could overwrite it."""
    from validation.tuning import TuningCache

    damaged = tmp_path / "tuning.json"
    damaged.write_text('{"abc": {"lr": 0.5}, "de')
    TuningCache.check(str(damaged))
    cache = TuningCache(str(damaged))
    assert cache.get("abc") is None
    cache.put("k", {"lr": 1.0})
    assert TuningCache(str(damaged)).get("k") == {"lr": 1.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuning.json"]  # no temporary file left
    foreign = tmp_path / "data.svm"
    foreign.write_text("+1 3:1 7:1\n")
    with pytest.raises(ValueError, match="is not a tuning cache of this tool"):
        TuningCache.check(str(foreign))
