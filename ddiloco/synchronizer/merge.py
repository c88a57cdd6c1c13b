"""Merging outer gradients: free functions over plain tensors."""

from __future__ import annotations

from typing import Sequence

import torch

EPS = 1e-12


def flatten(tensors: dict[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """Concatenate named tensors (in ``names`` order) into one float32 vector."""
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
    return (w / w.sum()).to(torch.float32)


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_m w_m * v_m / sum_m w_m."""
    w = _normalized_weights(weights)
    out = torch.zeros_like(vectors[0], dtype=torch.float32)
    for wi, v in zip(w, vectors):
        out.add_(v, alpha=float(wi))
    return out


def radial_directional_average(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Average norms and directions separately: norm * normalize(sum w * v/|v|).

    Outer gradients of different learners are nearly orthogonal, so a plain mean shrinks like
    1/sqrt(M); RDA keeps the typical step length and only averages where to go."""
    w = _normalized_weights(weights)
    norm = torch.zeros((), dtype=torch.float32)
    direction = torch.zeros_like(vectors[0], dtype=torch.float32)
    for wi, v in zip(w, vectors):
        n = torch.linalg.vector_norm(v)
        norm += wi * n
        if n > EPS:
            direction.add_(v, alpha=float(wi / n))
    dnorm = torch.linalg.vector_norm(direction)
    if dnorm <= EPS:
        return torch.zeros_like(direction)
    return direction * (norm / dnorm)


def merge_vectors(vectors: Sequence[torch.Tensor], weights: Sequence[float], method: str) -> torch.Tensor:
    if method == "rda":
        return radial_directional_average(vectors, weights)
    if method == "mean":
        return weighted_mean(vectors, weights)
    raise ValueError(f"merge.method must be 'rda' or 'mean', got {method!r}")
