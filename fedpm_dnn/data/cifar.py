"""CIFAR readers in plain numpy (no torchvision).

* ``load_cifar_pickle``: the standard python releases ``cifar-10-batches-py`` (data_batch_1..5,
  test_batch) and ``cifar-100-python`` (train, test; fine labels), the format users have on disk.
* ``load_cifar_jpeg``: a folder or zip of ``<split>/<class>/*.jpg`` (the project's CIFAR-10 copy),
  decoded once and cached as a .npz next to a cache directory.
Images are returned as uint8 arrays (n, 3, 32, 32); labels as int64.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import zipfile
from dataclasses import dataclass

import numpy as np

from fedconvex.files import open_regular, read_regular, replaced_atomically


class DatasetError(ValueError):
    """A dataset folder or file is missing or malformed; the message names it."""


@dataclass(frozen=True, eq=False)
class ImageData:
    x_train: np.ndarray  # (n, C, H, W) uint8
    y_train: np.ndarray  # (n,) int64
    x_test: np.ndarray
    y_test: np.ndarray
    classes: tuple
    name: str
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.25, 0.25, 0.25)
    source: str = ""  # "pickle", "jpeg" or "leaf"

    @property
    def num_classes(self):
        return len(self.classes)


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# per-channel statistics of the CIFAR training sets (the usual normalisation constants)
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))


# The only callables a CIFAR batch may name: numpy's array / dtype reconstruction (both module
# names numpy has used) and the codec Python 3 uses for bytes in protocol-2 pickles.  Everything
# else -- os.system, builtins.eval, any class -- is refused before it is looked up.
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _Refused(Exception):
    pass


class _DataOnlyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays, dicts, lists, tuples, bytes, str and numbers; nothing that runs code."""

    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def safe_unpickle(fh):
    return _DataOnlyUnpickler(fh, encoding="bytes").load()


def _unpickle(path):
    if not os.path.lexists(path):
        raise DatasetError(f"{path}: missing (expected the python-pickle CIFAR release)")
    fh = open_regular(path, error=DatasetError)  # never a FIFO or a device
    try:
        with fh:
            d = safe_unpickle(fh)
    except _Refused as exc:
        raise DatasetError(
            f"{path}: refused: the pickle names {exc}, which a CIFAR batch never does (loading it could run code)"
        ) from None
    except Exception as exc:  # truncated or foreign file
        raise DatasetError(f"{path}: not a CIFAR pickle batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(d, dict):
        raise DatasetError(f"{path}: not a CIFAR pickle batch (holds a {type(d).__name__}, not a dict)")
    return d


def _batch(path, label_key):
    d = _unpickle(path)
    try:
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[label_key], dtype=np.int64)
    except (KeyError, TypeError, ValueError, OverflowError):
        raise DatasetError(f"{path}: no {label_key.decode()!r}/'data' entries of integers") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise DatasetError(f"{path}: data of shape {data.shape} with {len(labels)} labels; expected (n, 3072)")
    return data.reshape(-1, 3, 32, 32), labels


def _names(path, key, k):
    names = _unpickle(path).get(key)
    if not isinstance(names, list) or len(names) != k or not all(isinstance(c, (bytes, str)) for c in names):
        raise DatasetError(f"{path}: {key.decode()!r} is not a list of {k} class names")
    return tuple(c.decode("utf-8", "replace") if isinstance(c, bytes) else c for c in names)


def load_cifar_pickle(root: str, which: str = "cifar10") -> ImageData:
    """CIFAR-10 from ``root`` = .../cifar-10-batches-py, CIFAR-100 from .../cifar-100-python."""
    if which == "cifar10":
        parts = [_batch(os.path.join(root, f"data_batch_{i}"), b"labels") for i in range(1, 6)]
        xt, yt = _batch(os.path.join(root, "test_batch"), b"labels")
        meta = os.path.join(root, "batches.meta")
        classes = _names(meta, b"label_names", 10) if os.path.isfile(meta) else CIFAR10_CLASSES
        stats = CIFAR10_STATS
    elif which == "cifar100":
        parts = [_batch(os.path.join(root, "train"), b"fine_labels")]
        xt, yt = _batch(os.path.join(root, "test"), b"fine_labels")
        meta = os.path.join(root, "meta")
        classes = _names(meta, b"fine_label_names", 100) if os.path.isfile(meta) else tuple(str(i) for i in range(100))
        stats = CIFAR100_STATS
    else:
        raise DatasetError(f"unknown CIFAR variant {which!r}")
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    _check_labels(root, y, yt, len(classes))
    return ImageData(x, y, xt, yt, classes, which, *stats, source="pickle")


def _check_labels(where, y, yt, k):
    for arr in (y, yt):
        if len(arr) and (arr.min() < 0 or arr.max() >= k):
            raise DatasetError(f"{where}: labels outside 0..{k - 1}")


# a 32x32 image takes a few kB in any format; a member beyond this is not one (and is never inflated in full)
MAX_IMAGE_BYTES = 2**20


class _Source:
    """Uniform access to a folder or a zip of <split>/<class>/<file>.jpg; every file is read as what it claims to
    be (a regular file, at most MAX_IMAGE_BYTES: never a FIFO, a device or a zip bomb)."""

    def __init__(self, path):
        self.path = path
        if os.path.isdir(path):
            self.names = sorted(
                os.path.relpath(os.path.join(d, f), path).replace(os.sep, "/") for d, _, fs in os.walk(path) for f in fs
            )
            self.read = self._read_file
        elif os.path.isfile(path) and zipfile.is_zipfile(path):
            try:
                self.zip = zipfile.ZipFile(path)
            except (zipfile.BadZipFile, OSError, ValueError) as exc:
                raise DatasetError(f"{path}: damaged zip file ({exc})") from None
            self.names = [n for n in self.zip.namelist() if not n.endswith("/")]
            self.read = self._read_member
        else:
            raise DatasetError(f"{path}: neither a folder nor a zip file")

    def _read_file(self, name):
        return read_regular(os.path.join(self.path, name), MAX_IMAGE_BYTES, DatasetError)

    def _read_member(self, name):
        where = f"{self.path}:{name}"
        info = self.zip.getinfo(name)
        if info.file_size > MAX_IMAGE_BYTES:
            raise DatasetError(f"{where}: {info.file_size} bytes, more than an image of 32x32 takes; not an image")
        try:
            with self.zip.open(info) as fh:
                data = fh.read(MAX_IMAGE_BYTES + 1)  # whatever its header says, never more than this
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
            raise DatasetError(f"{where}: damaged zip member ({exc})") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise DatasetError(f"{where}: more bytes than an image of 32x32 takes; not an image")
        return data

    def content_key(self) -> list:
        """What the decoded images depend on, without reading them: every member's (name, size, CRC) from the zip's
        central directory, or every file's (name, size, mtime_ns) in a folder."""
        if hasattr(self, "zip"):
            return sorted((i.filename, i.file_size, i.CRC) for i in self.zip.infolist())
        key = []
        for n in self.names:
            try:
                st = os.stat(os.path.join(self.path, n))
                key.append((n, st.st_size, st.st_mtime_ns))
            except OSError:
                key.append((n, -1, -1))  # read (and reported) when the images are decoded
        return key

    def images(self, split):
        """[(class, name)] of ``<split>/<class>/<image>``, sorted.  Entries a system or a tool leaves beside the
        images are not images of the data set: any path with a hidden part (``.ipynb_checkpoints/``, ``._x.jpg``)
        or macOS's ``__MACOSX/`` copy.  The split's folder must stand at one place: two ``train/`` folders (a copy
        inside the folder) would train on some images twice."""
        out, roots = [], set()
        for n in self.names:
            parts = n.split("/")
            if any(p.startswith(".") or p == "__MACOSX" for p in parts):
                continue
            if len(parts) >= 3 and parts[-3] == split and parts[-1].lower().endswith((".jpg", ".jpeg", ".png")):
                out.append((parts[-2], n))
                roots.add("/".join(parts[:-2]))
        if len(roots) > 1:
            first, second = sorted(roots)[:2]
            raise DatasetError(
                f"{self.path}: {split} images under two folders, {first}/ and {second}/; keep one of them"
            )
        return sorted(out)


def _decode(src, items, classes):
    from PIL import Image

    x = np.empty((len(items), 3, 32, 32), dtype=np.uint8)
    y = np.empty(len(items), dtype=np.int64)
    index = {c: i for i, c in enumerate(classes)}
    for k, (cls, name) in enumerate(items):
        data = src.read(name)
        try:
            img = Image.open(io.BytesIO(data)).convert("RGB")
        except Exception as exc:
            raise DatasetError(
                f"{src.path}:{name}: cannot decode image ({type(exc).__name__}: {str(exc) or 'no detail'})"
            ) from None
        if img.size != (32, 32):
            raise DatasetError(f"{src.path}:{name}: image is {img.size[0]}x{img.size[1]}, expected 32x32")
        x[k] = np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)
        y[k] = index[cls]
    return x, y


def _cache_path(sources, cache_dir):
    """The cache file of these sources' current contents: deleting a class, replacing an image or rewriting a zip
    gives another file (the folder's own mtime is not enough: it misses changes inside its class folders)."""
    key = hashlib.sha256(repr([(os.path.abspath(s.path), s.content_key()) for s in sources]).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"cifar_jpeg_{key}.npz")


_CACHE_ENTRIES = {"x_train": 4, "y_train": 1, "x_test": 4, "y_test": 1, "classes": 1}


def _read_cache(cache):
    """The cached arrays, or None when the cache is absent or damaged (then it is decoded again and rewritten)."""
    if not os.path.lexists(cache):
        return None
    try:
        with open_regular(cache, error=DatasetError) as fh, np.load(fh, allow_pickle=False) as z:
            arrays = {k: z[k] for k in _CACHE_ENTRIES}
    except (DatasetError, OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    ok = all(arrays[k].ndim == d for k, d in _CACHE_ENTRIES.items()) and all(
        arrays[x].dtype == np.uint8
        and arrays[x].shape[1:] == (3, 32, 32)
        and arrays[y].dtype == np.int64
        and len(arrays[y]) == len(arrays[x])
        for x, y in (("x_train", "y_train"), ("x_test", "y_test"))
    )
    if ok:
        k = len(arrays["classes"])
        ok = arrays["classes"].dtype.kind == "U" and all(
            len(arrays[y]) and arrays[y].min() >= 0 and arrays[y].max() < k for y in ("y_train", "y_test")
        )
    return arrays if ok else None


def default_cache_dir():
    return os.environ.get("FEDPM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fedpm"))


def load_cifar_jpeg(train: str, test: str | None = None, cache_dir: str | None = None) -> ImageData:
    """CIFAR-10 from JPEG files: ``train`` (and ``test``) are folders or zips holding
    ``train/<class>/*.jpg`` and ``test/<class>/*.jpg`` (one source may hold both splits)."""
    sources = [train] + ([test] if test and test != train else [])
    for s in sources:
        if not os.path.exists(s):
            raise DatasetError(f"{s}: no such file or folder")
    src_train = _Source(train)
    src_test = _Source(test) if test and test != train else src_train
    cache_dir = cache_dir or default_cache_dir()
    cache = _cache_path([src_train] + ([src_test] if src_test is not src_train else []), cache_dir)
    z = _read_cache(cache)
    if z is not None:
        return ImageData(
            z["x_train"],
            z["y_train"],
            z["x_test"],
            z["y_test"],
            tuple(z["classes"].tolist()),
            "cifar10",
            *CIFAR10_STATS,
            source="jpeg",
        )
    tr, te = src_train.images("train"), src_test.images("test")
    if not tr:
        raise DatasetError(f"{train}: no train/<class>/*.jpg images")
    if not te:
        raise DatasetError(f"{test or train}: no test/<class>/*.jpg images")
    classes = tuple(sorted({c for c, _ in tr}))
    foreign = [c for c in classes if c not in CIFAR10_CLASSES]
    if foreign:  # a folder beside the classes would silently become a class of its own
        raise DatasetError(
            f"{train}: train/{foreign[0]}/ is not a CIFAR-10 class ({', '.join(CIFAR10_CLASSES)}); move it out"
        )
    unknown = {c for c, _ in te} - set(classes)
    if unknown:
        raise DatasetError(f"{test or train}: test classes {sorted(unknown)} have no training images")
    x, y = _decode(src_train, tr, classes)
    xt, yt = _decode(src_test, te, classes)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        if os.path.lexists(cache) and not os.path.isfile(cache):
            raise OSError(f"{cache}: is not a regular file; remove it or choose another --cache-dir")
        # per process (two runs decoding at once never share a file); np.savez wants the .npz suffix
        with replaced_atomically(cache, f"{cache}.{os.getpid()}.tmp.npz") as tmp:
            np.savez(tmp, x_train=x, y_train=y, x_test=xt, y_test=yt, classes=np.array(classes))
    except OSError as exc:
        raise DatasetError(f"decoded-image cache: {exc}; choose another --cache-dir (or $FEDPM_CACHE)") from None
    return ImageData(x, y, xt, yt, classes, "cifar10", *CIFAR10_STATS, source="jpeg")
