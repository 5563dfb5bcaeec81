"""The DNN problem object of the round driver: the model, its FOOF blocks, the clients' data, and the
engine that trains a round's participants (what ``client_update`` runs on).

Engines (``task.train(alg, down, states, sel) -> [(reply, mean loss)]`` in the order of ``sel``):
  sequential  one client after the other on the shared model (``sequential.client_round``), the reference;
  vectorized  the participants stacked on a leading client axis (``vectorized.VectorizedEngine``),
              the same models client by client.
Each client's random stream derives from (seed, round, client) (``client_generator``), so a client
running in its own process (a Flower SuperNode) draws exactly what it draws here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from .. import foof
from ..data.augment import normalize
from . import step_graph as step_graph_module
from .sequential import _load, client_round


def client_generator(seed: int, round_: int, client: int) -> torch.Generator:
    """The random stream of one client in one round (data order, augmentation, FOOF subsets)."""
    mixed = np.random.SeedSequence([seed, round_, client]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) & (2**63 - 1))


def _sequential(task, alg, down, states, sel):
    return [
        client_round(
            alg,
            task.model,
            task.blocks,
            task.clients[i],
            cs,
            down,
            client_generator(task.seed, task.round, int(i)),
            task.loss_fn,
        )
        for i, cs in zip(sel, states, strict=False)
    ]


def _vectorized(task, alg, down, states, sel):
    if task.engine_state is None:
        from .vectorized import VectorizedEngine

        task.engine_state = VectorizedEngine(
            task.model, task.blocks, task.clients, task.device, task.client_chunk, task.step_graph
        )
    out = task.engine_state.round(
        alg, sel, states, down, [client_generator(task.seed, task.round, int(i)) for i in sel]
    )
    task.last_chunk = task.engine_state.last_chunk
    task.executed = getattr(task.engine_state, "executed", None)
    return out


ENGINES = {"sequential": _sequential, "vectorized": _vectorized}


class DnnTask:
    """``round`` is the round being played (the transport sets it; it seeds the clients' streams)."""

    def __init__(
        self,
        model,
        clients: list,
        device="cpu",
        seed: int = 0,
        engine: str = "sequential",
        client_chunk: int | None = None,
        loss_fn=F.cross_entropy,
        step_graph: str = "auto",
    ):
        if engine not in ENGINES:
            raise ValueError(f"engine must be {' or '.join(ENGINES)}, got {engine!r}")
        self.step_graph = step_graph_module.check(step_graph)  # vectorized: full steps as one graph (step_graph)
        self.loss_fn = loss_fn  # loss_fn(outputs, targets); the vectorized engine trains with cross-entropy
        self.model, self.blocks, self.clients = model, foof.foof_blocks(model), clients
        self.device, self.seed, self.engine, self.client_chunk = device, seed, engine, client_chunk
        self.n_clients = len(clients)
        self.sizes = np.array([len(c) for c in clients], dtype=np.float64)
        self.round = 1
        self.lr_schedule = None  # fedpm_dnn.engine.lr_schedule.LrSchedule: the local learning rate's factor per round
        self.engine_state = None
        self.executed = None  # the vectorized engine's record of what its rounds used (VectorizedEngine.executed)
        self.last_chunk = None

    def train(self, alg, down: dict, states: list, sel) -> list:
        if (
            self.lr_schedule is not None
        ):  # the round's local rate (fedpm_dnn.engine.lr_schedule); 1.0 leaves alg as it is
            factor = self.lr_schedule.factor(self.round)
            if factor != 1.0:
                alg = dataclasses.replace(alg, lr=alg.lr * factor)
        return ENGINES[self.engine](self, alg, down, states, sel)

    def initial_params(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    @torch.no_grad()
    def accuracy(self, params: dict, x, y, mean, std, batch: int = 1000) -> float:
        """Test accuracy of the global model ``params``."""
        _load(self.model, params)
        self.model.eval()
        correct = 0
        for s in range(0, len(x), batch):
            correct += int((self.model(normalize(x[s : s + batch], mean, std)).argmax(1) == y[s : s + batch]).sum())
        self.model.train()
        return correct / max(len(x), 1)
