"""The fragment store: immutable, content-checked safetensors blobs at any fsspec URL.

Blobs are never pickled, never overwritten, and verified against their sha256 on every read.
A blob is complete before it becomes visible: temp file + hard link on local disks, a single
conditional PUT on object stores."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import torch
from fsspec.core import url_to_fs
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from ddiloco.platform import stall
from ddiloco.platform.config import store_url_problem
from ddiloco.platform.ids import TMP_PREFIX, InvalidIdError, validate_key
from ddiloco.platform.redact import redact_url

# Transient failures (network, a restarting server) are retried; integrity failures are not.
RETRY_ATTEMPTS = 6


class StoreError(RuntimeError):
    """A blob could not be stored or read back intact."""


class BlobExistsError(StoreError):
    """The key already holds a blob: blobs are immutable."""


class BlobMissingError(StoreError):
    pass


class BlobCorruptError(StoreError):
    """The bytes under the key are not the blob that was registered (checksum, truncation, format)."""


@dataclass(frozen=True)
class BlobInfo:
    key: str
    sha256: str
    nbytes: int


def _is_transient(err: BaseException) -> bool:
    permanent = (StoreError, InvalidIdError, FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
    if isinstance(err, (*permanent, PermissionError, ValueError)):
        return False
    return isinstance(err, (OSError, ConnectionError, TimeoutError)) or type(err).__name__ in (
        "ClientError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ServerDisconnectedError",
        "ClientOSError",
    )


_retry = retry(
    retry=retry_if_exception(_is_transient),
    stop=stop_after_attempt(RETRY_ATTEMPTS),
    wait=wait_exponential(multiplier=0.2, max=8.0),
    reraise=True,
)


def encode_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Serialize tensors to safetensors bytes (contiguous CPU copies)."""
    clean = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return st_save(clean, metadata=metadata)


# Bounds on what a blob may ask of its reader, checked before Python parses any of it: an honest header
# lists a fragment's tensors (well under a megabyte) and nests three deep; a hostile one can be a
# 100,000-deep JSON document that makes a recursive parser raise on every poll. The header is parsed
# first by safetensors' Rust parser, whose serde_json refuses nesting past 128 (its recursion limit)
# and whatever is not a safetensors header; only then by Python, for the metadata.
MAX_HEADER_BYTES = 16 << 20
MAX_BLOB_BYTES = 1 << 40
MAX_JSON_DEPTH = 16
"""Metadata values are often JSON themselves (the delta codec's tensor list), parsed later by Python: bounded here."""
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # unrolled: 4x faster than an alternation per character
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("{"), ord("[")]] = 1
_BRACKET_STEP[[ord("}"), ord("]")]] = -1


def json_depth(text: bytes) -> int:
    """How deep the brackets of JSON ``text`` nest (brackets inside strings do not count); no recursion."""
    bare = np.frombuffer(_JSON_STRING.sub(b"", text), dtype=np.uint8)
    if not bare.size:
        return 0
    return int(np.cumsum(_BRACKET_STEP[bare], dtype=np.int32).max())


def _short(err: BaseException, limit: int = 160) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit] + "…"


def decode_tensors(data: bytes, key: str = "<bytes>") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse safetensors bytes with bounds; anything else (a pickle, a truncated file, a hostile header) raises BlobCorruptError."""
    if len(data) < 8:
        raise BlobCorruptError(f"blob {key!r} is truncated ({len(data)} bytes)")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise BlobCorruptError(f"blob {key!r} has a {header_len}-byte header (at most {MAX_HEADER_BYTES} allowed)")
    if header_len <= 0 or 8 + header_len > len(data):
        raise BlobCorruptError(f"blob {key!r} is not a safetensors file (bad header length {header_len})")
    try:
        tensors = st_load(data)
        header = json.loads(data[8 : 8 + header_len])  # a header safetensors accepted: shallow, a JSON object
    except Exception as err:  # noqa: BLE001 - whatever the parsers choke on, it is this blob's fault
        raise BlobCorruptError(f"blob {key!r} is not a valid safetensors file: {_short(err)}") from None
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise BlobCorruptError(f"blob {key!r} has __metadata__ that is not a map of strings")
    for name, value in meta.items():
        if value.lstrip()[:1] in ("[", "{") and json_depth(value.encode()) > MAX_JSON_DEPTH:
            raise BlobCorruptError(f"blob {key!r} has __metadata__ {name[:40]!r} nested deeper than {MAX_JSON_DEPTH}")
    return tensors, dict(meta)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fs_options(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """fsspec options of a run's store at ``url`` (its blobs and the learners' states): stalls bounded (``stall.py``)
    and no listings cache: s3fs answers reads from a cached listing, so a listing would make blobs (or a state's
    ``.metadata``) written after it look missing, and immutable objects gain nothing from it."""
    return {"use_listings_cache": False, **stall.store_options(url, storage_options)}


class FragmentStore:
    """Put/get of named tensor dicts under string keys below one fsspec root URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        why = store_url_problem(self.url)
        if why:
            raise StoreError(f"store {redact_url(self.url)}: {why}")
        self.fs, self.root = url_to_fs(self.url, **fs_options(self.url, storage_options))
        self.root = self.root.rstrip("/")
        self._local = "file" in _protocols(self.fs)
        self._memory = "memory" in _protocols(self.fs)
        if self._local:
            try:
                os.makedirs(self.root, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise StoreError(f"store {redact_url(self.url)}: {self.root} or a folder above it is a file, "
                                 "not a directory") from None

    def __repr__(self) -> str:
        return f"FragmentStore({redact_url(self.url)!r})"

    def path(self, key: str) -> str:
        return f"{self.root}/{validate_key(key)}"

    # --- writing -------------------------------------------------------------------------------

    def put(self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> BlobInfo:
        """Write a new blob; refuses to overwrite an existing key."""
        return self.put_bytes(key, encode_tensors(tensors, metadata))

    def put_bytes(self, key: str, data: bytes) -> BlobInfo:
        path = self.path(key)
        digest = sha256_hex(data)
        try:
            self._put_once(path, data)
        except BlobExistsError:
            # A retried PUT that had in fact landed the first time is not an error.
            if self._read(path) == data:
                return BlobInfo(key, digest, len(data))
            raise BlobExistsError(f"blob {key!r} already exists with other content: blobs are immutable") from None
        return BlobInfo(key, digest, len(data))

    @_retry
    def _put_once(self, path: str, data: bytes) -> None:
        if self._local:
            self._put_local(path, data)
            return
        parent = path.rsplit("/", 1)[0]
        if self._memory:
            self.fs.makedirs(parent, exist_ok=True)
            if self.fs.exists(path):
                raise BlobExistsError(path)
            self.fs.pipe_file(path, data)
            return
        try:
            # One conditional PUT (If-None-Match: *) on object stores that support it.
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            raise BlobExistsError(path) from None
        except (NotImplementedError, ValueError):
            if self.fs.exists(path):
                raise BlobExistsError(path) from None
            self.fs.pipe_file(path, data)

    @staticmethod
    def _put_local(path: str, data: bytes) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                # link() is atomic and, unlike rename(), fails if the key exists.
                os.link(tmp, path)
            except FileExistsError:
                raise BlobExistsError(path) from None
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    # --- reading -------------------------------------------------------------------------------

    @_retry
    def _read(self, path: str, limit: int | None = None) -> bytes:
        if self._memory:
            return self._read_memory(path, limit)
        # A ranged read of at most limit + 1 bytes: one byte more tells a longer object from an exact one.
        return self.fs.cat_file(path) if limit is None else self.fs.cat_file(path, start=0, end=limit + 1)

    def _read_memory(self, path: str, limit: int | None) -> bytes:
        """memory:// (in-process runs, tests): the stored bytes themselves. ``cat_file`` copies a blob twice per read
        (unsharing the file's buffer, then slicing it), which for a float32 blob of a 30M-parameter model in a run of
        eight learners is most of a synchronous round's host time; blobs are immutable bytes, so none is needed."""
        try:
            data = self.fs.store[self.fs._strip_protocol(path)].getvalue()
        except KeyError:
            raise FileNotFoundError(path) from None
        return data if limit is None or len(data) <= limit + 1 else data[: limit + 1]

    def get_bytes(self, key: str, sha256: str | None = None, nbytes: int | None = None) -> bytes:
        """The blob's bytes; with ``nbytes`` (the registered size) no more than that is ever read."""
        path = self.path(key)
        if nbytes is not None and not 0 < nbytes <= MAX_BLOB_BYTES:
            raise BlobCorruptError(f"blob {key!r} is registered with {nbytes} bytes (1..{MAX_BLOB_BYTES} allowed)")
        try:
            data = self._read(path, nbytes)
        except (FileNotFoundError, NotADirectoryError):
            # The store's URL is left out on purpose: reasons are recorded in the ledger and shown.
            raise BlobMissingError(f"blob {key!r} is missing") from None
        except IsADirectoryError:
            raise BlobCorruptError(f"blob {key!r} is a directory, not a blob") from None
        if nbytes is not None and len(data) != nbytes:
            size = "larger than" if len(data) > nbytes else f"{len(data)} bytes, not"
            raise BlobCorruptError(f"blob {key!r} is {size} the {nbytes} bytes registered")
        if sha256 is not None and sha256_hex(data) != sha256:
            raise BlobCorruptError(f"blob {key!r} does not match its sha256 (expected {sha256[:12]}…, {len(data)} bytes read)")
        return data

    def get(self, key: str, sha256: str | None = None, nbytes: int | None = None) -> dict[str, torch.Tensor]:
        """Read and verify a blob. Pass the registered sha256 (and size) whenever they are known."""
        return self.get_with_metadata(key, sha256, nbytes)[0]

    def get_with_metadata(
        self, key: str, sha256: str | None = None, nbytes: int | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return decode_tensors(self.get_bytes(key, sha256, nbytes), key)

    def verify(self, key: str, sha256: str) -> bool:
        try:
            self.get_with_metadata(key, sha256)
        except (StoreError, InvalidIdError):
            return False
        return True

    @_retry
    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    @_retry
    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass

    @_retry
    def delete_tree(self, key: str) -> None:
        """Delete a directory of blobs (a learner's checkpoint) and everything under it."""
        try:
            self.fs.rm(self.path(key), recursive=True)
        except FileNotFoundError:
            pass

    def list(self, prefix: str = "") -> list[str]:
        base = self.root + ("/" + prefix.strip("/") if prefix else "")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        out = []
        for p in found:
            p = p if p.startswith("/") or not self.root.startswith("/") else p
            rel = p[len(self.root) :].lstrip("/") if p.startswith(self.root) else p.split(self.root.lstrip("/"), 1)[-1].lstrip("/")
            if not rel.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
                out.append(rel)
        return sorted(out)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


_stores: dict[str, FragmentStore] = {}


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> FragmentStore:
    """One FragmentStore per URL and options per process (fsspec filesystems are reusable and thread-safe enough)."""
    key = url + "\0" + json.dumps(storage_options or {}, sort_keys=True, default=str)
    if key not in _stores:
        _stores[key] = FragmentStore(url, storage_options)
    return _stores[key]
