"""``FedPM``: a Flower strategy (``flwr.serverapp.strategy``, Message API) for any PyTorch model, used in a ServerApp
as ``FedAvg`` is: ``FedPM(...).start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=...)``.

Each training reply carries the client's model in an ``ArrayRecord`` (``"arrays"``, as FedAvg's clients send it),
its FOOF matrices in a second one (``"foof"``: block name -> (d, d)) and a ``MetricRecord`` with ``num-examples``;
``fedpm_flower.client.fedpm_fit`` builds exactly that.  The server checks every reply's structure against the
global model (``fedpm_dnn.transport.structure_problem``), screens the stacked replies as the round driver does
(``fedconvex.driver.screen_message``: NaN/Inf, non-PSD matrices, the optional magnitude guard; a rejected client is
logged and left out, the others' weights renormalised; with nobody left the model is kept), and mixes them with
``fedpm_dnn.mixing.mix_blocks`` -- the kernel of the in-process FedPM.  Sampling, configuration and federated
evaluation are FedAvg's.
"""

from __future__ import annotations

from logging import INFO

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedconvex.algorithms.base import RoundInfo
from fedconvex.driver import normalised, screen_message
from fedconvex.screening import log as server_log
from fedpm_dnn.algorithms.base import stack_replies
from fedpm_dnn.algorithms.fedpm import FedPM as _FedPMMethod
from fedpm_dnn.foof import DEFAULT_DAMPING
from fedpm_dnn.mixing import block_entries, mix_blocks
from fedpm_dnn.transport import structure_problem

MATRICES_KEY = "foof"  # the reply's ArrayRecord of FOOF matrices


class FedPM(FedAvg):
    """Federated Preconditioned Mixing (FOOF matrices) as a Flower strategy.

    damping    lam of (A + lam I) in the mixing; sent to the clients in the train config (``"damping"``) so that
               their local steps use the same value (identical clients then give back their own model)
    weighting  'uniform' (the paper's 1/N) or 'samples' (by the replies' ``num-examples``)
    max_ratio  the magnitude guard of ``fedconvex.screening`` (None: off)
    Other keyword arguments are FedAvg's (``fraction_train``, ``min_train_nodes``, ``fraction_evaluate``, ...).
    """

    def __init__(
        self,
        *,
        damping: float = DEFAULT_DAMPING,
        weighting: str = "uniform",
        max_ratio: float | None = None,
        **fedavg_kwargs,
    ):
        super().__init__(**fedavg_kwargs)
        if not damping >= 0:
            raise ValueError(f"damping must be >= 0, got {damping}")
        if weighting not in ("uniform", "samples"):
            raise ValueError(f"weighting must be uniform or samples, got {weighting!r}")
        self.damping, self.weighting, self.max_ratio = float(damping), weighting, max_ratio
        self._global: dict | None = None  # the arrays sent this round: the reference shapes, the integer entries
        self.rejected: dict = {}  # round -> [(node id, reason)]

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> FedPM: damping %g, %s weights, magnitude guard %s", self.damping, self.weighting,
            self.max_ratio)  # fmt: skip

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self._global = arrays.to_torch_state_dict()
        config["damping"] = self.damping
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        glob = self._global
        floats = {k: v for k, v in glob.items() if v.is_floating_point()}  # integer entries (counters) are kept
        rejected, kept, nodes, contents, weights = [], [], [], [], []
        shapes = {"params": {k: tuple(v.shape) for k, v in floats.items()}, "foof": None}
        like = None
        for msg in valid:
            node = int(msg.metadata.src_node_id)
            reply, problem = self._reply(msg, floats)
            if problem is None:
                problem = structure_problem(reply, shapes, like)
            if problem is not None:
                rejected.append((node, problem))
                server_log.warning("round %d: node %d rejected: %s", server_round, node, problem)
                continue
            if like is None:  # the first usable reply names the blocks; the others must name the same
                like = reply
                shapes["foof"] = {b: tuple(m.shape) for b, m in reply["foof"].items()}
            kept.append(reply)
            nodes.append(node)
            contents.append(msg.content)
            weights.append(_num_examples(msg, self.weighted_by_key) if self.weighting == "samples" else 1.0)
        self.rejected[server_round] = rejected
        if not kept:
            log(INFO, "aggregate_train: no usable reply, model kept")
            return None, None
        # node ids are unsigned 64-bit: as Python ints (an int64 or float64 array would lose or round them)
        sel = np.array(nodes, dtype=object)
        info = RoundInfo(sel=sel, weights=normalised(np.asarray(weights, dtype=np.float64)), n_clients=len(valid))
        up, info, more = screen_message(
            stack_replies(kept),
            info,
            None,
            server_round,
            label="FedPM",
            max_ratio=self.max_ratio,
            fields=_FedPMMethod.message_fields,
            own_clients=False,
        )
        rejected += [(n, "rejected by screening (reason logged)") for n in more]
        if up is None:
            return None, None
        w = torch.as_tensor(np.asarray(info.weights), dtype=torch.float32)
        mixed = mix_blocks(up["params"], up["foof"], w, self.damping)
        arrays = ArrayRecord({k: mixed.get(k, v) for k, v in glob.items()})
        used = {int(n) for n in info.sel}
        metrics = self.train_metrics_aggr_fn([c for n, c in zip(nodes, contents, strict=True) if n in used],
                                             self.weighted_by_key)  # fmt: skip
        metrics["rejected"] = len(rejected)
        return arrays, metrics

    def _reply(self, msg: Message, floats: dict):
        """(reply as {'params', 'foof'} tensors, None) or (None, why it is unusable)."""
        content = msg.content
        try:
            params = content[self.arrayrecord_key].to_torch_state_dict()
            mats = content[MATRICES_KEY].to_torch_state_dict()
            _num_examples(msg, self.weighted_by_key)
        except Exception as exc:  # a reply from a node that is not ours: any malformation is its problem
            return None, f"malformed reply ({type(exc).__name__}: {exc})"
        try:
            for block, m in mats.items():
                block_entries(block, m.shape[-1] if m.ndim == 2 else -1, floats, stacked=False)
        except ValueError as exc:
            return None, str(exc)
        return {"params": {k: params.get(k) for k in floats if k in params}, "foof": mats}, None


def _num_examples(msg: Message, key: str = "num-examples") -> float:
    value = next(iter(msg.content.metric_records.values()))[key]
    if isinstance(value, list) or not value >= 0:
        raise ValueError(f"{key} must be one number >= 0, got {value!r}")
    return float(value)
