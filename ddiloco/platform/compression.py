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
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ddiloco.platform.config import CODECS

FORMAT = "ddiloco-delta/1"
_LEVELS = {"int8": 127, "int4": 7}
_SEP = "::"


class CompressionError(ValueError):
    """A delta that cannot be encoded, or a blob that does not decode to what was expected."""


def _num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def codec_nbytes(numel: int, codec: str, block_size: int) -> int:
    """Bytes of ``numel`` values encoded with ``codec``: the values and their per-block scales, no blob header."""
    if codec == "none":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    scales = 4 * _num_blocks(numel, block_size)
    return (numel if codec == "int8" else -(-numel // 2)) + scales


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """A flat tensor as [blocks, block_size], the last block padded with zeros."""
    nb = _num_blocks(flat.numel(), block_size)
    return F.pad(flat, (0, nb * block_size - flat.numel())).view(nb, block_size)


def _quantize(flat: torch.Tensor, block_size: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat float32 -> (int8 codes in [-levels, levels] of the same length, float32 scale per block)."""
    n = flat.numel()
    blocks = _blocks(flat, block_size)
    amax = blocks.abs().amax(dim=1)
    # On a GPU, divided by a tensor, not a Python number: CUDA turns division by a host scalar into a multiplication
    # by its reciprocal (one bit off at times), and a device's codes must be the CPU's byte for byte.
    scale = amax.div_(torch.full_like(amax, levels)) if amax.is_cuda else amax.div_(levels)
    # An all-zero block has scale 0: divide by 1 instead so its codes are 0, not NaN.
    divisor = torch.where(scale > 0, scale, 1.0)
    q = torch.div(blocks, divisor.unsqueeze(1)).round_().clamp_(-levels, levels)
    q = q.nan_to_num_(nan=0.0)  # defined cast; the block's NaN/inf scale still poisons its decode
    return q.view(-1)[:n].to(torch.int8), scale


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] -> uint8, two codes a byte (low nibble first), offset by 8."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=u.device)])
    return u[0::2] | (u[1::2] << 4)


def _fusable(tensors: list[torch.Tensor], codec: str, block_size: int) -> bool:
    """A quantized fragment of several tensors on one GPU whose blocks (and int4 byte pairs) never straddle two of them.

    Encoding it as one buffer gives the same bytes with one set of kernels instead of one a tensor: fewer calls for the
    link's thread to make (each one takes the GIL back from the training thread). Not on a CPU, where the one buffer
    leaves the cache and costs more than the calls (docs/ddp.md)."""
    if codec not in _LEVELS or len(tensors) < 2 or not tensors[0].is_cuda:
        return False
    return all(t.device == tensors[0].device for t in tensors) and _straddle_free([t.numel() for t in tensors], codec, block_size)


def _straddle_free(numels: list[int], codec: str, block_size: int) -> bool:
    """Whether tensors of these sizes laid end to end start each at a block (and, int4, at a byte): all but the last
    fill their blocks (and pairs) exactly."""
    return all(n % block_size == 0 and (codec != "int4" or n % 2 == 0) for n in numels[:-1])


def _quantize_together(xs: list[torch.Tensor], codec: str, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per flat float32 tensor of ``xs``, its (codes, scales) in host memory, quantized as one buffer: two copies to host
    memory for the lot. The caller checks :func:`_fusable`, so the bytes are those of one tensor at a time."""
    q, scale = _quantize(torch.cat(xs), block_size, _LEVELS[codec])
    codes = (_pack4(q) if codec == "int4" else q).to("cpu")
    scales = scale.to("cpu")
    out, c0, s0 = [], 0, 0
    for x in xs:
        n = x.numel()
        nc, nb = (-(-n // 2) if codec == "int4" else n), _num_blocks(n, block_size)
        # Copies, not views: a blob's tensors must not share memory (safetensors refuses them).
        out.append((codes[c0 : c0 + nc].clone(), scales[s0 : s0 + nb].clone()))
        c0, s0 = c0 + nc, s0 + nb
    return out


def _encode_one(name: str, t: torch.Tensor, codec: str, block_size: int) -> dict[str, torch.Tensor]:
    # Encoded where the tensor lives (a GPU learner's increment stays on its device); only the encoded bytes
    # are copied to host memory, and copy=True: the result never aliases a live parameter that keeps training.
    x = t.detach().to(dtype=torch.float32).contiguous()
    if codec == "none":
        return {name + "::q": x.to("cpu", copy=True)}
    if codec == "bf16":
        return {name + "::q": x.to(torch.bfloat16).to("cpu")}
    # Codes and scales are new tensors (never views of x): on a CPU they are the result, not copied again.
    q, scale = _quantize(x.view(-1), block_size, _LEVELS[codec])
    return {name + "::q": (_pack4(q) if codec == "int4" else q).to("cpu"), name + "::scale": scale.to("cpu")}


def encode_delta(
    tensors: dict[str, torch.Tensor], codec: str, block_size: int = 64
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Encode float tensors with ``codec`` on their device, into host tensors; keys are ``<name>::q`` (and
    ``<name>::scale``). The bytes do not depend on the device: the same float32 operations either way."""
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
    if _fusable(list(tensors.values()), codec, block_size):
        xs = [t.detach().to(dtype=torch.float32).reshape(-1) for t in tensors.values()]
        for name, (q, scale) in zip(tensors, _quantize_together(xs, codec, block_size), strict=True):
            out[name + "::q"], out[name + "::scale"] = q, scale
    else:
        for name, t in tensors.items():
            out.update(_encode_one(name, t, codec, block_size))
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


def _check_against(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    if missing or extra:
        raise CompressionError(f"delta tensors do not match the fragment: missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if tuple(shape) != shapes[name]:
            raise CompressionError(f"delta tensor {name!r} has shape {shapes[name]}, expected {tuple(shape)}")


def decode_delta(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    expected: dict[str, tuple[int, ...]] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Decode to float32 tensors of the original shapes on ``device``, checking names and shapes against ``expected``.

    The tensors are views of one new flat buffer (see :func:`decode_delta_into`)."""
    _codec, _block_size, shapes = _parse_metadata(metadata)
    if expected is not None:
        _check_against(shapes, expected)
    layout = list(shapes.items())
    out = torch.empty(sum(math.prod(s) for _, s in layout), dtype=torch.float32, device=device)
    decode_delta_into(tensors, metadata, layout, out, norms=False)
    views, offset = {}, 0
    for name, shape in layout:
        numel = math.prod(shape)
        views[name] = out[offset : offset + numel].view(shape)
        offset += numel
    return views


DECODE_CHUNK = 1 << 19
"""Elements decoded at a time on a CPU (2 MB of float32): a chunk stays in cache (L2/L3) while it is
converted, checked, scaled and its squared norm summed, so each output byte goes to memory once;
measured best among 128 K, 512 K and 2 M on a 2-core EPYC (1 MB L2 per core, 32 MB L3)."""

_LITTLE_ENDIAN = sys.byteorder == "little"
# Big-endian fallback for int4: a table from a packed byte to its two int8 codes times 16, as the
# bytes of one int16 (built through a view, so it holds whatever int16 those bytes make here).
_INT4_PAIRS = torch.tensor([[((b & 0x0F) - 8) * 16, ((b >> 4) - 8) * 16] for b in range(256)], dtype=torch.int8).view(torch.int16)


def decode_delta_into(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    layout: Sequence[tuple[str, tuple[int, ...]]],
    out: torch.Tensor,
    *,
    norms: bool = True,
) -> torch.Tensor | None:
    """Decode into ``out``, the flat float32 vector holding ``layout``'s tensors back to back, in order
    (on any device); returns each tensor's squared L2 norm (float64, in layout order), unless not asked for ``norms``.

    The blob must hold exactly the layout's tensors and shapes. Nothing the size of the delta is
    allocated: each tensor is decoded chunk by chunk straight into its slice of ``out``."""
    codec, block_size, shapes = _parse_metadata(metadata)
    _check_against(shapes, {name: tuple(shape) for name, shape in layout})
    keys = {f"{name}::q" for name in shapes}
    if codec in _LEVELS:
        keys |= {f"{name}::scale" for name in shapes}
    unknown = sorted(set(tensors) - keys)
    if unknown:
        raise CompressionError(f"delta holds unexpected tensors {unknown}")
    total = sum(math.prod(shape) for _, shape in layout)
    if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != total or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 vector of {total} elements, got {out.dtype} {tuple(out.shape)}")
    # On a GPU one kernel per tensor is best; on a CPU, cache-sized chunks of whole blocks (and whole bytes of int4).
    largest = max((math.prod(shape) for _, shape in layout), default=1)
    unit = math.lcm(block_size, 2)
    # Never more than the largest tensor: a blob's block_size is its sender's claim, not a size to allocate.
    step = max(1, largest if out.device.type != "cpu" else min(largest, -(-DECODE_CHUNK // unit) * unit))
    scratch = _Scratch(step, out.device) if codec == "int4" else None
    sq = torch.empty(len(layout), dtype=torch.float64, device=out.device) if norms else None
    offset = 0
    for i, (name, shape) in enumerate(layout):
        numel = math.prod(shape)
        dst = out[offset : offset + numel]
        offset += numel
        if codec == "none":
            q, scale = _take(tensors, name + "::q", torch.float32, tuple(shape)).reshape(-1), None
        elif codec == "bf16":
            q, scale = _take(tensors, name + "::q", torch.bfloat16, tuple(shape)).reshape(-1), None
        else:
            scale = _take(tensors, name + "::scale", torch.float32, (_num_blocks(numel, block_size),)).to(out.device)
            if codec == "int8":
                q = _take(tensors, name + "::q", torch.int8, (numel,))
            else:
                q = _take(tensors, name + "::q", torch.uint8, (_num_blocks(numel, 2),))
                # Codes come out times 16 (see _unpack4); a power of two, so (16 c) (s / 16) == c s exactly.
                scale = scale / 16
        norm = _decode_tensor(codec, block_size, q.to(out.device), scale, dst, step, name, scratch, norms)
        if sq is not None:
            sq[i] = norm
    return sq


class _Scratch:
    """int4 unpacking's chunk-sized temporaries, shared by a blob's tensors."""

    def __init__(self, step: int, device: torch.device) -> None:
        half = (step + 1) // 2
        self.x = torch.empty(half, dtype=torch.uint8, device=device)
        self.lo = torch.empty(half, dtype=torch.int16, device=device)
        self.hi = torch.empty(half, dtype=torch.int16, device=device)
        self.idx = torch.empty(0 if _LITTLE_ENDIAN else half, dtype=torch.int32, device=device)


def _unpack4(packed: torch.Tensor, s: _Scratch) -> torch.Tensor:
    """Packed int4 (two codes a byte, low nibble first, offset by 8) -> int8 codes times 16, two per byte.

    nibble ^ 8 is the code's 4-bit two's complement; in the high half of a byte it reads as the int8
    code * 16. A byte p = lo + 16 hi becomes the int16 16 lo + 4096 hi = 16 (p + 15 (p & 0xF0)):
    its two bytes are [low code, high code] on a little-endian machine."""
    n = packed.numel()
    v, t = s.lo[:n], s.hi[:n]
    if not _LITTLE_ENDIAN:
        s.idx[:n].copy_(packed)
        torch.index_select(_INT4_PAIRS.to(packed.device), 0, s.idx[:n], out=v)
        return v.view(torch.int8)
    x = s.x[:n]
    v.copy_(torch.bitwise_xor(packed, 0x88, out=x))
    torch.bitwise_and(v, 0xF0, out=t)
    return v.add_(t, alpha=15).bitwise_left_shift_(4).view(torch.int8)  # (wraps in int16, as intended)


def _decode_tensor(
    codec: str, block_size: int, q: torch.Tensor, scale: torch.Tensor | None, dst: torch.Tensor, step: int, name: str,
    scratch: _Scratch | None, norm: bool = True,
) -> torch.Tensor | None:
    """Decode one tensor's codes ``q`` into ``dst`` chunk by chunk; returns its squared norm (0-d float64; None
    unless ``norm``)."""
    numel = dst.numel()
    sq = torch.zeros((), dtype=torch.float64, device=dst.device) if norm else None
    levels = _LEVELS.get(codec)
    # The smallest valid code, as it is read below (int4 codes come out times 16).
    lowest = None if levels is None else -levels * (16 if codec == "int4" else 1)
    for a in range(0, numel, step):
        b = min(numel, a + step)
        d = dst[a:b]
        if codec == "int4" and scratch is not None:
            codes = _unpack4(q[a // 2 : (b + 1) // 2], scratch)[: b - a]  # a is even: chunks start on a byte
        else:
            codes = q[a:b]
        if lowest is not None and scale is not None:
            if int(codes.amin()) < lowest:
                raise CompressionError(f"delta tensor {name + '::q'!r} holds codes outside [-{levels}, {levels}]")
            d.copy_(codes)
            full, first = (b - a) // block_size, a // block_size
            d[: full * block_size].view(full, block_size).mul_(scale[first : first + full, None])
            if full * block_size < b - a:
                d[full * block_size :].mul_(scale[first + full])
        else:
            d.copy_(codes)
        if sq is not None:
            sq += torch.dot(d, d)
    return sq


def encoded_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Payload bytes of encoded tensors (excluding the safetensors header)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --- compact downloads (the scheme: platform/compact.py) ------------------------------------------

Tensors = dict[str, torch.Tensor]


def encode_against(target: Tensors, base: Tensors, codec: str, block_size: int) -> tuple[Tensors, dict[str, str]]:
    """Q(target − base), as a blob's tensors and metadata (CPU, float32 arithmetic)."""
    diff = {n: target[n].detach().to("cpu", torch.float32) - base[n] for n in base}
    return encode_delta(diff, codec, block_size)


def apply_encoded(base: Tensors, tensors: Tensors, metadata: dict[str, str]) -> Tensors:
    """base + deq(blob): new tensors (never views of ``base``), on the base's device (the blob's codes are copied
    there). The same float32 operations on either side and on any device, so the synchronizer's next base and a
    learner's are the same bits."""
    device = next(iter(base.values())).device if base else torch.device("cpu")
    decoded = decode_delta(tensors, metadata, {n: tuple(t.shape) for n, t in base.items()}, device)
    # The sum lands in the decoded buffer (one op for all tensors): new memory all the same.
    out = [decoded[n] for n in base]
    torch._foreach_add_(out, [base[n] for n in base])
    return dict(zip(base, out))


def error_bound(diff: Tensors, codec: str, block_size: int) -> float:
    """The most any value of ``diff`` can move when encoded with ``codec``: half a quantization step of its block
    (int8, int4), half a unit in bf16's last place, 0 for float32."""
    worst = 0.0
    for t in diff.values():
        flat = t.detach().to("cpu", torch.float32).flatten()
        if flat.numel() == 0:
            continue
        if codec in _LEVELS:
            worst = max(worst, float(_blocks(flat, block_size).abs().amax(dim=1).max()) / _LEVELS[codec] / 2)
        elif codec == "bf16":
            worst = max(worst, float(flat.abs().max()) * 2.0**-8)
    return worst


@dataclass
class CompactBase:
    """A fragment's base, as the synchronizer and every learner following it hold it."""

    version: int
    tensors: Tensors


@dataclass
class CompactForm:
    """What one version's compact form is: the delta in each codec asked for, and when the base moved with this
    version, the new base (and the step to it from the previous one)."""

    base: CompactBase
    deltas: dict[str, tuple[Tensors, dict[str, str]]]
    new_base: bool
    step: tuple[Tensors, dict[str, str]] | None = None
    step_from: int | None = None


def compact_version(base: CompactBase | None, version: int, params: Tensors, codecs: Sequence[str], block_size: int,
                    every: int) -> CompactForm:
    """The compact form of ``version`` (parameters ``params``) against ``base`` in each of ``codecs`` (the first, the
    download codec, also encodes the step), moving the base on when it is ``every`` versions old (by a step, so
    learners holding it follow cheaply) or when there is none (exactly)."""
    codec = codecs[0]
    step = step_from = None
    new = False
    if base is None:
        base = CompactBase(version, {n: t.detach().to("cpu", torch.float32, copy=True) for n, t in params.items()})
        new = True
    elif version - base.version >= every:
        step = encode_against(params, base.tensors, codec, block_size)
        step_from = base.version
        base = CompactBase(version, apply_encoded(base.tensors, *step))
        new = True
    diff = {n: params[n].detach().to("cpu", torch.float32) - base.tensors[n] for n in base.tensors}
    return CompactForm(base, {c: encode_delta(diff, c, block_size) for c in codecs}, new, step, step_from)
