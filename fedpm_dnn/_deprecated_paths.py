"""The module paths fedpm_dnn had before its subpackages, kept for one release.

``import fedpm_dnn.client`` (or ``from fedpm_dnn.client import ClientData``) still works and warns with a
``DeprecationWarning`` that names the new path.  The old name is the moved module itself, not a copy: what is set on
one (a test's monkeypatch, a benchmark's timer) is set on the other.  A finder on ``sys.meta_path`` answers for the
old names only, so the package's folders hold no shim files and nothing inside the project can import one by
accident (tests/test_package_layout.py checks that no project file uses an old path).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "fedpm_dnn.batched_foof": "fedpm_dnn.foof.batched",
    "fedpm_dnn.precision": "fedpm_dnn.foof.precision",
    "fedpm_dnn.foof_cost": "fedpm_dnn.foof.cost",
    "fedpm_dnn.solve_graph": "fedpm_dnn.foof.solve_graph",
    "fedpm_dnn.optim": "fedpm_dnn.foof.optimizer",
    "fedpm_dnn.client": "fedpm_dnn.engine.sequential",
    "fedpm_dnn.vectorized": "fedpm_dnn.engine.vectorized",
    "fedpm_dnn.stacked": "fedpm_dnn.engine.stacked_model",
    "fedpm_dnn.run_stack": "fedpm_dnn.engine.stacked_runs",
    "fedpm_dnn.step_graph": "fedpm_dnn.engine.step_graph",
    "fedpm_dnn.simulation": "fedpm_dnn.engine.simulation",
    "fedpm_dnn.task": "fedpm_dnn.engine.training_task",
    "fedpm_dnn.schedule": "fedpm_dnn.engine.lr_schedule",
    "fedpm_dnn.checkpoint": "fedpm_dnn.engine.checkpoint",
    "fedpm_dnn.transport": "fedpm_dnn.engine.transport",
    "fedpm_dnn.augment": "fedpm_dnn.data.augment",
    "fedpm_dnn.wire": "fedpm_dnn.algorithms.fedpm_wire",
    "fedpm_dnn.names": "fedpm_dnn.method_names",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new path (imported there first), after a warning."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        # stacklevel 2: the import statement that named the old path (the import machinery's frames are skipped)
        warnings.warn(
            f"{spec.name} has moved to {self.new}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module):
        pass  # the module ran when it was imported at its new path


class _OldPaths(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        return importlib.util.spec_from_loader(fullname, _Alias(new)) if new else None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), so a stale file left at an old path is never imported."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
