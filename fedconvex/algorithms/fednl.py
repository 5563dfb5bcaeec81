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

Representation: on NumPy problems that pack their Hessians the H_i live on the clients' active blocks
(fednl_blocks.py: every update stays there, and a round costs what the blocks cost); on other backends
they are dense (N, d, d) stacks.  Both send the same messages, except that the identity compressor sends
the difference on the active block (and its feature indices) instead of a d x d matrix.

paper symbol -> field: alpha (Hessian learning rate) -> alpha, mu -> mu (default lam), C -> compressor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..backend import namespace
from ..hyperparams import POSITIVE
from ..mixing import simple_mix
from . import fednl_blocks
from .base import Algorithm, RoundInfo, State, start_stack
from .compressors import Identity, RankR, make_compressor
from .fednl_blocks import BlockState
from .grids import SECOND_ORDER_LR

# the compressors' index fields address upper-triangle entries (fedconvex.algorithms.compressors); the
# identity compressor on the active blocks (fednl_blocks) sends each block with its feature indices
COMPRESSED = {"index": "entries", "start": "entries", "active": "features"}


def _support(problem, sel):
    """Each client's active features (host arrays, on every backend): grad^2 f_i - H_i vanishes outside them
    (H_i^0 = grad^2 f_i(x^0) and every compressed update keeps that).  Rank-R on NumPy solves on the small
    block (it checks); Natural draws its uniforms for the block's entries only, as the block path does, so
    the dense path -- NumPy without a Hessian plan, or another backend -- sends the block path's messages."""
    active = getattr(problem, "active_host", None)
    return None if active is None else tuple(active[c] for c in sel)


def _initial_estimates(problem, theta0):
    """H_i^0 = grad^2 f_i(x^0) for every client: on the active blocks (fednl_blocks) where the problem
    packs its Hessians, else as a dense (N, d, d) stack; and the server's sum_i w_i H_i^0."""
    H0 = problem.hessians(start_stack(problem, theta0, problem.n_clients))
    if problem.xp is np and H0.packed is not None:
        return BlockState.of(H0), H0.weighted_sum(problem.client_weights)
    H0 = H0.dense()
    return H0, problem.xp.tensordot(problem.client_weights, H0, axes=1)


def _differences(problem, thetas, sel, H):
    """grad^2 f_i(x) - H_i: packed on the blocks (the lam I parts cancel) or a dense stack."""
    if isinstance(H, BlockState):
        diffs = problem.hessian_differences(thetas, sel, H.packed) if hasattr(problem, "hessian_differences") else None
        if diffs is not None:  # the same numbers as below, without a separate array of Hessians
            return diffs.packed, diffs
        hess = problem.hessians(thetas, sel)
        return hess.packed - H.packed, hess
    hess = problem.hessians(thetas, sel)
    return hess.plus_dense(-H, inplace=True), None  # scattered straight into -H_i (no dense Hessian stack)


def _compress(comp, problem, diff, hess, sel, rng):
    """(message, decoded update S) in the representation of ``diff``."""
    if hess is not None:
        return fednl_blocks.encode(comp, diff, hess.layout, hess.active, problem.d, rng)
    msg = comp.encode(problem.xp, diff, rng, support=_support(problem, sel))
    return msg, comp.decode(problem.xp, msg, problem.d)


def _update_sum(comp, problem, up, w):
    """sum_{i in S} w_i S_i (dense d x d) from the messages."""
    xp = problem.xp
    if xp is np and not (isinstance(comp, Identity) and "S" in up):
        return fednl_blocks.server_sum(comp, up, w, problem.d)
    return xp.tensordot(w, comp.decode(xp, up, problem.d), axes=1)


def _norms(diff, hess):
    """Per client Frobenius norm of the differences."""
    if hess is not None:
        return fednl_blocks.frobenius(diff, hess.layout, hess.active)
    return namespace(diff).sqrt((diff * diff).sum((1, 2)))


def _with(H, new):
    """The estimates ``new`` (packed numbers or a dense stack) in H's representation."""
    return BlockState(new, H.layout, H.active, H.d, H.shift) if isinstance(H, BlockState) else new


def _apply(H, thetas):
    """H_i theta_i for every client."""
    if isinstance(H, BlockState):
        return H.blocks().apply(thetas)
    return namespace(H).einsum("nij,nj->ni", H, thetas)


def _at_least(H, mu):
    """True if every eigenvalue of the symmetric H is >= mu up to round-off (NumPy): one Cholesky of
    H - (mu - tol) I, tol = d eps max|H_ii| (the size of eigh's own errors), instead of an
    eigendecomposition; the projection onto {H >= mu I} then changes H by at most tol."""
    if not isinstance(H, np.ndarray):
        return False
    from scipy.linalg.lapack import dpotrf

    d = H.shape[0]
    tol = d * np.finfo(np.float64).eps * float(np.abs(np.diagonal(H)).max(initial=0.0))
    S = np.array(H, order="F")
    S.flat[:: d + 1] -= mu - tol
    return dpotrf(S, lower=1, clean=0, overwrite_a=1)[1] == 0


def _add_scaled(H, alpha, S):
    """H + alpha S in one pass over a large stack (a new array: the old estimate may be shared)."""
    if alpha == 1.0:
        return H + S
    out = S * alpha
    out += H
    return out


@dataclass(frozen=True)
class FedNL(Algorithm):
    name: ClassVar[str] = "fednl"
    label: ClassVar[str] = "FedNL"
    server_tracked_state: ClassVar[tuple] = ("H",)  # the server's H is sum_i w_i H_i
    search_space: ClassVar[dict] = {"lr": SECOND_ORDER_LR}
    message_fields: ClassVar[dict] = {"grad": "update", **COMPRESSED}  # the gradient the server steps with
    ranges: ClassVar[dict] = {"mu": POSITIVE}  # a projection floor of 0 leaves the Hessian estimate singular

    lr: float = 1.0
    alpha: float = 1.0
    compressor: str = "identity"
    k: int | None = None  # TopK / RandK entries
    rank: int | None = None  # Rank-R
    option: str = "none"  # 'none' | 'project' | 'shift'
    mu: float | None = None  # projection floor; default the problem's lam

    def __post_init__(self):
        super().__post_init__()
        if self.option not in ("none", "project", "shift"):
            raise ValueError(f"FedNL option must be none, project or shift, got {self.option!r}")
        make_compressor(self.compressor, self.k, self.rank)  # validate early

    sends_values: ClassVar[bool] = False  # FedNL-LS: clients also send f_i(x^k)

    def init(self, problem, theta0) -> State:
        H0, Hbar = _initial_estimates(problem, theta0)
        return State(theta=theta0, server={"H": Hbar}, clients={"H": H0})

    def client_update(self, problem, down, cstate, sel, rng):
        thetas = start_stack(problem, down["theta"], len(sel))
        f, g = problem.values_and_gradients(thetas, sel)
        diff, hess = _differences(problem, thetas, sel, cstate["H"])  # grad^2 f_i(x^k) - H_i^k
        comp = make_compressor(self.compressor, self.k, self.rank)
        H = cstate["H"]
        if hess is not None and isinstance(comp, RankR):
            # Rank-R on the blocks forms H + alpha S block by block (the numbers of _add_scaled below)
            msg, H_new = fednl_blocks.encode(
                comp, diff, hess.layout, hess.active, problem.d, rng, base=H.packed, alpha=self.alpha
            )
        else:
            msg, S = _compress(comp, problem, diff, hess, sel, rng)
            H_new = _add_scaled(H.packed if hess is not None else H, self.alpha, S)
        up = {"grad": g, **msg}
        if self.option == "shift":
            up["l"] = _norms(diff, hess)
        if self.sends_values:
            up["f"] = f
        return up, {"H": _with(H, H_new)}

    def server_update(self, problem, state, up, info: RoundInfo) -> State:
        xp = problem.xp
        g = simple_mix(up["grad"], info.weights)
        H = state.server["H"]
        theta, server = self.step(problem, state, g, self.step_matrix(problem, H, up, info), up, info)
        # H^{k+1} = H^k + alpha sum_{i in S} w_i S_i with the problem's (unnormalised) weights
        w = problem.client_weights[xp.asarray(info.sel)]
        H_new = H + self.alpha * _update_sum(make_compressor(self.compressor, self.k, self.rank), problem, up, w)
        return State(
            theta=theta, server={**server, "H": 0.5 * (H_new + H_new.T)}, clients=state.clients, round=state.round + 1
        )

    def step(self, problem, state, g, Hs, up, info):
        """x^{k+1} = x^k - lr Hs^{-1} grad f(x^k); returns it and extra server state."""
        xp = problem.xp
        return state.theta - self.lr * xp.linalg.solve(Hs, g[:, None])[:, 0], {}

    def step_matrix(self, problem, H, up, info):
        xp = problem.xp
        if self.option == "project":
            mu = problem.lam if self.mu is None else self.mu
            if _at_least(H, mu):
                return H  # [H]_mu = H: nothing to clip
            lam, V = xp.linalg.eigh(H)
            Hs = (V * xp.maximum(lam, mu)[None, :]) @ V.T
        elif self.option == "shift":
            Hs = H + simple_mix(up["l"], info.weights) * xp.eye(H.shape[0], dtype=H.dtype)
        else:
            Hs = H
        return 0.5 * (Hs + Hs.T)


@dataclass(frozen=True)
class FedNLLS(FedNL):
    """FedNL-LS (Safaryan et al. 2022, Algorithm 2): FedNL's direction d^k = -[H^k]_mu^{-1} grad f(x^k)
    with a backtracking (Armijo) line search, which makes it a descent method from any start:

        x^{k+1} = x^k + t_k d^k,  t_k = max{lr c^s : f(x^k + lr c^s d^k) <= f(x^k) + gamma lr c^s <grad f(x^k), d^k>}.

    Clients also send f_i(x^k); every backtracking trial costs the server one broadcast of the trial
    point and one number per client (counted in ``state.server['ls_trials']``).  If no trial passes
    within ``max_backtracks`` the model is kept, so f(x^k) never increases.

    paper symbol -> field: c -> c, gamma -> gamma, mu -> mu (default lam); option 'project' by default.
    """

    name: ClassVar[str] = "fednl-ls"
    label: ClassVar[str] = "FedNL-LS"

    sends_values: ClassVar[bool] = True

    option: str = "project"
    c: float = 0.5
    gamma: float = 0.25
    max_backtracks: int = 40

    def step(self, problem, state, g, Hs, up, info):
        xp = problem.xp
        direction = -xp.linalg.solve(Hs, g[:, None])[:, 0]
        f0 = float((info.weights * up["f"]).sum())
        slope = float(g @ direction)
        t, trials, step = self.lr, 0, 0.0
        theta = state.theta
        while trials < self.max_backtracks and slope < 0:
            trials += 1
            trial = state.theta + t * direction
            if problem.value(trial) <= f0 + self.gamma * t * slope:
                theta, step = trial, t
                break
            t *= self.c
        return theta, {"ls_trials": state.server.get("ls_trials", 0) + trials, "ls_step": step}


@dataclass(frozen=True)
class FedNLPP(Algorithm):
    """FedNL-PP (Safaryan et al. 2022, Algorithm 3): FedNL with partial participation.

    Every client i keeps H_i, l_i and g_i = (H_i + l_i I) w_i - grad f_i(w_i) at its last model w_i; the
    server keeps their weighted sums H, l, g and sets x^{k+1} = (H^k + l^k I)^{-1} g^k.  A participant
    (w_i = x^{k+1}) updates H_i += alpha C(grad^2 f_i(w_i) - H_i), l_i = ||H_i - grad^2 f_i(w_i)||_F and
    g_i, and sends C(...), the change of l_i and the change of g_i; the others send nothing and keep
    their state, which the server's sums still hold.  With every client taking part, the identity
    compressor and alpha = 1 it is Newton's method (H_i exact, l_i = 0).

    Rounds line up with the paper's iterations: ``init`` is the paper's initialisation (clients upload
    H_i^0, l_i^0, g_i^0 at x^0), and round t ends with the paper's x^t.  In round 1 the participants
    re-read x^0, where their update is C(0) = 0 and their l_i, g_i are unchanged, so the server's step
    uses the initial sums exactly as the paper's first step x^1 = (H^0 + l^0 I)^{-1} g^0 does (that round
    costs one message per participant which the paper does not send).  With every client taking part
    this is the paper's Algorithm 3 (tests/test_fednl_family.py checks it against a transcription).

    paper symbol -> field: alpha -> alpha, C -> compressor, tau -> the run's ``participants``.  ``lr`` damps
    the model step: x <- x + lr ((H + l I)^{-1} g - x) (paper: lr = 1).
    """

    name: ClassVar[str] = "fednl-pp"
    label: ClassVar[str] = "FedNL-PP"
    server_tracked_state: ClassVar[tuple] = ("H", "l", "g")  # the server's H, l, g are their weighted sums
    search_space: ClassVar[dict] = {"lr": SECOND_ORDER_LR}
    message_fields: ClassVar[dict] = {"dg": "update", **COMPRESSED}

    lr: float = 1.0
    alpha: float = 1.0
    compressor: str = "identity"
    k: int | None = None
    rank: int | None = None

    def __post_init__(self):
        super().__post_init__()
        make_compressor(self.compressor, self.k, self.rank)

    def init(self, problem, theta0) -> State:
        xp, n = problem.xp, problem.n_clients
        thetas = start_stack(problem, theta0, n)
        H0, Hbar = _initial_estimates(problem, theta0)
        l0 = xp.zeros(n, dtype=thetas.dtype)  # H_i^0 = grad^2 f_i(x^0): no error
        g0 = _apply(H0, thetas) - problem.gradients(thetas)
        w = problem.client_weights
        return State(
            theta=theta0,
            server={"H": Hbar, "l": float((w * l0).sum()), "g": w @ g0},
            clients={"H": H0, "l": l0, "g": g0},
        )

    def client_update(self, problem, down, cstate, sel, rng):
        thetas = start_stack(problem, down["theta"], len(sel))
        grad = problem.gradients(thetas, sel)
        diff, hess = _differences(problem, thetas, sel, cstate["H"])  # grad^2 f_i - H_i
        comp = make_compressor(self.compressor, self.k, self.rank)
        msg, S = _compress(comp, problem, diff, hess, sel, rng)
        old = cstate["H"]
        H = _with(old, _add_scaled(old.packed if hess is not None else old, self.alpha, S))
        err = self.alpha * S - diff  # H_i^{new} - grad^2 f_i(w_i)
        shift = _norms(err, hess)  # l_i = ||H_i - grad^2 f_i(w_i)||
        g = _apply(H, thetas) + shift[:, None] * thetas - grad
        return {**msg, "dl": shift - cstate["l"], "dg": g - cstate["g"]}, {"H": H, "l": shift, "g": g}

    def server_update(self, problem, state, up, info: RoundInfo) -> State:
        xp = problem.xp
        w = problem.client_weights[xp.asarray(info.sel)]  # p_i, not renormalised: sums stay sum_i p_i (.)_i
        comp = make_compressor(self.compressor, self.k, self.rank)
        H = state.server["H"] + self.alpha * _update_sum(comp, problem, up, w)
        H = 0.5 * (H + H.T)
        shift = state.server["l"] + float((w * up["dl"]).sum())
        g = state.server["g"] + w @ up["dg"]
        x = xp.linalg.solve(H + shift * xp.eye(problem.d, dtype=H.dtype), g[:, None])[:, 0]
        theta = x if self.lr == 1.0 else state.theta + self.lr * (x - state.theta)
        return State(theta=theta, server={"H": H, "l": shift, "g": g}, clients=state.clients, round=state.round + 1)
