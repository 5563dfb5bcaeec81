"""DNN method configurations (paper Test 2): one frozen dataclass, one field per hyper-parameter.

paper symbol / table column -> field:
  learning rate -> lr, grad. clip -> clip (None = no clipping), weight decay -> weight_decay,
  FedProx mu -> mu, FedAvgM momentum -> momentum, damping term -> damping, server LR -> server_lr.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

METHODS = ("fedavg", "fedavgm", "fedprox", "scaffold", "fedadam", "localnewton", "fedpm")
FOOF_METHODS = ("localnewton", "fedpm")


@dataclass(frozen=True)
class MethodConfig:
    name: str
    lr: float = 0.1
    clip: float | None = None
    weight_decay: float = 1e-4
    mu: float = 0.0                 # FedProx proximal coefficient
    momentum: float = 0.9           # FedAvgM server momentum
    server_lr: float = 1.0          # FedAdam server learning rate (FedAvgM: 1.0)
    damping: float = 1.0            # FOOF damping lambda, the same in local steps and mixing
    beta1: float = 0.9              # FedAdam (paper appendix: fixed)
    beta2: float = 0.99
    tau: float = 1e-3
    local_epochs: int = 5
    batch_size: int = 64
    foof_samples: int | None = None  # None = the client's whole local dataset (paper)
    refresh_every: int | None = None # recompute FOOF matrices every s local steps (None: once per round)
    weighting: str = "uniform"       # mixing weights: uniform 1/N (paper) or 'samples'
    precond_dtype: str = "float32"   # dtype FOOF matrices travel in (float16 halves the bytes)
    # Where the clip acts.  'update' (default): on the preconditioned step eta (A+lam I)^{-1} G, over all
    # blocks together -- the only reading under which the appendix's choice of damping 1e-4 with clip 1.0
    # for LocalNewton is stable ((A+lam I)^{-1} amplifies near-dead ReLU inputs by up to 1/lam).
    # 'gradient': on the raw gradient before preconditioning.  Identical for first-order methods.
    clip_stage: str = "update"
    # Weight decay: 'coupled' (default) adds wd * theta to the gradient before preconditioning and
    # clipping, as torch.optim.SGD(weight_decay=...) does; 'decoupled' shrinks theta by lr * wd after the step.
    weight_decay_mode: str = "coupled"
    # how FedPM's matrices travel: 'none' (as precond_dtype says) or a codec of fedconvex.codecs
    # (sym, fp16, bf16, lowrank:R, delta:identity|topk:K|rankr:R), see fedpm_dnn/wire.py
    precond_codec: str = "none"

    def __post_init__(self):
        if self.name not in METHODS:
            raise ValueError(f"unknown method {self.name!r}; choose from {', '.join(METHODS)}")
        for field in ("lr", "batch_size", "local_epochs"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0 or None, got {self.clip}")
        if self.damping < 0 or self.weight_decay < 0 or self.mu < 0:
            raise ValueError("damping, weight_decay and mu must be >= 0")
        if self.weighting not in ("uniform", "samples"):
            raise ValueError(f"weighting must be uniform or samples, got {self.weighting!r}")
        if self.clip_stage not in ("gradient", "update"):
            raise ValueError(f"clip_stage must be gradient or update, got {self.clip_stage!r}")
        if self.weight_decay_mode not in ("coupled", "decoupled"):
            raise ValueError(f"weight_decay_mode must be coupled or decoupled, got {self.weight_decay_mode!r}")
        if self.precond_dtype not in ("float32", "float16"):
            raise ValueError(f"precond_dtype must be float32 or float16, got {self.precond_dtype!r}")
        from fedconvex.codecs import validate

        validate(self.precond_codec)
        if self.precond_codec != "none" and self.precond_dtype != "float32":
            raise ValueError("precond_dtype float16 and a precond_codec exclude each other (use the codec fp16)")

    @property
    def uses_foof(self) -> bool:
        return self.name in FOOF_METHODS

    def with_(self, **kw) -> "MethodConfig":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})
