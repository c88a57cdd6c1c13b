"""Balanced tensor fragmentation and the staggered schedule of fragment sends.

The parameters are split into P fragments of near-equal bytes (greedy bin-packing, largest piece
first into the lightest fragment). A tensor much larger than a fragment's fair share (a 128k-row
embedding is a fifth of a 1B Llama) would alone make its fragment several times the mean, so it is
first cut into row pieces along dim 0 (:data:`SPLIT_ABOVE`); every other tensor stays whole.
Fragment p is due every H inner steps, offset by p, so with H = P one fragment travels per step.

Piece keys, the one place they are defined: a fragment's tensors (in blobs, deltas, the ledger's
fragment specs) are keyed by

- ``name`` for a whole tensor (the parameter's own name), and
- ``name@rows:START:END`` for rows ``START:END`` (end exclusive) of parameter ``name`` along dim 0.

Keys come back from blobs, so :func:`parse_key` validates them; :func:`assemble` turns a set of
pieces back into whole tensors, :func:`split` cuts whole tensors into a layout's pieces."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddiloco.platform.config import ConfigError

if TYPE_CHECKING:
    # The plan itself is names and sizes: the dashboard and the ledger read it without loading torch
    # (an import of seconds, tens of seconds on a busy machine).
    import torch
    from torch import nn

ROWS = "@rows:"
"""What separates a parameter name from a piece's row range in its key."""

SPLIT_ABOVE = 1.25
"""A tensor is cut into row pieces when its bytes exceed this many times the mean fragment
(total / P), into ceil(bytes / mean) pieces of near-equal rows. Tensors just above the mean stay
whole: splitting them gains little balance and changes the layout of models that are fine as
they are."""

_MAX_INDEX_DIGITS = 15
_PIECE = re.compile(r"(?P<name>[^@]+)@rows:(?P<start>0|[1-9][0-9]*):(?P<end>[1-9][0-9]*)")


class PieceKeyError(ValueError):
    """A tensor key that is neither a parameter name nor a well-formed row piece."""


@dataclass(frozen=True)
class Piece:
    """A whole parameter tensor (``rows`` None) or rows ``start:end`` of it along dim 0."""

    key: str
    name: str
    rows: tuple[int, int] | None
    shape: tuple[int, ...]
    """The piece's own shape (rows first for a row piece)."""
    numel: int
    nbytes: int


@dataclass(frozen=True)
class Fragment:
    index: int
    pieces: tuple[Piece, ...]
    """In the model's order (a split tensor's pieces by row)."""
    numel: int
    nbytes: int

    @property
    def keys(self) -> tuple[str, ...]:
        """Piece keys: how the fragment's tensors are named in blobs and deltas."""
        return tuple(pc.key for pc in self.pieces)

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters this fragment holds all or part of, in the model's order."""
        return tuple(dict.fromkeys(pc.name for pc in self.pieces))


def piece_key(name: str, rows: tuple[int, int] | None = None) -> str:
    return name if rows is None else f"{name}{ROWS}{rows[0]}:{rows[1]}"


def parse_key(key: str) -> tuple[str, tuple[int, int] | None]:
    """(parameter name, row range or None for a whole tensor) of a piece key; raises :class:`PieceKeyError`."""
    if not isinstance(key, str) or not key:
        raise PieceKeyError(f"tensor key {key!r} is empty or not a string")
    if "@" not in key:
        return key, None
    m = _PIECE.fullmatch(key)
    if m is None or len(m["start"]) > _MAX_INDEX_DIGITS or len(m["end"]) > _MAX_INDEX_DIGITS:
        raise PieceKeyError(f"tensor key {key!r} is not 'name' or 'name{ROWS}START:END'")
    start, end = int(m["start"]), int(m["end"])
    if start >= end:
        raise PieceKeyError(f"tensor key {key!r} has an empty row range")
    return m["name"], (start, end)


def param_name(key: str) -> str:
    """The parameter a piece key belongs to."""
    return parse_key(key)[0]


def _row_bounds(rows: int, pieces: int) -> list[int]:
    return [i * rows // pieces for i in range(pieces + 1)]


def _pieces_of(name: str, shape: tuple[int, ...], bpe: int, target: float, split_above: float | None) -> list[Piece]:
    """One piece for a tensor within ``split_above`` times ``target``, a 0-d or 1-d tensor, or a
    single row; otherwise ceil(bytes / target) row pieces (at most one per row)."""
    numel = math.prod(shape)
    nbytes = numel * bpe
    if split_above is None or len(shape) < 2 or shape[0] < 2 or nbytes <= split_above * target:
        return [Piece(name, name, None, shape, numel, nbytes)]
    count = min(shape[0], math.ceil(nbytes / target))
    bounds = _row_bounds(shape[0], count)
    per_row = numel // shape[0]
    out = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        rows = end - start
        out.append(Piece(piece_key(name, (start, end)), name, (start, end), (rows, *shape[1:]), rows * per_row, rows * per_row * bpe))
    return out


def partition(
    named_shapes: Sequence[tuple[str, tuple[int, ...], int]], count: int, *, split_above: float | None = SPLIT_ABOVE
) -> list[Fragment]:
    """Split ``(name, shape, bytes per element)`` tensors into ``count`` fragments of near-equal bytes,
    cutting tensors above ``split_above`` times the mean fragment into row pieces (None: whole tensors only)."""
    if count < 1:
        raise ValueError(f"fragments.count must be >= 1, got {count}")
    names = [n for n, _, _ in named_shapes]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    for n in names:
        if not n or "@" in n:
            raise ValueError(f"parameter name {n!r} must be non-empty and free of '@' (it marks row pieces)")
    total = sum(math.prod(shape) * bpe for _, shape, bpe in named_shapes)
    target = total / count
    pieces = [pc for n, shape, bpe in named_shapes for pc in _pieces_of(n, tuple(shape), bpe, target, split_above)]
    if count > len(pieces):
        # A ConfigError: every process entry that loads a config reports it as the one line it is.
        raise ConfigError(
            f"fragments.count ({count}) exceeds the number of parameter tensors ({len(pieces)} after splitting "
            "large ones into row pieces), so some fragment would be empty: lower fragments.count"
        )

    members: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    # Largest first; ties keep the model's order, so the result is deterministic.
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i].nbytes, i)):
        # Lightest fragment; among equally light ones the emptiest (so zero-byte tensors cannot
        # leave a fragment empty), then the lowest index.
        p = min(range(count), key=lambda p: (load[p], len(members[p]), p))
        members[p].append(i)
        load[p] += pieces[i].nbytes

    return [
        Fragment(
            index=p,
            pieces=tuple(pieces[i] for i in sorted(idx)),
            numel=sum(pieces[i].numel for i in idx),
            nbytes=sum(pieces[i].nbytes for i in idx),
        )
        for p, idx in enumerate(members)
    ]


def partition_module(module: nn.Module, count: int) -> list[Fragment]:
    """:func:`partition` over the module's trainable parameters."""
    named = [(n, tuple(p.shape), p.element_size()) for n, p in module.named_parameters() if p.requires_grad]
    return partition(named, count)


def _view(param: torch.Tensor, piece: Piece) -> torch.Tensor:
    if piece.rows is None:
        return param
    # Detached, so that writes under no_grad and in-place optimizer steps on the parameter never
    # meet autograd's view bookkeeping; it still shares the parameter's memory.
    return param.detach().narrow(0, piece.rows[0], piece.rows[1] - piece.rows[0])


def fragment_views(params: Mapping[str, torch.Tensor], fragment: Fragment) -> dict[str, torch.Tensor]:
    """The fragment's tensors by piece key, as live views into ``params`` (a module's named parameters):
    a whole tensor is the parameter itself, a row piece a ``narrow`` of it along dim 0."""
    return {pc.key: _view(params[pc.name], pc) for pc in fragment.pieces}


def split(params: Mapping[str, torch.Tensor], fragments: Sequence[Fragment]) -> list[dict[str, torch.Tensor]]:
    """Whole tensors by parameter name -> each fragment's pieces by key (copies; the inverse of :func:`assemble`)."""
    return [{k: v.detach().clone() for k, v in fragment_views(params, f).items()} for f in fragments]


def assemble(pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pieces by key (from any number of fragments) -> whole tensors by parameter name.

    A split parameter's pieces must cover rows 0..R without gap or overlap and agree on the other
    dimensions and the dtype; a whole tensor must not come with pieces of itself. Raises
    :class:`PieceKeyError` naming the problem. Whether R is the model's row count is for the caller
    to check against its shapes."""
    import torch

    whole: dict[str, torch.Tensor] = {}
    split_rows: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for key, t in pieces.items():
        name, rows = parse_key(key)
        if rows is None:
            whole[name] = t
            continue
        if t.dim() < 1 or t.shape[0] != rows[1] - rows[0]:
            raise PieceKeyError(f"tensor {key!r} has shape {tuple(t.shape)}, which does not hold rows {rows[0]}:{rows[1]}")
        split_rows.setdefault(name, []).append((rows[0], rows[1], t))
    out = dict(whole)
    for name, parts in split_rows.items():
        if name in whole:
            raise PieceKeyError(f"parameter {name!r} comes both whole and in row pieces")
        parts.sort(key=lambda r: r[0])
        expected = 0
        for start, end, t in parts:
            if start != expected:
                what = "overlap" if start < expected else "gap"
                raise PieceKeyError(f"row pieces of {name!r} {what} at row {min(start, expected)} (next piece starts at {start})")
            if t.shape[1:] != parts[0][2].shape[1:] or t.dtype != parts[0][2].dtype:
                raise PieceKeyError(f"row pieces of {name!r} disagree on shape or dtype at rows {start}:{end}")
            expected = end
        out[name] = torch.cat([t for _, _, t in parts], dim=0)
    return out


def imbalance(fragments: Sequence[Fragment]) -> float:
    """Bytes of the heaviest fragment over the mean (1.0 is perfect balance)."""
    if not fragments:
        raise ValueError("imbalance of no fragments")
    mean = sum(f.nbytes for f in fragments) / len(fragments)
    return max(f.nbytes for f in fragments) / mean if mean else 1.0


def shard_fragments(nbytes: Sequence[int], shards: int) -> list[tuple[int, ...]]:
    """The fragments (by index) each synchronizer shard holds: near-equal bytes per shard, deterministic.

    Largest fragment first to the lightest shard (ties: the lowest shard), so every process of a run
    computes the same assignment from the run's fragment sizes alone."""
    if shards < 1 or shards > len(nbytes):
        raise ValueError(f"synchronizer.shards must be between 1 and the {len(nbytes)} fragments, got {shards}")
    members: list[list[int]] = [[] for _ in range(shards)]
    load = [0] * shards
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        k = min(range(shards), key=lambda k: (load[k], len(members[k]), k))
        members[k].append(i)
        load[k] += nbytes[i]
    return [tuple(sorted(m)) for m in members]


def due_fragments(step: int, count: int, every: int, stride: int = 1) -> list[int]:
    """Fragments due after ``step`` completed inner steps: p with (step - p * stride) % every == 0.

    A period k times H spreads the sends with ``stride`` k: one fragment every k steps, not H in a row."""
    if count < 1 or every < 1 or stride < 1:
        raise ValueError(f"count, every and stride must be >= 1, got count={count}, every={every}, stride={stride}")
    if step <= 0:
        return []
    # Solved for p rather than tried for each fragment: the learner asks every step, and the cost stays that of the
    # answer, not of P. p * stride = step (mod every) has solutions iff g = gcd(stride, every) divides step, and
    # they are one residue modulo every / g.
    g = math.gcd(stride, every)
    if step % g:
        return []
    m = every // g
    first = (step // g) * pow(stride // g, -1, m) % m
    return list(range(first, count, m))
