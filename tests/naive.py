"""Independent dense reference implementations (plain NumPy, per-client loops).

Tests compare the package against these, never against its own outputs.
"""

import numpy as np
import scipy.sparse as sp


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


class NaiveLogReg:
    def __init__(self, X, y, parts, lam, weighting="uniform"):
        X = X.toarray() if sp.issparse(X) else np.asarray(X)
        self.Xs = [X[p] for p in parts]
        self.ys = [np.asarray(y)[p] for p in parts]
        self.lam = lam
        sizes = np.array([len(p) for p in parts], float)
        self.p = sizes / sizes.sum() if weighting == "samples" else np.full(len(parts), 1 / len(parts))
        self.d = X.shape[1]

    def f_i(self, i, th):
        m = self.ys[i] * (self.Xs[i] @ th)
        return np.mean(np.logaddexp(0, -m)) + 0.5 * self.lam * th @ th

    def g_i(self, i, th):
        X, y = self.Xs[i], self.ys[i]
        m = y * (X @ th)
        return X.T @ (-y * sigmoid(-m)) / len(y) + self.lam * th

    def H_i(self, i, th):
        X, y = self.Xs[i], self.ys[i]
        s = sigmoid(y * (X @ th))
        return X.T @ (X * (s * (1 - s))[:, None]) / len(y) + self.lam * np.eye(self.d)

    def f(self, th):
        return sum(p * self.f_i(i, th) for i, p in enumerate(self.p))

    def g(self, th):
        return sum(p * self.g_i(i, th) for i, p in enumerate(self.p))

    def H(self, th):
        return sum(p * self.H_i(i, th) for i, p in enumerate(self.p))

    def newton_step(self, th, lr=1.0, H=None):
        H = self.H(th) if H is None else H
        return th - lr * np.linalg.solve(H, self.g(th))


def random_data(rng, n_clients, d, sizes=None, density=0.3, binary=False):
    """Sparse random design with some features unused by some clients, labels in {-1, +1}."""
    if sizes is None:
        sizes = rng.integers(3, 12, n_clients)
    n = int(np.sum(sizes))
    X = sp.random(n, d, density=density, random_state=np.random.RandomState(rng.integers(2**31)), format="csr")
    if binary:
        X.data[:] = 1.0
    else:
        X.data = rng.normal(size=X.nnz)
    y = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    parts = [np.arange(bounds[i], bounds[i + 1]) for i in range(n_clients)]
    return X, y, parts
