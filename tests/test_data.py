import bz2

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fedconvex.data.bundled as bundled
from fedconvex.data import (
    BUNDLED,
    DataError,
    client_class_counts,
    dirichlet_split,
    load_bundled,
    load_dataset,
    parse_libsvm,
    read_libsvm,
    relaysum_split,
    sequential_split,
    shuffled_split,
)


def write(tmp_path, text, name="d.svm"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


@pytest.mark.parametrize(
    "labels,expect", [((0, 1), (-1, 1)), ((1, 2), (-1, 1)), ((-1, 1), (-1, 1)), ((+1, -1), (1, -1))]
)
def test_labels_map_to_plus_minus_one(tmp_path, labels, expect):
    path = write(tmp_path, f"{labels[0]} 1:0.5 3:2\n{labels[1]} 2:1\n")
    ds = read_libsvm(path, n_features=4)
    assert ds.X.shape == (2, 4)
    np.testing.assert_array_equal(ds.y, expect)
    np.testing.assert_array_equal(ds.X.toarray(), [[0.5, 0, 2, 0], [0, 1, 0, 0]])


def test_n_features_explicit_keeps_unused_last_column(tmp_path):
    ds = read_libsvm(write(tmp_path, "-1 1:1\n+1 2:1\n"), n_features=123)
    assert ds.X.shape == (2, 123)
    assert read_libsvm(write(tmp_path, "-1 1:1\n+1 5:1\n", "b.svm")).X.shape == (2, 5)


def test_blank_lines_and_featureless_rows(tmp_path):
    ds = read_libsvm(write(tmp_path, "-1 \n\n+1 2:1\n"))
    assert ds.n == 2 and ds.X.nnz == 1


def test_compressed_files(tmp_path):
    p = tmp_path / "d.svm.bz2"
    p.write_bytes(bz2.compress(b"-1 1:1\n1 2:3\n"))
    assert read_libsvm(str(p)).X.toarray()[1, 1] == 3


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("-1 1:1\nabc 2:1\n", ":2: label 'abc'"),
        ("-1 1:1\n1 2-1\n", ":2: token '2-1'"),
        ("-1 1:x\n1 2:1\n", ":1: token '1:x'"),
        ("-1 0:1\n1 2:1\n", ":1: feature index 0"),
        ("-1 3:1 2:1\n1 2:1\n", ":1: feature indices must increase"),
        ("-1 1:nan\n1 2:1\n", ":1: value 'nan'"),
        ("-1 1:1\n1 2:inf\n", ":2: value 'inf'"),
        ("-1 1:1\n1 9:1\n", ":2: feature index 9 exceeds n_features=4"),
        ("-1 1:1\n1 2:1\n2 1:1\n", ":3: third label 2"),
        ("", "no samples"),
        ("\n\n", "no samples"),
        ("1 1:1\n1 2:1\n", "only one label"),
        ("nan 1:1\n", ":1: label 'nan' is not finite"),
        # Python's int()/float() read these as numbers (1_0 as 10, Arabic-Indic digits as digits); a LibSVM file does
        # not
        ("-1 1:1\n1 1_0:1\n", ":2: token '1_0:1' holds '_'"),
        ("-1 1:1\n1 2:0_5\n", ":2: token '2:0_5' holds '_'"),
        ("1_0 1:1\n-1 2:1\n", ":1: token '1_0' holds '_'"),
        ("-1 1:1\n1 \u0663:1\n", ":2: token '\u0663:1' holds non-ASCII character '\u0663' (U+0663)"),
        ("-1 1:1\n1 2:\uff11\n", ":2: token '2:\uff11' holds non-ASCII character '\uff11' (U+FF11)"),
        ("-1 1:1\u00a02:1\n1 2:1\n", ":1: non-ASCII character '\\xa0' (U+00A0) between tokens"),
    ],
)
def test_malformed_input_names_file_and_line(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(DataError) as err:
        read_libsvm(path, n_features=4)
    msg = str(err.value)
    assert path in msg and fragment in msg and "\n" not in msg


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_libsvm(str(tmp_path / "nope"))
    p = tmp_path / "bin"
    p.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(DataError, match="not a text file"):
        read_libsvm(str(p))
    with pytest.raises(DataError, match="neither a bundled dataset"):
        load_dataset(str(tmp_path / "nope"))


@pytest.mark.parametrize("name,shape,positives", [("w8a", (49749, 300), 1479), ("a9a", (32561, 123), 7841)])
def test_bundled_datasets_match_published_counts(name, shape, positives):
    ds = load_bundled(name)
    assert ds.X.shape == shape and int((ds.y > 0).sum()) == positives
    assert np.all(ds.X.data == 1.0)  # both files are binary


def test_bundled_checksum_is_verified(monkeypatch):
    fname, d, sha, n, m = BUNDLED["a9a"]
    monkeypatch.setitem(bundled.BUNDLED, "a9a", (fname, d, "0" * 64, n, m))
    with pytest.raises(DataError, match="checksum mismatch"):
        load_bundled("a9a")


def test_bundled_equals_reading_the_same_file(tmp_path):
    """The embedded copy parses exactly like the same text read from disk."""
    from importlib import resources

    raw = bz2.decompress(resources.files("fedconvex.data").joinpath("a9a.bz2").read_bytes())
    p = tmp_path / "a9a"
    p.write_bytes(raw)
    a, b = load_bundled("a9a"), read_libsvm(str(p), n_features=123)
    assert (a.X != b.X).nnz == 0 and np.array_equal(a.y, b.y)


def test_sequential_split_is_the_papers():
    parts = sequential_split(49749, 142, 350)
    assert len(parts) == 142 and all(len(p) == 350 for p in parts)
    assert parts[0][0] == 0 and parts[-1][-1] == 142 * 350 - 1
    assert sequential_split(10, 3)[2].tolist() == [6, 7, 8]  # M defaults to floor(rows / N)


@pytest.mark.parametrize("args", [(10, 0, None), (10, 4, 3), (3, 5, None)])
def test_split_errors(args):
    with pytest.raises(DataError):
        sequential_split(*args)


@pytest.mark.parametrize(
    "call,fragment",
    [
        (lambda: sequential_split(10, 1.5), "clients must be an integer, got 1.5"),
        (lambda: sequential_split(10.0, 2), "n_rows must be an integer, got 10.0"),
        (lambda: sequential_split(10, 2, 2.5), "per_client must be an integer, got 2.5"),
        (lambda: sequential_split(10, "2"), "clients must be an integer, got '2'"),
        (lambda: shuffled_split(10, True), "clients must be an integer, got True"),
        (lambda: dirichlet_split([0, 1, 0, 1], 2.0, 1.0), "clients must be an integer, got 2.0"),
        (lambda: dirichlet_split([0, 1, 0, 1], 2, 1.0, min_size=1.5), "min_size must be an integer, got 1.5"),
        (lambda: relaysum_split([0, 1, 0, 1], 2.5, 1.0), "clients must be an integer, got 2.5"),
    ],
    ids=["clients", "rows", "per-client", "text", "bool", "dirichlet", "dirichlet-min-size", "relaysum"],
)
def test_split_counts_must_be_integers(call, fragment):
    with pytest.raises(TypeError) as err:
        call()
    assert fragment in str(err.value)


def test_split_counts_may_be_numpy_integers():
    a = sequential_split(np.int64(10), np.int32(3), np.uint8(3))
    assert [p.tolist() for p in a] == [p.tolist() for p in sequential_split(10, 3)]


def test_shuffled_split_disjoint_and_seeded():
    a = shuffled_split(100, 7, 10, seed=3)
    b = shuffled_split(100, 7, 10, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=False))
    flat = np.concatenate(a)
    assert len(np.unique(flat)) == 70


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(20, 300),
    clients=st.integers(1, 10),
    classes=st.integers(2, 5),
    alpha=st.sampled_from([0.05, 0.1, 1.0, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_dirichlet_split_properties(n, clients, classes, alpha, seed):
    labels = np.random.default_rng(seed).integers(0, classes, n)
    parts = dirichlet_split(labels, clients, alpha, seed=seed)
    flat = np.concatenate(parts)
    assert len(parts) == clients
    assert sorted(flat.tolist()) == list(range(n))  # every sample exactly once
    assert min(len(p) for p in parts) >= 1  # no empty client
    again = dirichlet_split(labels, clients, alpha, seed=seed)
    assert all(np.array_equal(x, y) for x, y in zip(parts, again, strict=False))
    counts = client_class_counts(labels, parts)
    np.testing.assert_array_equal(counts.sum(0), np.bincount(labels, minlength=classes)[np.unique(labels)])


def test_dirichlet_small_alpha_is_more_skewed():
    labels = np.repeat(np.arange(10), 500)

    def skew(alpha):
        c = client_class_counts(labels, dirichlet_split(labels, 10, alpha, seed=0))
        return np.mean(c.max(1) / c.sum(1))

    assert skew(0.1) > skew(100.0) + 0.3


def test_dirichlet_errors():
    with pytest.raises(DataError, match="alpha"):
        dirichlet_split([0, 1], 2, 0.0)
    with pytest.raises(DataError, match="cannot give"):
        dirichlet_split([0, 1], 3, 1.0)


# ------------------------------------------------------------------ the whole-file reader of integer files
def _same_dataset(a, b):
    return (
        a.X.shape == b.X.shape
        and a.labels == b.labels
        and np.array_equal(a.y, b.y)
        and all(
            np.array_equal(getattr(a.X, k), getattr(b.X, k)) and getattr(a.X, k).dtype == getattr(b.X, k).dtype
            for k in ("data", "indices", "indptr")
        )
    )


@pytest.mark.parametrize("name", ["w8a", "a9a"])
def test_the_bundled_files_are_read_whole_exactly_as_line_by_line(name):
    from importlib import resources

    from fedconvex.data.libsvm import _parse_integer_file

    raw = bz2.decompress(resources.files("fedconvex.data").joinpath(BUNDLED[name][0]).read_bytes())
    lines = parse_libsvm(raw.decode("ascii").splitlines(), "x", n_features=BUNDLED[name][1])
    whole = _parse_integer_file(raw, "x", BUNDLED[name][1])
    assert whole is not None and _same_dataset(whole, lines)
    assert _same_dataset(load_bundled(name), lines)
    no_d = _parse_integer_file(raw, "x", None)
    assert no_d is not None and _same_dataset(no_d, parse_libsvm(raw.decode("ascii").splitlines(), "x"))


_token = st.one_of(st.integers(0, 40).map(str), st.sampled_from(["+1", "-1", "-0", "007", "0"]))
_feature = st.tuples(
    st.integers(0, 12), st.one_of(st.integers(0, 3).map(str), st.sampled_from(["1.5", "-1", "1e2", "", "nan"]))
)
_line = st.tuples(_token, st.lists(_feature, max_size=5), st.sampled_from([" ", "  "]), st.sampled_from(["", " "]))
_noise = st.sampled_from(["", "", "", "\t", "\r", ":", "::", " x", "1:2:3", "+", "3 ", "\n\n", "--1", ":4"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_line, min_size=1, max_size=6), _noise, st.integers(0, 200), st.one_of(st.none(), st.integers(1, 14)))
def test_the_whole_file_reader_reads_as_the_line_parser_or_leaves_it_to_it(lines, noise, at, n_features):
    """On any text the whole-file reader either gives the line parser's Dataset to the last bit, or declines
    (None) -- then the line parser reads it, errors and all; it never accepts what the line parser refuses."""
    from fedconvex.data.libsvm import _parse_integer_file

    text = "\n".join(lab + "".join(f"{sep}{i}:{v}" for i, v in feats) + tail for lab, feats, sep, tail in lines)
    at = min(at, len(text))
    text = text[:at] + noise + text[at:]
    try:
        ref = parse_libsvm(text.splitlines(), "x", n_features=n_features)
    except DataError:
        ref = None
    got = _parse_integer_file(text.encode("ascii"), "x", n_features)
    if got is not None:
        assert ref is not None and _same_dataset(got, ref)
    clean = noise == "" and all(v.isdigit() for _, feats, _, _ in lines for _, v in feats)
    if clean and ref is not None:
        assert got is not None  # plain integer files are read whole


def test_the_whole_file_reader_leaves_indices_past_32_bits_to_the_line_parser():
    """Column indices are stored in 32 bits: an index the line parser rejects must not wrap around."""
    from fedconvex.data.libsvm import _parse_integer_file

    text = b"1 3:1 4294967297:2\n-1 1:1\n"
    assert _parse_integer_file(text, "x", None) is None
    with pytest.raises(DataError, match="2147483647"):
        parse_libsvm(text.decode().splitlines(), "x")


@pytest.mark.parametrize(
    "raw", [b"-1 1:1\n1 1_0:1\n", "-1 1:1\n1 2:\u0661\n".encode("utf-8")], ids=["underscore", "unicode"]
)
def test_the_whole_file_reader_leaves_underscores_and_unicode_digits_to_the_line_parser_which_refuses_them(raw):
    from fedconvex.data.libsvm import _parse_integer_file

    assert _parse_integer_file(raw, "<x>", None) is None
    with pytest.raises(DataError, match="<x>:2: token .* holds"):
        parse_libsvm(raw.decode("utf-8").splitlines(), "<x>")
