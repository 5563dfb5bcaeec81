"""fedpmexample: the ClientApp -- local FOOF steps on the node's data, reply with model and matrices."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedpm_flower.client import fedpm_fit
from fedpmexample.task import load_data, make_net

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    data_dir = str(context.node_config.get("data-dir", cfg["data-dir"]))
    model = make_net(data_dir)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loader = load_data(
        data_dir,
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
        int(cfg["batch-size"]),
        int(cfg["seed"]) + int(msg.content["config"]["server-round"]),  # a fresh, reproducible order each round
        float(cfg.get("alpha", 0.1)),
        int(cfg.get("train-images", 0)),
    )
    content = fedpm_fit(model, loader, msg.content["config"], context.state)
    return Message(content=content, reply_to=msg)
