"""A ClientApp for tests of a real deployment: it runs our ClientApp and then, when its SuperNode's node
config says ``hostile=MODE``, falsifies the 'train' reply as an attacker controlling that SuperNode could;
``hostile="MODE1,MODE2,..."`` falsifies round t's reply the t-th way (cycling), so that one node shows every way
in one run.  Each mode is a reply our server must reject with a stated reason (fedconvex.screening,
fedpm_flower.wire)."""

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedconvex.codecs import pack_upper
from fedpm_flower import apps
from fedpm_flower.config import FlowerRunConfig
from fedpm_flower.transport import numpy, records


def _tamper(mode: str, arrays: dict, metrics) -> dict:
    if mode == "spoof":  # claims to be another client
        metrics["client"] = 0
    elif mode == "nan":
        arrays["theta"] = np.full_like(arrays["theta"], np.nan)
    elif mode == "huge":  # a valid but enormous preconditioner, 1e12 I: only the magnitude guard stops it
        huge = 1e12 * np.eye(len(arrays["P/active"]))
        if "P/code/upper" in arrays:  # sent through the 'sym' codec: the packed upper triangle
            arrays["P/code/upper"] = pack_upper(huge)
        else:
            arrays["P/block"] = huge
    elif mode == "dtype":
        arrays["theta"] = arrays["theta"].astype(np.complex128)
    elif mode == "shape":
        arrays["theta"] = arrays["theta"][:-1]
    elif mode == "oversized":  # 1.6 MB where 123 numbers are expected
        arrays["theta"] = np.zeros(200_000)
    elif mode == "codec":  # a truncated packed-triangle payload
        arrays["P/code/upper"] = arrays["P/code/upper"][:-1]
    else:
        raise ValueError(f"unknown hostile mode {mode!r}")
    return arrays


app = ClientApp()


@app.train()
def _train(msg: Message, context: Context) -> Message:
    reply = apps.train(msg, context, FlowerRunConfig.from_mapping(context.run_config))
    modes = str(context.node_config.get("hostile", "")).split(",")
    if modes != [""]:
        mode = modes[(int(msg.content["config"]["round"]) - 1) % len(modes)]
        metrics = reply.content["metrics"]
        reply.content["arrays"] = records(_tamper(mode, numpy(reply.content["arrays"]), metrics))
    return reply


@app.query()
def _query(msg: Message, context: Context) -> Message:
    return apps.query(msg, context, FlowerRunConfig.from_mapping(context.run_config))
