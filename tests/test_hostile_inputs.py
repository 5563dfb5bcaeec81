"""Hostile and mistaken inputs, one table: every case must end with exit code 2, exactly one
stderr line naming the cause, no traceback, and the working folder (the output folder and every
pre-existing file) exactly as it was.  The server cases check that the reply is rejected with a
reason naming the client and that the round completes with the others.

The commands run in-process (``main(argv)``), on tiny generated data."""

import hashlib
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fake_cifar import cifar_pickle  # noqa: E402

from figures import __main__ as figures_main  # noqa: E402
from validation import bench_convex, bench_dnn, common, dnn, dnn_output, experiments, flower, outputs, superlinear  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGS = {
    superlinear: "python -m validation.superlinear",
    dnn: "python -m validation.dnn",
    flower: "python -m validation.flower",
    bench_convex: "python -m validation.bench_convex",
    bench_dnn: "python -m validation.bench_dnn",
    experiments: "python -m validation.experiments",
    figures_main: "python -m figures",
}


class Evil:
    """Unpickling this creates a folder: proof that loading ran code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


DNN = ["--data-dir", "{W}/data", "--clients", "3", "--local-epochs", "1", "--foof-samples", "64", "--quiet"]


@pytest.fixture(scope="module")
def one_thread():
    """The DNN runs here are tiny: one torch thread avoids spin-waiting on a busy machine."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture(scope="module")
def base(tmp_path_factory, one_thread):
    """A working folder: data, a foreign folder, a file, a previous result, a DNN run to resume."""
    w = tmp_path_factory.mktemp("base")
    cifar_pickle(str(w / "data" / "cifar-10-batches-py"))
    (w / "foreign").mkdir()
    (w / "foreign" / "notes.txt").write_text("my thesis\n")
    (w / "file.txt").write_text("a file\n")
    (w / "tiny.svm").write_text("".join(f"{1 if i % 3 else 0} {1 + i % 4}:1 {5 + i % 3}:0.5\n" for i in range(60)))
    (w / "bad.svm").write_text("-1 1:1\n+1 2:1\n+1 3:oops\n")
    (w / "nan.svm").write_text("-1 1:1\n+1 2:nan\n")
    (w / "empty.svm").write_text("")
    (w / "onelabel.svm").write_text("1 1:1\n1 2:1\n")
    (w / "binary.svm").write_bytes(bytes(range(256)) * 4)
    (w / "bigindex.svm").write_text("1 1:1 1000000000:1\n-1 2:1\n1 3:1\n-1 4:1\n")
    (w / "hugeindex.svm").write_text("1 1:1 10000000000:1\n-1 2:1\n")
    (w / "list.json").write_text("[1]\n")
    (w / "ckdir" / "checkpoint.pt").mkdir(parents=True)  # a previous result whose checkpoint.pt is a folder
    (w / "ckdir" / ".fedpm-result").write_text("")
    (w / "app").mkdir()
    (w / "app" / "pyproject.toml").write_text("[project]\nname = 'mine'\n")
    os.symlink(w / "foreign", w / "link")
    # crafted data and checkpoints that would run code (create PWNED) if unpickled carelessly
    evil_dir = w / "evil" / "cifar-10-batches-py"
    shutil.copytree(w / "data" / "cifar-10-batches-py", evil_dir)
    with open(evil_dir / "data_batch_1", "wb") as fh:
        pickle.dump({b"data": Evil(str(w / "PWNED")), b"labels": [0]}, fh)
    # a finished DNN run (1 round) to resume
    run = [a.replace("{W}", str(w)) for a in DNN] + ["--rounds", "1", "--out", str(w / "run")]
    assert dnn.main(run) == 0
    for name, damage in [("trunc", "truncate"), ("crafted", "evil"), ("old", "old")]:
        shutil.copytree(w / "run", w / name)
        ck = w / name / "checkpoint.pt"
        if damage == "truncate":
            ck.write_bytes(ck.read_bytes()[:1500])
        elif damage == "evil":
            torch.save({"format": 2, "fingerprint": {}, "x": Evil(str(w / "PWNED"))}, str(ck))
        else:  # a checkpoint from before fingerprints
            ck_data = torch.load(str(ck), weights_only=True)
            del ck_data["fingerprint"]
            ck_data.pop("format")
            torch.save(ck_data, str(ck))
    return w


@pytest.fixture
def work(base, tmp_path):
    w = tmp_path / "w"
    shutil.copytree(base, w, symlinks=True)
    os.remove(w / "link")
    os.symlink(w / "foreign", w / "link")
    return w


def snapshot(root):
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            p = os.path.join(dirpath, d)
            out[os.path.relpath(p, root)] = "link" if os.path.islink(p) else "dir"
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = (hashlib.sha256(fh.read()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


S = [
    "--dataset",
    "a9a",
    "--clients",
    "8",
    "--per-client",
    "50",
    "--rounds",
    "2",
    "--quiet",
    "--no-cache",
    "--jobs",
    "1",
    "--methods",
    "fedpm",
]
OUT = ["--out", "{W}/out"]
D = DNN + ["--rounds", "1"]

CASES = [
    # ---------------------------------------------------------------- validation.superlinear
    ("sl-rounds-0", superlinear, S + OUT + ["--rounds", "0"], "--rounds: must be a positive integer"),
    ("sl-rounds-text", superlinear, S + OUT + ["--rounds", "many"], "--rounds: must be an integer"),
    ("sl-rounds-huge", superlinear, S + OUT + ["--rounds", "99999999999"], "--rounds: must be at most"),
    ("sl-lam-0", superlinear, S + OUT + ["--lam", "0"], "--lam: must be a number > 0"),
    ("sl-lam-inf", superlinear, S + OUT + ["--lam", "inf"], "--lam: must be a finite number"),
    ("sl-lam-nan", superlinear, S + OUT + ["--lam", "nan"], "--lam: must be a finite number"),
    ("sl-lam-neg", superlinear, S + OUT + ["--lam", "-1"], "--lam: must be a number > 0"),
    (
        "sl-alpha-inf",
        superlinear,
        S[:4] + S[6:] + OUT + ["--split", "dirichlet", "--alpha", "inf"],
        "--alpha: must be a finite number",
    ),
    ("sl-alpha-0", superlinear, S + OUT + ["--alpha", "0"], "--alpha: must be a number > 0"),
    (
        "sl-alpha-without-dirichlet",
        superlinear,
        S + OUT + ["--alpha", "0.3"],
        "--alpha applies to --split dirichlet only (this run's split is sequential)",
    ),
    ("sl-max-ratio-neg", superlinear, S + OUT + ["--max-ratio", "-1"], "--max-ratio: must be a number >= 0"),
    ("sl-max-ratio-nan", superlinear, S + OUT + ["--max-ratio", "nan"], "--max-ratio: must be a finite number"),
    (
        "sl-lr-diverges",
        superlinear,
        [
            "--dataset",
            "{W}/tiny.svm",
            "--clients",
            "3",
            "--rounds",
            "3",
            "--quiet",
            "--jobs",
            "1",
            "--methods",
            "fedavg",
            "--lr",
            "1e9",
        ]
        + OUT,
        "fedavg diverged with --lr 1e+09",
    ),
    ("sl-lr-nan", superlinear, S + OUT + ["--lr", "nan"], "--lr: must be a finite number"),
    ("sl-lr-neg", superlinear, S + OUT + ["--lr", "-1"], "--lr: must be a number > 0"),
    ("sl-seed-neg", superlinear, S + OUT + ["--seed", "-1"], "--seed: must be an integer in 0..4294967295"),
    ("sl-seed-big", superlinear, S + OUT + ["--seed", str(2**32)], "--seed: must be an integer in 0.."),
    (
        "sl-participants-gt-clients",
        superlinear,
        S + OUT + ["--participants", "20"],
        "--participants 20 exceeds the 8 clients (--clients)",
    ),
    (
        "sl-participants-gt-paper",
        superlinear,
        ["--dataset", "a9a", "--participants", "100", "--quiet"] + OUT,
        "--participants 100 exceeds the 80 clients",
    ),
    ("sl-participants-0", superlinear, S + OUT + ["--participants", "0"], "--participants: must be a positive integer"),
    ("sl-n-features-bundled", superlinear, S + OUT + ["--n-features", "5"], "--n-features applies to a LibSVM file"),
    ("sl-method-unknown", superlinear, S[:-1] + ["fedpm,fedxyz"] + OUT, "unknown method(s) fedxyz"),
    ("sl-method-none", superlinear, S[:-1] + [","] + OUT, "unknown method(s) (none given)"),
    ("sl-dataset-missing", superlinear, S[2:] + OUT + ["--dataset", "nowhere.svm"], "nowhere.svm: neither a bundled"),
    ("sl-dataset-folder", superlinear, S[2:] + OUT + ["--dataset", "{W}/foreign"], "is a folder"),
    ("sl-dataset-malformed", superlinear, ["--dataset", "{W}/bad.svm", "--quiet"] + OUT, "bad.svm:3: token '3:oops'"),
    ("sl-dataset-nan", superlinear, ["--dataset", "{W}/nan.svm", "--quiet"] + OUT, "is not finite"),
    ("sl-dataset-empty", superlinear, ["--dataset", "{W}/empty.svm", "--quiet"] + OUT, "no samples (empty file)"),
    ("sl-dataset-one-label", superlinear, ["--dataset", "{W}/onelabel.svm", "--quiet"] + OUT, "only one label"),
    ("sl-dataset-binary", superlinear, ["--dataset", "{W}/binary.svm", "--quiet"] + OUT, "binary.svm"),
    (
        "sl-dataset-feature-1e9",
        superlinear,
        ["--dataset", "{W}/bigindex.svm", "--clients", "2", "--quiet"] + OUT,
        "1000000000 features",
    ),
    (
        "sl-dataset-feature-1e10",
        superlinear,
        ["--dataset", "{W}/hugeindex.svm", "--quiet"] + OUT,
        "a feature index exceeds 2147483647",
    ),
    (
        "sl-clients-too-many",
        superlinear,
        S[:2] + OUT + ["--clients", "100000", "--quiet"],
        "cannot give 100000 clients",
    ),
    (
        "sl-per-client-too-many",
        superlinear,
        S[:4] + OUT + ["--per-client", "10000", "--quiet"],
        "exceeds the 32561 rows",
    ),
    ("sl-per-client-dirichlet", superlinear, S + OUT + ["--split", "dirichlet"], "--per-client does not apply"),
    (
        "sl-cache-folder",
        superlinear,
        [a for a in S if a != "--no-cache"] + ["--cache", "{W}/foreign"] + OUT,
        "--cache {W}/foreign: is not a regular file",
    ),
    (
        "sl-cache-foreign-file",
        superlinear,
        [a for a in S if a != "--no-cache"] + ["--cache", "{W}/file.txt"] + OUT,
        "--cache {W}/file.txt: is not a tuning cache of this tool (not a JSON object",
    ),
    (
        "sl-cache-json-list",
        superlinear,
        [a for a in S if a != "--no-cache"] + ["--cache", "{W}/list.json"] + OUT,
        "--cache {W}/list.json: is not a tuning cache of this tool (not a JSON object",
    ),
    ("sl-out-foreign", superlinear, S + ["--out", "{W}/foreign"], "is not a previous result of this tool"),
    ("sl-out-file", superlinear, S + ["--out", "{W}/file.txt"], "exists and is not a folder"),
    ("sl-out-symlink", superlinear, S + ["--out", "{W}/link"], "is a symbolic link"),
    ("sl-out-inside-file", superlinear, S + ["--out", "{W}/file.txt/sub"], "is not a folder"),
    ("sl-backend", superlinear, S + OUT + ["--backend", "jax"], "unknown backend 'jax'"),
    ("sl-init", superlinear, S + OUT + ["--init", "far"], "invalid choice: 'far'"),
    ("sl-local-steps-0", superlinear, S + OUT + ["--local-steps", "0"], "--local-steps: must be a positive integer"),
    ("sl-jobs-0", superlinear, S + OUT + ["--jobs", "0"], "--jobs: must be a positive integer"),
    ("sl-split", superlinear, S + OUT + ["--split", "random"], "invalid choice: 'random'"),
    ("sl-unknown-flag", superlinear, S + OUT + ["--bogus"], "unrecognized arguments: --bogus"),
    # ---------------------------------------------------------------- validation.dnn
    ("dnn-data-missing", dnn, D + OUT + ["--data-dir", "/nonexistent"], "/nonexistent: no such folder"),
    ("dnn-data-file", dnn, D + OUT + ["--data-dir", "{W}/file.txt"], "no such folder"),
    ("dnn-data-crafted-pickle", dnn, D + OUT + ["--data-dir", "{W}/evil"], "refused: the pickle names posix.mkdir"),
    ("dnn-alpha-inf", dnn, D + OUT + ["--alpha", "inf"], "--alpha: must be a finite number"),
    ("dnn-alpha-0", dnn, D + OUT + ["--alpha", "0"], "--alpha: must be a number > 0"),
    ("dnn-max-ratio-neg", dnn, D + OUT + ["--max-ratio", "-1"], "--max-ratio: must be a number >= 0"),
    ("dnn-split-unknown", dnn, D + OUT + ["--split", "iid"], "--split: invalid choice"),
    ("dnn-split-infeasible", dnn, D[:2] + D[4:] + OUT + ["--clients", "31"], "raise alpha or use fewer clients"),
    ("dnn-lr-nan", dnn, D + OUT + ["--lr", "nan"], "--lr: must be a finite number"),
    ("dnn-clip-neg", dnn, D + OUT + ["--clip", "-1"], "--clip: must be a number >= 0"),
    ("dnn-weight-decay-inf", dnn, D + OUT + ["--weight-decay", "inf"], "--weight-decay: must be a finite number"),
    ("dnn-seed-neg", dnn, D + OUT + ["--seed", "-1"], "--seed: must be an integer in 0.."),
    ("dnn-rounds-0", dnn, DNN + OUT + ["--rounds", "0"], "--rounds: must be a positive integer"),
    ("dnn-clients-0", dnn, D + OUT + ["--clients", "0"], "--clients: must be a positive integer"),
    ("dnn-batch-0", dnn, D + OUT + ["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (
        "dnn-preset-other-dataset",
        dnn,
        D + OUT + ["--dataset", "cifar10", "--preset", "cifar100-a0.1"],
        "is for --dataset cifar100",
    ),
    (
        "dnn-preset-no-row",
        dnn,
        D + OUT + ["--preset", "cifar10-foof-64", "--method", "fedavg"],
        "has no row for 'fedavg'",
    ),
    ("dnn-participants", dnn, D + OUT + ["--participants", "5"], "--participants 5 exceeds --clients 3"),
    (
        "dnn-participants-default-clients",
        dnn,
        D[:2] + D[4:] + OUT + ["--participants", "11"],
        "--participants 11 exceeds the 10 clients (default --clients)",
    ),
    ("dnn-train-subset-small", dnn, D + OUT + ["--train-subset", "5"], "--train-subset 5: must be between"),
    ("dnn-train-subset-big", dnn, D + OUT + ["--train-subset", "1000000"], "--train-subset 1000000: must be between"),
    ("dnn-test-subset-big", dnn, D + OUT + ["--test-subset", "1000000"], "--test-subset 1000000: must be between"),
    ("dnn-too-many-clients", dnn, D + OUT + ["--clients", "1000"], "samples cannot give 1000 clients"),
    ("dnn-out-foreign", dnn, D + ["--out", "{W}/foreign"], "is not a previous result of this tool"),
    ("dnn-out-file", dnn, D + ["--out", "{W}/file.txt"], "exists and is not a folder"),
    (
        "dnn-chunk-sequential",
        dnn,
        D + OUT + ["--engine", "sequential", "--client-chunk", "2"],
        "--client-chunk applies to --engine vectorized",
    ),
    ("dnn-threads-0", dnn, D + OUT + ["--threads", "0"], "--threads: must be a positive integer"),
    ("dnn-resume-nothing", dnn, D + OUT + ["--resume"], "--resume: {W}/out/checkpoint.pt does not exist"),
    (
        "dnn-checkpoint-no-resume",
        dnn,
        D + ["--out", "{W}/run", "--alpha", "0.5"],
        "--out {W}/run: holds another run (--alpha: checkpoint has 0.1, this run 0.5); choose another --out",
    ),
    (
        "dnn-checkpoint-folder",
        dnn,
        D + ["--out", "{W}/ckdir"],
        "{W}/ckdir/checkpoint.pt: is a folder, not a checkpoint file; move it away or choose another --out",
    ),
    (
        "dnn-checkpoint-folder-resume",
        dnn,
        D + ["--out", "{W}/ckdir", "--resume"],
        "{W}/ckdir/checkpoint.pt: is a folder, not a checkpoint file; move it away or choose another --out",
    ),
    (
        "dnn-resume-alpha",
        dnn,
        DNN + ["--rounds", "2", "--resume", "--out", "{W}/run", "--alpha", "0.5"],
        "different configuration (--alpha: checkpoint has 0.1, this run 0.5)",
    ),
    (
        "dnn-resume-model",
        dnn,
        DNN + ["--rounds", "2", "--resume", "--out", "{W}/run", "--model", "resnet18gn"],
        "(--model: checkpoint has 'cnn', this run 'resnet18gn')",
    ),
    (
        "dnn-resume-subset",
        dnn,
        DNN + ["--rounds", "2", "--resume", "--out", "{W}/run", "--train-subset", "100"],
        "(--train-subset: checkpoint has None, this run 100)",
    ),
    (
        "dnn-resume-method",
        dnn,
        DNN + ["--rounds", "2", "--resume", "--out", "{W}/run", "--method", "fedavg"],
        "(--method: checkpoint has 'fedpm', this run 'fedavg')",
    ),
    (
        "dnn-resume-seed",
        dnn,
        DNN + ["--rounds", "2", "--resume", "--out", "{W}/run", "--seed", "1"],
        "(--seed: checkpoint has 0, this run 1)",
    ),
    ("dnn-resume-truncated", dnn, DNN + ["--rounds", "2", "--resume", "--out", "{W}/trunc"], "truncated or corrupted"),
    ("dnn-resume-crafted", dnn, DNN + ["--rounds", "2", "--resume", "--out", "{W}/crafted"], "could run code"),
    ("dnn-resume-old-format", dnn, DNN + ["--rounds", "2", "--resume", "--out", "{W}/old"], "no fingerprint"),
    ("dnn-device", dnn, D + OUT + ["--device", "tpu"], "invalid choice: 'tpu'"),
    # ---------------------------------------------------------------- validation.flower
    (
        "fl-impossible-split",
        flower,
        ["--dataset", "{W}/tiny.svm", "--clients", "1000", "--mode", "deployment"] + OUT,
        "60 rows cannot give 1000 clients",
    ),
    ("fl-cnn-dataset", flower, ["--problem", "cnn", "--dataset", "w8a"] + OUT, "--dataset does not apply"),
    ("fl-max-ratio", flower, ["--max-ratio", "0.5"] + OUT, "--max-ratio 0.5: must be >= 1"),
    ("fl-timeout-inf", flower, ["--timeout", "inf"] + OUT, "--timeout: must be a finite number"),
    ("fl-timeout-0", flower, ["--timeout", "0"] + OUT, "--timeout: must be a number > 0"),
    ("fl-lr-inf", flower, ["--lr", "inf"] + OUT, "--lr: must be a finite number"),
    ("fl-lam-nan", flower, ["--lam", "nan"] + OUT, "--lam: must be a finite number"),
    ("fl-dataset-missing", flower, ["--dataset", "nowhere.svm"] + OUT, "nowhere.svm: neither a bundled"),
    ("fl-dataset-big-index", flower, ["--dataset", "{W}/bigindex.svm", "--clients", "2"] + OUT, "1000000000 features"),
    ("fl-method", flower, ["--method", "nosuch"] + OUT, "invalid choice: 'nosuch'"),
    (
        "fl-params",
        flower,
        ["--method", "scaffold", "--params", '{"momentum": 0.9}'] + OUT,
        "scaffold has no hyper-parameter 'momentum'",
    ),
    ("fl-params-not-json", flower, ["--params", "nan"] + OUT, "--params 'nan': not JSON"),
    ("fl-params-lr-text", flower, ["--params", '{"lr": "x"}'] + OUT, "fedpm: lr must be a number, got 'x'"),
    ("fl-params-lr-neg", flower, ["--params", '{"lr": -1}'] + OUT, "fedpm: lr must be > 0, got -1"),
    ("fl-params-lr-nan", flower, ["--params", '{"lr": NaN}'] + OUT, "fedpm: lr must be a finite number, got nan"),
    ("fl-params-steps-0", flower, ["--params", '{"local_steps": 0}'] + OUT, "fedpm: local_steps must be >= 1, got 0"),
    (
        "fl-params-cnn-lr-text",
        flower,
        ["--problem", "cnn", "--method", "fedavg", "--params", '{"lr": "x"}'] + OUT,
        "fedavg: lr must be a number, got 'x'",
    ),
    ("fl-lam-0", flower, ["--lam", "0"] + OUT, "--lam: must be a number > 0"),
    ("fl-participants", flower, ["--participants", "5"] + OUT, "--participants 5 exceeds --clients 3"),
    ("fl-write-app-empty", flower, ["--write-app", ""], "--write-app: empty path"),
    ("fl-cnn-method", flower, ["--problem", "cnn", "--method", "fednl"] + OUT, "--method fednl: the cnn runs fedavg"),
    ("fl-mode", flower, ["--mode", "cloud"] + OUT, "invalid choice: 'cloud'"),
    ("fl-out-foreign", flower, ["--out", "{W}/foreign"], "is not a previous result of this tool"),
    ("fl-out-file", flower, ["--out", "{W}/file.txt"], "exists and is not a folder"),
    ("fl-write-app-foreign", flower, ["--write-app", "{W}/app"], "is not a FedPM Flower app"),
    ("fl-write-app-file", flower, ["--write-app", "{W}/file.txt"], "exists and is not a folder"),
    # ---------------------------------------------------------------- validation.bench_*
    ("bc-dataset-missing", bench_convex, ["--dataset", "nope"], "--dataset nope: neither a bundled dataset"),
    ("bc-dataset-folder", bench_convex, ["--dataset", "{W}/foreign"], "neither a bundled dataset"),
    ("bc-dataset-tiny", bench_convex, ["--dataset", "{W}/onelabel.svm"], "only one label"),
    ("bc-dataset-big-index", bench_convex, ["--dataset", "{W}/bigindex.svm"], "1000000000 features"),
    ("bc-flag", bench_convex, ["--rounds", "3"], "unrecognized arguments: --rounds 3"),
    ("bd-models", bench_dnn, ["--models", "cnn,vgg"], "--models: unknown model(s) vgg"),
    ("bd-models-none", bench_dnn, ["--models", ","], "unknown model(s) (none given)"),
    ("bd-device", bench_dnn, ["--device", "tpu"], "invalid choice: 'tpu'"),
    ("bd-engines", bench_dnn, ["--engines", "vectorized,gpu"], "--engines: unknown engine(s) gpu"),
    (
        "bd-sizes-too-big",
        bench_dnn,
        ["--sizes", "99999999,99999999,1,1"],
        "--sizes 99999999,99999999,1,1: 99999999 clients x 99999999 images need",
    ),
    ("bd-engines-none", bench_dnn, ["--engines", ","], "unknown engine(s) (none given)"),
    ("bd-method", bench_dnn, ["--method", "fedpm,fednl"], "--method: unknown method(s) fednl; choose from fedavg"),
    # ---------------------------------------------------------------- validation.experiments, figures
    ("ex-profile", experiments, ["--profile", "huge"], "argument --profile: invalid choice: 'huge'"),
    ("ex-unknown-flag", experiments, ["--bogus"], "unrecognized arguments: --bogus"),
    ("ex-out-file", experiments, ["--out", "{W}/file.txt"], "--out {W}/file.txt: is not a folder"),
    ("fig-profile", figures_main, ["--profile", "huge"], "argument --profile: invalid choice: 'huge'"),
    (
        "fig-results-file",
        figures_main,
        ["--no-compute", "--results", "{W}/file.txt"],
        "--results {W}/file.txt: is not a folder",
    ),
    (
        "fig-out-file",
        figures_main,
        ["--no-compute", "--results", "{W}/foreign", "--out", "{W}/file.txt"],
        "--out {W}/file.txt: exists and is not a folder",
    ),
    (
        "fig-out-foreign",
        figures_main,
        ["--no-compute", "--results", "{W}/foreign", "--out", "{W}/foreign"],
        "--out {W}/foreign: is not a previous result of this tool: it holds notes.txt",
    ),
]


@pytest.mark.parametrize("name,module,argv,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_changes_nothing(work, capsys, name, module, argv, fragment):
    argv = [a.replace("{W}", str(work)) for a in argv]
    fragment = fragment.replace("{W}", str(work))
    before = snapshot(work)
    capsys.readouterr()
    try:
        rc = module.main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{PROGS[module]}: error: ") and fragment in lines[0], lines[0]
    assert snapshot(work) == before
    assert not (work / "PWNED").exists()


PREPARE = [
    (["--train-subset", "5"], "--train-subset 5: must be between the 10 classes and the 150 training images"),
    (["--train-subset", "99999"], "--train-subset 99999: must be between the 10 classes and the 150 training images"),
    (["--test-subset", "3"], "--test-subset 3: must be between the 10 classes and the 30 test images"),
    (["--out", ""], "--out: empty path"),
    (["--out", "{W}/link"], "--out {W}/link: is a symbolic link"),
    (["--out", "{W}/file.txt"], "--out {W}/file.txt: exists and is not an empty folder"),
]


@pytest.mark.parametrize(
    "argv,fragment", PREPARE, ids=["train-small", "train-big", "test-small", "out-empty", "out-symlink", "out-file"]
)
def test_prepare_bad_input_is_one_clear_line_and_changes_nothing(work, capsys, argv, fragment):
    argv = ["prepare", "--data-dir", str(work / "data"), "--clients", "3", "--out", str(work / "parts")] + [
        a.replace("{W}", str(work)) for a in argv
    ]
    before = snapshot(work)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        flower.main(argv)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exc.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("python -m validation.flower prepare: error: ")
    assert fragment.replace("{W}", str(work)) in lines[0], lines[0]
    assert snapshot(work) == before


def test_prepare_interrupted_while_writing_leaves_nothing(work, monkeypatch):
    from fedpm_flower import prepared

    real, calls = prepared.write, []

    def write_then_interrupt(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(prepared, "write", write_then_interrupt)
    before = snapshot(work)
    with pytest.raises(KeyboardInterrupt):
        flower.main(["prepare", "--data-dir", str(work / "data"), "--clients", "3", "--out", str(work / "parts")])
    assert snapshot(work) == before


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 60
    assert {m for _, m, _, _ in CASES} == set(PROGS)


@pytest.mark.parametrize(
    "method,params,message",
    [
        ("fedpm", {"lr": -1.0}, "fedpm: lr must be > 0, got -1.0"),
        ("fedpm", {"lr": float("nan")}, "fedpm: lr must be a finite number"),
        ("fedpm", {"lr": "1"}, "fedpm: lr must be a number, got '1'"),
        ("fedpm", {"local_steps": 0}, "fedpm: local_steps must be >= 1, got 0"),
        ("fedpm", {"local_steps": 1.5}, "fedpm: local_steps must be an integer, got 1.5"),
        ("fedpm", {"local_steps": True}, "fedpm: local_steps must be an integer, got True"),
        ("fedavgm", {"momentum": float("inf")}, "fedavgm: momentum must be a finite number"),
        ("fednl", {"compressor": 3}, "fednl: compressor must be a string, got 3"),
    ],
    ids=["lr-neg", "lr-nan", "lr-text", "steps-0", "steps-float", "steps-bool", "momentum-inf", "compressor-int"],
)
def test_make_algorithm_refuses_a_bad_value_at_construction(method, params, message):
    """README's library example builds methods with make_algorithm: a bad value is one ValueError there,
    not an obscure failure inside a round (or, for a negative lr, a silent ascent)."""
    from fedconvex.algorithms import make_algorithm

    with pytest.raises(ValueError) as exc:
        make_algorithm(method, **params)
    assert message in str(exc.value)


def test_loading_a_folder_as_a_checkpoint_says_it_is_a_folder(tmp_path):
    from fedpm_dnn.engine import checkpoint as ck

    (tmp_path / "checkpoint.pt").mkdir()
    with pytest.raises(ck.CheckpointError) as exc:
        ck.load(str(tmp_path / "checkpoint.pt"))
    assert (
        str(exc.value)
        == f"{tmp_path}/checkpoint.pt: is a folder, not a checkpoint file; move it away or choose another --out"
    )


def test_make_method_refuses_a_bad_value_at_construction():
    from fedpm_dnn.algorithms import make_method

    with pytest.raises(ValueError, match="fedavg: batch_size must be >= 1, got 0"):
        make_method("fedavg", batch_size=0)
    with pytest.raises(ValueError, match="fedpm: damping must be a number, got '1'"):
        make_method("fedpm", damping="1")


# ------------------------------------------------------------------------ the server
def _reply(rng, d=4, scale=1.0):
    A = rng.normal(size=(d, d))
    return {"params": {"w": rng.normal(size=(2, d))}, "foof": {"fc": scale * (A @ A.T + np.eye(d))}}


SHAPES = {"params": {"w": (2, 4)}, "foof": {"fc": (4, 4)}}


def _bad(kind):
    def f(r):
        r = {"params": dict(r["params"]), "foof": dict(r["foof"])}
        if kind == "complex-P":
            r["foof"]["fc"] = r["foof"]["fc"].astype(np.complex128)
        elif kind == "int-P":
            r["foof"]["fc"] = np.eye(4, dtype=np.int64)
        elif kind == "int-params":
            r["params"]["w"] = np.ones((2, 4), dtype=np.int32)
        elif kind == "bool-params":
            r["params"]["w"] = np.ones((2, 4), dtype=bool)
        elif kind == "list-params":
            r["params"]["w"] = [[1.0] * 4] * 2
        elif kind == "extra-block":
            r["foof"]["evil"] = np.eye(4)
        elif kind == "huge-P":
            r["foof"]["fc"] = 1e12 * np.eye(4)
        elif kind == "huge-params":
            r["params"]["w"] = 1e12 * np.ones((2, 4))
        elif kind == "not-a-dict":
            return [r]
        return r

    return f


SERVER_CASES = [
    ("complex-P", {}, "foof[fc] has dtype complex128, expected a real floating-point array"),
    ("int-P", {}, "foof[fc] has dtype int64"),
    ("int-params", {}, "params[w] has dtype int32"),
    ("bool-params", {}, "params[w] has dtype bool"),
    ("list-params", {}, "params[w] is a list, not an array"),
    ("extra-block", {}, "foof has entries"),
    ("not-a-dict", {}, "reply is a list, not a mapping"),
    ("huge-P", {"max_ratio": 100.0}, "preconditioner trace"),
    ("huge-params", {"max_ratio": 100.0}, "parameter norm"),
]


@pytest.mark.parametrize("kind,kw,reason", SERVER_CASES, ids=[c[0] for c in SERVER_CASES])
def test_server_rejects_each_hostile_reply_and_goes_on(caplog, kind, kw, reason):
    from fedconvex.screening import screen

    rng = np.random.default_rng(0)
    replies = [_reply(rng) for _ in range(4)]
    replies[2] = _bad(kind)(replies[2])
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        kept, rejected = screen(replies, [0, 1, 2, 3], SHAPES, {"foof"}, 1, n_clients=4, **kw)
    assert kept == [0, 1, 3] and [c for c, _ in rejected] == [2]
    assert reason in rejected[0][1]
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "\n" not in logged[0] and logged[0].startswith("round 1: client 2 rejected: ")


@pytest.mark.parametrize(
    "ids,senders,reason",
    [
        ([0, 1, 1, 3], None, "client id 1 is claimed by more than one reply"),
        ([0, 1, 9, 3], None, "client id 9 is outside 0..3"),
        ([0, 1, -1, 3], None, "client id -1 is outside 0..3"),
        ([0, 1, "2", 3], None, "client id '2' is not an integer"),
        ([0, 1, True, 3], None, "client id True is not an integer"),
        ([0, 1, 2, 3], [0, 1, 3, 3], "claims client id 2 but was sent by 3"),
    ],
    ids=["duplicate", "out-of-range", "negative", "string", "bool", "not-the-sender"],
)
def test_server_rejects_untrusted_client_ids(ids, senders, reason):
    from fedconvex.screening import screen

    rng = np.random.default_rng(1)
    replies = [_reply(rng) for _ in range(4)]
    kept, rejected = screen(replies, ids, SHAPES, {"foof"}, 1, n_clients=4, senders=senders)
    assert reason in {r for _, r in rejected}
    assert 0 in kept and 3 in kept or ids[1] == ids[2]


def guarded_d(cfg):
    from fedconvex.data import load_dataset

    return load_dataset(cfg.dataset).d


def _flower_run(cfg, tamper=None, nodes=None):
    """One ServerApp run over our ClientApps on a loopback grid (tests/flower_loopback.py)."""
    from flower_loopback import LoopbackGrid

    from fedpm_flower.apps import serve

    return serve(LoopbackGrid(cfg, nodes=nodes, tamper=tamper), cfg)


def _tamper(node, fn):
    from fedpm_flower.transport import numpy, records

    def tamper(dst, reply):
        if dst == node and not reply.has_error() and reply.metadata.message_type == "train":
            reply.content["arrays"] = records(fn(numpy(reply.content["arrays"])))
        return reply

    return tamper


def test_a_huge_preconditioner_cannot_set_the_model(base):
    """P = 1e12 I is valid (symmetric PSD) but would make its client's parameters the model."""
    from fedpm_flower.config import FlowerRunConfig

    cfg = FlowerRunConfig(method="fedpm", dataset=str(base / "tiny.svm"), clients=3, rounds=1)
    d = guarded_d(cfg)
    two = _flower_run(cfg, tamper=lambda node, r: None if node == 102 and r.metadata.message_type == "train" else r)

    def attack(a):
        return {**a, "theta": np.full(d, 50.0), "P/block": 1e12 * np.eye(len(a["P/active"]))}

    guarded = _flower_run(cfg, tamper=_tamper(102, attack))  # the magnitude guard is on by default (1000)
    assert guarded["history"][1]["used"] == 2 and guarded["history"][1]["rejected"] == 1
    np.testing.assert_allclose(guarded["theta"], two["theta"], rtol=1e-12)
    unguarded = _flower_run(FlowerRunConfig(**{**cfg.to_run_config(), "max_ratio": 0.0}), tamper=_tamper(102, attack))
    assert np.abs(np.asarray(unguarded["theta"]) - 50).min() < 1e-3  # without the guard it wins


@pytest.mark.parametrize(
    "corrupt,reason",
    [
        (lambda r: {**r, "P/block": r["P/block"].astype(np.complex64)}, "P: block has dtype complex64"),
        (lambda r: {**r, "P/block": r["P/block"].astype(np.int64)}, "P: block has dtype int64"),
        (lambda r: {**r, "P/active": r["P/active"].astype(np.float64)}, "P: feature indices has dtype float64"),
        (lambda r: {**r, "theta": r["theta"].astype(np.complex128)}, "theta has dtype complex128"),
    ],
    ids=["complex-block", "int-block", "float-indices", "complex-theta"],
)
def test_flower_logreg_server_dtype_checks(base, caplog, corrupt, reason):
    from fedpm_flower.config import FlowerRunConfig

    cfg = FlowerRunConfig(method="fedpm", dataset=str(base / "tiny.svm"), clients=3, rounds=1)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = _flower_run(cfg, tamper=_tamper(101, corrupt))
    assert result["history"][1]["used"] == 2 and result["history"][1]["rejected"] == 1
    assert f"client 1 rejected: {reason}" in caplog.text


def test_flower_logreg_server_rejects_foreign_partition_ids(base, caplog):
    """Nodes claiming a client id out of range, not an integer, or held by another node take no part."""
    from fedpm_flower.config import FlowerRunConfig

    cfg = FlowerRunConfig(method="fedpm", dataset=str(base / "tiny.svm"), clients=3, rounds=1)
    with caplog.at_level(logging.WARNING, logger="fedpm.server"):
        result = _flower_run(cfg, nodes=[0, 1, 2, 7, "x", 2])
    assert result["history"][1]["used"] == 3 and result["history"][1]["rejected"] == 0
    # a node whose configured id is not one of the run's clients fails its setup; a second claim is refused
    assert "setup: node 103 failed" in caplog.text and "setup: node 104 failed" in caplog.text
    assert "setup: node 105 rejected: client id 2 is held by node 102" in caplog.text


# ------------------------------------------------------------------------ outputs and interruptions
def test_a_previous_result_is_replaced_only_when_the_new_one_is_complete(tmp_path):
    out = tmp_path / "res"
    with outputs.ResultDir(str(out)) as tmp:
        open(os.path.join(tmp, "summary.json"), "w").write("1")
    assert (out / "summary.json").read_text() == "1" and (out / outputs.MARKER).exists()
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C while writing the new result
        with outputs.ResultDir(str(out)) as tmp:
            open(os.path.join(tmp, "summary.json"), "w").write("2")
            raise KeyboardInterrupt
    assert (out / "summary.json").read_text() == "1"
    with outputs.ResultDir(str(out)) as tmp:
        open(os.path.join(tmp, "summary.json"), "w").write("3")
    assert (out / "summary.json").read_text() == "3"
    assert sorted(os.listdir(tmp_path)) == ["res"]


def test_a_folder_without_the_marker_is_not_ours_and_a_stale_partial_of_a_dead_process_is_removed(tmp_path):
    unmarked = tmp_path / "superlinear-a9a"  # our file names, but nothing says we wrote them
    unmarked.mkdir()
    for f in ("history.csv", "summary.json", "convergence.png"):
        (unmarked / f).write_text("x")
    with pytest.raises(outputs.OutputError, match="is not a previous result of this tool: it holds convergence.png"):
        outputs.check_out(str(unmarked))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".partial-{dead.pid}-abc"
    stale.mkdir()
    (stale / outputs.TEMP_MARKER).write_text(json.dumps({"pid": dead.pid, "start": None}))
    unproven = tmp_path / f".partial-{dead.pid}-def"  # the name alone proves nothing
    unproven.mkdir()
    foreign = tmp_path / ".partial-notours"
    foreign.mkdir()
    with outputs.ResultDir(str(tmp_path / "new")) as tmp:
        open(os.path.join(tmp, "a"), "w").write("a")
    assert not stale.exists() and foreign.exists() and unproven.exists()


def _killed(*task):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_is_one_line_and_nothing_is_written(base, tmp_path, capsys, monkeypatch):
    """The parallel workers are forked: one of them killed (-9) must not hang the run."""
    monkeypatch.setattr(superlinear, "_run_method", _killed)  # a worker's task: a method with known lr,
    monkeypatch.setattr(superlinear, "_run_candidate", _killed)  # or one tuning candidate
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as exc:
        superlinear.main(
            [
                "--dataset",
                str(base / "tiny.svm"),
                "--clients",
                "3",
                "--rounds",
                "2",
                "--quiet",
                "--no-cache",
                "--jobs",
                "2",
                "--methods",
                "fedpm,fedavg",
                "--out",
                str(out),
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "a worker process ended abnormally" in err[0]
    assert os.listdir(tmp_path) == []


def test_sigterm_while_writing_leaves_no_partial_folder(tmp_path):
    # the file is closed by its block: one left to its finalizer would drop an exception raised while it closes,
    # silently (CPython's IOBase finalizer), and with it the SIGTERM
    code = (
        "import os, signal, sys, time\n"
        "from validation.outputs import ResultDir\n"
        "with ResultDir(sys.argv[1]) as tmp:\n"
        "    with open(os.path.join(tmp, 'started'), 'w') as fh:\n"
        "        fh.write('1')\n"
        "    time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "o")], env={**os.environ, "PYTHONPATH": ROOT})
    deadline = time.time() + 30
    while not any(n.startswith(".partial-") for n in os.listdir(tmp_path)) and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "where",
    [
        # held back while the temporary folder is made, raised as the block ends: the folder is removed
        "import tempfile\nmade = tempfile.mkdtemp\n"
        "def mkdtemp(*a, **k):\n    out = made(*a, **k)\n    os.kill(os.getpid(), signal.SIGTERM)\n    return out\n"
        "tempfile.mkdtemp = mkdtemp\nLATE = None\n",
        # raised in a finalizer, where Python drops the exception: the signal is sent again
        "class Late:\n    def __del__(self):\n        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        for _ in range(10**6): pass\n"
        "LATE = Late\n",
    ],
    ids=["while-the-folder-is-made", "in-a-finalizer"],
)
def test_a_sigterm_that_lands_where_it_is_held_or_dropped_still_ends_the_run_and_leaves_nothing(tmp_path, where):
    code = (
        "import os, signal, sys, time\n" + where + "from validation.outputs import ResultDir\n"
        "with ResultDir(sys.argv[1]) as tmp:\n"
        "    if LATE:\n"
        "        LATE()\n"
        "    time.sleep(60)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "o")],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        timeout=30,
    )
    assert p.returncode == 128 + signal.SIGTERM, p.stderr.decode()[-2000:]
    assert os.listdir(tmp_path) == []


def test_ctrl_c_is_one_line_and_leaves_nothing(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) mid-run: one line, exit 130, no
    traceback, no result and no temporary folder."""
    out = tmp_path / "o"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "validation.superlinear",
            "--dataset",
            "w8a",
            "--quiet",
            "--no-cache",
            "--methods",
            "fedpm,fedavg,fednl",
            "--rounds",
            "50",
            "--jobs",
            "2",
            "--out",
            str(out),
        ],
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # not inherited as ignored
    # interrupt the run, not the interpreter's start-up (slow on a loaded machine): once its output exists
    deadline = time.time() + 120
    while not os.listdir(tmp_path) and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    time.sleep(1)
    os.killpg(p.pid, signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 130 and "Traceback" not in err, err
    assert lines == ["python -m validation.superlinear: error: interrupted (Ctrl-C); nothing was written"], err
    assert os.listdir(tmp_path) == []


def _sleep_then_pid(seconds):
    time.sleep(seconds)
    return os.getpid()


def test_ctrl_c_reaches_a_tuning_worker_only_inside_a_task():
    """A terminal's Ctrl-C goes to every process of the group: a worker waiting for its next task must outlive it
    (it died with a traceback on stderr, a race the test above met once in a while), and a task in progress
    ends with KeyboardInterrupt, so the command stops at once."""
    with superlinear.worker_pool(1) as pool:
        pid = pool.submit(os.getpid).result(timeout=60)  # the worker as it starts, before any interruptible task
        os.kill(pid, signal.SIGINT)  # idle
        time.sleep(0.5)
        assert pool.submit(superlinear.interruptible, os.getpid).result(timeout=60) == pid
        busy = pool.submit(superlinear.interruptible, _sleep_then_pid, 60)
        time.sleep(1.0)
        start = time.time()
        os.kill(pid, signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            busy.result(timeout=30)
        assert time.time() - start < 10
        assert pool.submit(superlinear.interruptible, os.getpid).result(timeout=60) == pid


@pytest.mark.parametrize(
    "signal_exc,code,said",
    [(KeyboardInterrupt, 130, "interrupted (Ctrl-C)"), (common.Terminated, 143, "terminated (SIGTERM)")],
)
def test_a_signal_where_it_cannot_propagate_still_ends_the_command_in_one_line(capsys, signal_exc, code, said):
    """Ctrl-C or SIGTERM raised where Python cannot propagate it (a __del__, a weakref callback, an import's lock
    clean-up) is 'Exception ignored' with a traceback, and the command would run on: it is raised again at the
    next ordinary point."""
    ran_on = []

    class Collected:
        def __del__(self):
            raise signal_exc

    def main():
        Collected()  # collected at once: its exception goes to sys.unraisablehook
        for _ in range(200):
            time.sleep(0.01)
        ran_on.append(True)
        return 0

    # a command's process has Python's own SIGINT handler; this test process may not (Flower and Ray, run in it
    # earlier, install theirs)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert common.run_command("python -m validation.superlinear", main) == code
    finally:
        signal.signal(signal.SIGINT, before)
    err = capsys.readouterr().err
    assert err == f"python -m validation.superlinear: error: {said}; nothing was written\n", err
    assert not ran_on


def test_ctrl_c_while_a_checkpoint_is_written_keeps_the_old_one_and_no_temporary_file(tmp_path, monkeypatch):
    """torch's zip writer turns a Ctrl-C inside torch.save into a RuntimeError ('unexpected pos'): it must
    still end the run as a Ctrl-C (one line), leave the previous checkpoint and no checkpoint.pt.tmp."""
    from fedpm_dnn.engine import checkpoint as ck

    path = tmp_path / "checkpoint.pt"
    ck.save(str(path), {"round": torch.tensor(1)})
    before = path.read_bytes()

    def interrupted_save(obj, fh):
        fh.write(b"PK half a zip")
        try:
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3866432 vs 3866328")

    monkeypatch.setattr(ck.torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        ck.save(str(path), {"round": torch.tensor(2)})
    assert os.listdir(tmp_path) == ["checkpoint.pt"] and path.read_bytes() == before


def test_kill_9_then_resume_gives_the_uninterrupted_history(base, tmp_path, capsys):
    """The CLI killed with SIGKILL after its first checkpoint, then --resume: the same history as a
    run that was never interrupted (timings and memory aside)."""
    args = [a.replace("{W}", str(base)) for a in DNN] + ["--rounds", "3"]
    full = tmp_path / "full"
    assert dnn.main(args + ["--out", str(full)]) == 0
    killed = tmp_path / "killed"
    p = subprocess.Popen(
        [sys.executable, "-m", "validation.dnn", *args, "--out", str(killed)],
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (killed / "checkpoint.pt").exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    p.kill()
    p.wait()
    assert dnn.main(args + ["--out", str(killed), "--resume"]) == 0

    def rows(folder):
        lines = (folder / "history.csv").read_text().splitlines()
        head = lines[0].split(",")
        keep = [i for i, c in enumerate(head) if "seconds" not in c and c != "peak_memory_mb"]
        return [[ln.split(",")[i] for i in keep] for ln in lines]

    assert rows(killed) == rows(full) and len(rows(full)) == 4
    assert sorted(os.listdir(killed)) == sorted(os.listdir(full))


@pytest.mark.parametrize("where", ["before-round-1", "final-write"])
def test_ctrl_c_in_dnn_says_what_is_kept_and_leaves_an_empty_out_as_it_was(base, tmp_path, capsys, monkeypatch, where):
    """An empty --out that the run marked as ours is empty again after a Ctrl-C before the first round ('nothing
    was written' is then true); a Ctrl-C while the final files are written keeps the rounds and says so."""
    from fedpm_dnn.engine import simulation

    out = tmp_path / "empty"
    out.mkdir()
    args = [a.replace("{W}", str(base)) for a in DNN] + ["--rounds", "1", "--out", str(out)]
    if where == "before-round-1":
        monkeypatch.setattr(simulation, "run_experiment", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    else:
        real = dnn_output.write_outputs
        calls = []

        def interrupted_last_write(*a, **k):
            calls.append(1)
            if len(calls) == 2:  # the first is round 1's, the second the final one
                raise KeyboardInterrupt
            return real(*a, **k)

        monkeypatch.setattr(dnn_output, "write_outputs", interrupted_last_write)
    assert common.run_command("python -m validation.dnn", lambda: dnn.main(args)) == 130
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    if where == "before-round-1":
        assert line.endswith("interrupted (Ctrl-C); nothing was written") and os.listdir(out) == []
    else:
        assert line.endswith("keeps the rounds done so far; --resume continues")
        assert {"checkpoint.pt", "history.csv", "summary.json"} <= set(os.listdir(out))


def test_sigterm_to_the_command_alone_stops_its_workers_in_one_line(tmp_path):
    """SIGTERM to the main process only (``kill PID``, a scheduler, ``Popen.terminate``) while its tuning workers
    run: one line, exit 143, no result, and no worker left behind (they were orphaned, holding their memory)."""
    out = tmp_path / "o"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "validation.superlinear",
            "--dataset",
            "w8a",
            "--quiet",
            "--no-cache",
            "--methods",
            "fedpm,fedavg,fednl",
            "--rounds",
            "50",
            "--jobs",
            "2",
            "--out",
            str(out),
        ],
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def children():
        try:
            with open(f"/proc/{p.pid}/task/{p.pid}/children") as fh:
                return [int(c) for c in fh.read().split()]
        except OSError:
            return []

    deadline = time.time() + 60
    while len(children()) < 2 and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    workers = children()
    assert len(workers) >= 2, "the tuning pool did not start"
    time.sleep(1.0)
    p.terminate()
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 143 and "Traceback" not in err, err
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        "python -m validation.superlinear: error: terminated (SIGTERM); nothing was written"
    ], err
    deadline = time.time() + 30
    while any(os.path.exists(f"/proc/{w}") for w in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{w}") for w in workers), "a worker outlived the command"
    assert os.listdir(tmp_path) == []


def test_dnn_threads_flag_sets_and_records_torchs_threads(base, tmp_path):
    """--threads pins torch's CPU threads (float32 sums depend on them); summary.json says which ran."""
    before = torch.get_num_threads()
    try:
        out = tmp_path / "t"
        args = [a.replace("{W}", str(base)) for a in DNN] + ["--rounds", "1", "--threads", "1", "--out", str(out)]
        assert dnn.main(args) == 0
        assert json.loads((out / "summary.json").read_text())["torch_threads"] == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_figures_write_again_into_their_own_out(tmp_path, capsys):
    """An empty --out is taken and marked; a second run writes into it again (it is ours).  Drawn from the one run
    of the Test 1 figure, under the smoke profile (which ships no runs to draw besides)."""
    results = tmp_path / "results"
    shutil.copytree(os.path.join(ROOT, "reference", "superlinear-a9a"), results / "smoke" / "superlinear-a9a")
    out = tmp_path / "figs"
    out.mkdir()
    args = ["--no-compute", "--profile", "smoke", "--results", str(results), "--out", str(out)]
    assert figures_main.main(args) == 0 and (out / ".fedpm-result").exists()
    assert sorted(p.name for p in out.iterdir()) == [".fedpm-result", "test1_convergence.pdf", "test1_convergence.png"]
    (out / "test1_convergence.png").write_text("an earlier figure of ours\n")
    assert figures_main.main(args) == 0
    assert (out / "test1_convergence.png").read_bytes().startswith(b"\x89PNG")  # drawn again over it
