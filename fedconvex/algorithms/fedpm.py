"""FedPM (Ishii et al., AAAI 2026): local Newton steps + *preconditioned* mixing.

Client (eq. fedpm_multi): theta_i^{(t,0)} = theta^{(t)};  for k < K:
    P_i^{(t,k)} = grad^2 f_i(theta_i^{(t,k)}),
    theta_i^{(t,k+1)} = theta_i^{(t,k)} - eta (P_i^{(t,k)})^{-1} grad f_i(theta_i^{(t,k)});
sends theta_i^{(t,K)} and P_i^{(t,K-1)}.
Server: theta^{(t+1)} = (sum_i w_i P_i)^{-1} sum_i w_i P_i theta_i   (precond_mix), w_i = 1/N.
With K = 1 this is exactly one global Newton step theta - eta P^{-1} g.

paper symbol -> field: eta -> lr, K -> local_steps, w_i -> problem.client_weights.
precond_codec (default 'none'): how the preconditioners travel (fedconvex.codecs, fedconvex.precond_wire).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import precond_wire
from ..codecs import validate as validate_codec
from ..mixing import precond_mix
from .base import start_stack
from .localnewton import LocalNewton


@dataclass(frozen=True)
class FedPM(LocalNewton):
    name: ClassVar[str] = "fedpm"
    label: ClassVar[str] = "FedPM"

    precond_codec: str = "none"

    def __post_init__(self):
        super().__post_init__()
        validate_codec(self.precond_codec)

    def init(self, problem, theta0):
        return precond_wire.init_state(self, problem, super().init(problem, theta0))

    def client_update(self, problem, down, cstate, sel, rng):
        if self.precond_codec == "none":
            return super().client_update(problem, down, cstate, sel, rng)
        return precond_wire.client_update(
            self, problem, down, cstate, sel, start_stack(problem, down["theta"], len(sel))
        )

    def receive(self, problem, state, up, info):
        """Server side, before screening: decode the preconditioner payloads (codec 'none': nothing to do)."""
        if self.precond_codec == "none":
            return up, state
        return precond_wire.receive(self, problem, state, up, info)

    def server_update(self, problem, state, up, info):
        # the delta codec's estimates advance only for the clients kept after screening (info.sel)
        return super().server_update(problem, precond_wire.commit(self, state, info), up, info)

    def message(self, thetas, P) -> dict:
        return {"theta": thetas, "P": P}

    def mix(self, up, weights):
        # Test 1 adds no damping (Hessians are positive definite, paper appendix); the damping
        # of the FOOF variant is applied inside precond_mix on both sides.
        return precond_mix(up["P"], up["theta"], weights)
