"""FedNS (Li et al. 2024): Newton sketch of the client Hessians.

Client i forms A_i = diag(sqrt(s_j / M_i)) X_i with s_j = sigma(m_j)(1 - sigma(m_j)), so
A_i^T A_i is the loss part of its Hessian, draws a Gaussian sketch S_i (k x M_i, entries
N(0, 1/k)) and sends S_i A_i and grad f_i.  When k >= M_i a sketch cannot compress, so the
client sends A_i itself (S_i = I, exact).  Server:
    H = sum_i w_i (S_i A_i)^T (S_i A_i) + lam I,   theta <- theta - lr H^{-1} g.
Sketch size k = d in the paper's Test 1 (``sketch_size=None``).

paper symbol -> field: k -> sketch_size, eta -> lr.  S_i A_i is sent on the client's
active features only (the other columns of A_i are zero) together with their indices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..blocks import ActiveBlocks
from ..mixing import simple_mix
from .base import Algorithm, RoundInfo, State, start_stack
from .grids import SECOND_ORDER_LR


@dataclass(frozen=True)
class FedNS(Algorithm):
    name: ClassVar[str] = "fedns"
    label: ClassVar[str] = "FedNS"
    search_space: ClassVar[dict] = {"lr": SECOND_ORDER_LR}

    lr: float = 1.0
    sketch_size: int | None = None
    sketch: str = "gaussian"  # 'gaussian' or 'identity' (S = I, exact)

    def client_update(self, problem, down, cstate, sel, rng):
        xp = problem.xp
        thetas = start_stack(problem, down["theta"], len(sel))
        g = problem.gradients(thetas, sel)
        k = problem.d if self.sketch_size is None else self.sketch_size
        sketches = []
        for c in sel:
            m = int(problem.counts[c])
            if self.sketch == "identity" or k >= m:
                sketches.append(None)  # S = I: exact
            else:
                # drawn as S^T (M x k), the layout the sparse product consumes without a copy;
                # these draws dominate FedNS's cost (w8a: 15M normals, ~0.18 s a round here)
                St = rng.standard_normal((m, k))
                St *= 1.0 / np.sqrt(k)
                sketches.append(St if problem.xp is np else problem.to_backend(St))
        # (S_i A_i)^T on the client's active features: what the client sends (and its indices)
        SAt = problem.sketched_roots(thetas, sketches, sel)
        return {"grad": g, "SAt": SAt, "active": tuple(problem.active[c] for c in sel)}, cstate

    def server_update(self, problem, state, up, info: RoundInfo) -> State:
        xp = problem.xp
        g = simple_mix(up["grad"], info.weights)
        blocks = ActiveBlocks(tuple(R @ R.T for R in up["SAt"]), up["active"], problem.d, problem.lam)
        H = blocks.weighted_sum(info.weights)
        H = 0.5 * (H + H.T)
        theta = state.theta - self.lr * xp.linalg.solve(H, g[:, None])[:, 0]
        return State(theta=theta, server=state.server, clients=state.clients, round=state.round + 1)
