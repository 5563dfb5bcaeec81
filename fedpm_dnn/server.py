"""Server-side aggregation for the DNN methods, built from the fedconvex pieces.

FedAvg / FedProx / FedAvgM / FedAdam: one FedOpt step on the flattened pseudo-gradient
Delta = theta - mix(theta_i) with fedconvex.server_opt (SGD(1) / Momentum / Adam).
SCAFFOLD: theta += mix(theta_i - theta); c += (|S|/N) mean(Delta c_i)  (global step 1).
LocalNewton: simple mixing of every parameter.
FedPM: per FOOF block Theta = precond_mix(A_stack, Theta_stack, w, damping) -- the fedconvex
kernel on torch tensors, in float64 -- and simple mixing of the other parameters.
"""
from __future__ import annotations

import torch

from fedconvex.mixing import precond_mix, simple_mix
from fedconvex.server_opt import SGD, Adam, Momentum

from . import foof


def flatten(params: dict) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params.values()])


def unflatten(vec: torch.Tensor, like: dict) -> dict:
    out, k = {}, 0
    for name, p in like.items():
        out[name] = vec[k:k + p.numel()].view_as(p).clone()
        k += p.numel()
    return out


def server_optimizer(cfg):
    if cfg.name == "fedavgm":
        return Momentum(1.0, cfg.momentum)
    if cfg.name == "fedadam":
        return Adam(cfg.server_lr, cfg.beta1, cfg.beta2, cfg.tau)
    return SGD(1.0)


def init_server_state(cfg, params: dict) -> dict:
    state = {"params": {k: v.detach().clone() for k, v in params.items()}, "round": 0}
    if cfg.name in ("fedavg", "fedprox", "fedavgm", "fedadam"):
        state["opt"] = server_optimizer(cfg).init(flatten(params))
    if cfg.name == "scaffold":
        state["control"] = {k: torch.zeros_like(v) for k, v in params.items()}
    return state


def _stack(replies, key, name):
    return torch.stack([r[key][name] for r in replies])


def aggregate(cfg, state: dict, replies: list, weights: torch.Tensor, n_clients: int, blocks: dict) -> dict:
    """New server state from the participants' replies (weights sum to one)."""
    params = state["params"]
    new = dict(state)
    new["round"] = state["round"] + 1
    if cfg.name in ("fedavg", "fedprox", "fedavgm", "fedadam"):
        theta = flatten(params)
        mixed = simple_mix(torch.stack([flatten(r["params"]) for r in replies]), weights)
        theta, new["opt"] = server_optimizer(cfg).step(theta, theta - mixed, state["opt"], new["round"])
        new["params"] = unflatten(theta, params)
    elif cfg.name == "scaffold":
        new["params"] = {k: p + simple_mix(_stack(replies, "params", k) - p, weights) for k, p in params.items()}
        frac = len(replies) / n_clients
        new["control"] = {k: c + frac * _stack(replies, "dcontrol", k).mean(0) for k, c in state["control"].items()}
    elif cfg.name == "localnewton":
        new["params"] = {k: simple_mix(_stack(replies, "params", k), weights) for k in params}
    else:  # fedpm
        out, done = {}, set()
        w64 = weights.to(torch.float64)
        for bname, block in blocks.items():
            wname, bias_name = foof.param_name(bname, "weight"), foof.param_name(bname, "bias")
            thetas = torch.stack([foof.get_theta(block, r["params"][wname], r["params"].get(bias_name)
                                                 if block.has_bias else None) for r in replies]).to(torch.float64)
            A = torch.stack([r["foof"][bname] for r in replies]).to(torch.float64)
            mixed = precond_mix(A, thetas, w64, damping=cfg.damping)
            wt, bs = foof.split_theta(block, mixed.to(params[wname].dtype))
            out[wname] = wt
            done.add(wname)
            if bs is not None:
                out[bias_name] = bs
                done.add(bias_name)
        for k in params:
            if k not in done:
                out[k] = simple_mix(_stack(replies, "params", k), weights)
        new["params"] = {k: out[k] for k in params}
    return new
