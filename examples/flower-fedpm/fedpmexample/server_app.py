"""fedpmexample: the ServerApp -- the FedPM strategy, used as FedAvg is."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedpm_flower.strategy import FedPM
from fedpmexample.task import make_net, test_accuracy

app = ServerApp()


def make_strategy(cfg) -> FedPM:
    """The strategy of a run config (the in-process test builds the same one)."""
    return FedPM(damping=float(cfg["damping"]), fraction_evaluate=0.0)


def train_config(cfg) -> ConfigRecord:
    return ConfigRecord({"lr": float(cfg["lr"]), "clip": float(cfg["clip"]), "local-epochs": int(cfg["local-epochs"])})


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    torch.manual_seed(int(cfg["seed"]))
    data_dir = str(cfg["data-dir"])
    model = make_net(data_dir)  # no data: one clear error here, before any round

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": test_accuracy(model, data_dir)})

    result = make_strategy(cfg).start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=train_config(cfg),
        evaluate_fn=evaluate,
    )
    if cfg["out-file"]:
        torch.save(result.arrays.to_torch_state_dict(), str(cfg["out-file"]))
