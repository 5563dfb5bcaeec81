"""FedNL (Safaryan et al. 2022, Algorithm 1), as the paper runs it in Test 1.

Clients keep Hessian estimates H_i (H_i^0 = grad^2 f_i(x^0)).  Each round client i sends
grad f_i(x^k), S_i = C(grad^2 f_i(x^k) - H_i^k) and (option 'shift') l_i = ||H_i^k - grad^2 f_i(x^k)||_F,
then H_i^{k+1} = H_i^k + alpha S_i.  The server steps with the estimate learned *before* x^k:

    option 'none'    : x^{k+1} = x^k - lr [H^k]^{-1} grad f(x^k)
    option 'project' : x^{k+1} = x^k - lr [H^k]_mu^{-1} grad f(x^k)   (eigenvalues clipped at mu)
    option 'shift'   : x^{k+1} = x^k - lr [H^k + l^k I]^{-1} grad f(x^k)

and H^{k+1} = H^k + alpha sum_i w_i S_i.  With the identity compressor and alpha = 1 this is
Newton's method with a one-round-stale Hessian (FedPM with K = 1 uses the fresh one).
With client sampling only participants update their H_i, and the server adds only their
weighted corrections, so H stays sum_i w_i H_i.  The initial H_i^0 upload is not counted.

paper symbol -> field: alpha (Hessian learning rate) -> alpha, mu -> mu (default lam), C -> compressor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..mixing import simple_mix
from .base import Algorithm, RoundInfo, State, start_stack
from .compressors import make_compressor
from .grids import SECOND_ORDER_LR


@dataclass(frozen=True)
class FedNL(Algorithm):
    name: ClassVar[str] = "fednl"
    label: ClassVar[str] = "FedNL"
    search_space: ClassVar[dict] = {"lr": SECOND_ORDER_LR}

    lr: float = 1.0
    alpha: float = 1.0
    compressor: str = "identity"
    k: int | None = None          # TopK / RandK entries
    rank: int | None = None       # Rank-R
    option: str = "none"          # 'none' | 'project' | 'shift'
    mu: float | None = None       # projection floor; default the problem's lam

    def __post_init__(self):
        if self.option not in ("none", "project", "shift"):
            raise ValueError(f"FedNL option must be none, project or shift, got {self.option!r}")
        make_compressor(self.compressor, self.k, self.rank)  # validate early

    def init(self, problem, theta0) -> State:
        xp = problem.xp
        H0 = problem.hessians(start_stack(problem, theta0, problem.n_clients)).dense()
        Hbar = xp.tensordot(problem.client_weights, H0, axes=1)
        return State(theta=theta0, server={"H": Hbar}, clients={"H": H0})

    def client_update(self, problem, down, cstate, sel, rng):
        xp = problem.xp
        thetas = start_stack(problem, down["theta"], len(sel))
        g = problem.gradients(thetas, sel)
        # grad^2 f_i(x^k) - H_i^k, scattered straight into a copy of -H_i (no dense Hessian stack)
        diff = problem.hessians(thetas, sel).plus_dense(-cstate["H"])
        comp = make_compressor(self.compressor, self.k, self.rank)
        msg = comp.encode(xp, diff, rng)
        S = comp.decode(xp, msg, problem.d)
        up = {"grad": g, **msg}
        if self.option == "shift":
            up["l"] = xp.sqrt(xp.einsum("nij,nij->n", diff, diff))
        return up, {"H": cstate["H"] + self.alpha * S}

    def server_update(self, problem, state, up, info: RoundInfo) -> State:
        xp = problem.xp
        g = simple_mix(up["grad"], info.weights)
        H = state.server["H"]
        if self.option == "project":
            mu = problem.lam if self.mu is None else self.mu
            lam, V = xp.linalg.eigh(H)
            Hs = (V * xp.maximum(lam, mu)[None, :]) @ V.T
        elif self.option == "shift":
            Hs = H + simple_mix(up["l"], info.weights) * xp.eye(H.shape[0], dtype=H.dtype)
        else:
            Hs = H
        Hs = 0.5 * (Hs + Hs.T)
        theta = state.theta - self.lr * xp.linalg.solve(Hs, g[:, None])[:, 0]
        # H^{k+1} = H^k + alpha sum_{i in S} w_i S_i with the problem's (unnormalised) weights
        w = problem.client_weights[xp.asarray(info.sel)]
        S = make_compressor(self.compressor, self.k, self.rank).decode(xp, up, problem.d)
        H_new = H + self.alpha * xp.tensordot(w, S, axes=1)
        return State(theta=theta, server={"H": 0.5 * (H_new + H_new.T)}, clients=state.clients,
                     round=state.round + 1)
