"""The public API: every name a user is told to import (README.md, docs/, examples/) imports from where the docs
say, without a deprecation warning, and every module, name or file the docs cite in code spans exists."""

import importlib
import os
import re
import warnings

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# module -> the names users import from it.  A package's ``__all__`` is this list exactly: a name added to or
# dropped from the public face shows here first.
PUBLIC = {
    "fedpm_dnn": ("FOOF", "FederatedRun", "cost", "federated", "mix"),
    "fedpm_dnn.data": (
        "DatasetError",
        "ImageData",
        "dirichlet_partition",
        "effective_classes",
        "load_cifar_jpeg",
        "load_cifar_pickle",
        "load_femnist",
        "load_image_dataset",
        "partition_table",
    ),
    "fedpm_dnn.data.femnist": ("load_femnist",),
    "fedpm_dnn.models": ("MODELS", "ResNet18GN", "SimpleCNN", "make_model"),
    "fedpm_dnn.presets": ("PRESETS", "method_config", "preset_row", "resolve"),
    "fedpm_dnn.algorithms": (
        "DnnAlgorithm",
        "METHODS",
        "REGISTRY",
        "applicable",
        "hyperparameters_of",
        "make_method",
        "method_class",
    ),
    "fedpm_dnn.algorithms.base": ("DnnAlgorithm",),
    "fedpm_dnn.foof": ("DEFAULT_DAMPING", "foof_blocks", "compute_foof"),
    "fedpm_dnn.method_names": ("METHOD_LABELS", "METHOD_NAMES"),
    "fedpm_dnn.engine.sequential": ("ClientData", "LoaderData"),
    "fedpm_flower.client": ("fedpm_fit",),
    "fedpm_flower.strategy": ("FedPM",),
}
ALL_IS_PUBLIC = ("fedpm_dnn", "fedpm_dnn.data", "fedpm_dnn.algorithms")
DOCS = ["README.md"] + [f"docs/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]


def _doc_files():
    yield from DOCS
    for folder, _, files in os.walk(os.path.join(ROOT, "examples")):
        for f in files:
            if f.endswith((".py", ".md")):
                yield os.path.relpath(os.path.join(folder, f), ROOT)


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


def _resolve(dotted: str):
    """The object a dotted name names: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name is None or not ".".join(parts[:cut]).startswith(e.name):
                raise  # a module that exists but fails to import is a failure, not an absent name
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_public_name_imports_from_where_the_docs_say_without_a_warning():
    pytest.importorskip("flwr")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for module, names in PUBLIC.items():
            mod = importlib.import_module(module)
            for name in names:
                assert getattr(mod, name) is not None, f"{module}.{name}"
    for module in ALL_IS_PUBLIC:
        assert sorted(importlib.import_module(module).__all__) == sorted(PUBLIC[module]), module


def test_the_docs_import_only_public_names():
    """Every ``from fedpm_dnn... import ...`` in README.md, docs/ and examples/ is in PUBLIC, so this list is what
    users are told to import (and a doc that starts teaching a new import adds it here)."""
    told = set()
    for path in _doc_files():
        for module, names in re.findall(
            r"^\s*from ((?:fedpm_dnn|fedpm_flower)[\w.]*) import ([\w, ]+)", _read(path), re.M
        ):
            told |= {(module, n.strip()) for n in names.split(",") if n.strip()}
    assert told, "the docs' imports were not found"
    listed = {(m, n) for m, names in PUBLIC.items() for n in names}
    assert told - listed == set()


def test_every_module_name_and_file_the_docs_cite_exists():
    """`fedpm_dnn.x.y`, `fedconvex/...py` and the like in code spans of README.md, docs/ and examples/ name a module,
    an attribute or a file that is there (a module moved or renamed leaves no stale reference behind)."""
    pytest.importorskip("flwr")
    dotted, paths = set(), set()
    for path in _doc_files():
        for span in re.findall(r"`([^`\n]+)`", _read(path)):
            dotted |= set(re.findall(r"\b((?:fedpm_dnn|fedconvex|fedpm_flower)(?:\.[A-Za-z_]\w*)+)", span))
            paths |= set(re.findall(r"\b((?:fedpm_dnn|fedconvex|fedpm_flower)/[\w/]*\w(?:\.py)?)", span))
    assert "fedpm_dnn.FOOF" in dotted and "fedpm_dnn/presets.py" in paths  # the scan reads the docs
    missing = [p for p in sorted(paths) if not os.path.exists(os.path.join(ROOT, p))]
    unresolved = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in sorted(dotted):
            try:
                _resolve(name)
            except (ImportError, AttributeError, DeprecationWarning) as e:
                unresolved.append(f"{name}: {e}")
    assert missing == [] and unresolved == []
