"""``FedPM``: a Flower strategy (``flwr.serverapp.strategy``, Message API) for any PyTorch model, used in a ServerApp
as ``FedAvg`` is: ``FedPM(...).start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=...)``.

Each training reply carries the client's model in an ``ArrayRecord`` (``"arrays"``, as FedAvg's clients send it),
its FOOF matrices in a second one (``"foof"``: block name -> (d, d), float32) and a ``MetricRecord`` with
``num-examples``; ``fedpm_flower.client.fedpm_fit`` builds exactly that.  The server checks every reply against its
own template (``fedpm_flower.replies``: the arrays it sent, and one matrix for each FOOF block of that model) --
never against another reply -- screens the stacked replies as the round driver does
(``fedconvex.driver.screen_message``: NaN/Inf, non-PSD matrices, the optional magnitude guard; a rejected client is
logged and left out, the others' weights renormalised; with nobody left the model is kept), and mixes them with
``fedpm_dnn.mixing.mix_blocks`` -- the kernel of the in-process FedPM.  Sampling, configuration and federated
evaluation are FedAvg's.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedconvex.algorithms.base import RoundInfo
from fedconvex.driver import normalised, screen_message
from fedconvex.hyperparams import NONNEGATIVE, Range, checked_number
from fedconvex.screening import log as server_log
from fedconvex.screening import max_ratio_problem
from fedpm_dnn.algorithms.base import stack_replies
from fedpm_dnn.algorithms.fedpm import FedPM as _FedPMMethod
from fedpm_dnn.engine.transport import reply_problem
from fedpm_dnn.foof import DEFAULT_DAMPING, block_sizes, foof_blocks
from fedpm_dnn.mixing import block_entries, mix_blocks

from .replies import entries_of, num_examples_problem

MATRICES_KEY = "foof"  # the reply's ArrayRecord of FOOF matrices


class FedPM(FedAvg):
    """Federated Preconditioned Mixing (FOOF matrices) as a Flower strategy.

    damping    lam of (A + lam I) in the mixing; sent to the clients in the train config (``"damping"``) so that
               their local steps use the same value (identical clients then give back their own model)
    weighting  'uniform' (the paper's 1/N) or 'samples' (by the replies' ``num-examples``, each a finite
               number above 0; a reply claiming otherwise is rejected)
    max_ratio  the magnitude guard of ``fedconvex.screening`` (None or 0: off; else a finite number >= 1)
    blocks     the FOOF blocks a reply must carry a matrix for: the model itself (``fedpm_dnn.foof.foof_blocks``
               finds them, as ``FOOF`` does on the clients), or a mapping block name -> side of its matrix.
               None: every 2-D (Linear) and 4-D (Conv2d) floating-point ``<block>.weight`` of the arrays sent,
               side its columns (+1 where ``<block>.bias`` is an entry) -- pass the model where some of those are
               not FOOF blocks (an Embedding, a grouped convolution)
    Other keyword arguments are FedAvg's (``fraction_train``, ``min_train_nodes``, ``fraction_evaluate``, ...).
    """

    def __init__(
        self,
        *,
        damping: float = DEFAULT_DAMPING,
        weighting: str = "uniform",
        max_ratio: float | None = None,
        blocks=None,
        **fedavg_kwargs,
    ):
        checked_number("damping", damping, NONNEGATIVE)
        for key, value in fedavg_kwargs.items():  # Flower's FedAvg takes them as given; a fraction of NaN samples none
            if key.startswith("fraction_"):
                checked_number(key, value, Range(0.0, 1.0))
            elif key.startswith("min_") and key.endswith("_nodes"):
                checked_number(key, value, Range(0, MAX_NODES), integer=True)
        if not isinstance(weighting, str) or weighting not in ("uniform", "samples"):
            raise ValueError(f"weighting must be uniform or samples, got {weighting!r}")
        problem = max_ratio_problem(max_ratio)
        if problem:
            kind = TypeError if isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float)) else ValueError
            raise kind(f"max_ratio {problem}, got {max_ratio!r}")
        self._blocks = _block_sides(blocks)
        super().__init__(**fedavg_kwargs)
        self.damping, self.weighting = float(damping), weighting
        self.max_ratio = float(max_ratio) if max_ratio else None
        self._global: dict | None = None  # the arrays sent this round: the reference shapes, the integer entries
        self._template: dict | None = None  # what a usable reply to them is (``template``)
        self.rejected: dict = {}  # round -> [(node id, reason)]

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> FedPM: damping %g, %s weights, magnitude guard %s", self.damping, self.weighting,
            self.max_ratio)  # fmt: skip

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self._global = arrays.to_torch_state_dict()
        self._template = self.template(self._global)  # the server's own: never taken from a reply
        config["damping"] = self.damping
        return super().configure_train(server_round, arrays, config, grid)

    def template(self, arrays: dict) -> dict:
        """What a usable reply to ``arrays`` (the state dict sent) is: {'params': its floating-point entries, as
        sent; 'foof': a float32 (d, d) matrix per FOOF block} -- field -> {name: (shape, dtype)}."""
        floats = {k: v for k, v in arrays.items() if v.is_floating_point()}
        sides = self._blocks if self._blocks is not None else _derived_sides(floats)
        for block, side in sides.items():
            block_entries(block, side, floats, stacked=False)  # a ValueError names a block the model lacks
        return {
            "params": entries_of(floats),
            MATRICES_KEY: {b: ((d, d), torch.float32) for b, d in sides.items()},
        }

    def aggregate_train(self, server_round: int, replies) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        glob = self._global
        floats = {k: v for k, v in glob.items() if v.is_floating_point()}  # integer entries (counters) are kept
        rejected, kept, nodes, contents, weights = [], [], [], [], []
        for msg in valid:
            node = int(msg.metadata.src_node_id)
            reply, count, problem = self._reply(msg, floats)
            if problem is None:
                problem = reply_problem(reply, self._template)
            if problem is not None:
                rejected.append((node, problem))
                server_log.warning("round %d: node %d rejected: %s", server_round, node, problem)
                continue
            kept.append(reply)
            nodes.append(node)
            contents.append(msg.content)
            weights.append(count if self.weighting == "samples" else 1.0)
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
        metrics = self._metrics([c for n, c in zip(nodes, contents, strict=True) if n in used], server_round)
        metrics["rejected"] = len(rejected)
        return arrays, metrics

    def aggregate_evaluate(self, server_round: int, replies) -> MetricRecord | None:
        """FedAvg's aggregate of the evaluation replies' metrics, each reply's checked as a training reply's are:
        one MetricRecord with a finite ``num-examples`` (a node's bad reply is logged and left out)."""
        valid, _ = self._check_and_log_replies(replies, is_train=False, validate=False)
        usable = []
        for msg in valid:
            try:
                records = list(msg.content.metric_records.values())
                if len(records) != 1:
                    raise ValueError(f"{len(records)} MetricRecords, expected 1")
                problem = num_examples_problem(records[0][self.weighted_by_key], positive=False)
                problem = f"{self.weighted_by_key} {problem}" if problem else None
            except Exception as exc:  # a reply from a node that is not ours: any malformation is its problem
                problem = f"malformed reply ({type(exc).__name__}: {exc})"
            if problem:
                server_log.warning("round %d: evaluation of node %d rejected: %s", server_round,
                                   int(msg.metadata.src_node_id), problem)  # fmt: skip
            else:
                usable.append(msg.content)
        return self._metrics(usable, server_round, self.evaluate_metrics_aggr_fn) if usable else None

    def _metrics(self, contents: list, server_round: int, aggregate=None) -> MetricRecord:
        """FedAvg's aggregate of the used replies' metrics; a node's metrics that cannot be aggregated with the
        others' (a list where the others send a number, all counts 0) leave the round's metrics empty."""
        try:
            with np.errstate(all="raise"):
                return (aggregate or self.train_metrics_aggr_fn)(contents, self.weighted_by_key)
        except (ArithmeticError, TypeError, ValueError, KeyError, FloatingPointError) as exc:
            log(WARNING, "round %d: the replies' metrics cannot be aggregated (%s: %s)", server_round,
                type(exc).__name__, exc)  # fmt: skip
            return MetricRecord()

    def _reply(self, msg: Message, floats: dict):
        """(reply as {'params', 'foof'} tensors, its sample count, None) or (None, None, why it is unusable)."""
        content = msg.content
        try:
            params = content[self.arrayrecord_key].to_torch_state_dict()
            mats = content[MATRICES_KEY].to_torch_state_dict()
            metrics = list(content.metric_records.values())
            if len(metrics) != 1:
                raise ValueError(f"{len(metrics)} MetricRecords, expected 1")
            count = metrics[0][self.weighted_by_key]
        except Exception as exc:  # a reply from a node that is not ours: any malformation is its problem
            return None, None, f"malformed reply ({type(exc).__name__}: {exc})"
        problem = num_examples_problem(count, positive=self.weighting == "samples")
        if problem:
            return None, None, f"{self.weighted_by_key} {problem}"
        for block, m in mats.items():  # a block the model lacks is named as such, before the template's check
            try:
                block_entries(block, m.shape[-1] if m.ndim == 2 else -1, floats, stacked=False)
            except ValueError as exc:
                return None, None, str(exc)
        # the model's integer entries (counters) are the server's own, kept as sent; anything else must fit
        params = {k: v for k, v in params.items() if k in floats or k not in self._global}
        return {"params": params, MATRICES_KEY: mats}, float(count), None


MAX_NODES = 2**31 - 1  # far beyond any federation: a larger minimum would wait forever


def _block_sides(blocks) -> dict | None:
    """block name -> side of its FOOF matrix, from ``FedPM(blocks=...)``: a model, a mapping, or None."""
    if blocks is None:
        return None
    if isinstance(blocks, torch.nn.Module):
        return block_sizes(foof_blocks(blocks))
    if not isinstance(blocks, Mapping):
        raise TypeError(f"blocks must be a torch.nn.Module, a mapping block name -> side or None, got {blocks!r}")
    out = {}
    for name, side in blocks.items():
        if not isinstance(name, str) or isinstance(side, bool) or not isinstance(side, int) or side < 1:
            raise ValueError(f"blocks must map block names to matrix sides >= 1, got {name!r}: {side!r}")
        out[name] = side
    return out


def _derived_sides(floats: dict) -> dict:
    """The FOOF blocks of a state dict when the strategy was not told them: every 2-D or 4-D ``<block>.weight``."""
    out = {}
    for key, v in floats.items():
        if not (key == "weight" or key.endswith(".weight")) or v.ndim not in (2, 4):
            continue
        block = key[: -len(".weight")] if key != "weight" else ""
        bias = f"{block}.bias" if block else "bias"
        out[block] = int(np.prod(v.shape[1:])) + (1 if bias in floats else 0)
    return out
