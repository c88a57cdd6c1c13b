"""A small CNN for single-channel square images (scikit-learn's 8x8 digits by default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.platform.config import ModelConfig


class SmallCNN(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        side = cfg.image_size // 2
        self.fc1 = nn.Linear(32 * side * side, 64)
        self.fc2 = nn.Linear(64, cfg.n_classes)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1, S, S) images in [0, 1] -> (B, n_classes) logits."""
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, 32, S/2, S/2)
        x = self.drop(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)
