"""The registered DNN methods' names (in the paper's order) and display labels, importable without torch: a
command's --help and the figures list them before any heavy import.  fedpm_dnn.algorithms.REGISTRY holds the
classes; tests/test_cli_help.py keeps the two equal (a new method is a line there and an entry here)."""

METHOD_LABELS = {
    "fedavg": "FedAvg",
    "fedavgm": "FedAvgM",
    "fedprox": "FedProx",
    "scaffold": "SCAFFOLD",
    "fedadam": "FedAdam",
    "localnewton": "LocalNewton",
    "fedpm": "FedPM",
}
METHOD_NAMES = tuple(METHOD_LABELS)
