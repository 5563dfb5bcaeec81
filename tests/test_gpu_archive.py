"""The archive validation/gpu_checks.sh carries its results in from one GPU job to the next, the script's refusals
before it writes anything, and the checkpoints' packed FOOF matrices (what makes a FedPM stack's checkpoints travel)."""

import io
import os
import subprocess
import sys
import tarfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpm_dnn.engine import checkpoint
from validation import gpu_archive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "validation", "gpu_checks.sh")


def tree(root) -> dict:
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
        for d, _, files in os.walk(root)
        for f in files
    }


def work_folder(path, big=0):
    (path / "done").mkdir(parents=True)
    (path / "done" / "cnn_paper").write_text("2026-01-01T00:00:00Z\n")
    (path / "cnn_paper.json").write_text('{"results": []}')
    run = path / "stacks" / "stack_fedpm_a1.0" / "s0"
    run.mkdir(parents=True)
    (run / "checkpoint.pt").write_bytes(os.urandom(big) if big else b"x")
    return path


def test_an_archive_round_trip_gives_back_every_file_and_stays_within_its_volumes(tmp_path):
    work = work_folder(tmp_path / "w", big=300_000)  # incompressible: three volumes of 128 KiB
    out = tmp_path / "out"
    out.mkdir()
    archive = str(out / gpu_archive.NAME)
    size = gpu_archive.pack(str(work), archive, "NVIDIA H100 80GB HBM3", limit=2**17)
    names = sorted(os.listdir(out))
    assert names == ["results.tar.gz", "results.tar.gz.2", "results.tar.gz.3"], names
    assert all(os.path.getsize(out / n) <= 2**17 for n in names) and size > 2 * 2**17
    again = tmp_path / "again"
    assert gpu_archive.unpack(archive, str(again), "NVIDIA H100 80GB HBM3") == 3
    assert tree(again) == tree(work)
    # a smaller refresh leaves no stale volume behind
    (work / "stacks" / "stack_fedpm_a1.0" / "s0" / "checkpoint.pt").write_bytes(b"small")
    gpu_archive.pack(str(work), archive, "NVIDIA H100 80GB HBM3", limit=2**17)
    assert sorted(os.listdir(out)) == ["results.tar.gz"]


def test_an_archive_over_its_volumes_is_refused_and_the_previous_one_kept(tmp_path):
    work = work_folder(tmp_path / "w")
    archive = str(tmp_path / gpu_archive.NAME)
    gpu_archive.pack(str(work), archive, "CPU", limit=2**17, max_volumes=2)
    before = open(archive, "rb").read()
    (work / "stacks" / "stack_fedpm_a1.0" / "s0" / "checkpoint.pt").write_bytes(os.urandom(300_000))
    with pytest.raises(gpu_archive.ArchiveError, match="over 2 volumes.*checkpoint.pt.*previous archive is kept"):
        gpu_archive.pack(str(work), archive, "CPU", limit=2**17, max_volumes=2)
    assert open(archive, "rb").read() == before and sorted(os.listdir(tmp_path)) == ["results.tar.gz", "w"]


def test_results_of_another_device_are_never_continued_or_mixed(tmp_path):
    work = work_folder(tmp_path / "w")
    archive = str(tmp_path / gpu_archive.NAME)
    gpu_archive.pack(str(work), archive, "NVIDIA H100 80GB HBM3")
    with pytest.raises(gpu_archive.ArchiveError, match="measured on 'NVIDIA H100 80GB HBM3'.*'NVIDIA H200'"):
        gpu_archive.unpack(archive, str(tmp_path / "x"), "NVIDIA H200")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "link"])
def test_an_archive_member_outside_the_folder_or_not_a_file_is_refused(tmp_path, name):
    archive = tmp_path / gpu_archive.NAME
    with tarfile.open(archive, "w:gz") as tar:
        data = b'{"device": "CPU"}'
        info = tarfile.TarInfo(gpu_archive.MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(name)
        if name == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(gpu_archive.ArchiveError, match="is not a plain file inside"):
        gpu_archive.unpack(str(archive), str(tmp_path / "x"), "CPU")
    assert not (tmp_path / "x").exists() and not (tmp_path / "escape").exists()


def script(tmp_path, *args, tiny=True, **env):
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHON": sys.executable, **env}
    env.pop("GPU_CHECKS_TINY", None)
    if tiny:
        env["GPU_CHECKS_TINY"] = "1"
    return subprocess.run(["bash", SCRIPT, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_without_cuda_the_gpu_script_says_so_in_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "data").mkdir()
    r = script(tmp_path, "data", "out", tiny=False)
    assert r.returncode == 2 and r.stdout == "", r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device is visible" in lines[0] and "Traceback" not in r.stderr, lines
    assert sorted(os.listdir(tmp_path)) == ["data"]


def test_the_gpu_script_refuses_an_archive_of_another_device_before_any_unit(tmp_path):
    (tmp_path / "data").mkdir()
    work_folder(tmp_path / "w")
    gpu_archive.pack(str(tmp_path / "w"), str(tmp_path / "prev.tar.gz"), "NVIDIA H100 80GB HBM3")
    r = script(tmp_path, "data", "out", "60", "prev.tar.gz", GPU_CHECKS_WORK=str(tmp_path / "work"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "measured on 'NVIDIA H100 80GB HBM3'" in lines[0], r
    assert "===" not in r.stdout and not (tmp_path / "work" / "cnn_paper.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [(["missing", "out"], "DATA_DIR missing: no such folder"), (["data", "out", "9x"], "SECONDS must be a whole")],
)
def test_the_gpu_script_refuses_a_bad_argument_in_one_line(tmp_path, args, message):
    (tmp_path / "data").mkdir()
    r = script(tmp_path, *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("gpu_checks.sh: ") and message in lines[0]
    assert sorted(os.listdir(tmp_path)) == ["data"]


symmetric = st.integers(2, 40).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, 2**31 - 1), st.sampled_from([torch.float64, torch.float32]))
)


@settings(max_examples=25, deadline=None)
@given(symmetric)
def test_a_packed_symmetric_matrix_comes_back_bit_for_bit(case):
    n, seed, dtype = case
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    m = 0.5 * (a + a.T)  # exactly symmetric, as foof.StatsAccumulator leaves its matrices
    packed = checkpoint.pack_symmetric(m)
    assert packed["symmetric_upper"].numel() == n * (n + 1) // 2 and packed["symmetric_upper"].dtype == dtype
    back = checkpoint.unpack_symmetric(packed)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), m.view(torch.uint8))
    assert checkpoint.pack_symmetric(a) is a  # not exactly symmetric: stored whole


def test_a_checkpoint_keeps_the_foof_matrices_in_half_the_bytes_and_loads_them_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    mats = []
    for _ in range(3):
        a = torch.randn(400, 401, generator=g, dtype=torch.float64)
        mats.append({"fc1": a.T @ a / 400, "conv1": torch.eye(76, dtype=torch.float64)})
    mats = [{k: 0.5 * (v + v.T) for k, v in m.items()} for m in mats]
    payload = {
        "format": checkpoint.FORMAT,
        "fingerprint": {},
        "server": {"params": {"w": torch.randn(84, 84, generator=g)}, "round": 1},
        "clients": [{"foof": m, "foof_static": {"conv1": m["conv1"]}} for m in mats],
        "history": [],
    }
    path = str(tmp_path / "checkpoint.pt")
    checkpoint.save(path, payload)
    whole = sum(8 * (401**2 + 2 * 76**2) for _ in mats)
    assert os.path.getsize(path) < 0.55 * whole
    back = checkpoint.load(path)
    for got, want in zip(back["clients"], mats, strict=True):
        assert all(torch.equal(got["foof"][k], v) for k, v in want.items())
    assert torch.equal(back["server"]["params"]["w"], payload["server"]["params"]["w"])  # parameters as they were


def test_a_damaged_packed_matrix_is_one_checkpoint_error(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    bad = {checkpoint.PACKED: torch.zeros(5), "size": 3}
    torch.save({"format": checkpoint.FORMAT, "fingerprint": {}, "clients": [{"foof": {"fc1": bad}}]}, path)
    with pytest.raises(checkpoint.CheckpointError, match="damaged checkpoint .*triangle does not match its size"):
        checkpoint.load(path)


def test_a_finished_stack_units_checkpoints_stay_behind_and_its_histories_travel(tmp_path):
    work = work_folder(tmp_path / "w")
    run = work / "stacks" / "stack_fedpm_a1.0" / "s0"
    (run / "history.csv").write_text("round\n1\n")
    archive = str(tmp_path / gpu_archive.NAME)
    gpu_archive.pack(str(work), archive, "CPU")
    gpu_archive.unpack(archive, str(tmp_path / "a"), "CPU")
    assert (tmp_path / "a" / "stacks" / "stack_fedpm_a1.0" / "s0" / "checkpoint.pt").is_file()  # unfinished
    (work / "done" / "stack_fedpm_a1.0").write_text("")
    gpu_archive.pack(str(work), archive, "CPU")
    gpu_archive.unpack(archive, str(tmp_path / "b"), "CPU")
    got = tmp_path / "b" / "stacks" / "stack_fedpm_a1.0" / "s0"
    assert sorted(os.listdir(got)) == ["history.csv"]
