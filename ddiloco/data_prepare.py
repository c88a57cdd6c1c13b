"""``ddiloco data prepare``: tokenize a corpus once into token shards and a manifest at any fsspec URL.

Documents stream through: a file, a jsonl record, a parquet row or a dataset row at a time, encoded
in batches, written to the open shard, so memory holds one batch of documents whatever the corpus.
A document goes to the validation shard by a hash of its index (``val_fraction``); the manifest is
written last, so a manifest names only complete shards."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from fsspec.utils import infer_compression

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
    validation: Callable[[int], bool] | None = None
    """Document index -> whether it validates; None: a hash of the index decides (``val_fraction``)."""
    tokenizer_texts: Callable[[], Iterator[str]] | None = None
    """The texts ``--train-tokenizer`` learns from; None: every document (validation ones too)."""
    record: dict[str, Any] = field(default_factory=dict)
    """What the corpus is (its package list and digest), kept in the manifest's ``extra``."""


def _kind(url: str) -> str:
    """jsonl, parquet or text, from the file's name less a compression suffix fsspec knows (``a.jsonl.gz`` is jsonl)."""
    name = url.lower()
    if infer_compression(name):
        name = name.rsplit(".", 1)[0]
    return "jsonl" if name.endswith((".jsonl", ".ndjson")) else "parquet" if name.endswith((".parquet", ".pq")) else "text"


def _file_texts(url: str, column: str) -> Iterator[str]:
    kind = _kind(url)
    if kind == "jsonl":
        with fsspec.open(url, "rt", encoding="utf-8", compression="infer") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield str(json.loads(line)[column])
                    except (ValueError, KeyError, TypeError) as err:
                        raise ConfigError(f"{url!r} line {n}: no text field {column!r} in a JSON object ({err!r})") from None
    elif kind == "parquet":
        import pyarrow.parquet as pq

        with fsspec.open(url, "rb", compression="infer") as f:
            pf = pq.ParquetFile(f)
            if column not in pf.schema_arrow.names:
                raise ConfigError(f"{url!r} has no column {column!r} (columns: {', '.join(pf.schema_arrow.names)})")
            for g in range(pf.num_row_groups):
                yield from (str(t or "") for t in pf.read_row_group(g, columns=[column]).column(0).to_pylist())
    else:
        with fsspec.open(url, "rb", compression="infer") as f:
            yield f.read().decode("utf-8", "replace")


def file_corpus(pattern: str, column: str = "text", max_bytes: int | None = None) -> Corpus:
    """Files matched by ``pattern`` (``stdlib`` for the standard library, ``site-packages`` for the installed packages'
    sources): a text file is one document."""
    if pattern == SITE_PACKAGES:
        return site_packages_corpus(max_bytes)
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

    return Corpus(count=None if any(_kind(u) != "text" for u in urls) else len(urls),
                  texts=texts, where=f"--input {pattern}")


SITE_PACKAGES = "site-packages"
"""``--input site-packages``: the Python sources of the installed packages, split by package (:func:`site_packages_corpus`)."""
PROJECT = "ddiloco"
"""Left out of the site-packages corpus: the project's own code is not text someone else wrote."""
MAX_SOURCE_BYTES = 1 << 20
"""Larger .py files are left out: generated tables (Unicode data, parser states), not code."""
VAL_SHARE = 0.02
TOKENIZER_BYTES = 64 << 20
"""The first this many bytes of the training documents are what a BPE is trained on."""


@dataclass(frozen=True)
class SourceFile:
    package: str
    rel: str
    """The path its distribution's RECORD gives (never the machine's own)."""
    path: str
    nbytes: int


def _dist_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_sources(exclude: tuple[str, ...] = (PROJECT,),
                      max_file_bytes: int = MAX_SOURCE_BYTES) -> tuple[dict[str, str], list[SourceFile]]:
    """(distribution -> version, the ``.py`` files their RECORDs list): the first distribution of a name on sys.path,
    as imports see it; a file listed twice counts once."""
    import importlib.metadata as md

    versions: dict[str, str] = {}
    files: list[SourceFile] = []
    seen: set[str] = set()
    for dist in md.distributions():
        name = _dist_name(dist.metadata["Name"] or "")
        if not name or name in versions or name in exclude:
            continue
        versions[name] = dist.version
        for f in dist.files or ():
            rel = str(f)
            if not rel.endswith(".py"):
                continue
            path = os.path.realpath(dist.locate_file(f))
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            if 0 < size <= max_file_bytes and path not in seen:
                seen.add(path)
                files.append(SourceFile(name, rel, path, size))
    return versions, files


def validation_packages(sizes: dict[str, int], share: float) -> set[str]:
    """Packages in a fixed order (a hash of the name), each taken for validation if it still fits in ``share`` of the bytes:
    whole packages validate, so no file of a validation package is trained on."""
    from ddiloco.platform.data.core import stable_hash

    target, total, out = share * sum(sizes.values()), 0, set()
    for name in sorted(sizes, key=lambda n: stable_hash(f"val:{n}")):
        if total + sizes[name] <= target:
            out.add(name)
            total += sizes[name]
    return out


def _first_bytes(files: list[SourceFile], cap: float | None) -> list[SourceFile]:
    if cap is None:
        return files
    out, total = [], 0
    for f in files:
        if total >= cap:
            break
        out.append(f)
        total += f.nbytes
    return out


def site_packages_corpus(max_bytes: int | None = None, val_share: float = VAL_SHARE, tokenizer_bytes: int = TOKENIZER_BYTES) -> Corpus:
    """The ``.py`` files of the installed distributions (the project's own left out): whole packages validate
    (:func:`validation_packages`), the rest train. Files are ordered by a hash of package and path, so any contiguous
    range of the training stream (a learner's shard) mixes packages. ``max_bytes`` caps each side's share of it.

    The corpus's record (for the manifest) lists every package with its version, split, files and bytes, and a sha256
    of that listing: the same environment gives the same digest, on any machine."""
    from ddiloco.platform.data.core import stable_hash

    versions, files = installed_sources()
    sizes: dict[str, int] = {}
    for f in files:
        sizes[f.package] = sizes.get(f.package, 0) + f.nbytes
    val_packages = validation_packages(sizes, val_share)
    files.sort(key=lambda f: (stable_hash(f"{f.package}/{f.rel}"), f.package, f.rel))
    train = _first_bytes([f for f in files if f.package not in val_packages], None if max_bytes is None else max_bytes * (1 - val_share))
    val = _first_bytes([f for f in files if f.package in val_packages], None if max_bytes is None else max_bytes * val_share)
    if not train or not val:
        raise ConfigError(f"the installed packages hold {len(train)} training and {len(val)} validation source files: need both")
    docs = train + val
    digest = hashlib.sha256()
    per: dict[str, dict[str, Any]] = {}
    for f in docs:
        digest.update(f"{f.package}\t{versions[f.package]}\t{f.rel}\t{f.nbytes}\n".encode())
        p = per.setdefault(f.package, {"name": f.package, "version": versions[f.package],
                                       "split": "val" if f.package in val_packages else "train", "files": 0, "bytes": 0})
        p["files"] += 1
        p["bytes"] += f.nbytes
    rules = {"max_file_bytes": MAX_SOURCE_BYTES, "val_share": val_share, "max_bytes": max_bytes, "excluded": [PROJECT]}
    digest.update(json.dumps(rules, sort_keys=True).encode())

    def read(f: SourceFile) -> str:
        with open(f.path, "rb") as fh:
            return fh.read().decode("utf-8", "replace")

    def texts() -> Iterator[str]:
        return (read(f) for f in docs)

    def tokenizer_texts() -> Iterator[str]:
        return (read(f) for f in _first_bytes(train, tokenizer_bytes))

    import sys

    record = {
        "corpus": SITE_PACKAGES, "corpus_sha256": digest.hexdigest(), "python": sys.version.split()[0], "rules": rules,
        "train_bytes": sum(f.nbytes for f in train), "val_bytes": sum(f.nbytes for f in val),
        "train_files": len(train), "val_files": len(val), "packages": sorted(per.values(), key=lambda p: p["name"]),
    }
    return Corpus(count=len(docs), texts=texts, where="the installed packages' Python sources",
                  validation=lambda i: i >= len(train), tokenizer_texts=tokenizer_texts, record=record)


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
        self._sha: Any = None

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
        # A parquet writer's bytes go straight to the file: only .bin shards are hashed as written.
        self._sha = hashlib.sha256() if self.fmt == "bin" else None
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
        self.entries.append(ShardEntry(self._current, self._tokens, None if self._sha is None else self._sha.hexdigest()))
        self._file = None

    def write(self, docs: list[list[int]]) -> None:
        for doc in docs:
            if self._file is None:
                self._open()
            if self.fmt == "bin":
                raw = np.asarray(doc, dtype=self.dtype).tobytes()
                self._file.write(raw)
                self._sha.update(raw)
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
    eos: str | None = None,
    shard_tokens: int = 50_000_000,
    val_fraction: float = 0.01,
    fmt: str = "bin",
    progress: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Tokenize ``corpus`` into shards under ``out`` and write ``out/manifest.json``; the manifest.

    Every document ends with ``eos`` when given, else with the tokenizer's own end-of-text token (a trained BPE's is
    ``<|endoftext|>``); a tokenizer that names none is refused, as its documents would run together.
    ``progress(documents, tokens)`` is called after every batch of documents."""
    if (tokenizer is None) == (train_tokenizer is None):
        raise ConfigError("give exactly one of --tokenizer and --train-tokenizer")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if fmt not in ("bin", "parquet"):
        raise ConfigError(f"--format must be bin or parquet, got {fmt!r}")
    out = out.rstrip("/")
    if train_tokenizer is not None:
        text = train_bpe((corpus.tokenizer_texts or corpus.texts)(), train_tokenizer)
        write_text(tokenizer_json_url(out), text)
        tok: TextTokenizer = load_tokenizer(tokenizer_json_url(out), eos)
    else:
        assert tokenizer is not None
        tok = load_tokenizer(tokenizer, eos)
        if tok.eot_id is None:
            raise ConfigError(f"--tokenizer {tokenizer!r} names no end-of-text token, so documents would run together: "
                              "pass --eos TOKEN (the token that ends a document)")
        if tok.json is not None:
            write_text(tokenizer_json_url(out), tok.json)
    assert tok.eot_id is not None  # train_bpe's vocabulary holds EOT
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    train = _ShardWriter(out, "train", dtype, shard_tokens, fmt)
    val = _ShardWriter(out, "val", dtype, None, fmt)
    eot = [tok.eot_id]
    docs = tokens = 0
    last: list[int] | None = None
    pending: list[str] = []

    def validates(doc: int) -> bool:
        return corpus.validation(doc) if corpus.validation is not None else is_val(doc, val_fraction)

    def flush() -> None:
        nonlocal docs, tokens, last
        encoded = [ids + eot for ids in tok.encode_batch(pending)]
        for ids in encoded:
            if last is not None:  # one document behind, so the very last can go to validation if none did
                (val if validates(docs - 1) else train).write([last])
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
    (val if validates(docs - 1) or val.empty else train).write([last])
    train.close()
    val.close()
    if not train.entries:
        raise ConfigError(f"{corpus.where} holds {docs} document(s): too few for a training and a validation shard")
    manifest = Manifest(
        dtype=dtype, train=train.entries, val=val.entries[0], vocab_size=tok.vocab_size, tokenizer_sha256=tok.sha256,
        tokenizer="tokenizer.json" if tok.json is not None else tok.source, eot_id=tok.eot_id,
        extra={"documents": docs, "source": corpus.where, "format": fmt, **corpus.record},
    )
    write_manifest(f"{out}/manifest.json", manifest)
    return manifest
