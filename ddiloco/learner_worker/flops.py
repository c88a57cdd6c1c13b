"""The learner's MFU figure: its model FLOPs per token (``platform/models/cost.py``) against its device's peak.

Recomputed activations do not count, as in torchtitan's and PaLM's MFU, so turning activation checkpointing on lowers
the figure by what the recomputation costs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddiloco.platform.config import ModelConfig
from ddiloco.platform.models.cost import count_flops_per_token
from ddiloco.platform.units import format_flops

_FALLBACK_PEAK = 312e12
"""What torchtitan's table answers for a device it does not know (an A100's bf16 peak): not this device's figure."""


@dataclass(frozen=True)
class ModelCost:
    """Model FLOPs per trained token and the device's dense bf16 peak FLOP/s; either None where unknown, with why."""

    flops_per_token: float | None
    peak_flops: float | None
    device_name: str
    why_not: str = ""

    def per_device_flops(self, tokens_per_s: float, world: int) -> float | None:
        """Model FLOP/s of one device when the job trains ``tokens_per_s`` over ``world`` devices."""
        if self.flops_per_token is None:
            return None
        return tokens_per_s * self.flops_per_token / max(1, world)

    def mfu(self, tokens_per_s: float, world: int) -> float | None:
        """Model FLOPs utilisation: the share of the device's peak the job's tokens/s uses (None where unknown)."""
        flops = self.per_device_flops(tokens_per_s, world)
        return None if flops is None or self.peak_flops is None else flops / self.peak_flops

    def describe(self) -> str:
        """A clause for the learner's join line."""
        if self.flops_per_token is None:
            return f"model FLOPs not counted ({self.why_not})"
        peak = f"peak {format_flops(self.peak_flops)}/s ({self.device_name})" if self.peak_flops else f"no MFU ({self.why_not})"
        return f"{format_flops(self.flops_per_token)} per token, {peak}"


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(the device's dense bf16 peak FLOP/s from torchtitan's table, ""), or (None, why): a CPU, a GPU the table does
    not know (it would answer an A100's figure), or no torchtitan (the ``titan`` extra) installed."""
    if device.type != "cuda":
        return None, f"no peak is published for a {device.type} device"
    name = torch.cuda.get_device_name(device)
    try:
        from torchtitan.tools.utils import get_peak_flops
    except ImportError:
        return None, "the table of GPU peaks comes with torchtitan, which is not installed (pip install 'ddiloco[titan]')"
    peak = get_peak_flops(name)
    if peak == _FALLBACK_PEAK and "A100" not in name:
        return None, f"{name} is not in torchtitan's table of peaks"
    return peak, ""


def model_cost(model: ModelConfig, device: torch.device) -> ModelCost:
    """What the learner's MFU needs; never raises (a learner trains on without the figure)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    peak, why = peak_flops(device)
    try:
        per_token = count_flops_per_token(model)
    except ValueError as err:
        return ModelCost(None, peak, name, str(err))
    return ModelCost(per_token, peak, name, why)
