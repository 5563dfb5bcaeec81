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
replay overwrites them).  Where capture is not possible, or the first replay disagrees with the eager solves,
the caller falls back to the eager solves for that round (``capture`` returns None), says so once and records why.
"""

from __future__ import annotations

import os
import warnings

import torch

from .. import foof

ENV = "FEDPM_CUDA_GRAPHS"  # "0" turns the graphs off (benchmarks compare both)


def enabled(device) -> bool:
    return str(device).startswith("cuda") and os.environ.get(ENV, "1") != "0"


def capture_graph(fn, device, warmup: int = 0):
    """(graph, fn's outputs): ``fn`` captured as a CUDA graph, after ``warmup`` eager calls on a side stream.

    ``torch.cuda.graph``'s ``__exit__`` ends the capture before it restores the stream, so a capture that fails at
    its end would leave every later kernel on the capture stream; here the stream context is this function's own
    and is left however the capture ends."""
    prev = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(prev)
    with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS workspaces, allocator pool
        for _ in range(warmup):
            fn()
    prev.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(prev)
    try:
        with torch.cuda.stream(side):
            graph.capture_begin()
            try:
                out = fn()
            finally:
                graph.capture_end()  # raises where the capture failed
    finally:
        prev.wait_stream(side)
    return graph, out


CHECK_RTOL = 1e-4  # the first replay's directions against the eager solves' (float32 round-off: 1e-6 measured)
fallbacks: list = []  # why a capture of this process was given up (each run's summary records them)


class GraphedDirections:
    """inputs[name] (K, rows, cols) -> outputs[name] = inputs[name] (A + lam I)^{-1} for every block.

    Its first replay is checked against the eager solves on the same (generated) inputs; a disagreement is a
    failed capture.  ``graph_factory(fn, device, warmup)`` makes the graph (tests inject one)."""

    def __init__(self, factors: dict, shapes: dict, dtype, device, graph_factory=None):
        self.inputs = {b: torch.zeros(shape, dtype=dtype, device=device) for b, shape in shapes.items()}
        self._factors = factors
        self.graph, self.outputs = (graph_factory or capture_graph)(self._solve, device, 2)
        self._check()

    def _solve(self) -> dict:
        return {b: foof.direction(T, self._factors[b]) for b, T in self.inputs.items()}

    def _check(self) -> None:
        g = torch.Generator().manual_seed(0)
        for T in self.inputs.values():
            T.copy_(torch.randn(T.shape, generator=g))
        got = {b: v.clone() for b, v in self.replay().items()}
        for b, want in self._solve().items():
            rel = float((got[b] - want).norm() / want.norm().clamp_min(1e-30))
            if not rel <= CHECK_RTOL:
                raise RuntimeError(f"its first replay differs from the eager solves ({rel:.1e} in block {b})")
        for T in self.inputs.values():
            T.zero_()

    def replay(self) -> dict:
        self.graph.replay()
        return self.outputs


def capture(factors: dict, shapes: dict, dtype, device, graph_factory=None):
    """A GraphedDirections, or None (said once per process, recorded in ``fallbacks``) where capture fails."""
    try:
        return GraphedDirections(factors, shapes, dtype, device, graph_factory)
    except Exception as exc:  # capture is an optimisation: any failure means the eager solves
        why = f"CUDA graph capture of the FOOF solves failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        if why not in fallbacks:
            fallbacks.append(why)
            warnings.warn(f"{why}; using eager solves (set {ENV}=0 to skip the attempt)", RuntimeWarning, stacklevel=2)
        return None
