"""What a model costs, from its config alone: its parameters, the FLOPs of a trained token, and the state a learner's
rank keeps for it. The model is built on the meta device (shapes only: no memory, no arithmetic), so a 70B config is
sized in seconds on a laptop.

FLOPs are those of one sequence's forward and backward pass as torch's ``FlopCounterMode`` counts them. The meta
device takes the math attention path, so the whole T × T score matrix counts, as in torchtitan's and PaLM's MFU (a
causal kernel skips about half of it); recomputed activations do not count."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.platform.config import ModelConfig
from ddiloco.platform.redact import one_line

STATE_BYTES_PER_PARAM = 20
"""The float32 state a learner keeps per parameter: weights, gradients, AdamW's two moments and the outer snapshot the
next increment is taken against (4 bytes each). Activations, a step's transient buffers and FSDP's gathered bf16
blocks come on top."""


@dataclass(frozen=True)
class ModelSize:
    """A model's parameters (those of its embedding tables apart) and FLOPs per trained token (None, with why)."""

    params: int
    embedding_params: int
    flops_per_token: float | None
    why_uncounted: str = ""


def _first_sentence(err: BaseException) -> str:
    """An error's first sentence on one line, credentials masked: short enough for a log line."""
    return one_line(err, 400).split(". ")[0][:160]


def meta_model(model: ModelConfig) -> nn.Module:
    """The model ``model`` describes, on the meta device."""
    from ddiloco.platform.models import build_model

    with torch.device("meta"):
        return build_model(model)


def _flops_per_token(net: nn.Module, model: ModelConfig) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from ddiloco.platform.data import Batch
    from ddiloco.platform.models import training_loss

    if model.kind == "vision":
        raise ValueError("model.kind vision trains on images, not tokens")
    try:
        tokens = torch.zeros(1, model.seq_len, dtype=torch.long, device="meta")
        with FlopCounterMode(display=False) as counter:
            training_loss(net, Batch(tokens, tokens, model.seq_len)).backward()
    except Exception as err:  # noqa: BLE001 - any model may fail on the meta device; only the figure is lost
        raise ValueError(f"the model does not run on the meta device: {_first_sentence(err)}") from None
    return counter.get_total_flops() / model.seq_len


def count_flops_per_token(model: ModelConfig) -> float:
    """Forward-and-backward FLOPs per token of one ``model.seq_len`` sequence; ValueError naming why a model cannot
    be counted (one whose forward depends on its data, as a routed mixture of experts, cannot run on the meta device)."""
    try:
        net = meta_model(model)
    except Exception as err:  # noqa: BLE001 - a factory may refuse the meta device; only the figure is lost
        raise ValueError(f"the model cannot be built on the meta device: {_first_sentence(err)}") from None
    return _flops_per_token(net, model)


def model_size(model: ModelConfig, net: nn.Module | None = None) -> ModelSize:
    """Parameters and FLOPs per token of the model ``model`` describes (tied weights counted once); ``net``: its meta
    build, when the caller has one."""
    net = meta_model(model) if net is None else net
    params = sum(p.numel() for p in net.parameters())
    embedding = sum(p.numel() for p in {id(p): p for m in net.modules() if isinstance(m, nn.Embedding)
                                        for p in m.parameters(recurse=False)}.values())
    try:
        return ModelSize(params, embedding, _flops_per_token(net, model))
    except ValueError as err:
        return ModelSize(params, embedding, None, str(err))


def state_bytes_per_rank(params: int, parallelism: str, ranks: int) -> int:
    """The float32 state one rank keeps for a replica of ``params`` parameters: all of it under ddp, its row shard of
    ``ranks`` under fsdp (hsdp shards within a node: ``ranks`` is then the ranks of one node)."""
    share = params if parallelism == "ddp" else -(-params // max(1, ranks))
    return STATE_BYTES_PER_PARAM * share
