"""Server optimizers over the pseudo-gradient Delta = theta - mix(theta_i) (Reddi et al. 2021).

optax-style pure pairs ``init(theta) -> state`` and ``step(theta, delta, state, t) ->
(theta, state)``; FedAvg, FedAvgM and FedAdam are one FedOpt with a different optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SGD:
    lr: float = 1.0

    def init(self, theta):
        return {}

    def step(self, theta, delta, state, t):
        return theta - self.lr * delta, state


@dataclass(frozen=True)
class Momentum:
    """FedAvgM (Hsu et al. 2019; Flower's FedAvgM): v <- beta v + Delta; theta <- theta - lr v."""

    lr: float = 1.0
    beta: float = 0.9

    def init(self, theta):
        return {"v": theta * 0}

    def step(self, theta, delta, state, t):
        v = self.beta * state["v"] + delta
        return theta - self.lr * v, {"v": v}


@dataclass(frozen=True)
class Adam:
    """FedAdam (Reddi et al. 2021, as Flower defines it) with Adam's bias-corrected step.

    m <- b1 m + (1-b1)(-Delta); v <- b2 v + (1-b2) Delta^2;
    theta <- theta + lr_t m / (sqrt(v) + tau), lr_t = lr sqrt(1-b2^t) / (1-b1^t), t = 1, 2, ...
    (Flower's strategy uses t = server_round + 1; we use Kingma & Ba's t.)
    """

    lr: float = 0.03
    b1: float = 0.9
    b2: float = 0.99
    tau: float = 1e-3

    def init(self, theta):
        return {"m": theta * 0, "v": theta * 0}

    def step(self, theta, delta, state, t):
        m = self.b1 * state["m"] - (1 - self.b1) * delta
        v = self.b2 * state["v"] + (1 - self.b2) * delta * delta
        lr_t = self.lr * (1 - self.b2**t) ** 0.5 / (1 - self.b1**t)
        return theta + lr_t * m / (v**0.5 + self.tau), {"m": m, "v": v}
