"""Client-side local training shared by every DNN method.

One loop of minibatch SGD over the client's data for ``local_epochs`` epochs; methods differ
only in how the gradient is corrected before the step (the method's ``grad_hook``):
  FedProx  g += mu (theta - theta_global)
  SCAFFOLD g += c - c_i
  all      g += weight_decay * theta            (weight_decay_mode 'coupled', the default)
  FOOF     g_block <- (A + lam I)^{-1} g_block for every Linear / Conv2d block (LocalNewton, FedPM), by two
           triangular solves or one product with the inverse formed once per refresh (``foof_apply``)
  all      clip the global norm of the step direction (clip_stage 'update', the default: after the
           preconditioner; 'gradient': before it), then theta -= lr * direction
  all      theta -= lr * weight_decay * theta   (weight_decay_mode 'decoupled' only)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import foof
from .augment import normalize, random_crop_flip, standardize, to_unit


@dataclass
class ClientData:
    x: torch.Tensor  # uint8 (n, C, H, W) on the device
    y: torch.Tensor  # int64 (n,)
    mean: tuple
    std: tuple
    augment: bool = True

    def __len__(self):
        return self.x.shape[0]

    def batch(self, idx, generator):
        x = to_unit(self.x[idx])
        if self.augment:  # crop the raw image (zero padding = black), then standardise
            x = random_crop_flip(x, generator)
        return standardize(x, self.mean, self.std), self.y[idx]

    def plain_batches(self, idx, batch_size=512):
        """Un-augmented normalised inputs (for FOOF statistics and evaluation)."""
        for s in range(0, len(idx), batch_size):
            yield normalize(self.x[idx[s : s + batch_size]], self.mean, self.std)


def foof_matrices(model, blocks, data: ClientData, samples, generator, static: dict | None = None):
    """FOOF matrices on the client's data (all of it, or ``samples`` random samples).

    With all the data, ``static`` (kept per client) caches the first layer's matrix, which
    depends on the data alone; random subsets change every call, so nothing is cached then."""
    n = len(data)
    if samples is None or samples >= n:
        idx = torch.arange(n, device=data.x.device)
    else:
        idx = torch.randperm(n, generator=generator)[:samples].to(data.x.device)
        static = None
    return foof.compute_foof(model, blocks, data.plain_batches(idx), static)


def client_round(alg, model, blocks, data, cs: dict, down: dict, gen):
    """One client's round on the sequential engine, shared by the in-process simulator and the Flower
    ClientApp: load the global model, train locally, and build the reply.  ``cs`` is the client's
    persistent state (FOOF matrices and first-layer cache, the method's own entries), updated in place."""
    _load(model, down["params"])
    if alg.uses_foof and "foof" not in cs:  # first participation: matrices at the received model
        cs["foof"] = foof_matrices(model, blocks, data, alg.foof_samples, gen, cs.setdefault("foof_static", {}))
    loss, steps, _ = local_train(
        model,
        alg,
        data,
        gen,
        hook=alg.grad_hook(down, cs),
        foof_A=cs.get("foof"),
        blocks=blocks,
        foof_static=cs.get("foof_static"),
    )
    local = {k: v.detach().clone() for k, v in model.named_parameters()}
    end = (
        foof_matrices(model, blocks, data, alg.foof_samples, gen, cs.setdefault("foof_static", {}))
        if alg.uses_foof
        else None
    )
    return alg.client_reply(cs, local, steps, down, end), loss


def _load(model, params):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def local_train(model, cfg, data: ClientData, generator, *, hook=None, foof_A=None, blocks=None, foof_static=None):
    """Train ``model`` in place with the method ``cfg``'s settings; returns (mean training loss, number
    of steps, seconds).  ``hook(name, p, g)``: the method's gradient correction (``grad_hook``)."""
    start = time.perf_counter()
    params = [p for p in model.parameters()]
    named = dict(model.named_parameters())
    dtype = params[0].dtype
    apply = None
    if cfg.uses_foof:  # the steps one factor serves decide 'auto' (foof.resolve_apply)
        steps = cfg.local_epochs * -(-len(data) // cfg.batch_size)
        apply = foof.resolve_apply(cfg.foof_apply, data.x.device, blocks, min(steps, cfg.refresh_every or steps))
    factors = foof.prepare(foof_A, cfg.damping, dtype, apply) if cfg.uses_foof else None
    total_loss, steps, seen = 0.0, 0, 0
    n = len(data)
    for _ in range(cfg.local_epochs):
        order = torch.randperm(n, generator=generator).to(data.x.device)
        for s in range(0, n, cfg.batch_size):
            idx = order[s : s + cfg.batch_size]
            x, y = data.batch(idx, generator)
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            with torch.no_grad():
                for name, p in named.items():
                    if p.grad is None:
                        continue
                    if hook is not None:
                        hook(name, p, p.grad)
                    if cfg.weight_decay and cfg.weight_decay_mode == "coupled":
                        p.grad.add_(p, alpha=cfg.weight_decay)
                if cfg.clip is not None and cfg.clip_stage == "gradient":
                    torch.nn.utils.clip_grad_norm_(params, cfg.clip)
                if factors is not None:
                    foof.precondition_grads(model, blocks, factors)
                if cfg.clip is not None and cfg.clip_stage == "update":
                    torch.nn.utils.clip_grad_norm_(params, cfg.clip)  # bounds the step: lr * clip
                decay = cfg.lr * cfg.weight_decay if cfg.weight_decay_mode == "decoupled" else 0.0
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-cfg.lr)
                        if decay:
                            p.mul_(1.0 - decay)
            steps += 1
            total_loss += float(loss.detach()) * len(idx)
            seen += len(idx)
            if cfg.uses_foof and cfg.refresh_every and steps % cfg.refresh_every == 0:
                foof_A = foof_matrices(model, blocks, data, cfg.foof_samples, generator, foof_static)
                factors = foof.prepare(foof_A, cfg.damping, dtype, apply)
    if model.training and data.x.is_cuda:
        torch.cuda.synchronize()
    return total_loss / max(seen, 1), steps, time.perf_counter() - start
