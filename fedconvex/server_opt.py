"""Server optimizers over the pseudo-gradient Delta = theta - mix(theta_i) (Reddi et al. 2021).

optax-style pure pairs ``init(theta) -> state`` and ``step(theta, delta, state, t) ->
(theta, state)``; FedAvg, FedAvgM and FedAdam are one FedOpt with a different optimizer.

Two choices the literature makes differently, and which change what a tuned value means:

* the momentum's form.  heavy-ball (Hsu et al. 2019; Flower's FedAvgM): v <- beta v + Delta, whose
  steady-state step is 1/(1 - beta) times Delta's; ema (Adam's first moment, Reddi et al.'s FedAvgM
  written as FedOpt): v <- beta v + (1 - beta) Delta, a weighted mean of the Deltas.
* bias correction (Kingma & Ba): divide the moment by 1 - beta^t, t = 1, 2, ..., the share of its
  steady-state weight it has gathered after t rounds; it removes the start-up shrinkage towards zero.
  It means the same in both forms (heavy-ball = ema scaled by 1/(1 - beta)).
"""

from __future__ import annotations

from dataclasses import dataclass

MOMENTUM_FORMS = ("heavy-ball", "ema")


def check_form(form: str) -> None:
    if form not in MOMENTUM_FORMS:
        raise ValueError(f"momentum form {form!r}: choose from {', '.join(MOMENTUM_FORMS)}")


def moment(previous, new, beta: float, form: str):
    """One step of a moment: beta * previous + new (heavy-ball) or + (1 - beta) * new (ema)."""
    return beta * previous + (new if form == "heavy-ball" else (1 - beta) * new)


def debiased(m, beta: float, t: int, bias_correction: bool):
    """``m`` divided by 1 - beta^t if ``bias_correction`` (t = 1, 2, ... counts the rounds)."""
    return m / (1 - beta**t) if bias_correction else m


@dataclass(frozen=True)
class SGD:
    lr: float = 1.0

    def init(self, theta):
        return {}

    def step(self, theta, delta, state, t):
        return theta - self.lr * delta, state


@dataclass(frozen=True)
class Momentum:
    """FedAvgM: v <- moment(v, Delta); theta <- theta - lr debiased(v).  The defaults, heavy-ball without bias
    correction, are Hsu et al.'s and Flower's FedAvgM (v <- beta v + Delta; theta <- theta - lr v)."""

    lr: float = 1.0
    beta: float = 0.9
    form: str = "heavy-ball"
    bias_correction: bool = False

    def __post_init__(self):
        check_form(self.form)

    def init(self, theta):
        return {"v": theta * 0}

    def step(self, theta, delta, state, t):
        v = moment(state["v"], delta, self.beta, self.form)
        return theta - self.lr * debiased(v, self.beta, t, self.bias_correction), {"v": v}


@dataclass(frozen=True)
class Adam:
    """FedAdam (Reddi et al. 2021, as Flower defines it): Adam on -Delta, both moments ema.

    m <- b1 m + (1-b1)(-Delta); v <- b2 v + (1-b2) Delta^2;
    theta <- theta + lr_t m / (sqrt(v) + tau), with bias correction lr_t = lr sqrt(1-b2^t) / (1-b1^t),
    t = 1, 2, ... (Flower's strategy uses t = server_round + 1; we use Kingma & Ba's t), without it lr_t = lr
    (Reddi et al.'s Algorithm 2).
    """

    lr: float = 0.03
    b1: float = 0.9
    b2: float = 0.99
    tau: float = 1e-3
    bias_correction: bool = True

    def init(self, theta):
        return {"m": theta * 0, "v": theta * 0}

    def step(self, theta, delta, state, t):
        m = self.b1 * state["m"] - (1 - self.b1) * delta
        v = self.b2 * state["v"] + (1 - self.b2) * delta * delta
        lr_t = self.lr * (1 - self.b2**t) ** 0.5 / (1 - self.b1**t) if self.bias_correction else self.lr
        return theta + lr_t * m / (v**0.5 + self.tau), {"m": m, "v": v}
