"""Reading a model's weights from an export or a save_pretrained directory (``model.init_from``).

Only safetensors is read, from any fsspec URL or local path: a ``*.safetensors`` file, or a
directory holding ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Pickled
checkpoints (``pytorch_model.bin``) are refused, never unpickled."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping

import fsspec
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch import nn

from ddiloco.platform.config import ConfigError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightsError(ConfigError):
    """Weights that cannot be read or do not fit the run's model; the message names the problem."""


def _read_file(fs: fsspec.AbstractFileSystem, path: str, source: str) -> dict[str, torch.Tensor]:
    try:
        with fs.open(path, "rb") as f:
            return load_safetensors(f.read())
    except FileNotFoundError:
        raise WeightsError(f"{source}: {path} does not exist") from None
    except (SafetensorError, ValueError) as err:
        raise WeightsError(f"{source}: {path} is not a readable safetensors file: {err}") from None


def weight_files(url: str, source: str | None = None) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The safetensors files that hold the weights at ``url`` (a file, or a directory with ``model.safetensors`` or a sharded
    index), without reading them; errors start with ``source``."""
    label = source or url
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise WeightsError(f"{label}: no such file or directory")
    if not fs.isdir(path):
        if not path.endswith(".safetensors"):
            raise WeightsError(f"{label}: not a .safetensors file (only safetensors is read, never a pickled checkpoint)")
        return fs, [path]
    single, index = posixpath.join(path, WEIGHTS_FILE), posixpath.join(path, INDEX_FILE)
    if fs.exists(single):
        return fs, [single]
    if fs.exists(index):
        try:
            weight_map = json.loads(fs.cat_file(index))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise WeightsError(f"{label}: {INDEX_FILE} does not parse: {err}") from None
        for shard in shards:
            if not isinstance(shard, str) or posixpath.basename(shard) != shard:
                raise WeightsError(f"{label}: {INDEX_FILE} names a shard outside the directory: {shard!r}")
        return fs, [posixpath.join(path, shard) for shard in shards]
    raise WeightsError(f"{label}: no {WEIGHTS_FILE} or {INDEX_FILE} there (only safetensors is read, never a pickled checkpoint)")


def read_weights(url: str, source: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file or directory at ``url`` (a path or any fsspec URL); errors start with ``source``."""
    fs, files = weight_files(url, source)
    out: dict[str, torch.Tensor] = {}
    for path in files:
        out.update(_read_file(fs, path, source or url))
    return out


def load_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], source: str) -> nn.Module:
    """Copy ``weights`` into every parameter of ``model`` (in place, so tied parameters stay tied); returns the model.

    Every parameter must be there with its shape; other names are refused unless the model's
    state dict knows them (a tied alias such as ``lm_head.weight``, or a buffer), which are skipped."""
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(weights))
    if missing:
        raise WeightsError(f"{source}: {len(missing)} of the model's parameters are missing, e.g. {missing[:3]}")
    unknown = sorted(set(weights) - set(model.state_dict()))
    if unknown:
        raise WeightsError(f"{source}: {len(unknown)} tensors are not in the model, e.g. {unknown[:3]}")
    for name, p in own.items():
        if tuple(weights[name].shape) != tuple(p.shape):
            raise WeightsError(f"{source}: {name} has shape {tuple(weights[name].shape)}, the model's is {tuple(p.shape)}")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(weights[name])
    return model
