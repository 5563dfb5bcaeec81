"""FOOF's opt-in approximate precisions (``--foof-precision tf32`` / ``bf16``) on the CPU, and a run in which no
client contributed: the statistics a client builds are positive semidefinite as the server checks them, and a
run whose every reply was rejected ends in one line, exit 2, with nothing kept."""

import os

import pytest

torch = pytest.importorskip("torch")

from fedconvex.screening import psd_problem  # noqa: E402
from fedpm_dnn import foof  # noqa: E402
from fedpm_dnn.foof import precision  # noqa: E402
from tests.fake_cifar import cifar_pickle  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp32", "split-tf32"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_statistics_of_every_precision_pass_the_servers_psd_check(mode, bias):
    """Fewer rows than features (a client's few images): the Gram is singular, so the rounding of a bf16 output
    or a bias row summed from other inputs than the product's made it indefinite beyond float32's tolerance."""
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(400, 10, bias=bias)
    acc = foof.StatsAccumulator({"fc": foof.LinearBlock(layer)})
    with precision.use(mode):
        for _ in range(2):
            acc.add("fc", torch.relu(torch.randn(20, 400, generator=g)) * 3)
    A = acc.result()["fc"]
    assert psd_problem(A.float()) is None
    assert torch.equal(A, A.T)


def _run(tmp_path, *extra, seeds=None):
    from validation import dnn

    data = tmp_path / "data"
    if not data.exists():
        cifar_pickle(str(data / "cifar-10-batches-py"), n=60)
    argv = ["--dataset", "cifar10", "--data-dir", str(data), "--method", "fedpm", "--clients", "2"]
    argv += ["--local-epochs", "1", "--foof-samples", "64", "--train-subset", "40", "--test-subset", "20"]
    return dnn.main(argv + ["--rounds", "2", "--quiet", "--threads", "1", "--out", str(tmp_path / "out"), *extra])


@pytest.mark.parametrize("mode, engine", [("bf16", "sequential"), ("tf32", "sequential"), ("bf16", "vectorized")])
def test_fedpm_in_an_approximate_precision_uses_its_clients_replies(tmp_path, mode, engine, caplog):
    import csv

    assert _run(tmp_path, "--foof-precision", mode, "--engine", engine) == 0
    assert "rejected" not in caplog.text
    with open(tmp_path / "out" / "history.csv") as fh:
        assert [int(r["rejected"]) for r in csv.DictReader(fh)] == [0, 0]


def _reject_everyone(monkeypatch):
    """Every reply rejected: the server's PSD check refuses every matrix (as it did the approximate ones)."""
    import fedconvex.driver as driver

    monkeypatch.setattr(driver, "all_usable", lambda *a, **k: False)
    why = "preconditioner foof[fc1] is not positive semidefinite"
    monkeypatch.setattr(driver, "client_problem", lambda *a, **k: why)


def test_a_run_no_client_contributed_to_fails_in_one_line_and_keeps_nothing(tmp_path, monkeypatch, capsys):
    _reject_everyone(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        _run(tmp_path)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no client contributed to any of the 2 rounds" in err, err
    assert not os.path.exists(tmp_path / "out")


def test_an_empty_out_folder_is_left_empty_when_no_client_contributed(tmp_path, monkeypatch, capsys):
    (tmp_path / "out").mkdir()
    _reject_everyone(monkeypatch)
    with pytest.raises(SystemExit):
        _run(tmp_path)
    assert os.listdir(tmp_path / "out") == []


def test_a_stack_reports_each_run_no_client_contributed_to(tmp_path, monkeypatch, capsys):
    _reject_everyone(monkeypatch)
    assert _run(tmp_path, "--seeds", "0,1") == 1
    err = capsys.readouterr().err
    assert err.count("no client contributed") == 2, err
    out = tmp_path / "out"
    assert not out.exists() or not [n for n in os.listdir(out) if not n.startswith(".")]
