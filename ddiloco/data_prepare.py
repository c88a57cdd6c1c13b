"""``ddiloco data prepare``: tokenize a corpus once into token shards and a manifest at any fsspec URL.

Documents stream through: a file, a jsonl record, a parquet row or a dataset row at a time, encoded
in batches, written to the open shard, so memory holds one batch of documents whatever the corpus.
A document goes to the validation shard by a hash of its index (``val_fraction``); the manifest is
written last, so a manifest names only complete shards."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fsspec
import numpy as np
from fsspec.core import url_to_fs

from ddiloco.platform.config import ConfigError
from ddiloco.platform.manifest import Manifest, ShardEntry, write_manifest
from ddiloco.platform.tokenize import TextTokenizer, load_tokenizer, tokenizer_json_url, train_bpe, write_text

STDLIB = "stdlib"
"""``--input stdlib``: the standard library's .py files, the corpus the demo trains on."""
ENCODE_BATCH = 256
ROW_GROUP_TOKENS = 1 << 16
"""Parquet shards: documents are buffered into row groups of about this many tokens (the unit a reader fetches)."""


@dataclass(frozen=True)
class Corpus:
    """Documents to tokenize: how many (when known) and a fresh iterator over their texts."""

    count: int | None
    texts: Callable[[], Iterator[str]]
    where: str


def _file_texts(url: str, column: str) -> Iterator[str]:
    lower = url.lower()
    if lower.endswith((".jsonl", ".ndjson")):
        with fsspec.open(url, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield str(json.loads(line)[column])
                    except (ValueError, KeyError, TypeError) as err:
                        raise ConfigError(f"{url!r} line {n}: no text field {column!r} in a JSON object ({err!r})") from None
    elif lower.endswith((".parquet", ".pq")):
        import pyarrow.parquet as pq

        with fsspec.open(url, "rb") as f:
            pf = pq.ParquetFile(f)
            if column not in pf.schema_arrow.names:
                raise ConfigError(f"{url!r} has no column {column!r} (columns: {', '.join(pf.schema_arrow.names)})")
            for g in range(pf.num_row_groups):
                yield from (str(t or "") for t in pf.read_row_group(g, columns=[column]).column(0).to_pylist())
    else:
        with fsspec.open(url, "rb") as f:
            yield f.read().decode("utf-8", "replace")


def file_corpus(pattern: str, column: str = "text", max_bytes: int | None = None) -> Corpus:
    """Files matched by ``pattern`` (``stdlib`` for the standard library): a text file is one document."""
    if pattern == STDLIB:
        import sysconfig

        from ddiloco.platform.data.builtin import _stdlib_files

        files = _stdlib_files(sysconfig.get_paths()["stdlib"])

        def stdlib_texts() -> Iterator[str]:
            total = 0
            for _, read in files:
                if max_bytes is not None and total >= max_bytes:
                    return
                data = read()
                total += len(data)
                yield data.decode("utf-8", "replace")

        return Corpus(count=len(files) if max_bytes is None else None, texts=stdlib_texts, where="the standard library")
    fs, path = url_to_fs(pattern)
    urls = [fs.unstrip_protocol(p) for p in (sorted(fs.glob(path)) if any(c in path for c in "*?[") else [path])]
    urls = [u for u in urls if not fs.isdir(url_to_fs(u)[1])]
    if not urls:
        raise ConfigError(f"--input {pattern!r} matched no files")

    def texts() -> Iterator[str]:
        for u in urls:
            yield from _file_texts(u, column)

    return Corpus(count=None if any(u.lower().endswith((".jsonl", ".ndjson", ".parquet", ".pq")) for u in urls) else len(urls),
                  texts=texts, where=f"--input {pattern}")


def hf_corpus(url: str, split: str = "train", column: str = "text") -> Corpus:
    """A Hugging Face dataset: a ``save_to_disk`` folder, else ``load_dataset(..., streaming=True)`` (one pass)."""
    import datasets

    fs, path = url_to_fs(url)
    if any(fs.exists(f"{path.rstrip('/')}/{n}") for n in ("state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(url)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
        count: int | None = len(ds)
    else:
        ds = datasets.load_dataset(url, split=split, streaming=True)
        count = None
    if ds.column_names is not None and column not in ds.column_names:
        raise ConfigError(f"--hf-dataset {url!r} has no column {column!r} (columns: {', '.join(ds.column_names)})")

    def texts() -> Iterator[str]:
        for row in ds:
            yield str(row[column] or "")

    return Corpus(count=count, texts=texts, where=f"--hf-dataset {url}")


class _ShardWriter:
    """Appends token arrays to numbered shards of at most ``shard_tokens`` tokens (``.bin`` or parquet)."""

    def __init__(self, out: str, prefix: str, dtype: str, shard_tokens: int | None, fmt: str) -> None:
        self.out, self.prefix, self.dtype, self.shard_tokens, self.fmt = out, prefix, np.dtype(dtype), shard_tokens, fmt
        self.entries: list[ShardEntry] = []
        self._file = None
        self._writer = None
        self._tokens = 0
        self._rows: list[list[int]] = []
        self._row_tokens = 0

    @property
    def empty(self) -> bool:
        """Nothing written yet (then the last document goes to validation: every corpus gets a validation shard)."""
        return not self.entries and self._file is None

    def _name(self) -> str:
        suffix = "bin" if self.fmt == "bin" else "parquet"
        return f"{self.prefix}.{suffix}" if self.shard_tokens is None else f"{self.prefix}-{len(self.entries):05d}.{suffix}"

    def _open(self) -> None:
        name = self._name()
        self._current = name
        self._file = fsspec.open(f"{self.out}/{name}", "wb").open()
        self._tokens = 0
        if self.fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            self._writer = pq.ParquetWriter(self._file, pa.schema([("tokens", pa.list_(pa.uint32()))]))

    def _flush_rows(self) -> None:
        import pyarrow as pa

        if self._rows:
            self._writer.write_table(pa.table({"tokens": pa.array(self._rows, type=pa.list_(pa.uint32()))}))
        self._rows, self._row_tokens = [], 0

    def close(self) -> None:
        if self._file is None:
            return
        if self._writer is not None:
            self._flush_rows()
            self._writer.close()
            self._writer = None
        self._file.close()
        self.entries.append(ShardEntry(self._current, self._tokens))
        self._file = None

    def write(self, docs: list[list[int]]) -> None:
        for doc in docs:
            if self._file is None:
                self._open()
            if self.fmt == "bin":
                self._file.write(np.asarray(doc, dtype=self.dtype).tobytes())
            else:
                self._rows.append(doc)
                self._row_tokens += len(doc)
                if self._row_tokens >= ROW_GROUP_TOKENS:
                    self._flush_rows()
            self._tokens += len(doc)
            if self.shard_tokens is not None and self._tokens >= self.shard_tokens:
                self.close()


def is_val(doc: int, val_fraction: float) -> bool:
    """Whether document ``doc`` goes to the validation shard: a hash of its index, the same on every machine."""
    from ddiloco.platform.data.core import stable_hash

    return stable_hash(f"val:{doc}") < val_fraction * 2**64


def prepare(
    corpus: Corpus,
    out: str,
    *,
    tokenizer: str | None = None,
    train_tokenizer: int | None = None,
    shard_tokens: int = 50_000_000,
    val_fraction: float = 0.01,
    fmt: str = "bin",
    progress: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Tokenize ``corpus`` into shards under ``out`` and write ``out/manifest.json``; the manifest.

    ``progress(documents, tokens)`` is called after every batch of documents."""
    if (tokenizer is None) == (train_tokenizer is None):
        raise ConfigError("give exactly one of --tokenizer and --train-tokenizer")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if fmt not in ("bin", "parquet"):
        raise ConfigError(f"--format must be bin or parquet, got {fmt!r}")
    out = out.rstrip("/")
    if train_tokenizer is not None:
        text = train_bpe(corpus.texts(), train_tokenizer)
        write_text(tokenizer_json_url(out), text)
        tok: TextTokenizer = load_tokenizer(tokenizer_json_url(out))
    else:
        assert tokenizer is not None
        tok = load_tokenizer(tokenizer)
        if tok.json is not None:
            write_text(tokenizer_json_url(out), tok.json)
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    train = _ShardWriter(out, "train", dtype, shard_tokens, fmt)
    val = _ShardWriter(out, "val", dtype, None, fmt)
    eot = [] if tok.eot_id is None else [tok.eot_id]
    docs = tokens = 0
    last: list[int] | None = None
    pending: list[str] = []

    def flush() -> None:
        nonlocal docs, tokens, last
        encoded = [ids + eot for ids in tok.encode_batch(pending)]
        for ids in encoded:
            if last is not None:  # one document behind, so the very last can go to validation if none did
                (val if is_val(docs - 1, val_fraction) else train).write([last])
            last = ids
            docs += 1
            tokens += len(ids)
        pending.clear()
        if progress is not None:
            progress(docs, tokens)

    for text in corpus.texts():
        pending.append(text)
        if len(pending) >= ENCODE_BATCH:
            flush()
    if pending:
        flush()
    if last is None:
        raise ConfigError(f"{corpus.where} holds no documents")
    (val if is_val(docs - 1, val_fraction) or val.empty else train).write([last])
    train.close()
    val.close()
    if not train.entries:
        raise ConfigError(f"{corpus.where} holds {docs} document(s): too few for a training and a validation shard")
    manifest = Manifest(
        dtype=dtype, train=train.entries, val=val.entries[0], vocab_size=tok.vocab_size, tokenizer_sha256=tok.sha256,
        tokenizer="tokenizer.json" if tok.json is not None else tok.source, eot_id=tok.eot_id,
        extra={"documents": docs, "source": corpus.where, "format": fmt},
    )
    write_manifest(f"{out}/manifest.json", manifest)
    return manifest
