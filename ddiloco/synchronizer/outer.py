"""The outer optimizer: torch's own SGD (Nesterov) fed the merged outer gradient."""

from __future__ import annotations

import torch
from torch.optim.sgd import sgd

MOMENTUM_PREFIX = "momentum::"


def outer_lr(lr: float, version: int, warmup: int) -> float:
    """The outer lr of the step from ``version`` to ``version + 1``: linear warm-up over the first ``warmup`` steps."""
    return lr if warmup <= 0 else lr * min(1.0, (version + 1) / warmup)


def async_momentum(beta: float, periods: float, staleness: float) -> float:
    """``outer.momentum_adjust: async``: the momentum of a merge whose updates carry ``periods`` send periods and
    are ``staleness`` versions behind, token-weighted: ``beta`` for updates of at most one period (an increment re-applies
    nothing, however stale its base), else ``beta ** periods - s / (1 + s)``, at least 0."""
    if beta <= 0:
        return 0.0
    if periods <= 1:
        return beta
    s = max(0.0, staleness)
    return max(0.0, beta**periods - s / (1.0 + s))


def outer_step_(
    params: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor | None, *, lr: float, beta: float, nesterov: bool = True
) -> None:
    """One outer step on flat float32 tensors, in place: ``params`` and ``momentum`` (when given) are updated.

    torch.optim's functional SGD, fused (one pass, no temporaries). A momentum buffer of zeros is the
    first step: beta * 0 + grad is torch's first-step buffer, grad, exactly. A buffer given with beta 0 (a merge whose
    momentum ``outer.momentum_adjust`` took to 0) becomes beta * m + grad = grad, which torch's SGD would skip."""
    if beta > 0 and momentum is None:
        raise ValueError("an outer step with momentum needs a momentum buffer (zeros before the first step)")
    sgd([params], [grad], [momentum if beta > 0 else None], fused=True, weight_decay=0.0, momentum=beta, lr=lr,
        dampening=0.0, nesterov=nesterov and beta > 0, maximize=False)
    if momentum is not None and beta == 0:
        momentum.copy_(grad)


def outer_step(
    params: dict[str, torch.Tensor],
    outer_grad: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor] | None,
    *,
    lr: float,
    beta: float,
    nesterov: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One outer step Theta <- SGD(Theta, grad = merged Delta) on tensors by name; returns (new params, new momentum).

    Inputs are not modified. ``momentum`` None means the optimizer has not stepped yet."""
    new_params, new_momentum = {}, {}
    for n, p in params.items():
        new_p = p.detach().to(torch.float32, copy=True)
        buf = torch.zeros_like(new_p) if momentum is None or n not in momentum else momentum[n].detach().to(torch.float32, copy=True)
        outer_step_(new_p, outer_grad[n].detach().to(torch.float32).reshape(new_p.shape), buf, lr=lr, beta=beta, nesterov=nesterov)
        new_params[n] = new_p
        if beta > 0:
            new_momentum[n] = buf
    return new_params, new_momentum


def momentum_to_blob(momentum: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {MOMENTUM_PREFIX + n: t for n, t in momentum.items()}


def momentum_from_blob(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    out = {k[len(MOMENTUM_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MOMENTUM_PREFIX)}
    return out or None
