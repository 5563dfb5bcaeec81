"""``FOOF``: the local step of FedPM / LocalNewton-FOOF as a ``torch.optim.Optimizer`` for any model.

Every ``nn.Linear`` and ``nn.Conv2d`` layer is a FOOF block (``fedpm_dnn.foof``): its gradient, written as
G_Theta of shape (d_in (+1 for the bias), d_out), is replaced by (A + lam I)^{-1} G_Theta, where
A = E[a a^T] is the second moment of the layer's input (augmented with a constant 1 when it has a bias),
measured on the client's data by ``update_statistics``.  Every other parameter (LayerNorm, embeddings,
attention's non-Linear parts, ...) takes a plain SGD step.  The order within a step is the one of
``fedpm_dnn.client.local_train``: weight decay added to the gradient, clip (``clip_stage``: 'update' clips
the preconditioned step over all parameters together, 'gradient' the raw gradient), step of size lr.

The damped inverses are formed once per ``update_statistics`` from float64 Cholesky factors
(``foof.damped_inverses``) and applied as one product per block and step.

paper symbol -> argument: eta -> lr, lam -> damping; A_i -> ``matrices()``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from . import foof


def batch_inputs(batch, device=None):
    """The model input of a batch: the batch itself, or the first element of an (inputs, targets, ...)
    tuple or list, moved to ``device``."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return x.to(device) if device is not None and torch.is_tensor(x) else x


class FOOF(torch.optim.Optimizer):
    """FOOF-preconditioned SGD for ``model``'s parameters (see the module docstring).

    model         the network; its Linear / Conv2d layers are found once, here
    lr            step size eta
    damping       lam of (A + lam I); use the same value in ``fedpm_dnn.mix``
    clip          max norm of the step direction (None: no clipping)
    weight_decay  added to the gradient (coupled, as ``torch.optim.SGD``), before preconditioning
    clip_stage    'update' (after the preconditioner, the default) or 'gradient' (before it)
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        damping: float = foof.DEFAULT_DAMPING,
        clip: float | None = None,
        weight_decay: float = 0.0,
        clip_stage: str = "update",
    ):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not damping >= 0:
            raise ValueError(f"damping must be >= 0, got {damping}")
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be > 0 or None, got {clip}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if clip_stage not in ("update", "gradient"):
            raise ValueError(f"clip_stage must be update or gradient, got {clip_stage!r}")
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.model, self.damping, self.clip, self.clip_stage = model, damping, clip, clip_stage
        self.blocks = foof.foof_blocks(model)
        self._matrices: dict | None = None
        self._inverses: dict | None = None

    @torch.no_grad()
    def update_statistics(self, batches: Iterable) -> dict:
        """A = E[a a^T] of every block over ``batches`` (the client's data: a DataLoader, or any iterable of
        input tensors or (inputs, targets) pairs), at the model's current parameters, in float64; then the
        damped inverses for the next steps.  Returns the matrices (as ``matrices()``)."""
        device = next(iter(self.model.parameters())).device
        A = foof.compute_foof(self.model, self.blocks, (batch_inputs(b, device) for b in batches))
        if any(name not in A for name in self.blocks):
            raise ValueError("update_statistics saw no batch: pass the client's data")
        self.set_matrices(A)
        return self.matrices()

    def set_matrices(self, matrices: dict) -> None:
        """Use these FOOF matrices (block name -> (d, d), as ``matrices()`` returns) from now on: a client's
        matrices kept from its previous round, for instance."""
        sides = {name: b.module.weight[0].numel() + int(b.has_bias) for name, b in self.blocks.items()}
        if set(matrices) != set(sides):
            raise ValueError(f"FOOF matrices name blocks {sorted(matrices)}, the model has {sorted(sides)}")
        for name, d in sides.items():
            if tuple(matrices[name].shape) != (d, d):
                raise ValueError(f"FOOF matrix {name!r} has shape {tuple(matrices[name].shape)}, expected {(d, d)}")
        dtype = self.param_groups[0]["params"][0].dtype if self.param_groups[0]["params"] else None
        self._matrices = {k: v.detach().to(torch.float64) for k, v in matrices.items()}
        self._inverses = foof.damped_inverses(self._matrices, self.damping, dtype)

    def matrices(self) -> dict:
        """The FOOF matrices in use (block name -> (d, d) float64): what a FedPM client sends for mixing."""
        if self._matrices is None:
            raise RuntimeError("FOOF has no matrices yet: call update_statistics(batches) first")
        return dict(self._matrices)

    @torch.no_grad()
    def step(self, closure=None):
        """One preconditioned step from the parameters' ``.grad``; ``closure`` (optional) re-evaluates the loss."""
        if self._inverses is None:
            raise RuntimeError("FOOF has no matrices yet: call update_statistics(batches) before step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for group in self.param_groups:
            if group["weight_decay"]:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.add_(p, alpha=group["weight_decay"])
        if self.clip is not None and self.clip_stage == "gradient":
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        # rows (d_out, d) times the symmetric inverse: G_Theta^T (A + lam I)^{-1}
        foof.apply_to_grads(self.blocks, lambda name, T: T @ self._inverses[name])
        if self.clip is not None and self.clip_stage == "update":
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss
