"""FedPM and its baselines as Flower apps (flwr Message API): simulation and deployment."""
