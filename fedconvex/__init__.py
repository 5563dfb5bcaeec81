"""fedconvex: exact second-order federated optimization on convex problems."""
