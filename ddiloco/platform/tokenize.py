"""Tokenizers from a local file, directory or fsspec URL; the vocabulary check; BPE training.

A ``tokenizer.json`` (Hugging Face ``tokenizers``) is loaded with ``Tokenizer.from_str`` from any
fsspec URL; a ``save_pretrained`` directory without one goes through
``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)``. Nothing is downloaded.
Torch-free, so ``ddiloco config`` can check a vocabulary in its first second."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from ddiloco.platform.config import ConfigError, DataConfig, ModelConfig

EOT = "<|endoftext|>"
BYTE_VOCAB = 256


@dataclass(frozen=True)
class TextTokenizer:
    """What the data path needs of a tokenizer: batch encoding, the vocabulary, an end-of-text id, a hash."""

    encode_batch: Callable[[list[str]], list[list[int]]]
    vocab_size: int
    eot_id: int | None
    sha256: str
    source: str
    json: str | None = None
    """The ``tokenizer.json`` text when the tokenizer is one (``data prepare`` stores it beside the shards)."""


def _from_json(text: str, source: str) -> TextTokenizer:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise ConfigError(f"data.tokenizer {source!r} is not a valid tokenizer.json: {str(err).splitlines()[0]}") from None

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]

    return TextTokenizer(
        encode_batch=encode_batch, vocab_size=tok.get_vocab_size(with_added_tokens=True), eot_id=tok.token_to_id(EOT),
        sha256=hashlib.sha256(text.encode()).hexdigest(), source=source, json=text,
    )


def _from_pretrained(path: str) -> TextTokenizer:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError or others for a directory it cannot use
        raise ConfigError(f"data.tokenizer {path!r} holds no usable tokenizer: {str(err).splitlines()[0]}") from None
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            digest.update(name.encode() + b"\0")
            with open(full, "rb") as f:
                digest.update(f.read())

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=False)["input_ids"]

    return TextTokenizer(encode_batch=encode_batch, vocab_size=len(tok), eot_id=tok.eos_token_id, sha256=digest.hexdigest(), source=path)


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str) -> TextTokenizer:
    """The tokenizer at ``path`` (a tokenizer.json, or a directory holding one or a save_pretrained tokenizer)."""
    fs, stripped = url_to_fs(path)
    try:
        is_dir = fs.isdir(stripped)
        candidate = stripped.rstrip("/") + "/tokenizer.json" if is_dir else stripped
        if fs.isfile(candidate):
            with fs.open(candidate, "rb") as f:
                return _from_json(f.read().decode("utf-8"), path)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"data.tokenizer {path!r} cannot be read: {err}") from None
    if is_dir and isinstance(fs, LocalFileSystem):
        return _from_pretrained(stripped)
    raise ConfigError(f"data.tokenizer {path!r} does not exist (a tokenizer.json file or a directory holding one)")


def train_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on ``texts``; its tokenizer.json text (``EOT`` is token 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


def data_vocab(data: DataConfig) -> tuple[int, str] | None:
    """The vocabulary the data needs and where it comes from, or None when unknown before reading tokens."""
    if data.source in ("stdlib", "glob"):
        return BYTE_VOCAB, f"data.source {data.source!r} is byte-level"
    if data.source == "tokens" and data.manifest:
        from ddiloco.platform.manifest import read_manifest

        return read_manifest(data.manifest).vocab_size, f"data.manifest {data.manifest}"
    if data.tokenizer:
        return load_tokenizer(data.tokenizer).vocab_size, f"data.tokenizer {data.tokenizer}"
    return None


def check_vocab(model: ModelConfig, data: DataConfig) -> int | None:
    """Refuse a model whose vocabulary cannot embed every token the data yields; the data's vocabulary."""
    if model.kind in ("vision", "import") or data.source == "digits":
        return None  # an imported factory's vocabulary is its own, not model.vocab_size
    need = data_vocab(data)
    if need is None:
        return None
    vocab, where = need
    if model.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size {model.vocab_size} is smaller than the tokenizer's vocabulary {vocab} ({where})")
    return vocab


def tokenizer_json_url(url: str) -> str:
    """Where ``data prepare`` stores a tokenizer beside the shards."""
    return url.rstrip("/") + "/tokenizer.json"


def write_text(url: str, text: str) -> None:
    with fsspec.open(url, "w") as f:
        f.write(text)
