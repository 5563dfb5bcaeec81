"""The DNN round loop: all clients in one process on one device, checkpoint every round.

Per round it records test accuracy of the global model, mean train loss, client compute
seconds (local training + FOOF statistics), server seconds, bytes up/down per participating
client (from the tensors in the messages) and peak memory.  ``resume=True`` continues a
killed run from its last checkpoint to the identical result: the checkpoint holds the model,
server and client states and the client-sampling generator (each client's stream derives from seed,
round and client, see client_generator).
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import checkpoint as _ck
from . import foof
from .augment import normalize
from .client import ClientData, foof_matrices, local_train
from .methods import MethodConfig
from .models import make_model
from .server import aggregate, init_server_state
from .wire import acknowledge, commit, decode_replies, encode_foof
from fedconvex.screening import screen

HISTORY_COLUMNS = ("round", "test_acc", "train_loss", "client_seconds", "server_seconds", "bytes_up", "bytes_down",
                   "peak_memory_mb", "wall_seconds", "rejected")


@dataclass
class Experiment:
    cfg: MethodConfig
    model: str
    num_classes: int
    clients: list                 # ClientData per client
    x_test: torch.Tensor          # uint8 on the device
    y_test: torch.Tensor
    mean: tuple
    std: tuple
    rounds: int = 100
    participants: int | None = None
    seed: int = 0
    device: str = "cpu"
    in_channels: int = 3
    image_size: int = 32
    meta: dict = field(default_factory=dict)
    engine: str = "sequential"    # or "vectorized": the participants trained together (fedpm_dnn.vectorized)
    max_ratio: float | None = None    # server magnitude guard (fedconvex.screening); None: off, as in the paper
    client_chunk: int | None = None   # vectorized: clients per chunk (None: from the free device memory)


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    return 0


@torch.no_grad()
def evaluate(model, x, y, mean, std, batch=1000) -> float:
    model.eval()
    correct = 0
    for s in range(0, len(x), batch):
        correct += int((model(normalize(x[s:s + batch], mean, std)).argmax(1) == y[s:s + batch]).sum())
    model.train()
    return correct / max(len(x), 1)


def _reset_peak_memory(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 to clear_refs resets this process's peak RSS (VmHWM)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _peak_memory_mb(device) -> float:
    """Peak memory of the round: CUDA allocator peak, or on CPU the process's peak RSS since the
    round started (where the OS cannot reset it, since the process started)."""
    if str(device).startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def client_generator(seed: int, round_: int, client: int) -> torch.Generator:
    """The random stream of one client in one round (data order, augmentation, FOOF subsets).

    Derived from (seed, round, client) rather than shared, so a client running in its own process
    (a Flower SuperNode) draws exactly what it draws in this simulator."""
    mixed = np.random.SeedSequence([seed, round_, client]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) & (2 ** 63 - 1))


def client_round(cfg, model, blocks, data, cs: dict, params: dict, control, gen):
    """One client's round, shared by this simulator and the Flower ClientApp: load the global
    model, train locally, and build the reply.  ``cs`` is the client's persistent state
    (FOOF matrices and first-layer cache, SCAFFOLD control), updated in place."""
    _load(model, params)
    if cfg.uses_foof and "foof" not in cs:   # first participation: matrices at the received model
        cs["foof"] = foof_matrices(model, blocks, data, cfg.foof_samples, gen, cs.setdefault("foof_static", {}))
    if cfg.name == "scaffold" and "control" not in cs:
        cs["control"] = {k: torch.zeros_like(v) for k, v in params.items()}
    loss, steps, _ = local_train(model, cfg, data, gen, global_params=params, control=control,
                                 client_control=cs.get("control"), foof_A=cs.get("foof"), blocks=blocks,
                                 foof_static=cs.get("foof_static"))
    local = {k: v.detach().clone() for k, v in model.named_parameters()}
    end = foof_matrices(model, blocks, data, cfg.foof_samples, gen, cs.setdefault("foof_static", {})) \
        if cfg.uses_foof else None
    return finish_reply(cfg, cs, local, steps, params, control, end), loss


def finish_reply(cfg, cs: dict, local: dict, steps: int, params: dict, control, end_foof):
    """The reply of a client that trained to ``local`` in ``steps`` steps (both engines build it here);
    ``end_foof``: its FOOF matrices at the end of the round (FOOF methods)."""
    reply = {"params": local}
    if cfg.uses_foof:   # matrices at the end of the round: mixing now, local steps next round
        cs["foof"] = end_foof
        if cfg.name == "fedpm" and cfg.precond_codec != "none":
            reply["foof"] = encode_foof(cfg, cs, cs["foof"])
        elif cfg.name == "fedpm":
            wire = torch.float16 if cfg.precond_dtype == "float16" else torch.float32
            reply["foof"] = {k: v.to(wire) for k, v in cs["foof"].items()}
    if cfg.name == "scaffold":
        new_c = {k: cs["control"][k] - control[k] + (params[k] - local[k]) / (steps * cfg.lr) for k in local}
        reply["dcontrol"] = {k: new_c[k] - cs["control"][k] for k in local}
        cs["control"] = new_c
    return reply


def _load(model, params):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def reply_shapes(cfg, params: dict, blocks: dict) -> dict:
    """What a usable reply of this method looks like (for fedconvex.screening)."""
    shapes = {"params": {k: tuple(v.shape) for k, v in params.items()}}
    if cfg.name == "fedpm":
        shapes["foof"] = {}
        for name, b in blocks.items():
            d = b.module.weight[0].numel() + (1 if b.has_bias else 0)
            shapes["foof"][name] = (d, d)
    if cfg.name == "scaffold":
        shapes["dcontrol"] = dict(shapes["params"])
    return shapes


def screen_replies(cfg, replies, sel, shapes, round_, n_clients=None, max_ratio=None):
    """Usable replies (others rejected and logged); raises when every client diverged.
    ``max_ratio``: the server's magnitude guard (fedconvex.screening; None = off)."""
    kept, rejected = screen(replies, sel, shapes, {"foof"} if cfg.name == "fedpm" else (), round_,
                            n_clients=n_clients, max_ratio=max_ratio)
    if not kept and rejected and all("NaN or Inf" in r for _, r in rejected):
        raise ArithmeticError(f"{cfg.name} diverged at round {round_} (lr={cfg.lr:g}): every client returned "
                              "non-finite parameters")
    return kept, rejected


def screen_decoded(cfg, state, replies, sel, shapes, round_, n_clients=None, max_ratio=None):
    """Decode FedPM's compressed matrices (if any), then screen: (kept, rejected, state, replies)."""
    if cfg.name != "fedpm" or cfg.precond_codec == "none":
        return (*screen_replies(cfg, replies, sel, shapes, round_, n_clients, max_ratio), state, replies)
    replies, bad, state, pending = decode_replies(cfg, state, replies, sel, shapes, round_)
    ok = [k for k, r in enumerate(replies) if r is not None]
    kept, rejected = screen_replies(cfg, [replies[k] for k in ok], np.asarray(sel)[ok], shapes, round_, n_clients,
                                    max_ratio)
    kept = [ok[k] for k in kept]
    state = commit(state, pending, np.asarray(sel)[kept])   # delta: only accepted replies move A_hat
    return kept, bad + rejected, state, replies


def run_experiment(exp: Experiment, checkpoint: str | None = None, resume: bool = False, on_round=None,
                   tamper=None):
    """Run (or resume) the experiment; returns the list of per-round history rows.

    Replies are screened before aggregation (wrong shape, NaN/Inf, non-PSD FOOF matrix: the
    client is rejected with a logged reason, the others' weights renormalised; with none left
    the round is skipped and the model kept).  ``tamper(round, client, reply) -> reply``
    injects faults for tests."""
    cfg, dev = exp.cfg, exp.device
    torch.manual_seed(exp.seed)
    model = make_model(exp.model, exp.num_classes, exp.in_channels, exp.image_size).to(dev)
    blocks = foof.foof_blocks(model)
    n = len(exp.clients)
    sizes = np.array([len(c) for c in exp.clients], dtype=np.float64)
    rng = np.random.default_rng(exp.seed)
    state = init_server_state(cfg, dict(model.named_parameters()))
    shapes = reply_shapes(cfg, state["params"], blocks)
    client_state = [dict() for _ in range(n)]
    history = []
    fp = _ck.fingerprint(exp) if checkpoint else None
    if resume and checkpoint and os.path.isfile(checkpoint):
        ck = _ck.load(checkpoint, map_location=dev)   # weights_only: a checkpoint never runs code
        diff = _ck.first_difference(ck["fingerprint"], fp)
        if diff:
            raise ValueError(f"{checkpoint}: written by a different configuration ({diff}); remove it or drop --resume")
        _ck.check_structure(checkpoint, ck, state, n)
        state, client_state, history = ck["server"], ck["clients"], ck["history"]
        try:
            rng.bit_generator.state = ck["np_rng"]
        except (TypeError, ValueError, KeyError) as exc:
            raise _ck.CheckpointError(f"{checkpoint}: damaged checkpoint (random generator state: {exc}); "
                                      "remove it or choose another --out") from None
    if exp.engine not in ("sequential", "vectorized"):
        raise ValueError(f"engine must be sequential or vectorized, got {exp.engine!r}")
    engine = None
    wall0 = time.perf_counter() - (history[-1]["wall_seconds"] if history else 0.0)
    for t in range(len(history) + 1, exp.rounds + 1):
        _reset_peak_memory(dev)
        k = exp.participants or n
        sel = np.sort(rng.choice(n, k, replace=False)) if k < n else np.arange(n)
        replies, client_seconds, losses = [], 0.0, []
        down = {"params": state["params"], **({"control": state["control"]} if cfg.name == "scaffold" else {})}
        if exp.engine == "vectorized":
            start = time.perf_counter()
            if engine is None:
                from .vectorized import VectorizedEngine
                engine = VectorizedEngine(model, blocks, exp.clients, dev, exp.client_chunk)
            out = engine.round(cfg, sel, [client_state[i] for i in sel], state["params"], state.get("control"),
                               [client_generator(exp.seed, t, int(i)) for i in sel])
            exp.meta["client_chunk"] = engine.last_chunk
            if str(dev).startswith("cuda"):
                torch.cuda.synchronize(dev)
            client_seconds = time.perf_counter() - start
            for i, (reply, loss) in zip(sel, out):
                losses.append(loss)
                replies.append(tamper(t, int(i), reply) if tamper is not None else reply)
        for i in (sel if exp.engine == "sequential" else ()):
            start = time.perf_counter()
            reply, loss = client_round(cfg, model, blocks, exp.clients[i], client_state[i], state["params"],
                                       state.get("control"), client_generator(exp.seed, t, int(i)))
            if str(dev).startswith("cuda"):
                torch.cuda.synchronize(dev)
            client_seconds += time.perf_counter() - start
            losses.append(loss)
            replies.append(tamper(t, int(i), reply) if tamper is not None else reply)
        start = time.perf_counter()
        up_bytes = sum(tensor_bytes(r) for r in replies) // len(replies)   # as sent (before decoding)
        kept, rejected, state, replies = screen_decoded(cfg, state, replies, sel, shapes, t, n_clients=n,
                                                        max_ratio=exp.max_ratio)
        acknowledge(cfg, state, client_state, sel)   # delta codec: what the server now holds (fedpm_dnn.wire)
        if kept:
            w = sizes[sel[kept]] if cfg.weighting == "samples" else np.ones(len(kept))
            weights = torch.as_tensor(w / w.sum(), dtype=torch.float32, device=dev)
            state = aggregate(cfg, state, [replies[k] for k in kept], weights, n, blocks)
        else:
            state = {**state, "round": state["round"] + 1}
        if str(dev).startswith("cuda"):
            torch.cuda.synchronize(dev)
        server_seconds = time.perf_counter() - start
        if not all(bool(torch.isfinite(p).all()) for p in state["params"].values()):
            raise ArithmeticError(f"{cfg.name} diverged at round {t} (lr={cfg.lr:g}): parameters are not finite")
        _load(model, state["params"])
        acc = evaluate(model, exp.x_test, exp.y_test, exp.mean, exp.std)
        prev = history[-1] if history else {"bytes_up": 0, "bytes_down": 0}
        row = {"round": t, "test_acc": acc, "train_loss": float(np.average(losses, weights=sizes[sel])),
               "client_seconds": client_seconds, "server_seconds": server_seconds,
               "bytes_up": prev["bytes_up"] + up_bytes,
               "bytes_down": prev["bytes_down"] + tensor_bytes(down),
               "peak_memory_mb": _peak_memory_mb(dev), "wall_seconds": time.perf_counter() - wall0,
               "rejected": len(rejected)}
        history.append(row)
        if checkpoint:
            _ck.save(checkpoint, {"format": _ck.FORMAT, "fingerprint": fp, "config": asdict(cfg), "seed": exp.seed,
                                  "n_clients": n, "server": state, "clients": client_state, "history": history,
                                  "np_rng": rng.bit_generator.state})
        if on_round:
            on_round(row, history)
    return history
