"""fedpmexample: FedPM on FEMNIST writers with a LayerNorm MLP (a Flower app)."""
