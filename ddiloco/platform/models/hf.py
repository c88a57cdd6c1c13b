"""``model.kind: hf``: a Hugging Face ``transformers`` causal LM, from a config dict or a save_pretrained directory
(local or any fsspec URL: only its config.json is read).

The model is used as transformers builds it (no wrapper), so its parameter names are the ones
``save_pretrained`` writes and ``from_pretrained`` reads; tied input and output embeddings are one
parameter, so ``named_parameters()`` lists it once and a fragment holds it once."""

from __future__ import annotations

import json
import posixpath
from typing import Any

import torch
from fsspec.core import url_to_fs
from torch import nn

from ddiloco.platform.config import ConfigError, ModelConfig


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config as a plain dict: ``model.hf_config`` (vocab_size defaulting to
    model.vocab_size) or the config.json of ``model.hf_path`` (a local folder or any fsspec URL)."""
    if cfg.hf_config is not None:
        return {"vocab_size": cfg.vocab_size, **cfg.hf_config}
    assert cfg.hf_path is not None  # the config validator guarantees one of the two
    fs, root = url_to_fs(cfg.hf_path)
    path = posixpath.join(root.rstrip("/"), "config.json")
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise ConfigError(f"model.hf_path {cfg.hf_path!r}: no config.json there (expected a save_pretrained directory)") from None
    except OSError as err:
        raise ConfigError(f"model.hf_path {cfg.hf_path!r}: config.json cannot be read: {' '.join(str(err).split())}") from None
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise ConfigError(f"model.hf_path {cfg.hf_path!r}: config.json does not parse: {err}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"model.hf_path {cfg.hf_path!r}: config.json has no model_type")
    return data


def build_hf_config(cfg: ModelConfig) -> Any:
    """The ``transformers`` config object, checked against model.vocab_size and model.seq_len."""
    from transformers import AutoConfig

    data = dict(hf_config_dict(cfg))
    model_type = data.pop("model_type")
    try:
        hf = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"model.hf_config: transformers cannot build a {model_type!r} config: {err}") from None
    why = cfg.hf_mismatch(hf.to_dict())
    if why:
        raise ConfigError(why)
    return hf


def build_hf(cfg: ModelConfig) -> nn.Module:
    """A freshly initialised causal LM (float32; the caller seeds torch's RNG)."""
    from transformers import AutoModelForCausalLM

    hf = build_hf_config(cfg)
    try:
        return AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    except ValueError as err:
        raise ConfigError(f"model.hf_config: {hf.model_type!r} is not a causal LM transformers can build: {err}") from None


def is_hf(model: nn.Module) -> bool:
    """True for a ``transformers`` model (it has ``save_pretrained``)."""
    return callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config")
