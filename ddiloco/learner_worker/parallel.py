"""How a learner's replica is spread over its ranks, and how its fragments cross between them.

``learners.parallelism``:
- ``ddp``: every rank holds the whole replica (``DistributedDataParallel``);
- ``fsdp``: every parameter is cut into row shards, one per rank (FSDP2, ``fully_shard`` per block);
- ``hsdp``: shards within groups of ``learners.shard_size`` ranks, the groups replicated.

The fragment plan is over full parameter names, so what leaves a learner does not depend on this:
each rank works on the rows of each fragment piece it holds (:class:`LocalPiece`), and rank 0
gathers the rows of its shard group into whole tensors before encoding (one padded ``gather`` per
fragment). World size 1 is the same code: one rank holding every row, nothing gathered.

``learners.activation_checkpoint`` makes each block recompute its activations in the backward pass
(:func:`checkpoint_blocks`), before any wrapping, as torchtitan orders it (checkpointing, compile, FSDP): ``full``
recomputes the whole block, ``selective`` keeps the outputs of its matrix products and attention and recomputes the
cheap rest (torchtitan's per-op policy)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ddiloco.platform.config import ConfigError
from ddiloco.platform.fragments import Fragment
from ddiloco.platform.models.hf import is_hf

Tensors = dict[str, torch.Tensor]


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """Rows ``[start, end)`` that shard ``index`` of ``shards`` holds of a dim-0 of ``rows`` (``torch.chunk``'s cut,
    which FSDP2's ``Shard(0)`` uses: ceil(rows / shards) rows each, the last ones short or empty)."""
    size = -(-rows // shards)
    start = min(index * size, rows)
    return start, min(start + size, rows)


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: ``shards`` ranks share each parameter's rows, this rank holds shard ``shard``;
    ``gathers``: this rank is in rank 0's shard group (its rows go to rank 0 at a send)."""

    parallelism: str
    shards: int = 1
    shard: int = 0
    gathers: bool = True
    group: Any = None
    """The process group of rank 0's shard group (None: nothing to gather)."""

    @property
    def sharded(self) -> bool:
        return self.shards > 1


def hsdp_shape(world: int, shard_size: int | None, local_world: int) -> tuple[int, int]:
    """(replicas, shards) of an HSDP mesh: ``shard_size`` ranks per shard group (default: the ranks of one node)."""
    size = shard_size or local_world
    if size < 1 or world % size:
        raise ValueError(f"learners.shard_size {size} must divide the learner's world size {world}")
    return world // size, size


@dataclass(frozen=True)
class LocalPiece:
    """The rows of one fragment piece that this rank holds: ``view`` (a live view of its local shard, possibly of
    0 rows) is rows ``[first, first + rows)`` of the piece."""

    key: str
    view: torch.Tensor
    first: int
    rows: int
    row_numel: int


def _piece_rows(fragment: Fragment, shapes: Mapping[str, torch.Size]) -> list[tuple[str, str, int, int]]:
    """(key, parameter, first row, end row) of each piece, as rows of its parameter."""
    out = []
    for pc in fragment.pieces:
        shape = shapes[pc.name]
        a, b = pc.rows if pc.rows is not None else (0, shape[0] if len(shape) else 1)
        out.append((pc.key, pc.name, a, b))
    return out


def local_pieces(
    fragment: Fragment, local: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size], layout: Layout
) -> list[LocalPiece]:
    """This rank's rows of each piece of ``fragment``; ``local`` holds each parameter's local shard (the whole
    parameter when unsharded), ``shapes`` the full shapes."""
    out = []
    for key, name, a, b in _piece_rows(fragment, shapes):
        shape = shapes[name]
        t = local[name]
        if len(shape) == 0:
            if layout.sharded:
                raise ValueError(f"parameter {name!r} is a scalar: FSDP cannot shard it by rows")
            out.append(LocalPiece(key, t, 0, 1, 1))
            continue
        r0, r1 = shard_rows(shape[0], layout.shards, layout.shard) if layout.sharded else (0, shape[0])
        lo, hi = max(a, r0), min(b, r1)
        n = max(0, hi - lo)
        view = t.narrow(0, lo - r0 if n else 0, n)
        out.append(LocalPiece(key, view, lo - a if n else 0, n, math.prod(shape[1:])))
    return out


def gather_sizes(fragment: Fragment, shapes: Mapping[str, torch.Size], layout: Layout) -> list[list[int]]:
    """Per shard of rank 0's group, the elements it holds of each piece (in piece order)."""
    out = []
    for s in range(layout.shards):
        sizes = []
        for _key, name, a, b in _piece_rows(fragment, shapes):
            shape = shapes[name]
            r0, r1 = shard_rows(shape[0], layout.shards, s) if len(shape) else (0, 1)
            sizes.append(max(0, min(b, r1) - max(a, r0)) * (math.prod(shape[1:]) if len(shape) else 1))
        out.append(sizes)
    return out


def gather_pieces(
    local: Sequence[torch.Tensor], keys: Sequence[str], piece_shapes: Sequence[torch.Size], sizes: list[list[int]],
    layout: Layout, is_rank0: bool,
) -> Tensors | None:
    """Rank 0: whole piece tensors from every shard's rows of them (``local``: this rank's, in piece order);
    other ranks of the group send theirs and get None. One padded gather, on the ranks' device."""
    if not layout.sharded:
        return {k: t.reshape(s) for k, t, s in zip(keys, local, piece_shapes)} if is_rank0 else None
    flat = torch.cat([t.reshape(-1) for t in local]) if local else torch.empty(0)
    longest = max(sum(s) for s in sizes)
    padded = torch.zeros(longest, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()].copy_(flat)
    bufs = [torch.empty_like(padded) for _ in range(layout.shards)] if is_rank0 else None
    dist.gather(padded, bufs, dst=0, group=layout.group)
    if not is_rank0:
        return None
    per_shard = [buf[: sum(s)].split(s) for buf, s in zip(bufs, sizes)]
    return {k: torch.cat([parts[i] for parts in per_shard]).reshape(piece_shapes[i]) for i, k in enumerate(keys)}


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the children of its outermost ``ModuleList`` / ``ModuleDict`` that hold
    parameters (a GPT's blocks, a Llama's layers, torchtitan's layers) — FSDP2's units, one all-gather each."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    for m in model.modules():
        if id(m) in seen:
            continue
        if isinstance(m, nn.ModuleList | nn.ModuleDict):
            for inner in m.modules():
                seen.add(id(inner))
            out += [c for c in m.children() if any(True for _ in c.parameters())]
    return out


def _kept_ops() -> frozenset:
    """What ``selective`` keeps for the backward pass: the outputs of matrix products, attention and FSDP's gradient
    reduce-scatter, the ops that cost the most to run again for their memory (torchtitan's per-op list)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    if hasattr(torch.ops, "_c10d_functional"):
        ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return frozenset(ops)


KEPT_OPS = _kept_ops()


def _keep_products(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_keep_products)


@functools.cache
def _checkpointed(cls: type, mode: str) -> type:
    """``cls``'s subclass whose forward recomputes in the backward pass, all of it (``full``) or all but its matrix
    products and attention (``selective``); one per class and mode (as FSDP2 makes its own)."""
    extra = {} if mode == "full" else {"context_fn": _selective_context}

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: keyword arguments (a Hugging Face layer's position embeddings) pass through, and
        # torch.compile traces it. The RNG state is kept so that a model with dropout recomputes the same masks.
        return checkpoint(super(sub, self).forward, *args, use_reentrant=False, **extra, **kwargs)

    prefix = "Checkpointed" if mode == "full" else "SelectivelyCheckpointed"
    sub = type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward, "_recomputes": mode, "__module__": cls.__module__})
    return sub


def checkpoint_blocks(model: nn.Module, mode: str = "full") -> int:
    """Activation checkpointing of every block of ``model`` in place (how many). ``full``: a block keeps only its
    inputs for the backward pass and runs its forward again there; ``selective``: it also keeps the outputs of its
    matrix products and attention, and runs again only the rest (norms, activations, rotations, sums). The class of
    each block is swapped for a subclass, so parameter names (the fragment plan's), state dicts and deep copies are
    unchanged, unlike a wrapper module."""
    if mode not in ("full", "selective"):
        raise ConfigError(f"learners.activation_checkpoint: {mode!r} is not none, full or selective")
    found = blocks(model)
    if not found:
        raise ConfigError(f"learners.activation_checkpoint: {type(model).__name__} has no repeated blocks (the children "
                         "of a ModuleList or ModuleDict) to recompute; set it to none for this model")
    for block in found:
        if not getattr(type(block), "_recomputes", False):  # already (a subclass FSDP2 made of) a recomputing class
            block.__class__ = _checkpointed(type(block), mode)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # As transformers does under its own gradient checkpointing: a layer run again in the backward pass would
        # find the forward's keys in the key/value cache and attend to both (and selective's kept outputs would no
        # longer line up with the ops run again). Training never reads the cache.
        config.use_cache = False
    return len(found)


def cache_off_advice(model: nn.Module, device: torch.device, compiled: bool) -> str | None:
    """Why this learner's GPU would wait every step (and what to do), or None: a Hugging Face model with its key/value
    cache off (``learners.activation_checkpoint`` turns it off; a config may too) runs eagerly on a GPU."""
    if device.type != "cuda" or compiled or not is_hf(model) or getattr(model.config, "use_cache", True):
        return None
    return ("this Hugging Face model trains with its key/value cache off (learners.activation_checkpoint turns it off), "
            "and without one transformers checks the position ids with a data-dependent .all() in every forward: on a "
            "GPU the host waits for the device each step, so the platform's work between steps no longer overlaps the "
            "GPU's. Set learners.compile: true (compiled, the check is skipped).")


def shard_model(model: nn.Module, mesh: Any, device: torch.device) -> None:
    """FSDP2 on ``model`` in place: each block its own unit, then the root; bf16 compute with fp32 gradient
    reduction on GPUs (the sharded parameters and AdamW stay fp32), full precision on CPUs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """A parameter's rows on this rank: the local shard of a DTensor, the parameter itself otherwise."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param


def shard_replica(model: nn.Module, parallelism: str, shard_size: int | None, rank: int, world: int,
                  device: torch.device) -> Layout:
    """Shard ``model`` in place over the learner's ranks (``fsdp`` or ``hsdp``) and say where this rank sits.

    The learner's process group must exist (one of one rank for a world of 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallelism == "fsdp":
        mesh = init_device_mesh(device.type, (world,))
        layout = Layout("fsdp", shards=world, shard=rank, gathers=True, group=mesh.get_group())
    elif parallelism == "hsdp":
        replicas, size = hsdp_shape(world, shard_size, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        mesh = init_device_mesh(device.type, (replicas, size), mesh_dim_names=("replicate", "shard"))
        layout = Layout("hsdp", shards=size, shard=rank % size, gathers=rank < size, group=mesh.get_group("shard"))
    else:
        raise ValueError(f"learners.parallelism must be ddp, fsdp or hsdp, got {parallelism!r}")
    shard_model(model, mesh, device)
    for name, p in model.named_parameters():
        got = tuple(local_tensor(p).shape)
        if p.dim() == 0:
            raise ValueError(f"parameter {name!r} is a scalar: {parallelism} cannot shard it by rows")
        r0, r1 = shard_rows(p.shape[0], layout.shards, layout.shard)
        if got != (r1 - r0, *p.shape[1:]):
            raise RuntimeError(f"{parallelism} gave rank {rank} rows of shape {got} of {name!r}, expected rows {r0}:{r1}")
    return layout
