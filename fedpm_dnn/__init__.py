"""fedpm_dnn: FedPM with FOOF preconditioners for federated DNN training (PyTorch)."""
