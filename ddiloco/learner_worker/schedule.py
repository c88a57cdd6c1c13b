"""The inner loop's learning-rate schedule and parameter groups (pure helpers, nanoGPT style)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ddiloco.platform.config import InnerOptimizerConfig, RunConfig, tokens_per_step


def lr_factor(step: int, cfg: InnerOptimizerConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` at inner step ``step`` (0-based): linear warm-up, then the schedule."""
    warm = cfg.warmup_steps
    if warm > 0 and step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant" or total_steps <= warm:
        return 1.0
    progress = min(1.0, (step - warm) / max(1, total_steps - warm))
    if cfg.schedule == "cosine":
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    stable = 1.0 - cfg.decay_fraction
    if progress <= stable:
        return 1.0
    return 1.0 - (1 - cfg.min_lr_ratio) * (progress - stable) / cfg.decay_fraction


def schedule_steps(cfg: RunConfig, world: int) -> int:
    """Inner steps a learner of ``world`` ranks takes over its share of the run's token budget."""
    per_step = tokens_per_step(cfg.model, cfg.learners.batch_size * cfg.inner.grad_accum_steps, world)
    return max(1, cfg.token_budget // (cfg.learners.count * per_step))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: matrices decay; norms, biases (every tensor under 2-D) and embeddings do not."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    decay: list[torch.Tensor] = []
    keep: list[torch.Tensor] = []
    for p in model.parameters():
        (keep if p.dim() < 2 or id(p) in embeddings else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
