"""Merging outer gradients: free functions over plain tensors, and one fragment's whole merge.

:func:`merge_fragment` is the method's steps 4 and 5 as one pure function: the per-learner sum of
increments, token weights, RDA or the plain mean (per tensor), the participation scale and the outer
step. The synchronizer fetches and validates before it and publishes after it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ddiloco.platform.fragments import param_name
from ddiloco.synchronizer.outer import outer_step
from ddiloco.synchronizer.policy import participation_scale, token_weight

if TYPE_CHECKING:
    from ddiloco.platform.config import RunConfig

CANCEL_TOL = 1e-6
"""RDA: a mean direction shorter than this (the unit directions cancel) merges to zero. It is a
relative length: the mean of unit vectors that all agree has length 1. What is left below it is
rounding, and stretching that to the mean norm would step in an arbitrary direction."""


def flatten(tensors: dict[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """Concatenate named tensors (in ``names`` order) into one new float32 vector."""
    return torch.cat([tensors[n].reshape(-1).to(torch.float32) for n in names])


def unflatten(vector: torch.Tensor, like: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for n in names:
        numel = like[n].numel()
        out[n] = vector[offset : offset + numel].view_as(like[n]).clone()
        offset += numel
    return out


def _normalized_weights(weights: Sequence[float]) -> torch.Tensor:
    w = torch.tensor(list(weights), dtype=torch.float64)
    if len(w) == 0 or not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"merge weights must be finite, non-negative and not all zero, got {list(weights)}")
    return w / w.sum()


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_m w_m * v_m / sum_m w_m."""
    w = _normalized_weights(weights).to(torch.float32)
    out = torch.zeros_like(vectors[0], dtype=torch.float32)
    for wi, v in zip(w, vectors, strict=True):
        out.add_(v, alpha=float(wi))
    return out


def radial_directional_average(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Average norms and directions separately: norm * normalize(sum w * v/|v|).

    Outer gradients of different learners are nearly orthogonal, so a plain mean shrinks like
    1/sqrt(M); RDA keeps the typical step length and only averages where to go."""
    w = _normalized_weights(weights)
    norm = 0.0
    # float64: summed in float32 (fused multiply-add), v/|v| + (-v)/|v| leaves rounding of about 1e-8, not zero.
    direction = torch.zeros(vectors[0].shape, dtype=torch.float64)
    for wi, v in zip(w.tolist(), vectors, strict=True):
        n = float(torch.linalg.vector_norm(v))
        norm += wi * n
        if n > 0:
            direction.add_(v, alpha=wi / n)
    dnorm = float(torch.linalg.vector_norm(direction))
    if dnorm <= CANCEL_TOL:
        return torch.zeros_like(vectors[0], dtype=torch.float32)
    return direction.to(torch.float32).mul_(norm / dnorm)


def merge_vectors(vectors: Sequence[torch.Tensor], weights: Sequence[float], method: str) -> torch.Tensor:
    if method == "rda":
        return radial_directional_average(vectors, weights)
    if method == "mean":
        return weighted_mean(vectors, weights)
    raise ValueError(f"merge.method must be 'rda' or 'mean', got {method!r}")


def norm_of(tensors: dict[str, torch.Tensor]) -> float:
    """The L2 norm of all tensors together, as if flattened into one vector."""
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.to(torch.float32)) for t in tensors.values()])))


# --- one fragment's merge ------------------------------------------------------------------------


@dataclass(frozen=True)
class GlobalFragment:
    """A published version of one fragment: parameters and the outer optimizer's momentum."""

    version: int
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor] | None
    """None until the outer optimizer has stepped."""


@dataclass(frozen=True)
class Member:
    """One validated submission: what a learner learned on the fragment since its previous send."""

    submission: int
    learner: str
    delta: dict[str, torch.Tensor]
    """Decoded outer-gradient increment, by tensor name."""
    norm: float
    c_steps: int
    c_tokens: int
    base_version: int


@dataclass(frozen=True)
class MergePolicy:
    """The merge and outer-optimizer settings (``merge`` and ``outer`` of the run's config)."""

    method: str = "rda"
    weighting: str = "tokens"
    plain_mean: tuple[str, ...] = ("embed",)
    """Tensors whose name contains one of these use the plain weighted mean when method is rda."""
    participation_scaling: bool = True
    lr: float = 0.5
    momentum: float = 0.9
    nesterov: bool = True

    @classmethod
    def from_config(cls, cfg: RunConfig) -> MergePolicy:
        m, o = cfg.merge, cfg.outer
        return cls(
            method=m.method, weighting=m.weighting, plain_mean=tuple(m.plain_mean_fragments),
            participation_scaling=m.participation_scaling, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
        )


@dataclass(frozen=True)
class MergeOutcome:
    version: int
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    detail: dict[str, Any]
    """The merge record's detail: method, plain-mean tensors, scale, and each member's weight, norm, staleness."""


def plain_mean_tensors(names: Sequence[str], policy: MergePolicy) -> list[str]:
    """The tensors merged with the plain weighted mean: all of them for method mean, else those the policy names."""
    if policy.method == "mean":
        return list(names)
    # Tags match the parameter's name, so every row piece of an embedding (name@rows:a:b) matches too.
    return [n for n in names if any(tag in param_name(n) for tag in policy.plain_mean)]


def merge_fragment(current: GlobalFragment, members: Sequence[Member], policy: MergePolicy, *, live_learners: int) -> MergeOutcome:
    """Merge the members' outer gradients into ``current`` and take one outer step (version + 1).

    A learner's members are increments (each carries what it learned since its previous send or
    receipt), so they add up to that learner's outer gradient; learners are then weighted and
    merged. Inputs are not modified."""
    if not members:
        raise ValueError("merge_fragment needs at least one member")
    by_learner: dict[str, list[Member]] = {}
    for m in members:
        by_learner.setdefault(m.learner, []).append(m)
    weight = {
        lid: token_weight(sum(m.c_tokens for m in ms), sum(m.c_steps for m in ms), policy.weighting)
        for lid, ms in by_learner.items()
    }
    weights = list(weight.values())
    scale = participation_scale(len(by_learner), live_learners) if policy.participation_scaling else 1.0
    names = list(current.params)
    mean_names = plain_mean_tensors(names, policy)
    rda_names = [n for n in names if n not in mean_names]
    outer_grad: dict[str, torch.Tensor] = {}
    for group, method in ((rda_names, "rda"), (mean_names, "mean")):
        if not group:
            continue
        vectors = [_learner_sum(ms, group) for ms in by_learner.values()]
        merged = merge_vectors(vectors, weights, method)
        if scale != 1.0:
            merged = merged * scale
        outer_grad.update(unflatten(merged, current.params, group))
    params, momentum = outer_step(
        current.params, outer_grad, current.momentum, lr=policy.lr, beta=policy.momentum, nesterov=policy.nesterov
    )
    detail = {
        "method": policy.method,
        "plain_mean_tensors": mean_names if policy.method == "rda" else [],
        "participation_scale": scale,
        "base_version": current.version,
        "learners": len(by_learner),
        "members": [
            {"submission": m.submission, "learner": m.learner, "weight": weight[m.learner], "norm": m.norm,
             "staleness": current.version - m.base_version}
            for ms in by_learner.values()
            for m in ms
        ],
    }
    return MergeOutcome(current.version + 1, params, momentum, detail)


def _learner_sum(members: Sequence[Member], names: Sequence[str]) -> torch.Tensor:
    vector = flatten(members[0].delta, names)
    for m in members[1:]:
        vector.add_(flatten(m.delta, names))
    return vector
