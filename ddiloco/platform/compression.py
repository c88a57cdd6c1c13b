"""Codecs for outer gradients: float32, bf16, and int8 / int4 with per-block absmax scales.

``encode_delta`` returns tensors and string metadata ready for a safetensors blob;
``decode_delta`` checks everything it reads, because a blob comes from another process.

Quantisation is symmetric round-to-nearest: a block of ``block_size`` consecutive values (of the
flattened tensor) shares the scale ``absmax / L`` with L = 127 (int8) or 7 (int4), so every value
is reproduced within ``scale / 2``. A block holding a non-finite value decodes to non-finite values,
which the synchronizer's validation rejects."""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.nn.functional as F

CODECS = ("none", "bf16", "int8", "int4")
FORMAT = "ddiloco-delta/1"
_LEVELS = {"int8": 127, "int4": 7}
_SEP = "::"


class CompressionError(ValueError):
    """A delta that cannot be encoded, or a blob that does not decode to what was expected."""


def _num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _quantize(flat: torch.Tensor, block_size: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat float32 -> (int8 codes in [-levels, levels] of the same length, float32 scale per block)."""
    n = flat.numel()
    nb = _num_blocks(n, block_size)
    blocks = F.pad(flat, (0, nb * block_size - n)).view(nb, block_size)
    scale = blocks.abs().amax(dim=1) / levels
    # An all-zero block has scale 0: divide by 1 instead so its codes are 0, not NaN.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / divisor.unsqueeze(1)).clamp_(-levels, levels)
    q = torch.nan_to_num(q, nan=0.0)  # defined cast; the block's NaN/inf scale still poisons its decode
    return q.flatten()[:n].to(torch.int8), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    nb = scale.numel()
    blocks = F.pad(q.to(torch.float32), (0, nb * block_size - numel)).view(nb, block_size)
    return (blocks * scale.unsqueeze(1)).flatten()[:numel]


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] -> uint8, two codes a byte (low nibble first), offset by 8."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8)])
    return u[0::2] | (u[1::2] << 4)


def _unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    u = torch.stack([packed & 0x0F, packed >> 4], dim=1).flatten()[:numel]
    return u.to(torch.int8) - 8


def encode_delta(
    tensors: dict[str, torch.Tensor], codec: str, block_size: int = 64
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Encode float tensors with ``codec``; keys are ``<name>::q`` (and ``<name>::scale``)."""
    if codec not in CODECS:
        raise CompressionError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    if block_size < 1:
        raise CompressionError(f"block_size must be >= 1, got {block_size}")
    out: dict[str, torch.Tensor] = {}
    info: dict[str, dict[str, Any]] = {}
    for name, t in tensors.items():
        if _SEP in name:
            raise CompressionError(f"tensor name {name!r} must not contain {_SEP!r}")
        if not t.is_floating_point():
            raise CompressionError(f"tensor {name!r} has dtype {t.dtype}; only floating-point deltas are encoded")
        info[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        # copy=True: the result must not alias a live parameter that keeps training.
        x = t.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
        if codec == "none":
            out[name + "::q"] = x
        elif codec == "bf16":
            out[name + "::q"] = x.to(torch.bfloat16).contiguous()
        else:
            q, scale = _quantize(x.flatten(), block_size, _LEVELS[codec])
            out[name + "::q"] = (_pack4(q) if codec == "int4" else q).contiguous()
            out[name + "::scale"] = scale.contiguous()
    metadata = {
        "format": FORMAT,
        "codec": codec,
        "block_size": str(block_size),
        "tensors": json.dumps(info, sort_keys=True, separators=(",", ":")),
    }
    return out, metadata


def _parse_metadata(metadata: dict[str, str] | None) -> tuple[str, int, dict[str, tuple[int, ...]]]:
    if not metadata:
        raise CompressionError("delta metadata is missing")
    codec = metadata.get("codec")
    if codec not in CODECS:
        raise CompressionError(f"unknown codec {codec!r} in delta metadata; expected one of {', '.join(CODECS)}")
    try:
        block_size = int(metadata["block_size"])
        raw = json.loads(metadata["tensors"])
    except KeyError as err:
        raise CompressionError(f"delta metadata lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise CompressionError(f"malformed delta metadata: {err}") from None
    if block_size < 1:
        raise CompressionError(f"malformed delta metadata: block_size {block_size} must be >= 1")
    if not isinstance(raw, dict):
        raise CompressionError("malformed delta metadata: 'tensors' must be a JSON object")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, spec in raw.items():
        shape = spec.get("shape") if isinstance(spec, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CompressionError(f"malformed delta metadata: tensor {name!r} has no valid shape")
        shapes[name] = tuple(shape)
    return codec, block_size, shapes


def _take(tensors: dict[str, torch.Tensor], key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = tensors.get(key)
    if t is None:
        raise CompressionError(f"delta is missing tensor {key!r}")
    if t.dtype != dtype:
        raise CompressionError(f"delta tensor {key!r} has dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != shape:
        raise CompressionError(f"delta tensor {key!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def decode_delta(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    expected: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Decode to float32 tensors of the original shapes, checking names and shapes against ``expected``."""
    codec, block_size, shapes = _parse_metadata(metadata)
    if expected is not None:
        missing = sorted(set(expected) - set(shapes))
        extra = sorted(set(shapes) - set(expected))
        if missing or extra:
            raise CompressionError(f"delta tensors do not match the fragment: missing {missing}, unexpected {extra}")
        for name, shape in expected.items():
            if tuple(shape) != shapes[name]:
                raise CompressionError(f"delta tensor {name!r} has shape {shapes[name]}, expected {tuple(shape)}")
    keys = {f"{name}::q" for name in shapes}
    if codec in _LEVELS:
        keys |= {f"{name}::scale" for name in shapes}
    unknown = sorted(set(tensors) - keys)
    if unknown:
        raise CompressionError(f"delta holds unexpected tensors {unknown}")

    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if codec == "none":
            out[name] = _take(tensors, name + "::q", torch.float32, shape).clone()
        elif codec == "bf16":
            out[name] = _take(tensors, name + "::q", torch.bfloat16, shape).to(torch.float32)
        else:
            scale = _take(tensors, name + "::scale", torch.float32, (_num_blocks(numel, block_size),))
            if codec == "int8":
                q = _take(tensors, name + "::q", torch.int8, (numel,))
            else:
                q = _unpack4(_take(tensors, name + "::q", torch.uint8, (_num_blocks(numel, 2),)), numel)
            if numel and int(q.min()) < -_LEVELS[codec]:
                raise CompressionError(f"delta tensor {name + '::q'!r} holds codes outside [-{_LEVELS[codec]}, {_LEVELS[codec]}]")
            out[name] = _dequantize(q, scale, block_size, numel).view(shape)
    return out


def encoded_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Payload bytes of encoded tensors (excluding the safetensors header)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
