"""Tokenizers from a local file, directory or fsspec URL; the vocabulary check; BPE training.

A bare ``tokenizer.json`` (Hugging Face ``tokenizers``) is loaded with ``Tokenizer.from_str`` from
any fsspec URL. A directory that ``save_pretrained`` wrote (a ``tokenizer_config.json`` or the files
of a slow tokenizer) goes through ``transformers.AutoTokenizer.from_pretrained(dir,
local_files_only=True)``, which knows the tokenizer's own end-of-text token; a remote one is first
copied (its tokenizer files only) into a local folder, once per process. Nothing is downloaded from
the Hugging Face Hub. Torch-free, so ``ddiloco config`` can check a vocabulary in its first second."""

from __future__ import annotations

import atexit
import functools
import hashlib
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from ddiloco.platform.config import ConfigError, DataConfig, ModelConfig

EOT = "<|endoftext|>"
"""The end-of-text token of a bare tokenizer.json (which names none of its own) and of ``train_bpe``."""
BYTE_VOCAB = 256
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
})
"""What ``save_pretrained`` writes for a tokenizer: the files read (or copied) from a tokenizer directory,
which may hold much else, e.g. the token shards ``data prepare`` wrote beside its tokenizer.json."""


@dataclass(frozen=True)
class TextTokenizer:
    """What the data path needs of a tokenizer: batch encoding, the vocabulary, an end-of-text id, a hash."""

    encode_batch: Callable[[list[str]], list[list[int]]]
    vocab_size: int
    eot_id: int | None
    sha256: str
    source: str
    json: str | None = None
    """The ``tokenizer.json`` text when the tokenizer has one (``data prepare`` stores it beside the shards)."""
    eot: str | None = None
    """The end-of-text token itself (what separates documents), when there is one."""


def _eot(source: str, eos: str | None, own: str | None, lookup: Callable[[str], int | None]) -> tuple[str | None, int | None]:
    """(token, id) that ends a document: ``eos`` when given, else the tokenizer's own; a token must be in the vocabulary."""
    token = eos if eos is not None else own
    if token is None:
        return None, None
    tid = lookup(token)
    if tid is None:
        if eos is None:
            return None, None  # a bare tokenizer.json without EOT names no end-of-text token
        raise ConfigError(f"end-of-text token {eos!r} is not in the vocabulary of tokenizer {source!r}")
    return token, tid


def _from_json(text: str, source: str, eos: str | None) -> TextTokenizer:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise ConfigError(f"data.tokenizer {source!r} is not a valid tokenizer.json: {str(err).splitlines()[0]}") from None

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]

    eot, eot_id = _eot(source, eos, EOT, tok.token_to_id)
    return TextTokenizer(
        encode_batch=encode_batch, vocab_size=tok.get_vocab_size(with_added_tokens=True), eot_id=eot_id,
        sha256=hashlib.sha256(text.encode()).hexdigest(), source=source, json=text, eot=eot,
    )


def _from_pretrained(local: str, source: str, eos: str | None) -> TextTokenizer:
    """A ``save_pretrained`` tokenizer in the local folder ``local`` (``source`` is what the config named)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(local, local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError or others for a directory it cannot use
        raise ConfigError(f"data.tokenizer {source!r} holds no usable tokenizer: {str(err).splitlines()[0]}") from None
    names = sorted(n for n in TOKENIZER_FILES if posixpath.isfile(posixpath.join(local, n)))
    digest = hashlib.sha256()
    text = None
    if "tokenizer.json" in names:
        with open(posixpath.join(local, "tokenizer.json"), encoding="utf-8") as f:
            text = f.read()
        digest.update(text.encode())  # the same tokenizer as the bare file, whatever its config says
    else:
        for name in names:
            with open(posixpath.join(local, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    vocab = tok.get_vocab()

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=False)["input_ids"]

    eot, eot_id = _eot(source, eos, tok.eos_token, vocab.get)
    return TextTokenizer(encode_batch=encode_batch, vocab_size=len(tok), eot_id=eot_id, sha256=digest.hexdigest(),
                         source=source, json=text, eot=eot)


def local_copy(fs: fsspec.AbstractFileSystem, path: str, names: Iterable[str], prefix: str = "ddiloco-") -> str:
    """The files ``names`` of the remote directory ``path`` copied into a fresh local folder (removed at exit): transformers
    reads local folders only."""
    local = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, local, ignore_errors=True)
    for name in names:
        fs.get_file(posixpath.join(path, name), posixpath.join(local, name))
    return local


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str, eos: str | None = None) -> TextTokenizer:
    """The tokenizer at ``path`` (a tokenizer.json, or a directory holding one or a save_pretrained tokenizer), local or any
    fsspec URL. Documents end with ``eos`` when given, else with the tokenizer's own end-of-text token: the
    ``eos_token`` of a save_pretrained directory, ``<|endoftext|>`` for a bare tokenizer.json that has it."""
    fs, stripped = url_to_fs(path)
    stripped = stripped.rstrip("/") or stripped
    try:
        if fs.isfile(stripped):
            with fs.open(stripped, "rb") as f:
                return _from_json(f.read().decode("utf-8"), path, eos)
        if not fs.isdir(stripped):
            raise ConfigError(f"data.tokenizer {path!r} does not exist (a tokenizer.json file or a directory holding one)")
        names = sorted(n for n in (posixpath.basename(p.rstrip("/")) for p in fs.ls(stripped, detail=False)) if n in TOKENIZER_FILES)
        if names == ["tokenizer.json"]:  # nothing says which token ends a document but the file itself
            with fs.open(posixpath.join(stripped, "tokenizer.json"), "rb") as f:
                return _from_json(f.read().decode("utf-8"), path, eos)
        if not names:
            raise ConfigError(f"data.tokenizer {path!r} holds no usable tokenizer: none of {', '.join(sorted(TOKENIZER_FILES))}")
        local = stripped if isinstance(fs, LocalFileSystem) else local_copy(fs, stripped, names, prefix="ddiloco-tokenizer-")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"data.tokenizer {path!r} cannot be read: {' '.join(str(err).split())}") from None
    return _from_pretrained(local, path, eos)


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
        return load_tokenizer(data.tokenizer, data.eos).vocab_size, f"data.tokenizer {data.tokenizer}"
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
