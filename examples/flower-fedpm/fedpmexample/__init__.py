"""fedpmexample: FedPM on CIFAR-10 (or FEMNIST writers) with the paper's SimpleCNN (a Flower app)."""
