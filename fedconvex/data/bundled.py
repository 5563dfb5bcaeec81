"""The LibSVM training files that ship inside the package (w8a, a9a), verified on load.

The checksum is the SHA-256 of the *decompressed* file, i.e. of the original LibSVM
file, so it can be compared with any public copy.
"""

from __future__ import annotations

import bz2
import hashlib
import os
from importlib import resources

from .libsvm import DataError, Dataset, _parse_integer_file, parse_libsvm, read_libsvm

# name: (file, n_features, sha256 of the decompressed original, paper's N clients, M per client)
BUNDLED = {
    "w8a": ("w8a.bz2", 300, "5745d77182ae41c3f489f05e6874b6490842556ec8a0184e70ff4670ca71d9bb", 142, 350),
    "a9a": ("a9a.bz2", 123, "f5d5ffd8d865ff41328e7ee043e4b020816914ff6843ff15b98905ddbedce906", 80, 407),
}


def load_bundled(name: str) -> Dataset:
    fname, d, sha, _, _ = BUNDLED[name]
    raw = bz2.decompress(resources.files(__package__).joinpath(fname).read_bytes())
    got = hashlib.sha256(raw).hexdigest()
    if got != sha:
        raise DataError(
            f"bundled dataset {name}: checksum mismatch (got {got[:12]}…, expected {sha[:12]}…); reinstall the package"
        )
    ds = _parse_integer_file(raw, f"<bundled {name}>", d)  # the bundled files are integers throughout
    return ds if ds is not None else parse_libsvm(raw.decode("ascii").splitlines(), f"<bundled {name}>", n_features=d)


def load_dataset(name_or_path: str, n_features: int | None = None) -> Dataset:
    """A bundled dataset by name, or any LibSVM file by path."""
    if name_or_path in BUNDLED:
        return load_bundled(name_or_path)
    if not os.path.exists(name_or_path):
        names = ", ".join(BUNDLED)
        raise DataError(f"{name_or_path}: neither a bundled dataset ({names}) nor an existing file")
    return read_libsvm(name_or_path, n_features)


def paper_split_sizes(name: str):
    """(clients, per_client) of the paper's Test 1 for a bundled dataset, else None."""
    entry = BUNDLED.get(name)
    return (entry[3], entry[4]) if entry else None
