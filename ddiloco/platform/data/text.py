"""Raw text tokenized on the fly: jsonl / parquet / text files (``text``) and Hugging Face datasets (``hf``).

The corpus is a list of *units* with random access: a jsonl record, a parquet row, a dataset row, or
a chunk of about ``4 · (seq_len + 1)`` bytes of a plain text file (read with a ranged request). The
last ``1/val_every`` of the units validate; learner × rank ``s`` of ``S`` owns a contiguous, disjoint
range of the rest. Row ``r`` of batch ``n`` is the unit at position ``n·B + r`` of a keyed random
order (every unit once per epoch), tokenized (plus end-of-text), from a seeded offset, continued
with the following units until it holds ``seq_len + 1`` tokens — a function of ``n`` alone, so
``start_batch`` seeks in O(1). For a corpus trained many times over, ``ddiloco data prepare``
tokenizes once and every token is trained once per epoch (docs/data.md)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
from fsspec.core import url_to_fs
from fsspec.utils import infer_compression

from ddiloco.platform.config import ConfigError, DataConfig
from ddiloco.platform.data.core import Batch, check_stream_args, epoch_order, rows_batch, stable_hash
from ddiloco.platform.data.tokens import PARQUET_SUFFIXES, _expand
from ddiloco.platform.tokenize import TextTokenizer, load_tokenizer

JSONL_SUFFIXES = (".jsonl", ".ndjson")
_SCAN_BYTES = 8 << 20


class Units(Protocol):
    def __len__(self) -> int: ...

    def texts(self, idx: list[int]) -> list[str]:
        """The text of each unit in ``idx``."""
        ...


class _TextFile:
    """A plain text file in chunks of ``chunk`` bytes (bytes cut mid-character are dropped)."""

    def __init__(self, url: str, chunk: int) -> None:
        self.fs, self.path = url_to_fs(url)
        self.chunk = chunk
        self.size = self.fs.size(self.path)
        self.n = -(-self.size // chunk)

    def texts(self, idx: list[int]) -> list[str]:
        return [self.fs.cat_file(self.path, start=i * self.chunk, end=min((i + 1) * self.chunk, self.size)).decode("utf-8", "ignore")
                for i in idx]


class _JsonlFile:
    """One document a line; the line offsets come from one scan of the file (8 bytes a document)."""

    def __init__(self, url: str, column: str) -> None:
        self.url, self.column = url, column
        self.fs, self.path = url_to_fs(url)
        ends = []
        pos = 0
        with self.fs.open(self.path, "rb") as f:
            while block := f.read(_SCAN_BYTES):
                ends.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10) + pos + 1)
                pos += len(block)
        bounds = np.concatenate([[0], *ends]).astype(np.int64)
        if bounds[-1] < pos:
            bounds = np.append(bounds, pos)  # a last line without a newline
        lengths = np.diff(bounds)
        keep = lengths > 1  # blank lines are not documents
        self.starts, self.ends = bounds[:-1][keep], bounds[1:][keep]
        self.n = len(self.starts)

    def texts(self, idx: list[int]) -> list[str]:
        out = []
        for i in idx:
            line = self.fs.cat_file(self.path, start=int(self.starts[i]), end=int(self.ends[i]))
            try:
                out.append(str(json.loads(line)[self.column]))
            except (ValueError, KeyError, TypeError) as err:
                raise ConfigError(f"{self.url!r} line {i + 1}: no text field {self.column!r} in a JSON object ({err!r})") from None
        return out


class _ParquetTextFile:
    """One document a row of a text column, read one row group at a time."""

    def __init__(self, url: str, column: str) -> None:
        import pyarrow.parquet as pq

        fs, path = url_to_fs(url)
        try:
            self.file = pq.ParquetFile(fs.open(path, "rb"))
        except Exception as err:  # pyarrow raises ArrowInvalid / OSError for what is not parquet
            raise ConfigError(f"text file {url!r} is not readable parquet: {err}") from None
        if column not in self.file.schema_arrow.names:
            raise ConfigError(f"text file {url!r} has no column {column!r} (columns: {', '.join(self.file.schema_arrow.names)})")
        self.column = column
        rows = [self.file.metadata.row_group(g).num_rows for g in range(self.file.num_row_groups)]
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.n = int(self.offsets[-1])
        self._cache: OrderedDict[int, list[Any]] = OrderedDict()

    def texts(self, idx: list[int]) -> list[str]:
        out = []
        for i in idx:
            g = int(np.searchsorted(self.offsets, i, side="right")) - 1
            if g not in self._cache:
                self._cache[g] = self.file.read_row_group(g, columns=[self.column]).column(0).to_pylist()
                while len(self._cache) > 2:
                    self._cache.popitem(last=False)
            out.append(str(self._cache[g][i - int(self.offsets[g])] or ""))
        return out


class FileUnits:
    """The units of a list of files, in order."""

    def __init__(self, files: list[Any]) -> None:
        self.files = files
        self.starts = np.concatenate([[0], np.cumsum([f.n for f in files])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def texts(self, idx: list[int]) -> list[str]:
        which = np.searchsorted(self.starts, idx, side="right") - 1
        out: list[str] = [""] * len(idx)
        for f in np.unique(which):
            pos = [k for k in range(len(idx)) if which[k] == f]
            for k, text in zip(pos, self.files[f].texts([idx[k] - int(self.starts[f]) for k in pos]), strict=True):
                out[k] = text
        return out


class HFUnits:
    """Rows of a Hugging Face dataset: ``load_from_disk`` for a ``save_to_disk`` folder, else ``load_dataset``
    (memory-mapped Arrow either way, so a row is one random access)."""

    def __init__(self, url: str, split: str, column: str) -> None:
        import datasets

        fs, path = url_to_fs(url)
        try:
            if any(fs.exists(f"{path.rstrip('/')}/{name}") for name in ("state.json", "dataset_dict.json")):
                ds = datasets.load_from_disk(url)
                if isinstance(ds, datasets.DatasetDict):
                    ds = ds[split]
            else:
                ds = datasets.load_dataset(url, split=split)
        except (FileNotFoundError, ValueError, KeyError) as err:
            raise ConfigError(f"data.hf_dataset {url!r} cannot be loaded: {str(err).splitlines()[0] if str(err) else err!r}") from None
        if column not in ds.column_names:
            raise ConfigError(f"data.hf_dataset {url!r} has no column {column!r} (columns: {', '.join(ds.column_names)})")
        self.ds = ds.select_columns([column])
        self.column = column

    def __len__(self) -> int:
        return len(self.ds)

    def texts(self, idx: list[int]) -> list[str]:
        return [str(t or "") for t in self.ds[idx][self.column]]


def refuse_compressed(url: str) -> None:
    """A text source's file must allow ranged reads: a compressed one (by its suffix, as fsspec infers it) is refused."""
    compression = infer_compression(url)
    if compression:
        raise ConfigError(f"text file {url!r} is {compression}-compressed: data.source 'text' reads documents with ranged "
                          "reads, which compressed files do not allow; tokenize it with 'ddiloco data prepare' instead")


def text_units(data: DataConfig, seq_len: int) -> Units:
    if data.source == "hf":
        assert data.hf_dataset is not None  # the config validator guarantees it
        return HFUnits(data.hf_dataset, data.hf_split, data.text_column)
    urls = _expand(data.shards)
    if not urls:
        raise ConfigError(f"data.shards {data.shards} matched no files")
    files: list[Any] = []
    for url in urls:
        refuse_compressed(url)
        try:
            if url.lower().endswith(JSONL_SUFFIXES):
                files.append(_JsonlFile(url, data.text_column))
            elif url.lower().endswith(PARQUET_SUFFIXES):
                files.append(_ParquetTextFile(url, data.text_column))
            else:
                files.append(_TextFile(url, 4 * (seq_len + 1)))
        except FileNotFoundError:
            raise ConfigError(f"text file {url!r} does not exist") from None
    return FileUnits(files)


class TextDataset:
    """Windows of ``seq_len + 1`` tokens from text tokenized as it is read."""

    def __init__(self, data: DataConfig, seq_len: int, tokenizer: TextTokenizer | None = None) -> None:
        self.kind = data.source
        self.seq_len = seq_len
        self.n_val_batches = data.val_batches
        assert data.tokenizer is not None  # the config validator guarantees it
        self.tokenizer = tokenizer or load_tokenizer(data.tokenizer, data.eos)
        if self.tokenizer.eot_id is None:
            raise ConfigError(f"data.tokenizer {data.tokenizer!r} names no end-of-text token, so documents would run together: "
                              "set data.eos to the token that ends a document")
        self.vocab_size = self.tokenizer.vocab_size
        self.units = text_units(data, seq_len)
        n = len(self.units)
        self.n_val = max(1, n // data.val_every)
        self.n_train = n - self.n_val
        where = f"data.hf_dataset {data.hf_dataset!r}" if data.source == "hf" else f"data.shards {data.shards}"
        if self.n_train < 1:
            raise ConfigError(f"{where} holds {n} document(s): too few for a training and a validation part")
        self.units.texts([0])  # a missing text field fails here, before training
        self._val_cache: dict[int, list[Batch]] = {}

    def _encode(self, units: list[int]) -> list[list[int]]:
        eot = [] if self.tokenizer.eot_id is None else [self.tokenizer.eot_id]
        return [ids + eot for ids in self.tokenizer.encode_batch(self.units.texts(units))]

    def _rows(self, first: list[int], offsets: list[int], lo: int, hi: int) -> np.ndarray:
        """Rows of ``seq_len + 1`` tokens from unit ``first[r]`` on, at ``offsets[r]`` (modulo its length),
        continued with the next units of ``[lo, hi)`` (wrapping)."""
        need = self.seq_len + 1
        toks = self._encode(first)
        starts = [off % len(t) if t else 0 for off, t in zip(offsets, toks, strict=True)]
        nxt = list(first)
        for _ in range(hi - lo):
            short = [r for r in range(len(toks)) if len(toks[r]) - starts[r] < need]
            if not short:
                break
            for r in short:
                nxt[r] = lo + (nxt[r] + 1 - lo) % (hi - lo)
            for r, more in zip(short, self._encode([nxt[r] for r in short]), strict=True):
                toks[r] = toks[r] + more
        else:
            raise ConfigError(f"units [{lo}, {hi}) hold fewer than model.seq_len + 1 = {need} tokens together")
        return np.array([t[s : s + need] for t, s in zip(toks, starts, strict=True)], dtype=np.int64)

    def shard_range(self, shard: int, num_shards: int) -> tuple[int, int]:
        """Learner × rank ``shard``'s contiguous, disjoint range of training units."""
        return shard * self.n_train // num_shards, (shard + 1) * self.n_train // num_shards

    def train_batches(self, shard: int, num_shards: int, batch_size: int, seed: int, start_batch: int = 0) -> Iterator[Batch]:
        check_stream_args(shard, num_shards, batch_size, start_batch)
        lo, hi = self.shard_range(shard, num_shards)
        if hi <= lo:
            raise ValueError(f"training shard {shard} of {num_shards} is empty: {self.n_train} training documents")
        return self._train_iter(lo, hi, batch_size, f"text:{seed}:{shard}", start_batch)

    def _train_iter(self, lo: int, hi: int, batch_size: int, key: str, start: int) -> Iterator[Batch]:
        i = start
        while True:
            counter = np.arange(i * batch_size, (i + 1) * batch_size, dtype=np.int64)
            units = (lo + epoch_order(counter, hi - lo, key)).tolist()
            offsets = [stable_hash(f"{key}:{j}") for j in counter.tolist()]
            yield rows_batch(self._rows(units, offsets, lo, hi))
            i += 1

    def val_batches(self, batch_size: int) -> list[Batch]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size not in self._val_cache:
            lo, hi = self.n_train, self.n_train + self.n_val
            units = [lo + k % self.n_val for k in range(self.n_val_batches * batch_size)]
            rows = self._rows(units, [0] * len(units), lo, hi)
            self._val_cache[batch_size] = [rows_batch(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
        return self._val_cache[batch_size]
