"""Image loaders on small generated files of every supported format; partitions; augmentation."""

import gzip
import io
import json
import os
import pickle
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from fedpm_dnn.data import (  # noqa: E402
    DatasetError,
    dirichlet_partition,
    load_cifar_jpeg,
    load_cifar_pickle,
    load_femnist,
    load_image_dataset,
    partition_table,
)
from fedpm_dnn.data.augment import random_crop_flip  # noqa: E402
from fedpm_dnn.data.partition import relaysum_partition  # noqa: E402


def _batch(path, n, k, label_key, rng):
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = rng.integers(0, k, n).tolist()
    with open(path, "wb") as fh:
        pickle.dump({b"data": data, label_key: labels}, fh)
    return data, labels


def make_cifar10_pickle(root, rng, n=4):
    os.makedirs(root)
    batches = [_batch(os.path.join(root, f"data_batch_{i}"), n, 10, b"labels", rng) for i in range(1, 6)]
    test = _batch(os.path.join(root, "test_batch"), n, 10, b"labels", rng)
    with open(os.path.join(root, "batches.meta"), "wb") as fh:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, fh)
    return batches, test


def test_cifar10_pickle_release(tmp_path, rng):
    root = tmp_path / "cifar-10-batches-py"
    batches, test = make_cifar10_pickle(str(root), rng)
    d = load_cifar_pickle(str(root), "cifar10")
    assert d.x_train.shape == (20, 3, 32, 32) and d.x_test.shape == (4, 3, 32, 32)
    # channel-major rows: the first 1024 bytes are the red plane
    np.testing.assert_array_equal(d.x_train[0, 0].reshape(-1), batches[0][0][0, :1024])
    np.testing.assert_array_equal(d.y_train[:4], batches[0][1])
    assert d.classes[3] == "c3" and d.source == "pickle"
    same, natural = load_image_dataset("cifar10", str(tmp_path))
    assert natural is None and np.array_equal(same.x_train, d.x_train)


def test_cifar100_pickle_release(tmp_path, rng):
    root = tmp_path / "cifar-100-python"
    os.makedirs(root)
    _batch(str(root / "train"), 6, 100, b"fine_labels", rng)
    _batch(str(root / "test"), 3, 100, b"fine_labels", rng)
    d, _ = load_image_dataset("cifar100", str(tmp_path))
    assert d.num_classes == 100 and d.x_train.shape == (6, 3, 32, 32)


@pytest.mark.parametrize(
    "breakage,fragment",
    [
        ("missing", "data_batch_3: missing"),
        ("garbage", "not a CIFAR pickle batch"),
        ("shape", "expected (n, 3072)"),
        ("labels", "labels outside 0..9"),
    ],
)
def test_cifar_pickle_errors(tmp_path, rng, breakage, fragment):
    root = str(tmp_path / "cifar-10-batches-py")
    make_cifar10_pickle(root, rng)
    target = os.path.join(root, "data_batch_3")
    if breakage == "missing":
        os.remove(target)
    elif breakage == "garbage":
        open(target, "wb").write(b"not a pickle")
    elif breakage == "shape":
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, open(target, "wb"))
    else:
        pickle.dump({b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}, open(target, "wb"))
    with pytest.raises(DatasetError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_cifar_pickle(root, "cifar10")


def _jpeg(arr):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def make_jpeg_tree(root, rng, classes=("cat", "dog"), per=3, as_zip=None):
    files = {}
    for split in ("train", "test"):
        for c in classes:
            for i in range(per):
                files[f"{split}/{c}/{i:04d}.jpg"] = np.full((32, 32, 3), 40 + 150 * (c == classes[1]), np.uint8)
    if as_zip:
        with zipfile.ZipFile(as_zip, "w") as z:
            for name, arr in files.items():
                z.writestr(name, _jpeg(arr))
        return as_zip
    for name, arr in files.items():
        os.makedirs(os.path.join(root, os.path.dirname(name)), exist_ok=True)
        open(os.path.join(root, name), "wb").write(_jpeg(arr))
    return root


@pytest.mark.parametrize("kind", ["folder", "zip"])
def test_cifar_jpeg_folder_and_zip_are_decoded_once_and_cached(tmp_path, rng, kind):
    src = make_jpeg_tree(str(tmp_path / "tree"), rng, as_zip=str(tmp_path / "c.zip") if kind == "zip" else None)
    cache = tmp_path / "cache"
    d = load_cifar_jpeg(src, src, cache_dir=str(cache))
    assert d.x_train.shape == (6, 3, 32, 32) and d.classes == ("cat", "dog") and d.source == "jpeg"
    assert sorted(d.y_train.tolist()) == [0, 0, 0, 1, 1, 1]
    assert abs(int(d.x_train[d.y_train == 1].mean()) - 190) <= 3  # lossy, but close to the pixels written
    cached = list(cache.iterdir())
    assert len(cached) == 1
    again = load_cifar_jpeg(src, src, cache_dir=str(cache))  # served from the cache
    assert np.array_equal(again.x_train, d.x_train)


def test_jpeg_split_across_two_zips_and_errors(tmp_path, rng, monkeypatch):
    tr = make_jpeg_tree(None, rng, as_zip=str(tmp_path / "cifar10_jpeg_train.zip"))
    te = make_jpeg_tree(None, rng, as_zip=str(tmp_path / "cifar10_jpeg_test.zip"))
    d, _ = load_image_dataset("cifar10", str(tmp_path), cache_dir=str(tmp_path / "cache"))
    assert len(d.y_test) == 6 and tr != te
    bad = tmp_path / "bad"
    os.makedirs(bad / "train" / "cat")
    os.makedirs(bad / "test" / "cat")
    (bad / "train" / "cat" / "0.jpg").write_bytes(b"nope")
    (bad / "test" / "cat" / "0.jpg").write_bytes(_jpeg(np.zeros((32, 32, 3), np.uint8)))
    with pytest.raises(DatasetError, match="cannot decode image"):
        load_cifar_jpeg(str(bad), str(bad), cache_dir=str(tmp_path / "c2"))
    with pytest.raises(DatasetError, match="no such folder"):
        load_image_dataset("cifar10", str(tmp_path / "nowhere"))
    monkeypatch.delenv("FEDPM_DATA", raising=False)
    with pytest.raises(DatasetError, match="FEDPM_DATA"):
        load_image_dataset("cifar10", None)


def make_leaf(root, rng, users=("w1", "w2", "w3"), gz=False):
    """A LEAF folder; gz=True writes LEAF's JSON gzip-compressed (*.json.gz), as the shared copy holds it."""
    for split, n in (("train", 4), ("test", 2)):
        os.makedirs(os.path.join(root, split))
        data = {
            "users": list(users),
            "num_samples": [n] * len(users),
            "user_data": {
                u: {"x": rng.random((n, 784)).round(3).tolist(), "y": rng.integers(0, 62, n).tolist()} for u in users
            },
        }
        name = os.path.join(root, split, f"all_data_0_{split}.json")
        with gzip.open(name + ".gz", "wt") if gz else open(name, "w") as fh:
            json.dump(data, fh)


def test_femnist_leaf_json(tmp_path, rng):
    make_leaf(str(tmp_path), rng)
    data, parts, users = load_femnist(str(tmp_path))
    assert data.x_train.shape == (12, 1, 28, 28) and data.x_train.dtype == np.uint8
    assert users == ["w1", "w2", "w3"] and [len(p) for p in parts] == [4, 4, 4]
    d2, natural = load_image_dataset("femnist", str(tmp_path))
    assert len(natural) == 3 and d2.num_classes == 62
    bad = tmp_path / "train" / "all_data_0_train.json"
    bad.write_text(json.dumps({"users": ["w1"], "user_data": {"w1": {"x": [[0.0] * 10], "y": [1]}}}))
    with pytest.raises(DatasetError, match="expected \\(n, 784\\)"):
        load_femnist(str(tmp_path))


def test_femnist_reads_json_gz_as_the_same_data_as_json(tmp_path):
    plain, packed, mixed = tmp_path / "plain", tmp_path / "packed", tmp_path / "mixed"
    make_leaf(str(plain), np.random.default_rng(5))
    make_leaf(str(packed), np.random.default_rng(5), gz=True)
    assert not list(packed.glob("*/*.json")) and len(list(packed.glob("*/*.json.gz"))) == 2
    # one split plain, the other gzipped, and a second gzipped shard of new writers beside a plain one
    make_leaf(str(mixed), np.random.default_rng(5))
    make_leaf(str(tmp_path / "more"), np.random.default_rng(6), users=("w4", "w5"), gz=True)
    for split in ("train", "test"):
        (mixed / split / "more.json.gz").write_bytes(
            (tmp_path / "more" / split / f"all_data_0_{split}.json.gz").read_bytes()
        )
    a, pa, ua = load_femnist(str(plain))
    b, pb, ub = load_femnist(str(packed))
    assert ua == ub and all(np.array_equal(x, y) for x, y in zip(pa, pb, strict=True))
    for f in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    c, pc, uc = load_femnist(str(mixed))
    assert uc == ["w1", "w2", "w3", "w4", "w5"] and [len(p) for p in pc] == [4] * 5
    np.testing.assert_array_equal(c.x_train[:12], a.x_train)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(30, 400), clients=st.integers(2, 12), alpha=st.sampled_from([0.1, 1.0]), seed=st.integers(0, 1000))
def test_dirichlet_partition_table(n, clients, alpha, seed):
    labels = np.random.default_rng(seed).integers(0, 10, n)
    parts = dirichlet_partition(labels, clients, alpha, seed)
    table = partition_table(labels, parts, 10)
    assert table.shape == (clients, 10) and table.sum() == n and (table.sum(1) > 0).all()
    np.testing.assert_array_equal(table.sum(0), np.bincount(labels, minlength=10))
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))


@st.composite
def _feasible_split(draw):
    """At small alpha each class lands on one or two clients, so a split of few classes over many
    clients has no draw meeting the 50 % floor (the partitioner then says so): keep clients <= classes."""
    classes = draw(st.integers(2, 10))
    return draw(st.integers(200, 3000)), draw(st.integers(2, classes)), classes


@settings(max_examples=40, deadline=None)
@given(sizes=_feasible_split(), alpha=st.sampled_from([0.1, 0.5, 1.0, 10.0]), seed=st.integers(0, 10_000))
def test_relaysum_split_properties(sizes, alpha, seed):
    n, clients, classes = sizes
    labels = np.random.default_rng(seed).integers(0, classes, n)
    parts = relaysum_partition(labels, clients, alpha, seed)
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == n and sorted(np.concatenate(parts).tolist()) == list(range(n))
    assert (sizes >= 0.5 * n / clients).all()
    # the cap: a client stops receiving once it holds n/K, so it overshoots by at most one class
    assert (sizes < n / clients + np.bincount(labels).max() + 1).all()
    again = relaysum_partition(labels, clients, alpha, seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=False))


def test_relaysum_split_is_seeded_and_unequal_at_small_alpha_uniform_at_large():
    labels = np.repeat(np.arange(10), 500)
    a = relaysum_partition(labels, 10, 0.1, seed=0)
    b = relaysum_partition(labels, 10, 0.1, seed=1)
    assert any(len(x) != len(y) or not np.array_equal(x, y) for x, y in zip(a, b, strict=False))
    sizes = np.array([len(p) for p in a])
    assert sizes.max() > 1.2 * sizes.min()  # sizes stay unequal (no equalising step)
    table = partition_table(labels, a, 10)
    assert (table.max(1) > 0.5 * table.sum(1)).mean() > 0.5  # alpha = 0.1: most clients dominated by a class
    uniform = partition_table(labels, relaysum_partition(labels, 10, 1e5, seed=0), 10)
    frac = uniform / uniform.sum(1, keepdims=True)
    assert np.abs(frac - 0.1).max() < 0.01  # alpha -> infinity: every client sees uniform classes


def test_relaysum_split_refuses_what_it_cannot_satisfy():
    from fedconvex.data import DataError, relaysum_split

    with pytest.raises(DataError, match="alpha must be a finite number"):
        relaysum_split(np.zeros(10, int), 2, float("inf"))
    with pytest.raises(DataError, match="cannot give 20 clients"):
        relaysum_split(np.zeros(10, int), 20, 1.0)
    # two classes at alpha 0.1 cannot fill seven clients to half the mean: refused, not looped forever
    with pytest.raises(DataError, match="raise alpha or use fewer clients"):
        relaysum_split(np.repeat([0, 1], 100), 7, 0.1, max_tries=200)


def test_femnist_every_writer_is_a_client_and_the_preset_samples_ten(tmp_path, rng):
    from validation import dnn

    make_leaf(str(tmp_path), rng, users=tuple(f"w{i}" for i in range(14)))
    exp, desc = dnn.build(
        dnn.parse_args(
            [
                "--dataset",
                "femnist",
                "--data-dir",
                str(tmp_path),
                "--preset",
                "femnist",
                "--method",
                "fedpm",
                "--device",
                "cpu",
                "--out",
                str(tmp_path / "o"),
            ]
        )
    )
    assert len(exp.clients) == 14 and exp.participants == 10 and desc["participants"] == 10
    assert desc["client_sizes"] == [4] * 14 and desc["partition"] == "natural (writers)"
    exp, _ = dnn.build(
        dnn.parse_args(
            [
                "--dataset",
                "femnist",
                "--data-dir",
                str(tmp_path),
                "--preset",
                "femnist",
                "--participants",
                "3",
                "--clients",
                "5",
                "--device",
                "cpu",
            ]
        )
    )
    assert len(exp.clients) == 5 and exp.participants == 3


def test_femnist_rounds_sample_participants_from_every_writer(tmp_path, rng):
    from fedpm_dnn.engine.simulation import run_experiment
    from validation import dnn

    make_leaf(str(tmp_path), rng, users=tuple(f"w{i}" for i in range(14)))
    exp, _ = dnn.build(
        dnn.parse_args(
            [
                "--dataset",
                "femnist",
                "--data-dir",
                str(tmp_path),
                "--preset",
                "femnist",
                "--method",
                "fedavg",
                "--device",
                "cpu",
                "--rounds",
                "3",
                "--local-epochs",
                "1",
                "--engine",
                "sequential",
            ]
        )
    )  # the spy watches client_round
    seen = []
    import fedpm_dnn.engine.training_task as sim  # the sequential engine's client_round

    original = sim.client_round

    def spy(cfg, model, blocks, data, *a, **k):
        seen.append(next(i for i, c in enumerate(exp.clients) if c is data))
        return original(cfg, model, blocks, data, *a, **k)

    sim.client_round = spy
    try:
        run_experiment(exp)
    finally:
        sim.client_round = original
    rounds = [seen[i : i + 10] for i in range(0, 30, 10)]
    assert len(seen) == 30 and all(len(set(r)) == 10 for r in rounds)
    assert len(set(seen)) > 10  # sampling reaches writers beyond the first ten


def test_augmentation_crops_within_padding_and_flips():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) + 1
    g = torch.Generator().manual_seed(0)
    out = random_crop_flip(x, g, padding=2, flip=False)
    assert out.shape == x.shape
    for b in range(2):
        padded = torch.nn.functional.pad(x[b], (2, 2, 2, 2))
        found = any(torch.equal(out[b], padded[:, i : i + 8, j : j + 8]) for i in range(5) for j in range(5))
        assert found
    same = random_crop_flip(x, torch.Generator().manual_seed(0), padding=2, flip=False)
    assert torch.equal(out, same)
    flipped = random_crop_flip(x, torch.Generator().manual_seed(1), padding=0, flip=True)
    for b in range(2):
        assert torch.equal(flipped[b], x[b]) or torch.equal(flipped[b], x[b].flip(2))


def test_crop_flip_is_a_padded_crop_then_a_mirror_per_image():
    """The one-gather crop/flip equals, image by image, zero padding, slicing at the offsets and flipping."""
    from fedpm_dnn.data.augment import crop_flip

    g = torch.Generator().manual_seed(4)
    x = torch.rand(9, 3, 6, 5, generator=g)
    oy, ox = torch.randint(0, 5, (9,), generator=g), torch.randint(0, 5, (9,), generator=g)
    flip = torch.rand(9, generator=g) < 0.5
    out = crop_flip(x, oy, ox, flip, padding=2)
    for i in range(9):
        ref = torch.nn.functional.pad(x[i], (2, 2, 2, 2))[:, oy[i] : oy[i] + 6, ox[i] : ox[i] + 5]
        assert torch.equal(out[i], ref.flip(2) if flip[i] else ref)
    assert flip.any() and (~flip).any()


def test_engine_auto_is_the_faster_engine_of_the_device(tmp_path, rng, monkeypatch):
    """--engine auto (default) resolves to the sequential engine on a CPU and the vectorized one on a GPU,
    and the resolved engine is what the run and its summary record."""
    from validation import dnn

    make_leaf(str(tmp_path), rng, users=("w0", "w1"))
    base = ["--dataset", "femnist", "--data-dir", str(tmp_path), "--method", "fedavg", "--device", "cpu"]
    exp, desc = dnn.build(dnn.parse_args(base))
    assert exp.engine == desc["engine"] == "sequential"
    exp, desc = dnn.build(dnn.parse_args(base + ["--engine", "vectorized"]))
    assert exp.engine == desc["engine"] == "vectorized"
    assert dnn.AUTO_ENGINE == {"cuda": "vectorized", "cpu": "sequential"}


def test_an_interrupted_cache_write_leaves_no_file(tmp_path, rng, monkeypatch):
    """Ctrl-C while the decoded images are written to the cache: no half-written file, no cache; the next load
    decodes again and caches."""
    src = make_jpeg_tree(str(tmp_path / "tree"), rng)
    cache = tmp_path / "cache"
    real = np.savez

    def interrupted(path, **arrays):
        open(path, "wb").write(b"PK half")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_cifar_jpeg(src, src, cache_dir=str(cache))
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(np, "savez", real)
    d = load_cifar_jpeg(src, src, cache_dir=str(cache))
    assert d.x_train.shape == (6, 3, 32, 32) and len(list(cache.iterdir())) == 1
