"""The outer optimizer: a standard torch SGD (Nesterov) fed the merged outer gradient."""

from __future__ import annotations

import torch

MOMENTUM_PREFIX = "momentum::"


def outer_step(
    params: dict[str, torch.Tensor],
    outer_grad: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor] | None,
    *,
    lr: float,
    beta: float,
    nesterov: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One outer step Theta <- SGD(Theta, grad = merged Delta); returns (new params, new momentum).

    Inputs are not modified. ``momentum`` None means the optimizer has not stepped yet."""
    names = list(params)
    leaves = [torch.nn.Parameter(params[n].detach().to(torch.float32).clone()) for n in names]
    opt = torch.optim.SGD(leaves, lr=lr, momentum=beta, nesterov=nesterov and beta > 0)
    for n, p in zip(names, leaves, strict=True):
        p.grad = outer_grad[n].detach().to(torch.float32).reshape(p.shape).clone()
        if momentum is not None and beta > 0 and n in momentum:
            opt.state[p]["momentum_buffer"] = momentum[n].detach().to(torch.float32).clone()
    opt.step()
    new_params = {n: p.detach().clone() for n, p in zip(names, leaves, strict=True)}
    new_momentum = {}
    if beta > 0:
        new_momentum = {n: opt.state[p]["momentum_buffer"].detach().clone() for n, p in zip(names, leaves, strict=True)}
    return new_params, new_momentum


def momentum_to_blob(momentum: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {MOMENTUM_PREFIX + n: t for n, t in momentum.items()}


def momentum_from_blob(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    out = {k[len(MOMENTUM_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MOMENTUM_PREFIX)}
    return out or None
