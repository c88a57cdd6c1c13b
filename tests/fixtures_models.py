"""Model factories for the ``model.kind: import`` tests."""

from __future__ import annotations

from torch import nn


def tiny_mlp(in_features: int = 4, hidden: int = 8, out_features: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))


def not_a_module() -> str:
    return "not a module"
