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

from .. import foof
from ..data.augment import normalize, random_crop_flip, standardize, to_unit
from ..foof import precision


def batch_starts_end(n: int, batch_size: int, last_batch: str) -> int:
    """Where an epoch's batch starts stop: the whole ``n`` ('keep', or a client smaller than one batch, which
    trains on what it has), else the end of the last full batch ('drop')."""
    return n if last_batch == "keep" or n < batch_size else n - n % batch_size


def epoch_batches(n: int, batch_size: int, last_batch: str) -> int:
    """The local steps of one epoch over ``n`` samples."""
    return -(-batch_starts_end(n, batch_size, last_batch) // batch_size)


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

    def train_batches(self, batch_size: int, generator, last_batch: str = "keep"):
        """One epoch of (inputs, labels) minibatches in a random order drawn from ``generator``; with
        ``last_batch`` 'drop', only the full ones (``epoch_batches``)."""
        n = len(self)
        order = torch.randperm(n, generator=generator).to(self.x.device)
        for s in range(0, batch_starts_end(n, batch_size, last_batch), batch_size):
            yield self.batch(order[s : s + batch_size], generator)

    def stats_batches(self, samples, generator):
        """(the inputs FOOF statistics are taken over, whether they are the same every call): all the data
        un-augmented, or ``samples`` random samples of it."""
        n = len(self)
        if samples is None or samples >= n:
            return self.plain_batches(torch.arange(n, device=self.x.device)), True
        return self.plain_batches(torch.randperm(n, generator=generator)[:samples].to(self.x.device)), False


def loader_generators(loader) -> list:
    """The torch generators a DataLoader draws its order from, other than the global one: its own
    (``DataLoader(generator=g)``) and its samplers' (``RandomSampler(generator=g)``), each once."""
    found = []
    for holder in (
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        g = getattr(holder, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


class LoaderData:
    """A client whose data is any iterable of (inputs, targets, ...) batches, e.g. a ``torch.utils.data.DataLoader``
    over any dataset: training takes its batches as it makes them (its batch size, order and transforms; the
    method's ``batch_size`` does not apply), FOOF statistics its inputs (the first ``samples`` of an epoch with a
    sample limit).  Before each pass the global torch generator, and the generators of the loader's own
    (``DataLoader(generator=g)``, a sampler's ``generator``), are seeded from the client's stream (seed, round,
    client), so that a shuffling loader, dropout and random transforms repeat in a resumed run.  Randomness kept
    elsewhere (a sampler drawing from NumPy, a dataset's own state) is the caller's to make repeatable."""

    def __init__(self, loader, device="cpu"):
        self.loader, self.device = loader, device
        try:
            self.n = len(loader.dataset)
        except (AttributeError, TypeError):  # no sized dataset: count one pass
            self.n = sum(batch_length(_targets(b)) for b in loader)
        if self.n < 1:
            raise ValueError("a client's DataLoader holds no samples")

    def __len__(self):
        return self.n

    def _batches(self, generator):
        seed = int(torch.randint(2**62, (1,), generator=generator))
        torch.manual_seed(seed)
        for g in loader_generators(self.loader):  # a loader's own generator draws its order, not the global one
            g.manual_seed(seed)
        for batch in self.loader:
            yield _to(batch[0], self.device), _to(_targets(batch), self.device)

    def train_batches(self, batch_size: int, generator, last_batch: str = "keep"):
        """The loader's batches; with ``last_batch`` 'drop', a batch smaller than the loader's ``batch_size``
        (its last partial one) is passed over, unless the loader holds less than one batch."""
        size = getattr(self.loader, "batch_size", None)
        if last_batch == "keep" or size is None or self.n < size:
            return self._batches(generator)
        return ((x, y) for x, y in self._batches(generator) if batch_length(y) >= size)

    def stats_batches(self, samples, generator):
        def inputs():
            left = self.n if samples is None else samples
            for x, _ in self._batches(generator):
                if left <= 0:
                    return
                yield x[:left]
                left -= batch_length(x)

        return inputs(), False


def _targets(batch):
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError("a client's DataLoader must yield (inputs, targets) batches")
    return batch[1]


def _to(x, device):
    return x.to(device) if torch.is_tensor(x) else x


def batch_length(y) -> int:
    """Samples in a batch's targets (or inputs)."""
    return int(y.shape[0]) if hasattr(y, "shape") else len(y)


def foof_matrices(model, blocks, data, samples, generator, static: dict | None = None):
    """FOOF matrices on the client's data (all of it, or ``samples`` random samples).

    With all the data, ``static`` (kept per client) caches the first layer's matrix, which
    depends on the data alone; data that change between calls (random subsets, a loader's
    transforms) cache nothing."""
    batches, fixed = data.stats_batches(samples, generator)
    return foof.compute_foof(model, blocks, batches, static if fixed else None)


def client_round(alg, model, blocks, data, cs: dict, down: dict, gen, loss_fn=F.cross_entropy):
    """One client's round on the sequential engine, shared by the in-process simulator and the Flower
    ClientApp: load the global model, train locally, and build the reply.  ``cs`` is the client's
    persistent state (FOOF matrices and first-layer cache, the method's own entries), updated in place.
    FOOF's products in the method's ``foof_precision`` (fedpm_dnn.foof.precision)."""
    with precision.use(getattr(alg, "foof_precision", "fp32")):
        return _client_round(alg, model, blocks, data, cs, down, gen, loss_fn)


def _client_round(alg, model, blocks, data, cs, down, gen, loss_fn):
    _load(model, down["params"])
    if "foof_digest" in cs and "foof" not in cs:  # a vectorized engine's compact checkpoint (engine.checkpoint)
        raise ValueError("this client state stands in for FOOF matrices the vectorized engine remakes: resume it there")
    if alg.uses_foof and "foof" not in cs:  # first participation: matrices at the received model
        mats = foof_matrices(model, blocks, data, alg.foof_samples, gen, cs.setdefault("foof_static", {}))
        cs["foof"] = getattr(alg, "kept_foof", dict)(mats)  # foof_state_dtype (LocalNewton and its kin)
    loss, steps, _ = local_train(
        model,
        alg,
        data,
        gen,
        hook=alg.grad_hook(down, cs),
        foof_A=cs.get("foof"),
        blocks=blocks,
        foof_static=cs.get("foof_static"),
        loss_fn=loss_fn,
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


def local_train(
    model,
    cfg,
    data,
    generator,
    *,
    hook=None,
    foof_A=None,
    blocks=None,
    foof_static=None,
    loss_fn=F.cross_entropy,
):
    """Train ``model`` in place with the method ``cfg``'s settings on ``data`` (a ``ClientData`` or
    ``LoaderData``); returns (mean training loss, number of steps, seconds).  ``hook(name, p, g)``: the
    method's gradient correction (``grad_hook``); ``loss_fn(outputs, targets)``: the loss."""
    start = time.perf_counter()
    params = [p for p in model.parameters()]
    named = dict(model.named_parameters())
    dtype = params[0].dtype
    apply = None
    if cfg.uses_foof:  # the steps one factor serves decide 'auto' (foof.resolve_apply)
        steps = cfg.local_epochs * epoch_batches(len(data), cfg.batch_size, cfg.last_batch)
        apply = foof.resolve_apply(cfg.foof_apply, params[0].device, blocks, min(steps, cfg.refresh_every or steps))
    factors = foof.prepare(foof_A, cfg.damping, dtype, apply) if cfg.uses_foof else None
    total_loss, steps, seen = 0.0, 0, 0
    for _ in range(cfg.local_epochs):
        for x, y in data.train_batches(cfg.batch_size, generator, cfg.last_batch):
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
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
            total_loss += float(loss.detach()) * batch_length(y)
            seen += batch_length(y)
            if cfg.uses_foof and cfg.refresh_every and steps % cfg.refresh_every == 0:
                foof_A = foof_matrices(model, blocks, data, cfg.foof_samples, generator, foof_static)
                factors = foof.prepare(foof_A, cfg.damping, dtype, apply)
    if model.training and params[0].is_cuda:
        torch.cuda.synchronize()
    return total_loss / max(seen, 1), steps, time.perf_counter() - start
