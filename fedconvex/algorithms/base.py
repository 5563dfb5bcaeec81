"""The algorithm protocol: a frozen dataclass of hyper-parameters with pure methods.

One round, as ``fedconvex.driver`` drives it for every front-end::

    down        = alg.broadcast(state)                                  # same for every client
    up, cstate  = alg.client_update(problem, down, cstate_sel, sel, rng) # stacked over participants
    state       = alg.server_update(problem, state_with_cstate, up, info)

``up`` and ``down`` are dicts of arrays (or structured stacks with ``nbytes``); the run
loop counts their bytes, so an algorithm's communication is exactly what it returns.
Per-client persistent state (SCAFFOLD's control variates, FedNL's Hessian estimates) lives
in ``State.clients`` with a leading client axis; the loop gathers and scatters the rows of
the participants.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from ..hyperparams import check_hyperparameters


@dataclass(frozen=True)
class State:
    theta: Any  # global parameters (d,)
    server: dict = field(default_factory=dict)  # server-only state (optimizer moments, ...)
    clients: dict = field(default_factory=dict)  # per-client state, arrays with leading axis N
    round: int = 0


@dataclass(frozen=True)
class RoundInfo:
    sel: np.ndarray  # participating client ids (host)
    weights: Any  # their mixing weights (backend), normalised to sum to one
    n_clients: int  # N, for participation fractions


@dataclass(frozen=True)
class Algorithm:
    """Base class: subclasses set ``name``/``label`` and implement the three steps."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    # hyper-parameters the tuner searches: field name -> candidate values (lr grid first)
    search_space: ClassVar[dict] = {}
    # the reply's declaration: field -> 'model' (the client's parameters: norm-checked by the magnitude
    # guard), 'update' (a step or gradient the server applies: norm-checked too), 'psd' (preconditioners:
    # PSD-checked and trace-checked) or 'data' (finite-checked only).
    # Screening, byte counting and Flower's encoding follow from it (fedconvex.driver).  Integer fields
    # name their range, which a transport that receives replies from outside (Flower) checks before
    # anything indexes with them: 'features' (0..d-1) or 'entries' (0..d(d+1)/2-1, upper-triangle entries).
    message_fields: ClassVar[dict] = {"theta": "model", "P": "psd"}

    # per-client state the server's own state sums (SCAFFOLD's c_i, FedNL's H_i): it advances only in a
    # round whose reply the server used (fedconvex.driver), else client and server drift apart for good
    server_tracked_state: ClassVar[tuple] = ()
    # hyper-parameters fixed by the method's definition (PSGD: one local step): a command line's shared
    # setting of them does not apply, and make_algorithm refuses any other value
    fixed: ClassVar[dict] = {}
    # a narrower range for a field than fedconvex.hyperparams.RANGES gives every method (field -> Range)
    ranges: ClassVar[dict] = {}

    lr: float = 1.0

    def __post_init__(self):
        check_hyperparameters(self)  # every field's type and range, one place (subclasses call this first)

    def init(self, problem, theta0) -> State:
        return State(theta=theta0)

    def broadcast(self, state: State) -> dict:
        return {"theta": state.theta}

    def client_update(self, problem, down: dict, cstate: dict, sel, rng):
        raise NotImplementedError

    def server_update(self, problem, state: State, up: dict, info: RoundInfo) -> State:
        raise NotImplementedError

    def hyperparameters(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    def with_params(self, **kw) -> Algorithm:
        return replace(self, **kw)


def start_stack(problem, theta, n):
    """Every participant starts its local steps from the broadcast model."""
    xp = problem.xp
    return xp.broadcast_to(theta[None, :], (n, theta.shape[0])) * 1.0
