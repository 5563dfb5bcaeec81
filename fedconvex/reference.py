"""Reference solution and initial points of the paper's Test 1."""

from __future__ import annotations

import numpy as np


def solve_optimum(problem, iterations: int = 20):
    """theta* by ``iterations`` full Newton steps from 0 on all the data (paper: 20).

    Returns (theta*, f*, ||grad f(theta*)||)."""
    xp = problem.xp
    theta = problem.to_backend(np.zeros(problem.d))
    for _ in range(iterations):
        H = problem.hessian(theta)
        theta = theta - xp.linalg.solve(H, problem.gradient(theta)[:, None])[:, 0]
    gnorm = float(np.linalg.norm(problem.to_host(problem.gradient(theta))))
    return theta, problem.value(theta), gnorm


def initial_point(problem, theta_star, kind: str = "paper", seed: int = 0, scale: float = 0.1):
    """'paper': theta* + N(0, scale^2 I) (seeded); 'zero': the origin."""
    if kind == "zero":
        return problem.to_backend(np.zeros(problem.d))
    if kind != "paper":
        raise ValueError(f"init must be 'paper' or 'zero', got {kind!r}")
    noise = np.random.default_rng(seed).normal(0.0, scale, problem.d)
    return problem.to_backend(problem.to_host(theta_star) + noise)
