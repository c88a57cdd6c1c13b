"""Balanced tensor fragmentation and the staggered schedule of fragment sends.

The parameters are split into P fragments of whole tensors with near-equal bytes (greedy
bin-packing, largest tensor first into the lightest fragment). Fragment p is due every H inner
steps, offset by p, so with H = P one fragment travels per step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Fragment:
    index: int
    names: tuple[str, ...]
    """Parameter names, in the model's order."""
    numel: int
    nbytes: int


def partition(named_shapes: list[tuple[str, tuple[int, ...], int]], count: int) -> list[Fragment]:
    """Split ``(name, shape, bytes per element)`` tensors into ``count`` fragments of near-equal bytes."""
    if count < 1:
        raise ValueError(f"fragments.count must be >= 1, got {count}")
    if count > len(named_shapes):
        raise ValueError(
            f"fragments.count ({count}) exceeds the number of parameter tensors ({len(named_shapes)}): "
            "fragments hold whole tensors, so lower fragments.count"
        )
    names = [n for n, _, _ in named_shapes]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    sizes = [(math.prod(shape), math.prod(shape) * bpe) for _, shape, bpe in named_shapes]

    members: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    # Largest first; ties keep the model's order, so the result is deterministic.
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], i)):
        # Lightest fragment; among equally light ones the emptiest (so zero-byte tensors cannot
        # leave a fragment empty), then the lowest index.
        target = min(range(count), key=lambda p: (load[p], len(members[p]), p))
        members[target].append(i)
        load[target] += sizes[i][1]

    fragments = []
    for p, idx in enumerate(members):
        idx.sort()
        fragments.append(
            Fragment(
                index=p,
                names=tuple(names[i] for i in idx),
                numel=sum(sizes[i][0] for i in idx),
                nbytes=sum(sizes[i][1] for i in idx),
            )
        )
    return fragments


def partition_module(module: nn.Module, count: int) -> list[Fragment]:
    """:func:`partition` over the module's trainable parameters."""
    named = [(n, tuple(p.shape), p.element_size()) for n, p in module.named_parameters() if p.requires_grad]
    return partition(named, count)


def fragment_views(params: dict[str, torch.Tensor], fragment: Fragment) -> dict[str, torch.Tensor]:
    """The fragment's tensors by name, as live views into ``params`` (a module's named parameters)."""
    return {n: params[n] for n in fragment.names}


def imbalance(fragments: list[Fragment]) -> float:
    """Bytes of the heaviest fragment over the mean (1.0 is perfect balance)."""
    if not fragments:
        raise ValueError("imbalance of no fragments")
    mean = sum(f.nbytes for f in fragments) / len(fragments)
    return max(f.nbytes for f in fragments) / mean if mean else 1.0


def due_fragments(step: int, count: int, every: int) -> list[int]:
    """Fragments due after ``step`` completed inner steps: p with (step - p) % every == 0."""
    if count < 1 or every < 1:
        raise ValueError(f"count and every must be >= 1, got count={count}, every={every}")
    if step <= 0:
        return []
    return [p for p in range(count) if (step - p) % every == 0]
