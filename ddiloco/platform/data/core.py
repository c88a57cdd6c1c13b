"""What every dataset shares: the batch, the protocol, stable hashing and the seekable random order.

A training stream is a pure function of (shard, num_shards, batch_size, seed) and batch index: batch
``n`` is computed from its index alone (item counters, per-epoch keyed permutations, per-batch
seeds), so ``start_batch=n`` seeks in O(1) — nothing of the first ``n`` batches is read or drawn."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor
    tokens: int
    """Target tokens in the batch (examples, for classification)."""


class Dataset(Protocol):
    kind: str

    def train_batches(self, shard: int, num_shards: int, batch_size: int, seed: int, start_batch: int = 0) -> Iterator[Batch]:
        """Infinite, deterministic stream of batches from shard ``shard`` of ``num_shards``, from batch ``start_batch`` on."""
        ...

    def val_batches(self, batch_size: int) -> list[Batch]:
        """The fixed validation batches, identical for every caller."""
        ...


def rows_batch(rows: np.ndarray) -> Batch:
    """A language-modelling batch from rows of ``seq_len + 1`` token ids: inputs and next-token targets."""
    x = torch.from_numpy(rows)
    return Batch(inputs=x[:, :-1], targets=x[:, 1:], tokens=x.shape[0] * (x.shape[1] - 1))


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def batch_generator(seed: int, shard: int, batch: int) -> torch.Generator:
    """The generator of batch ``batch`` of a stream: seeded per batch, so any batch is reachable directly."""
    return torch.Generator().manual_seed(stable_hash(f"{seed}:{shard}:{batch}") & (2**63 - 1))


def check_stream_args(shard: int, num_shards: int, batch_size: int, start_batch: int = 0) -> None:
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if start_batch < 0:
        raise ValueError(f"start_batch must be >= 0, got {start_batch}")


def shard_range(n: int, shard: int, num_shards: int) -> tuple[int, int]:
    """Shard ``shard``'s contiguous, disjoint part ``[start, end)`` of ``n`` items."""
    return shard * n // num_shards, (shard + 1) * n // num_shards


# ------------------------------------------------------------------ a seekable random order

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping multiplication)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def permute(idx: np.ndarray, n: int, key: str) -> np.ndarray:
    """A keyed random permutation of ``[0, n)`` evaluated at ``idx``, in O(len(idx)) without building it.

    A 4-round Feistel network on the smallest even bit width holding ``n`` is a bijection of
    ``[0, 2**bits)``; cycle-walking (apply again while the value is >= n) restricts it to ``[0, n)``."""
    idx = np.asarray(idx, dtype=np.uint64)
    if idx.size and int(idx.max()) >= n:
        # Cycle-walking from outside [0, n) may never come back into it.
        raise ValueError(f"permute: index {int(idx.max())} is outside [0, {n})")
    if n <= 1:
        return np.zeros(idx.shape, dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(stable_hash(f"{key}:{r}")) for r in range(4)]

    def rounds(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    out = rounds(idx)
    bad = out >= np.uint64(n)
    while bad.any():
        out[bad] = rounds(out[bad])
        bad = out >= np.uint64(n)
    return out.astype(np.int64)


def epoch_order(counter: np.ndarray, n: int, key: str) -> np.ndarray:
    """Item of ``[0, n)`` at each position of an endless sequence of epochs, each a fresh permutation.

    Position ``j`` is item ``permute(j % n)`` of epoch ``j // n``: every item once per epoch."""
    counter = np.asarray(counter, dtype=np.int64)
    out = np.empty_like(counter)
    epochs = counter // n
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = permute(counter[sel] % n, n, f"{key}:e{e}")
    return out


def rotation(block: np.ndarray, k: int, key: str) -> np.ndarray:
    """A keyed offset in ``[0, k)`` per block, so blocks sharing one permutation differ."""
    return (_mix(np.asarray(block, dtype=np.uint64) ^ np.uint64(stable_hash(key))) % np.uint64(k)).astype(np.int64)
