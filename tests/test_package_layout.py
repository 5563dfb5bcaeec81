"""fedpm_dnn's layers (docs/architecture.md, "fedpm_dnn's layers"): every module's imports, function-local ones
included, read from the source with ast; a module imports only from its own room or from a room of a lower rank,
and no import circle exists.  The module paths of before the subpackages still import, with a warning, and no file
of the project uses one."""

import ast
import graphlib
import importlib
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# room -> rank.  A room is a subpackage or a top-level module; rooms of one rank do not import each other.
ROOMS = {
    "fedpm_dnn.method_names": 0,  # leaves: no import from the package
    "fedpm_dnn.models": 0,
    "fedpm_dnn.data": 0,
    "fedpm_dnn.foof": 1,  # the preconditioner
    "fedpm_dnn.mixing": 2,  # the server's preconditioned mixing
    "fedpm_dnn.algorithms": 3,  # the methods
    "fedpm_dnn.engine": 4,  # the engines and what drives a run
    "fedpm_dnn.presets": 5,  # the library face
    "fedpm_dnn.federated": 5,
    "fedpm_dnn._deprecated_paths": 6,  # the module paths of before the subpackages (imported by name, at run time)
    "fedpm_dnn": 7,  # the package's lazy exports
}


def modules_of(package_dir: str, package: str) -> dict:
    """module name -> (source path, whether it is a package's __init__) for every .py file under package_dir."""
    found = {}
    for folder, _, files in os.walk(package_dir):
        rel = os.path.relpath(folder, package_dir)
        prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                init = f == "__init__.py"
                found[prefix if init else f"{prefix}.{f[:-3]}"] = (os.path.join(folder, f), init)
    return found


def imports_of(name: str, path: str, is_init: bool, modules: dict, package: str) -> set:
    """The package's modules that ``name`` imports anywhere in its source (module level, functions, classes)."""
    here = name if is_init else name.rpartition(".")[0]
    out = set()
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            # ``from pkg import sub`` imports the submodule pkg.sub; ``from mod import name`` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            if t == package or t.startswith(package + "."):
                while t and t not in modules:  # ``import pkg.mod.attr``-like names resolve to the module holding them
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.add(t)
    return out


def import_graph(package_dir: str, package: str) -> dict:
    modules = modules_of(package_dir, package)
    return {m: imports_of(m, path, init, modules, package) for m, (path, init) in modules.items()}


def room_of(module: str, rooms: dict) -> str:
    """The longest room that holds ``module``; a module in no room is an error (a new top-level module takes a
    place in ROOMS and in docs/architecture.md)."""
    best = max((r for r in rooms if module == r or module.startswith(r + ".")), key=len, default=None)
    if best is None or (best == module.split(".")[0] and module not in rooms):
        raise AssertionError(f"{module} is in no room of the layer table")
    return best


def layer_problems(graph: dict, rooms: dict) -> list:
    """One line per import that goes to a room of the same or a higher rank (its own room aside), and per circle."""
    problems = []
    for module, targets in sorted(graph.items()):
        src = room_of(module, rooms)
        for t in sorted(targets):
            dst = room_of(t, rooms)
            if dst != src and rooms[dst] >= rooms[src]:
                problems.append(f"{module} (rank {rooms[src]}) imports {t} (rank {rooms[dst]})")
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        problems.append("import circle: " + " -> ".join(e.args[1]))
    return problems


def test_fedpm_dnn_imports_only_downward_and_without_a_circle():
    graph = import_graph(os.path.join(ROOT, "fedpm_dnn"), "fedpm_dnn")
    assert "fedpm_dnn.engine.simulation" in graph and "fedpm_dnn.foof.batched" in graph  # the walk found the rooms
    assert "fedpm_dnn.foof" in graph["fedpm_dnn.algorithms.localnewton"]  # and reads what a module imports
    assert layer_problems(graph, ROOMS) == []


def _write(root, rel, text):
    path = os.path.join(root, *rel.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def test_the_rule_finds_an_upward_import_and_a_circle_even_inside_a_function(tmp_path):
    """A copy of the rule's inputs in miniature: the preconditioner reaching up into an engine from inside a function,
    and two methods importing each other, are each reported; the same tree without them is clean."""
    pkg = tmp_path / "fedpm_dnn"
    _write(pkg, "__init__.py", "")
    _write(pkg, "foof/__init__.py", "from . import precision\n")
    _write(pkg, "foof/precision.py", "")
    _write(pkg, "engine/__init__.py", "")
    _write(pkg, "engine/vectorized.py", "from ..foof import precision\n")
    _write(pkg, "algorithms/__init__.py", "")
    _write(pkg, "algorithms/fedpm.py", "from .. import foof\n")
    _write(pkg, "algorithms/fedpm_wire.py", "import fedpm_dnn.foof.precision\n")
    assert layer_problems(import_graph(str(pkg), "fedpm_dnn"), ROOMS) == []

    _write(pkg, "foof/batched.py", "def f():\n    from fedpm_dnn.engine.vectorized import X\n")
    _write(pkg, "algorithms/fedpm.py", "from .. import foof\nfrom . import fedpm_wire\n")
    _write(pkg, "algorithms/fedpm_wire.py", "def g():\n    from .fedpm import block_sizes\n")
    problems = layer_problems(import_graph(str(pkg), "fedpm_dnn"), ROOMS)
    assert problems[0] == "fedpm_dnn.foof.batched (rank 1) imports fedpm_dnn.engine.vectorized (rank 4)"
    assert len(problems) == 2 and problems[1].startswith("import circle: ")
    assert {"fedpm_dnn.algorithms.fedpm", "fedpm_dnn.algorithms.fedpm_wire"} <= set(problems[1][15:].split(" -> "))

    _write(pkg, "helpers.py", "")  # a new top-level module must be placed in the table
    with pytest.raises(AssertionError, match="fedpm_dnn.helpers is in no room"):
        layer_problems(import_graph(str(pkg), "fedpm_dnn"), ROOMS)


pytest.importorskip("torch")
from fedpm_dnn._deprecated_paths import MOVED  # noqa: E402


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_moved_module_with_a_warning_naming_the_new_one(old, monkeypatch):
    new = MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} has moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_from_an_old_path_import_a_name_still_works_and_warns(monkeypatch):
    from fedpm_dnn.engine.sequential import ClientData as moved

    monkeypatch.delitem(sys.modules, "fedpm_dnn.client", raising=False)
    with pytest.warns(DeprecationWarning, match="fedpm_dnn.engine.sequential"):
        from fedpm_dnn.client import ClientData
    assert ClientData is moved
    with pytest.raises(ModuleNotFoundError):  # a name that never was a module stays unknown
        importlib.import_module("fedpm_dnn.clients")


PROJECT_CODE = ("fedconvex", "fedpm_dnn", "fedpm_flower", "validation", "figures", "tests", "benchmarks", "examples")
OLD_NAMES = sorted((m.split(".", 1)[1] for m in MOVED), key=len, reverse=True)
OLD = re.compile(r"\bfedpm_dnn[./](" + "|".join(OLD_NAMES) + r")\b")


def test_no_file_of_the_project_imports_or_names_an_old_path():
    """Every import in the project's code (ast, function-local ones included) and every module path in the docs uses
    the new paths: the deprecated ones are for users' code only."""
    modules = {}
    for top in PROJECT_CODE:
        if os.path.isdir(os.path.join(ROOT, top)):
            modules.update(modules_of(os.path.join(ROOT, top), top))
    modules.update({m: None for m in MOVED})  # so that ``from fedpm_dnn import client`` resolves to the old module
    found = []
    for name, where in modules.items():
        if where is None or os.path.abspath(where[0]) == os.path.abspath(__file__):
            continue
        if not name.startswith("fedpm_dnn"):  # elsewhere only an absolute import can name the package
            with open(where[0], encoding="utf-8") as fh:
                if "fedpm_dnn" not in fh.read():
                    continue
        used = imports_of(name, where[0], where[1], modules, "fedpm_dnn") & set(MOVED)
        found += [f"{os.path.relpath(where[0], ROOT)} imports {old}" for old in sorted(used)]
    docs = [os.path.join(ROOT, "README.md")] + [
        os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
    ]
    for path in docs:
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                found += [f"{os.path.relpath(path, ROOT)}:{i} names {m.group(0)}" for m in OLD.finditer(line)]
    assert found == []
