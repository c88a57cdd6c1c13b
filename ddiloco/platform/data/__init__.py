"""Datasets: byte-level text and digits (``builtin``), pre-tokenized shards (``tokens``), text tokenized on
the fly (``text``). Every one streams ``train_batches(shard, num_shards, batch_size, seed, start_batch)``
— disjoint per learner × rank, a pure function of its arguments, O(1) to seek — and a fixed
``val_batches(batch_size)``. Sources, keys and choices: docs/data.md."""

from __future__ import annotations

import functools
import sysconfig

from ddiloco.platform.config import ConfigError, DataConfig, ModelConfig
from ddiloco.platform.data.builtin import BYTE_VOCAB, ByteDataset, DigitsDataset, _load_glob, _load_stdlib
from ddiloco.platform.data.core import Batch, Dataset, stable_hash
from ddiloco.platform.tokenize import check_vocab

__all__ = ["BYTE_VOCAB", "Batch", "ByteDataset", "Dataset", "DigitsDataset", "build_dataset", "check_vocab", "stable_hash"]


def build_dataset(data: DataConfig, model: ModelConfig) -> Dataset:
    """The dataset ``data`` names, checked against what ``model`` consumes (a ConfigError before any training)."""
    if data.source == "digits":
        if model.kind not in ("vision", "import"):
            raise ConfigError(f"data.source 'digits' yields images; model.kind {model.kind!r} needs a text or token source")
        if model.kind == "vision" and model.image_size != 8 or model.n_classes < 10:
            raise ConfigError(
                f"data.source 'digits' has 8x8 images and 10 classes; got model.image_size {model.image_size}, "
                f"model.n_classes {model.n_classes}"
            )
        return DigitsDataset(data.val_batches)

    if model.kind == "vision":
        raise ConfigError(f"data.source {data.source!r} yields token sequences; model.kind 'vision' needs data.source 'digits'")
    check_vocab(model, data)
    if data.source in ("tokens", "text", "hf"):
        return _streaming_dataset(data.model_dump_json(), model.seq_len, model.vocab_size)
    if data.source == "stdlib":
        corpus = _load_stdlib(sysconfig.get_paths()["stdlib"], data.max_bytes, data.val_every)
        where = "the standard library"
    else:
        assert data.glob is not None  # the config validator guarantees it for source "glob"
        corpus = _load_glob(data.glob, data.max_bytes, data.val_every)
        where = f"data.glob {data.glob!r}"
    if corpus.files == 0:
        raise ConfigError(f"{where} holds no readable bytes: the corpus is empty")
    need = model.seq_len + 1
    if corpus.train.numel() < need or corpus.val.numel() < need:
        raise ConfigError(
            f"{where} is too small: {corpus.train.numel()} training and {corpus.val.numel()} validation bytes, "
            f"each needs at least model.seq_len + 1 = {need}"
        )
    return ByteDataset(corpus, model.seq_len, data.val_batches, kind=data.source)


# Cached per process like the byte corpus: the synchronizer evaluates every few seconds, and opening
# shards (sizes, footers, the sampled id check, the validation windows) is a round of ranged reads.
@functools.lru_cache(maxsize=4)
def _streaming_dataset(data_json: str, seq_len: int, vocab_size: int) -> Dataset:
    data = DataConfig.model_validate_json(data_json)
    if data.source == "tokens":
        from ddiloco.platform.data.tokens import TokenDataset

        return TokenDataset(data, seq_len, vocab_size)
    from ddiloco.platform.data.text import TextDataset

    return TextDataset(data, seq_len)
