"""--list's time estimates say which machine measured the rounds they come from, switch to this machine's once it
has measured one, and estimate the paper's runs from the rounds measured on an H100 where nothing here is like them."""

import json
import os

import pytest

from validation import experiments, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_RUNS = os.path.join(ROOT, "reference", "gpu", "2026-11-27-h100")
RUNS = [r for r in experiments.plan("quick") if r.name.startswith("main-cifar10-a0.1-")]


def status(seconds, machine, device="cpu", state=sweep.DONE):
    return sweep.Status(state, rounds_done=4, round_seconds=seconds, device=device, machine=machine)


def test_estimates_come_from_the_shipped_machine_until_this_one_has_measured_a_run():
    shipped = {r.name: status(6.0, "AMD EPYC, 2 cores") for r in RUNS[:2]}
    missing = {r.name: sweep.Status(sweep.MISSING) for r in RUNS[2:]}
    states = shipped | missing
    est = sweep.round_seconds(RUNS, states, "cpu", "Other CPU, 2 cores")
    assert set(est.values()) == {6.0}
    assert sweep.measured_on(states, "cpu", "Other CPU, 2 cores") == ["AMD EPYC, 2 cores"]
    # one run measured here at 60 s a round: every estimate is this machine's from now on
    states[RUNS[2].name] = status(60.0, "Other CPU, 2 cores")
    est = sweep.round_seconds(RUNS, states, "cpu", "Other CPU, 2 cores")
    assert est[RUNS[2].name] == 60.0 and est[RUNS[0].name] == 60.0 and RUNS[0].name in est
    assert sweep.measured_on(states, "cpu", "Other CPU, 2 cores") == ["Other CPU, 2 cores"]


def test_listing_names_the_machine_of_its_estimates(tmp_path):
    shipped = experiments.shipped_runs("quick")
    if not shipped:
        pytest.skip("this copy ships no reference/quick")
    lines = sweep.listing(experiments.plan("quick"), str(tmp_path), "cpu", shipped, machine="Other CPU, 2 cores")
    machines = {json.load(open(os.path.join(f, "summary.json"))).get("cpu") for f in shipped.values()}
    assert lines[-1].startswith("estimated time left on this machine (cpu: Other CPU, 2 cores): ")
    assert f"from runs measured on {' and '.join(sorted(machines))}, not on it" in lines[-1]


def test_the_paper_profile_on_a_cpu_is_estimated_from_the_h100s_rounds(tmp_path):
    runs = experiments.plan("paper")
    dnn = [r for r in runs if r.kind == "dnn"]
    line = sweep.listing(runs, str(tmp_path), "cpu", {}, machine="Other CPU, 2 cores")[-1]
    assert " 0 s" not in line and f"unknown for {len(dnn)} runs" in line
    want = sum(100 * sweep.elsewhere_round_seconds(r) + sweep.START_SECONDS for r in dnn if r.rounds == 100)
    want += sum(r.rounds * sweep.elsewhere_round_seconds(r) + sweep.START_SECONDS for r in dnn if r.rounds != 100)
    assert f"{len(dnn)} of those: ~{sweep.hours(want)} on one {sweep.H100}" in line


@pytest.mark.skipif(not os.path.isdir(H100_RUNS), reason="this copy ships no reference/gpu")
def test_the_h100_round_seconds_are_the_shipped_measurements():
    def results(name):
        with open(os.path.join(H100_RUNS, name)) as fh:
            record = json.load(fh)
        assert record["device_name"] == sweep.H100
        return record["results"][0]

    cnn, resnet = results("stack3_cnn.json"), results("resnet_applies.json")
    assert (cnn["clients"], cnn["samples_per_client"], cnn["local_epochs"]) == (10, 5000, 5)  # the paper's size
    by = cnn["round_seconds_by_method"]["vectorized"]
    assert sweep.H100_ROUND_SECONDS["cifar10"] == pytest.approx(
        {"first-order": by["fedavg"], "foof": by["fedpm"]}, abs=0.005
    )
    scale = 10 * 5000 * 5 / (resnet["clients"] * resnet["samples_per_client"] * resnet["local_epochs"])
    fedavg = resnet["round_seconds_by_method"]["vectorized"]["fedavg"] * scale
    fedpm = resnet["projected_100_round_minutes"] * 60 / 100
    assert sweep.H100_ROUND_SECONDS["cifar100"] == pytest.approx({"first-order": fedavg, "foof": fedpm}, abs=0.05)
