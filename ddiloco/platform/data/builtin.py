"""The built-in datasets: byte-level text (the interpreter's standard library, or any fsspec glob) and digits.

Every learner reads its own disjoint shard of the training data; the validation batches are fixed
and identical for every process, so evaluations are comparable across learners and runs."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import fsspec
import numpy as np
import torch
from fsspec.core import url_to_fs

from ddiloco.platform.data.core import Batch, batch_generator, check_stream_args, epoch_order, stable_hash

BYTE_VOCAB = 256
# Directories of the stdlib that are not the standard library proper (or are mostly test data).
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
DIGITS_VAL_FRACTION = 0.2


# ---------------------------------------------------------------------------------------- bytes


@dataclass(frozen=True)
class _Corpus:
    train: torch.Tensor  # uint8, concatenated training files
    val: torch.Tensor  # uint8, concatenated validation files
    files: int


def _split_corpus(files: Iterable[tuple[str, Callable[[], bytes]]], max_bytes: int, val_every: int) -> _Corpus:
    """Read ``(relative path, reader)`` pairs in order up to ``max_bytes``; hash paths into train/val."""
    train: list[bytes] = []
    val: list[bytes] = []
    total = count = 0
    for rel, read in files:
        if total >= max_bytes:
            break
        data = read()[: max_bytes - total]
        if not data:
            continue
        (val if stable_hash(rel) % val_every == 0 else train).append(data)
        total += len(data)
        count += 1
    if not train or not val:
        # Too few files for the hash split to give both sides something (e.g. one large file):
        # fall back to holding out the tail of the concatenated bytes.
        blob = b"".join(train + val)
        cut = len(blob) - len(blob) // val_every
        train, val = [blob[:cut]], [blob[cut:]]

    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        blob = b"".join(parts)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)

    return _Corpus(train=as_tensor(train), val=as_tensor(val), files=count)


def _stdlib_files(root: str) -> list[tuple[str, Callable[[], bytes]]]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP)
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    rel = sorted((os.path.relpath(p, root).replace(os.sep, "/"), p) for p in found)
    return [(r, functools.partial(_read_local, p)) for r, p in rel]


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# Cached per process: several learners in one process share one read-only copy of the corpus.
@functools.lru_cache(maxsize=8)
def _load_stdlib(root: str, max_bytes: int, val_every: int) -> _Corpus:
    return _split_corpus(_stdlib_files(root), max_bytes, val_every)


def _static_prefix(path: str) -> str:
    """The directory part of a glob before its first wildcard: paths below it are 'relative'."""
    cut = min((i for i in (path.find(c) for c in "*?[") if i >= 0), default=len(path))
    return path[: path.rfind("/", 0, cut) + 1]


@functools.lru_cache(maxsize=8)
def _load_glob(pattern: str, max_bytes: int, val_every: int) -> _Corpus:
    _, stripped = url_to_fs(pattern)
    prefix = _static_prefix(stripped)
    files = sorted(fsspec.open_files(pattern, mode="rb"), key=lambda of: of.path)
    if not files:
        raise ValueError(f"data.glob {pattern!r} matched no files")

    def reader(of: fsspec.core.OpenFile) -> Callable[[], bytes]:
        def read() -> bytes:
            try:
                with of as f:
                    return f.read()
            except IsADirectoryError:
                return b""

        return read

    items = [(of.path[len(prefix) :] if of.path.startswith(prefix) else of.path, reader(of)) for of in files]
    return _split_corpus(items, max_bytes, val_every)


class ByteDataset:
    """Byte-level language modelling on a corpus: random windows of ``seq_len + 1`` bytes."""

    def __init__(self, corpus: _Corpus, seq_len: int, n_val_batches: int, kind: str) -> None:
        self.kind = kind
        self.seq_len = seq_len
        self.n_val_batches = n_val_batches
        self.vocab_size = BYTE_VOCAB
        self.train = corpus.train
        self.val = corpus.val
        self.files = corpus.files
        self._val_cache: dict[int, list[Batch]] = {}

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> Batch:
        idx = starts.unsqueeze(1) + torch.arange(self.seq_len + 1)  # (B, T+1)
        x = data[idx].long()
        return Batch(inputs=x[:, :-1], targets=x[:, 1:], tokens=x.shape[0] * self.seq_len)

    def shard_bytes(self, shard: int, num_shards: int) -> torch.Tensor:
        """Shard ``shard``'s contiguous, disjoint slice of the training bytes."""
        n = self.train.numel()
        return self.train[shard * n // num_shards : (shard + 1) * n // num_shards]

    def train_batches(self, shard: int, num_shards: int, batch_size: int, seed: int, start_batch: int = 0) -> Iterator[Batch]:
        """Random windows of shard ``shard``; batch i depends on (seed, shard, i) alone, so ``start_batch`` seeks."""
        check_stream_args(shard, num_shards, batch_size, start_batch)
        data = self.shard_bytes(shard, num_shards)
        if data.numel() < self.seq_len + 1:
            raise ValueError(
                f"training shard {shard} of {num_shards} holds {data.numel()} bytes, fewer than model.seq_len + 1 "
                f"({self.seq_len + 1}); raise data.max_bytes or lower the shard count"
            )
        return self._train_iter(data, batch_size, seed, shard, start_batch)

    def _train_iter(self, data: torch.Tensor, batch_size: int, seed: int, shard: int, start: int) -> Iterator[Batch]:
        high = data.numel() - self.seq_len  # last valid start + 1
        i = start
        while True:
            gen = batch_generator(seed, shard, i)
            yield self._windows(data, torch.randint(0, high, (batch_size,), generator=gen))
            i += 1

    def val_batches(self, batch_size: int) -> list[Batch]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size not in self._val_cache:
            # Evenly spaced windows cover the whole validation set without any RNG.
            n = self.n_val_batches * batch_size
            starts = torch.linspace(0, self.val.numel() - self.seq_len - 1, n).long()
            self._val_cache[batch_size] = [self._windows(self.val, s) for s in starts.split(batch_size)]
        return self._val_cache[batch_size]


# --------------------------------------------------------------------------------------- digits


@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    labels = torch.tensor(d.target, dtype=torch.long)
    return images, labels


class DigitsDataset:
    """scikit-learn's bundled 8x8 digits; a fixed 20% validation split."""

    kind = "digits"

    def __init__(self, n_val_batches: int) -> None:
        images, labels = _load_digits()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        n_val = int(len(labels) * DIGITS_VAL_FRACTION)
        self.val_x, self.val_y = images[order[:n_val]], labels[order[:n_val]]
        self.train_x, self.train_y = images[order[n_val:]], labels[order[n_val:]]
        self.n_val_batches = n_val_batches

    def shard_indices(self, shard: int, num_shards: int) -> torch.Tensor:
        """Indices into the training examples of shard ``shard`` (contiguous and disjoint)."""
        n = len(self.train_y)
        return torch.arange(shard * n // num_shards, (shard + 1) * n // num_shards)

    def train_batches(self, shard: int, num_shards: int, batch_size: int, seed: int, start_batch: int = 0) -> Iterator[Batch]:
        """Epochs of fresh permutations of the shard (every example once per epoch); ``start_batch`` seeks."""
        check_stream_args(shard, num_shards, batch_size, start_batch)
        idx = self.shard_indices(shard, num_shards)
        if idx.numel() == 0:
            raise ValueError(f"training shard {shard} of {num_shards} is empty: {len(self.train_y)} training examples")
        return self._train_iter(idx, batch_size, seed, shard, start_batch)

    def _train_iter(self, idx: torch.Tensor, batch_size: int, seed: int, shard: int, start: int) -> Iterator[Batch]:
        i = start
        while True:
            counter = np.arange(i * batch_size, (i + 1) * batch_size)
            take = idx[torch.from_numpy(epoch_order(counter, idx.numel(), f"digits:{seed}:{shard}"))]
            yield Batch(inputs=self.train_x[take], targets=self.train_y[take], tokens=batch_size)
            i += 1

    def val_batches(self, batch_size: int) -> list[Batch]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = min(self.n_val_batches * batch_size, len(self.val_y))
        return [
            Batch(inputs=self.val_x[i : i + batch_size], targets=self.val_y[i : i + batch_size], tokens=min(batch_size, n - i))
            for i in range(0, n, batch_size)
        ]
