"""Local solvers shared by the algorithms (docs/architecture.md: shared pieces instead of copies)."""

from __future__ import annotations


def gd_steps(problem, thetas, sel, lr: float, steps: int, grad_hook=None):
    """``steps`` full-batch gradient steps on every selected client.

    ``grad_hook(grads, thetas) -> grads`` lets FedProx add its proximal term and SCAFFOLD
    its control-variate correction without copying the loop.
    """
    for _ in range(steps):
        g = problem.gradients(thetas, sel)
        if grad_hook is not None:
            g = grad_hook(g, thetas)
        thetas = thetas - lr * g
    return thetas


def newton_steps(problem, thetas, sel, lr: float, steps: int):
    """``steps`` local Newton steps theta <- theta - lr * H(theta)^{-1} grad(theta).

    Returns the final parameters and the Hessians of the *last* step (P_i^{(t,K-1)}),
    which is the preconditioner FedPM sends to the server.
    """
    H = None
    for _ in range(steps):
        g = problem.gradients(thetas, sel)
        H = problem.hessians(thetas, sel)
        thetas = thetas - lr * H.solve(g)
    return thetas, H
