"""FedPM-FOOF (paper eqs. foof_local / foof_mixing): LocalNewton-FOOF's local steps, and the clients'
FOOF matrices sent up for preconditioned mixing.

Server, per FOOF block: Theta = precond_mix(A_stack, Theta_stack, w, damping=lam) -- the fedconvex
kernel on torch tensors, in float64 -- and simple mixing of the other parameters.  The matrices travel
in ``precond_dtype`` or through a codec of ``fedconvex.codecs`` (``fedpm_dnn.algorithms.fedpm_wire``), decoded by
``receive`` before screening.  With one Linear layer, squared loss and one full-batch local step this
is a global Newton step on the pooled data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fedconvex.codecs import parse, validate

from ..foof import block_sizes
from ..mixing import mix_blocks
from . import fedpm_wire as wire
from .localnewton import LocalNewton


@dataclass(frozen=True)
class FedPM(LocalNewton):
    name: ClassVar[str] = "fedpm"
    label: ClassVar[str] = "FedPM"
    message_fields: ClassVar[dict] = {"params": "model", "foof": "psd"}

    precond_dtype: str = "float32"  # dtype the matrices travel in (float16 halves the bytes)
    # 'none' (as precond_dtype says) or a codec of fedconvex.codecs (sym, fp16, bf16, lowrank:R,
    # delta:identity|topk:K|rankr:R), see fedpm_dnn/algorithms/fedpm_wire.py
    precond_codec: str = "none"

    def __post_init__(self):
        super().__post_init__()
        if self.precond_dtype not in ("float32", "float16"):
            raise ValueError(f"precond_dtype must be float32 or float16, got {self.precond_dtype!r}")
        validate(self.precond_codec)
        if self.precond_codec != "none" and self.precond_dtype != "float32":
            raise ValueError("precond_dtype float16 and a precond_codec exclude each other (use the codec fp16)")

    def init_server(self, params):
        # the delta codecs keep the server's estimate of every client's matrices (state['foof_hat'])
        codec = parse(self.precond_codec)
        return {"foof_hat": {}, wire.PENDING: {}} if codec is not None and codec.stateful else {}

    def finish_reply(self, cs, local, steps, down, end_foof):
        reply = super().finish_reply(cs, local, steps, down, end_foof)
        if self.precond_codec != "none":
            reply["foof"] = wire.encode_foof(self, cs, cs["foof"])
        else:
            dtype = torch.float16 if self.precond_dtype == "float16" else torch.float32
            reply["foof"] = {k: v.to(dtype) for k, v in cs["foof"].items()}
        return reply

    def reply_shapes(self, params, blocks):
        shapes = super().reply_shapes(params, blocks)
        if self.precond_codec != "none":  # payloads: their structure is checked by decoding them
            return {**shapes, "foof": None}
        return {**shapes, "foof": {name: (d, d) for name, d in block_sizes(blocks).items()}}

    def receive(self, task, state, up, info):
        """Upcast the parameters (``param_dtype``) and decode the codec's payloads (before screening);
        see fedpm_dnn.algorithms.fedpm_wire."""
        up, state = super().receive(task, state, up, info)
        if self.precond_codec == "none":
            return up, state
        return wire.receive(self, task, state, up, info)

    def server_update(self, task, state, up, info):
        # the delta codec's estimates advance only for the clients kept after screening (info.sel)
        return super().server_update(task, wire.commit(self, state, info), up, info)

    def mix(self, task, params, up, w):
        # the matrices name the blocks; every other parameter is simply averaged (fedpm_dnn.mixing)
        return mix_blocks(up["params"], up["foof"], w, self.damping)
