"""Pre-tokenized shards from any fsspec URL: flat uint16/uint32 ``.bin`` files and parquet token-list columns.

Nothing is read whole: a local ``.bin`` is memory-mapped for each block it serves, a remote one is
read with ranged requests (``cat_file(path, start, end)``), a parquet file one row group at a time.
The training shards form one virtual token stream; learner × rank ``s`` of ``S`` owns the contiguous
range ``[s·N/S, (s+1)·N/S)`` of it and cuts it into windows of ``seq_len + 1`` tokens (stride
``seq_len``: every token is a target once per epoch). Windows are grouped in blocks of about
``block_tokens``; an epoch visits the blocks in a keyed random order and the windows of a block in a
keyed random order, so a learner makes one ranged read per block and batch ``n`` is computed from
``n`` alone (O(1) seek)."""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from ddiloco.platform.config import ConfigError, DataConfig
from ddiloco.platform.data.core import Batch, check_stream_args, permute, rotation, rows_batch
from ddiloco.platform.manifest import DTYPES, read_manifest, resolve

PARQUET_SUFFIXES = (".parquet", ".pq")
SAMPLE_TOKENS = 4096
"""Tokens read from each end of every shard for the out-of-vocabulary check."""


class CorruptShardError(ConfigError):
    """A token shard that cannot be what it claims to be: its size, its type or its token ids."""


# --------------------------------------------------------------------------------- one shard


class BinShard:
    """A flat array of ``dtype`` tokens (nanoGPT's ``.bin``): memory-mapped when local, ranged reads otherwise."""

    def __init__(self, url: str, dtype: str, tokens: int | None = None) -> None:
        self.url = url
        self.dtype = np.dtype(dtype)
        self.fs, self.path = url_to_fs(url)
        try:
            size = self.fs.size(self.path)
        except FileNotFoundError:
            raise CorruptShardError(f"token shard {url!r} does not exist") from None
        if size % self.dtype.itemsize:
            raise CorruptShardError(f"token shard {url!r} holds {size} bytes, not a multiple of {dtype} ({self.dtype.itemsize} bytes)")
        self.tokens = size // self.dtype.itemsize
        if tokens is not None and tokens != self.tokens:
            raise CorruptShardError(f"token shard {url!r} holds {self.tokens} tokens, the manifest says {tokens}")
        self.local = isinstance(self.fs, LocalFileSystem)

    def read(self, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` as a fresh array (never a view of a mapping that outlives the call)."""
        if end <= start:
            return np.empty(0, dtype=self.dtype)
        isz = self.dtype.itemsize
        if self.local:
            # A mapping per read and a copy out of it: resident memory stays one block, whatever the corpus.
            return np.array(np.memmap(self.path, dtype=self.dtype, mode="r", offset=start * isz, shape=(end - start,)))
        return np.frombuffer(self.fs.cat_file(self.path, start=start * isz, end=end * isz), dtype=self.dtype).copy()


class ParquetShard:
    """A parquet file with a column of token-id lists (one document a row), read one row group at a time."""

    def __init__(self, url: str, column: str, tokens: int | None = None) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.url = url
        self.column = column
        fs, path = url_to_fs(url)
        try:
            self.file = pq.ParquetFile(fs.open(path, "rb"))
            schema = self.file.schema_arrow
            field = schema.field(column) if column in schema.names else None
            if field is None or not (pa.types.is_list(field.type) or pa.types.is_large_list(field.type)):
                raise ValueError(f"no list column {column!r} (columns: {', '.join(schema.names)})")
            if not pa.types.is_integer(field.type.value_type):
                raise ValueError(f"column {column!r} holds {field.type}, not lists of integers")
            meta = self.file.metadata
            leaf = next(i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] == column)
            # The leaf column's value count per row group is in the footer: no data page is read to size the file.
            counts = [meta.row_group(g).column(leaf).num_values for g in range(meta.num_row_groups)]
        except FileNotFoundError:
            raise CorruptShardError(f"token shard {url!r} does not exist") from None
        except (OSError, ValueError, pa.ArrowException) as err:
            raise CorruptShardError(f"token shard {url!r} is not a readable parquet token file: {err}") from None
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.tokens = int(self.offsets[-1])
        if tokens is not None and tokens != self.tokens:
            raise CorruptShardError(f"token shard {url!r} holds {self.tokens} tokens, the manifest says {tokens}")
        self.dtype = np.dtype(np.uint32)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # one open file: a learner and an evaluation in one process take turns

    def _group(self, g: int) -> np.ndarray:
        with self._lock:
            return self._group_locked(g)

    def _group_locked(self, g: int) -> np.ndarray:
        if g not in self._cache:
            col = self.file.read_row_group(g, columns=[self.column]).column(0).combine_chunks()
            values = col.flatten().to_numpy(zero_copy_only=False)
            if len(values) != self.offsets[g + 1] - self.offsets[g]:
                raise CorruptShardError(f"token shard {self.url!r}: row group {g} holds empty or null token lists")
            self._cache[g] = values
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return self._cache[g]

    def read(self, start: int, end: int) -> np.ndarray:
        parts = []
        g = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < end:
            lo, hi = int(self.offsets[g]), int(self.offsets[g + 1])
            take = min(end, hi)
            parts.append(self._group(g)[start - lo : take - lo])
            start, g = take, g + 1
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def open_shard(url: str, dtype: str, column: str, tokens: int | None = None) -> BinShard | ParquetShard:
    if url.lower().endswith(PARQUET_SUFFIXES):
        return ParquetShard(url, column, tokens)
    return BinShard(url, dtype, tokens)


class TokenStream:
    """Shards read as one concatenated token stream."""

    def __init__(self, shards: list[BinShard | ParquetShard]) -> None:
        self.shards = shards
        self.starts = [0]
        for s in shards:
            self.starts.append(self.starts[-1] + s.tokens)

    @property
    def tokens(self) -> int:
        return self.starts[-1]

    def read(self, start: int, end: int) -> np.ndarray:
        parts = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < end and i < len(self.shards):
            lo, hi = self.starts[i], self.starts[i + 1]
            take = min(end, hi)
            if take > start:
                parts.append(self.shards[i].read(start - lo, take - lo).astype(np.int64))
            start, i = take, i + 1
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


# ----------------------------------------------------------------------------- shard listing


@dataclass(frozen=True)
class ShardPlan:
    train: list[tuple[str, int | None]]
    val: tuple[str, int | None]
    dtype: str
    column: str
    vocab_size: int | None
    where: str


def _expand(patterns: list[str]) -> list[str]:
    urls: list[str] = []
    for pattern in patterns:
        fs, path = url_to_fs(pattern)
        found = sorted(fs.glob(path)) if any(c in path for c in "*?[") else [path]
        urls.extend(fs.unstrip_protocol(p) for p in found)
    return urls


def plan_shards(data: DataConfig) -> ShardPlan:
    """Which shards train and which validates, from the manifest or the shard list (the last one validates)."""
    if data.manifest:
        m = read_manifest(data.manifest)
        if not m.train:
            raise ConfigError(f"data.manifest {data.manifest!r} lists no training shards")
        return ShardPlan(
            train=[(resolve(data.manifest, s.path), s.tokens) for s in m.train], val=(resolve(data.manifest, m.val.path), m.val.tokens),
            dtype=m.dtype, column=m.column, vocab_size=m.vocab_size, where=f"data.manifest {data.manifest}",
        )
    urls = _expand(data.shards)
    val = _expand([data.val_shard]) if data.val_shard else urls[-1:]
    train = [u for u in urls if u not in val]
    if not train or not val:
        raise ConfigError(
            f"data.shards {data.shards} matched {len(urls)} shard(s): need at least one training shard and a validation shard "
            "(the last one, or data.val_shard)"
        )
    return ShardPlan(train=[(u, None) for u in train], val=(val[0], None), dtype=data.dtype, column=data.tokens_column,
                     vocab_size=None, where=f"data.shards {data.shards}")


def check_ids(shards: list[BinShard | ParquetShard], vocab_size: int) -> None:
    """Sampled check: the first and last ``SAMPLE_TOKENS`` of every shard are ids below ``vocab_size``."""
    for s in shards:
        for lo, hi in ((0, min(s.tokens, SAMPLE_TOKENS)), (max(0, s.tokens - SAMPLE_TOKENS), s.tokens)):
            ids = s.read(lo, hi)
            if len(ids) and int(ids.max()) >= vocab_size:
                raise CorruptShardError(
                    f"token shard {s.url!r} holds token id {int(ids.max())}, not below model.vocab_size {vocab_size}"
                )


# ---------------------------------------------------------------------------------- dataset


class TokenDataset:
    """Windows of ``seq_len + 1`` tokens from pre-tokenized shards; a fixed validation shard."""

    kind = "tokens"

    def __init__(self, data: DataConfig, seq_len: int, vocab_size: int) -> None:
        plan = plan_shards(data)
        if plan.dtype not in DTYPES:
            raise ConfigError(f"dtype {plan.dtype!r} is not one of {sorted(DTYPES)}")
        self.where = plan.where
        self.seq_len = seq_len
        self.n_val_batches = data.val_batches
        self.block_windows = max(1, data.block_tokens // seq_len)
        self.vocab_size = plan.vocab_size
        train = [open_shard(u, plan.dtype, plan.column, n) for u, n in plan.train]
        val = open_shard(plan.val[0], plan.dtype, plan.column, plan.val[1])
        check_ids([*train, val], vocab_size)
        self.train = TokenStream(train)
        self.val = val
        if self.train.tokens < seq_len + 1 or val.tokens < seq_len + 1:
            raise ConfigError(
                f"{self.where}: {self.train.tokens} training and {val.tokens} validation tokens, "
                f"each needs at least model.seq_len + 1 = {seq_len + 1}"
            )
        self._val_cache: dict[int, list[Batch]] = {}

    def shard_range(self, shard: int, num_shards: int) -> tuple[int, int]:
        """Learner × rank ``shard``'s contiguous, disjoint token range of the training stream."""
        n = self.train.tokens
        return shard * n // num_shards, (shard + 1) * n // num_shards

    def train_batches(self, shard: int, num_shards: int, batch_size: int, seed: int, start_batch: int = 0) -> Iterator[Batch]:
        check_stream_args(shard, num_shards, batch_size, start_batch)
        lo, hi = self.shard_range(shard, num_shards)
        if hi - lo < self.seq_len + 1:
            raise ValueError(
                f"training shard {shard} of {num_shards} holds {hi - lo} tokens, fewer than model.seq_len + 1 ({self.seq_len + 1})"
            )
        windows = _WindowStream(self.train, lo, hi, self.seq_len, self.block_windows, f"tokens:{seed}:{shard}")
        return windows.batches(batch_size, start_batch)

    def val_batches(self, batch_size: int) -> list[Batch]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size not in self._val_cache:
            # Evenly spaced windows over the validation shard, without any RNG.
            n = self.n_val_batches * batch_size
            starts = np.linspace(0, self.val.tokens - self.seq_len - 1, n).astype(np.int64)
            rows = np.stack([self.val.read(int(s), int(s) + self.seq_len + 1).astype(np.int64) for s in starts])
            self._val_cache[batch_size] = [rows_batch(rows[i : i + batch_size]) for i in range(0, n, batch_size)]
        return self._val_cache[batch_size]




class _WindowStream:
    """The windows of one token range in blocks; window ``j`` of the endless stream is found from ``j`` alone."""

    def __init__(self, stream: TokenStream, lo: int, hi: int, seq_len: int, block_windows: int, key: str) -> None:
        self.stream, self.lo, self.seq_len, self.key = stream, lo, seq_len, key
        self.windows = (hi - lo - 1) // seq_len
        self.k = min(block_windows, self.windows)
        self.full_blocks = self.windows // self.k
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()

    def window_ids(self, counter: np.ndarray) -> np.ndarray:
        """Window index (in ``[0, windows)``) at each position of the endless stream of epochs."""
        out = np.empty_like(counter)
        epochs, q = np.divmod(counter, self.windows)
        full = self.full_blocks * self.k
        for e in np.unique(epochs):
            sel = epochs == e
            qe = q[sel]
            ids = np.empty_like(qe)
            head = qe < full
            if head.any():
                blocks = permute(qe[head] // self.k, self.full_blocks, f"{self.key}:e{e}:blocks")
                inner = permute(qe[head] % self.k, self.k, f"{self.key}:e{e}:inner") + rotation(blocks, self.k, f"{self.key}:e{e}")
                ids[head] = blocks * self.k + inner % self.k
            if not head.all():  # the windows past the last full block close every epoch, in their own order
                ids[~head] = full + permute(qe[~head] - full, self.windows - full, f"{self.key}:e{e}:tail")
            out[sel] = ids
        return out

    def _block(self, b: int) -> np.ndarray:
        if b not in self._blocks:
            first = b * self.k
            last = min(first + self.k, self.windows)
            start = self.lo + first * self.seq_len
            self._blocks[b] = self.stream.read(start, self.lo + last * self.seq_len + 1)
            while len(self._blocks) > 2:
                self._blocks.popitem(last=False)
        return self._blocks[b]

    def rows(self, counter: np.ndarray) -> np.ndarray:
        ids = self.window_ids(counter)
        rows = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for i, w in enumerate(ids.tolist()):
            b = min(w // self.k, self.full_blocks)  # the tail windows belong to one last block
            off = (w - b * self.k) * self.seq_len
            rows[i] = self._block(b)[off : off + self.seq_len + 1]
        return rows

    def batches(self, batch_size: int, start: int) -> Iterator[Batch]:
        i = start
        while True:
            yield rows_batch(self.rows(np.arange(i * batch_size, (i + 1) * batch_size, dtype=np.int64)))
            i += 1
