"""fedpmexample: the ServerApp -- the FedPM strategy, used as FedAvg is; the global model's test accuracy after
every round in the run's log and, with ``history-file`` set, in a CSV file."""

import csv
import os
import tempfile
import time

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


def write_history(path: str, rows: list) -> None:
    """The rows so far as CSV, replacing the file whole (a reader never sees half a file)."""
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False, newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(fh.name, path)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    torch.manual_seed(int(cfg["seed"]))
    data_dir = str(cfg["data-dir"])
    test_images = int(cfg.get("test-images", 0))
    model = make_net(data_dir)  # no data: one clear error here, before any round
    history_file, rows, start = str(cfg.get("history-file", "")), [], time.time()
    if history_file and not os.path.isdir(os.path.dirname(os.path.abspath(history_file))):
        raise ValueError(f"history-file {history_file!r}: its folder does not exist")

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        accuracy = test_accuracy(model, data_dir, test_images)
        rows.append({"round": server_round, "test_accuracy": accuracy, "seconds": round(time.time() - start, 1)})
        print(f"round {server_round}: test accuracy {accuracy:.4f} ({rows[-1]['seconds']:.0f} s)", flush=True)
        if history_file:
            write_history(history_file, rows)
        return MetricRecord({"accuracy": accuracy})

    result = make_strategy(cfg).start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=train_config(cfg),
        evaluate_fn=evaluate,
    )
    if cfg["out-file"]:
        torch.save(result.arrays.to_torch_state_dict(), str(cfg["out-file"]))
