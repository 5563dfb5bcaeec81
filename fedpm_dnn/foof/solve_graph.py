"""The FOOF step directions of every block as one CUDA graph (vectorized engine, CUDA only).

On a GPU the vectorized engine is launch-bound: a SimpleCNN step of 10 stacked clients keeps the
device busy for about a third of the time the host spends issuing it.  ``torch.linalg.solve_triangular``
is the costliest call to issue (measured on an H200: ~185 us of host time a call against ~7 us for a
plain kernel; it builds cuBLAS pointer arrays and launches several kernels), and FedPM makes two per
block per step.  Captured once per round into a graph, the ten calls become one replay of the eager
path's kernels in their order (on an H200 the replies agree with eager solves to 1e-6, the CUDA test's
tolerance).

The graph reads the round's factors in place (a refresh writes new factors into the same tensors) and
the gradients from its own input buffers, which the step fills with one ``cat(..., out=)`` per block,
as the eager path builds its right-hand sides; the directions land in the graph's output buffers, which
the step uses as views (its update and clipping read them on the same stream before the next step's
replay overwrites them).  Where capture is not possible the caller falls back to the eager solves
(``capture`` returns None) and says so once.
"""

from __future__ import annotations

import os
import warnings

import torch

from .. import foof

ENV = "FEDPM_CUDA_GRAPHS"  # "0" turns the graphs off (benchmarks compare both)
_warned = []


def enabled(device) -> bool:
    return str(device).startswith("cuda") and os.environ.get(ENV, "1") != "0"


class GraphedDirections:
    """inputs[name] (K, rows, cols) -> outputs[name] = inputs[name] (A + lam I)^{-1} for every block."""

    def __init__(self, factors: dict, shapes: dict, dtype, device):
        self.inputs = {b: torch.zeros(shape, dtype=dtype, device=device) for b, shape in shapes.items()}
        self._factors = factors
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS workspaces, allocator pool
            for _ in range(2):
                self._solve()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self._solve()

    def _solve(self) -> dict:
        return {b: foof.direction(T, self._factors[b]) for b, T in self.inputs.items()}

    def replay(self) -> dict:
        self.graph.replay()
        return self.outputs


def capture(factors: dict, shapes: dict, dtype, device):
    """A GraphedDirections, or None (with one warning per process) where capture fails."""
    try:
        return GraphedDirections(factors, shapes, dtype, device)
    except Exception as exc:  # capture is an optimisation: any failure means the eager solves
        if not _warned:
            _warned.append(exc)
            warnings.warn(
                f"CUDA graph capture of the FOOF solves failed ({type(exc).__name__}: {exc}); "
                f"using eager solves (set {ENV}=0 to skip the attempt)",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
