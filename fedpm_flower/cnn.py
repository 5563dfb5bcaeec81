"""The CNN (FOOF) on Flower: a SuperNode runs fedpm_dnn's ``client_round`` -- the very function the
in-process simulator's sequential engine runs -- on its partition, keeping its FOOF matrices in the
node's state; the ServerApp screens the replies and applies the method's ``server_update``
(``fedpm_dnn.transport.server_step``; FedPM: precond_mix per block).
Data: the seeded synthetic task (every process rebuilds the same partitions)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from types import SimpleNamespace

from fedpm_dnn import foof
from fedpm_dnn.algorithms import applicable, make_method
from fedpm_dnn.client import ClientData, client_round
from fedpm_dnn.data.synthetic import MEAN, STD, synthetic_task
from fedpm_dnn.models import make_model
from fedpm_dnn.task import client_generator
from fedpm_dnn.transport import server_step

log = logging.getLogger("fedpm.server")
CLASSES, IMAGE = 3, 16
_CACHE = {}


def method_config(cfg):
    """The fedpm_dnn method object for the run's settings (those the method takes)."""
    from fedconvex.codecs import parse

    codec = parse(cfg.precond_codec)
    if codec is not None and codec.stateful:
        raise ValueError(f"precond codec {cfg.precond_codec!r}: the delta codecs are simulator-only (per-node estimates)")
    settings = dict(lr=cfg.lr, local_epochs=cfg.local_steps, batch_size=16, damping=1.0, clip=1.0, weight_decay=1e-4,
                    precond_dtype="float16" if cfg.precond_dtype == "float16" else "float32",
                    precond_codec=cfg.precond_codec)
    return make_method(cfg.method, **applicable(cfg.method, settings))


def task(cfg):
    key = ("task", cfg.clients, cfg.seed)
    if key not in _CACHE:
        _CACHE[key] = synthetic_task(cfg.clients, seed=cfg.seed, classes=CLASSES, image_size=IMAGE)
    return _CACHE[key]


def new_model(seed):
    torch.manual_seed(seed)
    model = make_model("cnn", CLASSES, image_size=IMAGE)
    return model, foof.foof_blocks(model)


def client_data(cfg, partition):
    x, y = task(cfg)[0][partition]
    return ClientData(torch.as_tensor(x), torch.as_tensor(y), MEAN, STD)


def client_train(cfg, partition: int, params: dict, round_: int, state: dict) -> tuple[dict, float]:
    """``state`` (name -> numpy array) is the node's persistent FOOF state, updated in place."""
    model, blocks = _CACHE.setdefault(("model", cfg.seed), new_model(cfg.seed))
    cs = {}
    for key in ("foof", "foof_static"):
        entries = {k.split("/", 1)[1]: torch.as_tensor(v) for k, v in state.items() if k.startswith(key + "/")}
        if entries:
            cs[key] = entries
    received = {k.split("/", 1)[1]: torch.as_tensor(v) for k, v in params.items() if k.startswith("params/")}
    reply, loss = client_round(method_config(cfg), model, blocks, client_data(cfg, partition), cs,
                               {"params": received}, client_generator(cfg.seed, round_, partition))
    state.clear()
    for key in ("foof", "foof_static"):
        for k, v in cs.get(key, {}).items():
            state[f"{key}/{k}"] = v.numpy()
    out = {f"params/{k}": v.numpy() for k, v in reply["params"].items()}
    for k, v in reply.get("foof", {}).items():   # a matrix, or a codec's payload (dict of arrays)
        out.update({f"foof/{k}/{f}": a.numpy() for f, a in v.items()} if isinstance(v, dict) else {f"foof/{k}": v.numpy()})
    return out, loss


def unflatten(arrays: dict) -> dict:
    reply = {}
    for k, v in arrays.items():
        group, name = k.split("/", 1)
        reply.setdefault(group, {})[name] = torch.as_tensor(v)
    return reply


def regroup_payloads(reply: dict) -> dict:
    """foof entries 'block/field' -> {block: {field: array}} (a codec's payloads)."""
    if "foof" in reply:
        grouped = {}
        for k, v in reply["foof"].items():
            block, _, field = k.rpartition("/")
            grouped.setdefault(block, {})[field] = v
        reply["foof"] = grouped
    return reply


class CnnServer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.mcfg = method_config(cfg)
        model, blocks = new_model(cfg.seed)   # the same initial model as the in-process simulator
        self.task = SimpleNamespace(blocks=blocks, n_clients=cfg.clients)   # what the server step sees
        self.state = self.mcfg.init(self.task, {k: v.detach().clone() for k, v in model.named_parameters()})

    @property
    def theta(self) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in self.state.theta.values()]).numpy().astype(np.float64)

    def broadcast(self) -> dict:
        return {f"params/{k}": v.detach().numpy() for k, v in self.state.theta.items()}

    def step(self, replies: dict, round_: int) -> dict:
        parts = sorted(replies)
        encoded = getattr(self.mcfg, "precond_codec", "none") != "none"   # payloads, not matrices
        unpacked = [regroup_payloads(unflatten(replies[p])) if encoded else unflatten(replies[p]) for p in parts]
        try:
            self.state, used, rejected = server_step(self.mcfg, self.task, self.state, unpacked, parts, round_,
                                                     max_ratio=self.cfg.max_ratio or None)
        except ArithmeticError as exc:
            log.warning("round %d: %s; round skipped", round_, exc)
            return {"used": 0, "rejected": len(parts)}
        return {"used": used, "rejected": rejected}


def in_process(cfg) -> np.ndarray:
    """The same method and data in fedpm_dnn's in-process simulator: final parameters, flattened."""
    import os
    import tempfile

    from fedpm_dnn.simulation import Experiment, run_experiment

    parts, (xt, yt) = task(cfg)
    clients = [ClientData(torch.as_tensor(x), torch.as_tensor(y), MEAN, STD) for x, y in parts]
    exp = Experiment(cfg=method_config(cfg), model="cnn", num_classes=CLASSES, clients=clients,
                     x_test=torch.as_tensor(xt), y_test=torch.as_tensor(yt), mean=MEAN, std=STD, rounds=cfg.rounds,
                     seed=cfg.seed, image_size=IMAGE)
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(tmp, "ck.pt")
        run_experiment(exp, checkpoint=ck)
        params = torch.load(ck, weights_only=True)["server"]["params"]
    return torch.cat([p.detach().reshape(-1) for p in params.values()]).numpy().astype(np.float64)
