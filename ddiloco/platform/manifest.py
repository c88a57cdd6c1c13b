"""The manifest of a prepared token corpus (``manifest.json``, written by ``ddiloco data prepare``).

Shard paths are relative to the manifest's own folder, so a prefix of shards can be copied or moved
(local disk to a bucket) as a whole. Torch-free: ``ddiloco config`` reads it in its first second."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec

from ddiloco.platform.config import ConfigError

MANIFEST_FORMAT = "ddiloco-tokens/1"
DTYPES = {"uint16": 2, "uint32": 4}


@dataclass(frozen=True)
class ShardEntry:
    path: str
    """Relative to the manifest's folder, or an absolute URL."""
    tokens: int
    sha256: str | None = None
    """Of the shard's bytes, as written (``.bin`` shards; None where the writer could not see them)."""


@dataclass(frozen=True)
class Manifest:
    dtype: str
    train: list[ShardEntry]
    val: ShardEntry
    vocab_size: int
    tokenizer_sha256: str
    tokenizer: str | None = None
    """The tokenizer file, relative to the manifest's folder, when it was stored beside the shards."""
    eot_id: int | None = None
    column: str = "tokens"
    """The token-id list column of parquet shards."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def train_tokens(self) -> int:
        return sum(s.tokens for s in self.train)

    def to_json(self) -> str:
        body = asdict(self)
        return json.dumps({"format": MANIFEST_FORMAT, **body}, indent=2) + "\n"


def resolve(base_url: str, rel: str) -> str:
    """``rel`` against the folder of ``base_url`` (a manifest URL); absolute URLs are returned unchanged."""
    if "://" in rel or rel.startswith("/"):
        return rel
    return base_url.rsplit("/", 1)[0] + "/" + rel if "/" in base_url else rel


def read_manifest(url: str) -> Manifest:
    """The manifest at ``url``, or a one-line ConfigError naming what is missing or wrong."""
    try:
        with fsspec.open(url, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(f"data.manifest {url!r} does not exist (write it with 'ddiloco data prepare')") from None
    except OSError as err:
        raise ConfigError(f"data.manifest {url!r} cannot be read: {err}") from None
    try:
        body = json.loads(raw)
        if body.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format is {body.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        if body["dtype"] not in DTYPES:
            raise ValueError(f"dtype {body['dtype']!r} is not one of {sorted(DTYPES)}")
        train = [ShardEntry(str(s["path"]), int(s["tokens"]), s.get("sha256")) for s in body["train"]]
        val = ShardEntry(str(body["val"]["path"]), int(body["val"]["tokens"]), body["val"].get("sha256"))
        return Manifest(
            dtype=body["dtype"], train=train, val=val, vocab_size=int(body["vocab_size"]),
            tokenizer_sha256=str(body["tokenizer_sha256"]), tokenizer=body.get("tokenizer"),
            eot_id=body.get("eot_id"), column=body.get("column", "tokens"), extra=body.get("extra", {}),
        )
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"data.manifest {url!r} is not a valid manifest: {err!r}") from None


def write_manifest(url: str, manifest: Manifest) -> None:
    """Write the manifest last: its presence means every shard it names is complete."""
    with fsspec.open(url, "w") as f:
        f.write(manifest.to_json())
