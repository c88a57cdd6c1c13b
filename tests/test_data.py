from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest
import torch

from ddiloco.platform.config import DataConfig, ModelConfig
from ddiloco.platform.data import Batch, ByteDataset, DigitsDataset, _load_stdlib, build_dataset, stable_hash

SMALL = DataConfig(max_bytes=100_000)
GPT = ModelConfig(seq_len=16)


def _windows_in(data: torch.Tensor, batch: Batch) -> bool:
    """Every input row (plus its last target) is a contiguous window of ``data``."""
    hay = data.tolist()
    for inp, tgt in zip(batch.inputs.tolist(), batch.targets.tolist()):
        window = inp + tgt[-1:]
        if not any(hay[i : i + len(window)] == window for i in range(len(hay) - len(window) + 1)):
            return False
    return True


def test_stable_hash_is_a_literal() -> None:
    # sha256("abc") starts with ba7816bf8f01cfea
    assert stable_hash("abc") == 0xBA7816BF8F01CFEA


def test_stdlib_batches_shapes_and_targets_shift() -> None:
    ds = build_dataset(SMALL, GPT)
    assert isinstance(ds, ByteDataset) and ds.kind == "stdlib"
    assert ds.train.numel() + ds.val.numel() == 100_000
    batch = next(ds.train_batches(0, 2, batch_size=4, seed=0))
    assert batch.inputs.shape == batch.targets.shape == (4, 16)
    assert batch.inputs.dtype == batch.targets.dtype == torch.long
    assert batch.tokens == 64
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    assert int(batch.inputs.max()) < 256


def test_stdlib_corpus_is_cached_per_process() -> None:
    a = build_dataset(SMALL, GPT)
    b = build_dataset(SMALL, ModelConfig(seq_len=32))
    assert a.train is b.train  # one read, shared
    assert _load_stdlib.cache_info().hits >= 1


def test_stdlib_validation_files_chosen_by_path_hash() -> None:
    ds = build_dataset(DataConfig(max_bytes=100_000, val_every=2), GPT)
    other = build_dataset(DataConfig(max_bytes=100_000, val_every=3), GPT)
    # About half (resp. a third) of the bytes are held out; the split depends only on the paths.
    assert 0.15 < ds.val.numel() / 100_000 < 0.85
    assert other.val.numel() != ds.val.numel()


def test_shards_are_disjoint_and_cover_training_bytes() -> None:
    ds = build_dataset(SMALL, GPT)
    parts = [ds.shard_bytes(i, 3) for i in range(3)]
    assert sum(p.numel() for p in parts) == ds.train.numel()
    assert torch.equal(torch.cat(parts), ds.train)
    # Batches of shard 1 come from shard 1's bytes only.
    for batch in islice(ds.train_batches(1, 3, batch_size=4, seed=7), 3):
        assert _windows_in(parts[1], batch)


def test_train_batches_deterministic_and_seed_and_shard_dependent() -> None:
    ds = build_dataset(SMALL, GPT)

    def first(shard: int, seed: int) -> list[torch.Tensor]:
        return [b.inputs for b in islice(ds.train_batches(shard, 2, batch_size=4, seed=seed), 3)]

    a, b = first(0, 1), first(0, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(first(0, 2)[0], a[0])
    assert not torch.equal(first(1, 1)[0], a[0])


def test_val_batches_fixed_and_identical_across_instances() -> None:
    cfg = DataConfig(max_bytes=100_000, val_batches=3)
    a = build_dataset(cfg, GPT).val_batches(5)
    _load_stdlib.cache_clear()
    b = build_dataset(cfg, GPT).val_batches(5)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x.inputs.shape == (5, 16)
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)


def test_shard_too_small_for_seq_len() -> None:
    ds = build_dataset(DataConfig(max_bytes=10_000), ModelConfig(seq_len=64))
    with pytest.raises(ValueError, match="seq_len"):
        ds.train_batches(0, 1000, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="shard"):
        ds.train_batches(3, 3, batch_size=2, seed=0)


def test_glob_source_local_files(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_bytes(bytes([65 + i % 26]) * 300)
    cfg = DataConfig(source="glob", glob=str(tmp_path / "*.txt"), val_every=4)
    ds = build_dataset(cfg, GPT)
    assert ds.kind == "glob"
    assert ds.train.numel() + ds.val.numel() == 40 * 300
    assert ds.files == 40
    # Split by path hash relative to the glob's directory, so it does not depend on tmp_path.
    expected_val = sum(300 for i in range(40) if stable_hash(f"f{i:02d}.txt") % 4 == 0)
    assert ds.val.numel() == expected_val
    assert next(ds.train_batches(0, 2, 2, 0)).inputs.shape == (2, 16)


def test_glob_single_file_falls_back_to_tail_split(tmp_path: Path) -> None:
    (tmp_path / "only.txt").write_bytes(bytes(range(256)) * 10)
    ds = build_dataset(DataConfig(source="glob", glob=str(tmp_path / "*.txt"), val_every=4), GPT)
    assert ds.train.numel() == 1920 and ds.val.numel() == 640


def test_glob_memory_filesystem() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    for i in range(10):
        fs.pipe(f"/ddiloco-test-data/{i}.txt", b"hello world " * 50)
    ds = build_dataset(DataConfig(source="glob", glob="memory:///ddiloco-test-data/*.txt"), GPT)
    assert ds.train.numel() + ds.val.numel() == 10 * 600


def test_glob_empty_and_too_small(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="matched no files"):
        build_dataset(DataConfig(source="glob", glob=str(tmp_path / "*.nothing")), GPT)
    (tmp_path / "a.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        build_dataset(DataConfig(source="glob", glob=str(tmp_path / "a.txt")), GPT)
    (tmp_path / "b.txt").write_bytes(b"x" * 40)
    with pytest.raises(ValueError, match="too small"):
        build_dataset(DataConfig(source="glob", glob=str(tmp_path / "b.txt")), GPT)


def test_digits_split_shards_and_batches() -> None:
    cfg = DataConfig(source="digits", val_batches=4)
    ds = build_dataset(cfg, ModelConfig(kind="vision"))
    assert isinstance(ds, DigitsDataset) and ds.kind == "digits"
    assert len(ds.val_y) == 359 and len(ds.train_y) == 1797 - 359
    idx = [set(ds.shard_indices(i, 4).tolist()) for i in range(4)]
    assert sum(len(s) for s in idx) == len(ds.train_y)
    assert all(not (idx[i] & idx[j]) for i in range(4) for j in range(i + 1, 4))

    batch = next(ds.train_batches(2, 4, batch_size=8, seed=0))
    assert batch.inputs.shape == (8, 1, 8, 8) and batch.inputs.dtype == torch.float32
    assert batch.targets.dtype == torch.long and batch.tokens == 8
    assert 0.0 <= float(batch.inputs.min()) and float(batch.inputs.max()) <= 1.0
    shard_x = ds.train_x[ds.shard_indices(2, 4)]
    assert all(any(torch.equal(x, s) for s in shard_x) for x in batch.inputs)

    # One epoch of a shard visits each example exactly once.
    n = len(idx[0])
    (epoch,) = islice(ds.train_batches(0, 4, batch_size=n, seed=1), 1)
    assert sorted(epoch.targets.tolist()) == sorted(ds.train_y[ds.shard_indices(0, 4)].tolist())
    def rows(x: torch.Tensor) -> list[list[float]]:
        return sorted(x.flatten(1).tolist())

    assert rows(epoch.inputs) == rows(ds.train_x[ds.shard_indices(0, 4)])

    a, b = ds.val_batches(16), build_dataset(cfg, ModelConfig(kind="vision")).val_batches(16)
    assert len(a) == 4 and all(torch.equal(x.inputs, y.inputs) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "data, model, match",
    [
        (DataConfig(source="digits"), ModelConfig(kind="gpt"), "digits"),
        (DataConfig(source="digits"), ModelConfig(kind="vision", image_size=16), "image_size"),
        (SMALL, ModelConfig(kind="vision"), "vision"),
        (SMALL, ModelConfig(vocab_size=100), "vocab_size"),
    ],
)
def test_model_data_mismatch(data: DataConfig, model: ModelConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_dataset(data, model)


@pytest.mark.parametrize("source", ["stdlib", "digits"])
def test_start_batch_is_the_stream_from_batch_n_on(source: str) -> None:
    if source == "digits":
        ds = build_dataset(DataConfig(source="digits"), ModelConfig(kind="vision"))
    else:
        ds = build_dataset(SMALL, GPT)
    # 40 batches of 16 cross several digits epochs (about 360 examples a shard).
    full = [b.inputs for b in islice(ds.train_batches(1, 4, 16, seed=3), 40)]
    for n in (1, 23, 39):
        tail = [b.inputs for b in islice(ds.train_batches(1, 4, 16, seed=3, start_batch=n), 40 - n)]
        assert all(torch.equal(x, y) for x, y in zip(full[n:], tail, strict=True))
    with pytest.raises(ValueError, match="start_batch"):
        ds.train_batches(0, 1, 2, seed=0, start_batch=-1)
