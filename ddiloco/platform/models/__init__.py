"""Model zoo: build a model from its config, compute its training loss, evaluate it.

Every model takes ``Batch.inputs`` and returns logits (or a ``transformers`` output holding them);
a model may instead define ``compute_loss(batch) -> (loss, info)``. A model that exposes ``aux_loss`` (a tensor set during
``forward``) and ``aux_loss_coef`` gets the auxiliary term added to its training loss."""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddiloco.platform.config import ModelConfig
from ddiloco.platform.data import Batch
from ddiloco.platform.models.gpt import GPT
from ddiloco.platform.models.moe import MoEGPT
from ddiloco.platform.models.vision import SmallCNN

__all__ = ["GPT", "MoEGPT", "SmallCNN", "build_model", "compute_loss", "evaluate", "load_factory", "logits_of", "training_loss"]


def load_factory(import_path: str) -> Any:
    """Resolve ``package.module:attr.path`` to the object it names."""
    module_name, _, attr_path = import_path.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"model.import_path {import_path!r} must look like 'package.module:factory'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:
        raise ValueError(f"model.import_path {import_path!r}: cannot import module {module_name!r}: {err}") from err
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"model.import_path {import_path!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(obj):
        raise ValueError(f"model.import_path {import_path!r}: {attr_path!r} is not callable")
    return obj


def _build_imported(cfg: ModelConfig) -> nn.Module:
    assert cfg.import_path is not None  # the config validator guarantees it for kind "import"
    factory = load_factory(cfg.import_path)
    try:
        model = factory(**cfg.kwargs)
    except Exception as err:
        raise ValueError(
            f"model.import_path {cfg.import_path!r}: calling the factory with model.kwargs {cfg.kwargs} failed: {err}"
        ) from err
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.import_path {cfg.import_path!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """Build the model ``cfg`` describes, on CPU, with weights determined by ``seed`` alone."""
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.kind == "gpt":
            return GPT(cfg)
        if cfg.kind == "moe_gpt":
            return MoEGPT(cfg)
        if cfg.kind == "vision":
            return SmallCNN(cfg)
        if cfg.kind == "import":
            return _build_imported(cfg)
        if cfg.kind == "hf":
            from ddiloco.platform.models.hf import build_hf

            return build_hf(cfg)
        if cfg.kind == "torchtitan":
            from ddiloco.platform.models.titan import build_titan

            return build_titan(cfg)
    raise ValueError(f"model.kind {cfg.kind!r} is not one of gpt, moe_gpt, vision, import, hf, torchtitan")


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a forward pass: a tensor, a ``transformers`` ``ModelOutput``'s ``.logits``, or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returned {type(output).__name__}: expected logits, a ModelOutput with .logits, or a tuple")


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _loss_parts(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(training loss, cross-entropy, aux loss or None) of a model without its own ``compute_loss``."""
    # Batch.targets are already the next tokens: no shift here (a transformers model given labels would shift again).
    logits = logits_of(model(batch.inputs))
    ce = _cross_entropy(logits, batch.targets)
    aux = getattr(model, "aux_loss", None)
    if isinstance(aux, torch.Tensor):
        return ce + float(getattr(model, "aux_loss_coef", 0.0)) * aux, ce, aux
    return ce, ce, None


def training_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The loss a step trains on (cross-entropy plus any weighted aux loss), with nothing read back from the device:
    on a GPU, reading a value here would make the host wait for the forward before it could queue the backward."""
    own = getattr(model, "compute_loss", None)
    if callable(own):
        result = own(batch)
        return result if isinstance(result, torch.Tensor) else result[0]
    return _loss_parts(model, batch)[0]


def compute_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Training loss (cross-entropy plus any weighted aux loss) and its parts as floats."""
    own = getattr(model, "compute_loss", None)
    if callable(own):
        result = own(batch)
        if isinstance(result, torch.Tensor):
            return result, {"loss": float(result.detach())}
        return result
    loss, ce, aux = _loss_parts(model, batch)
    info = {"loss": float(ce.detach())}
    if aux is not None:
        info["aux"] = float(aux.detach())
    return loss, info


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch]) -> tuple[float, float | None]:
    """(mean cross-entropy weighted by tokens, accuracy for classifiers else None)."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    was_training = model.training
    model.eval()
    try:
        loss_sum, tokens, correct, examples = 0.0, 0, 0, 0
        classifier = True
        own = getattr(model, "compute_loss", None)
        for batch in batches:
            if callable(own):
                loss, info = compute_loss(model, batch)
                ce = info.get("loss", float(loss))
                classifier = False
            else:
                logits = logits_of(model(batch.inputs))
                ce = float(_cross_entropy(logits, batch.targets))
                # Classification: one label per example, (B, C) logits.
                if logits.dim() == 2 and batch.targets.dim() == 1:
                    correct += int((logits.argmax(dim=-1) == batch.targets).sum())
                    examples += batch.targets.numel()
                else:
                    classifier = False
            loss_sum += ce * batch.tokens
            tokens += batch.tokens
        accuracy = correct / examples if classifier and examples else None
        return loss_sum / max(tokens, 1), accuracy
    finally:
        model.train(was_training)
