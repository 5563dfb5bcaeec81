"""LocalNewton-FOOF (Gupta et al. 2021, with FOOF curvature, Benzing 2022): local steps preconditioned
per Linear / Conv2d block, simple mixing at the server.

Client: Theta <- Theta - lr (A + lam I)^{-1} G_Theta per block (``fedpm_dnn.foof``); A = E[a a^T] of
the block's input over the client's data, computed at the end of each round (and once at the start of
the first), optionally every ``refresh_every`` local steps.  Server: theta = mix_i(theta_i).

paper symbol -> field: lam (damping term) -> damping; FOOF samples -> foof_samples (None: all local data);
how (A + lam I)^{-1} is applied each step -> foof_apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedconvex.mixing import simple_mix

from .. import foof
from ..foof import DEFAULT_DAMPING, precision
from .base import DnnAlgorithm, State, mixing_weights

STATE_DTYPES = {"float64": torch.float64, "float32": torch.float32}  # foof_state_dtype


@dataclass(frozen=True)
class LocalNewton(DnnAlgorithm):
    name: ClassVar[str] = "localnewton"
    label: ClassVar[str] = "LocalNewton"
    uses_foof: ClassVar[bool] = True

    damping: float = DEFAULT_DAMPING  # FOOF damping lambda, the same in local steps and mixing
    foof_samples: int | None = None  # None = the client's whole local dataset (paper)
    refresh_every: int | None = None  # recompute the matrices every s local steps (None: once per round)
    # how a local step applies (A + lam I)^{-1}: 'solve' (two triangular solves with the Cholesky factor),
    # 'inverse' (one product with the inverse formed once per refresh, as the paper's cost table counts) or
    # 'auto' (fedpm_dnn.foof.resolve_apply's measured rule); the results agree within float32 round-off
    foof_apply: str = "solve"
    # the arithmetic of the apply's product and the statistics Gram (fedpm_dnn.foof.precision): 'fp32' (plain float32),
    # 'split-tf32' (tensor cores at float32's accuracy), 'tf32' / 'bf16' (opt-in approximations)
    foof_precision: str = "fp32"
    # the dtype of the FOOF matrices a client keeps between rounds: 'float64' (as accumulated), or 'float32' (half
    # the memory; opt-in: the next round's factorisation, still in float64, then starts from A rounded to float32,
    # which changes results at float32 round-off)
    foof_state_dtype: str = "float64"

    def __post_init__(self):
        super().__post_init__()  # types and ranges (fedconvex.hyperparams), damping >= 0 among them
        if self.foof_apply not in foof.APPLIES:
            raise ValueError(f"foof_apply must be {' or '.join(foof.APPLIES)}, got {self.foof_apply!r}")
        precision.check(self.foof_precision)
        if self.foof_state_dtype not in STATE_DTYPES:
            raise ValueError(f"foof_state_dtype must be float64 or float32, got {self.foof_state_dtype!r}")

    def kept_foof(self, mats: dict) -> dict:
        """The FOOF matrices ``mats`` as a client keeps them between rounds (``foof_state_dtype``)."""
        dtype = STATE_DTYPES[self.foof_state_dtype]
        return {k: v.to(dtype) for k, v in mats.items()}

    def finish_reply(self, cs, local, steps, down, end_foof):
        cs["foof"] = self.kept_foof(end_foof)  # matrices at the end of the round: mixing now, local steps next round
        return {"params": local}

    def mix(self, task, params: dict, up: dict, w) -> dict:
        return {k: simple_mix(up["params"][k], w) for k in params}

    def server_update(self, task, state: State, up, info) -> State:
        w = mixing_weights(info, next(iter(state.theta.values())))
        return State(
            theta=self.mix(task, state.theta, up, w), server=state.server, clients=state.clients, round=state.round + 1
        )
