"""Token shards (``data.source: tokens``) on file://, memory:// and s3:// (moto): windows, disjointness, seeking, errors.

The corpora are tokens that are their own positions, so every window says where it was read from."""

from __future__ import annotations

from itertools import islice

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ddiloco.platform.config import ConfigError, DataConfig, ModelConfig
from ddiloco.platform.data import build_dataset
from ddiloco.platform.data.core import epoch_order, permute
from ddiloco.platform.data.tokens import CorruptShardError, TokenDataset

T = 16
MODEL = ModelConfig(seq_len=T, vocab_size=8192)


def write_bin(url: str, tokens: np.ndarray, dtype: str = "uint16") -> None:
    with fsspec.open(url, "wb") as f:
        f.write(tokens.astype(dtype).tobytes())


def write_parquet(url: str, docs: list[np.ndarray], row_group_size: int = 4) -> None:
    table = pa.table({"tokens": pa.array([d.tolist() for d in docs], type=pa.list_(pa.uint32())), "id": list(range(len(docs)))})
    with fsspec.open(url, "wb") as f:
        pq.write_table(table, f, row_group_size=row_group_size)


def positions_corpus(root: str, fmt: str = "bin", sizes: tuple[int, ...] = (1000, 700, 1300)) -> DataConfig:
    """Training shards holding 0, 1, 2, … across shards; a validation shard of 5000 + its positions."""
    start = 0
    for i, n in enumerate(sizes):
        tokens = np.arange(start, start + n)
        if fmt == "bin":
            write_bin(f"{root}/train-{i}.bin", tokens)
        else:
            write_parquet(f"{root}/train-{i}.parquet", np.array_split(tokens, 7))
        start += n
    suffix = "bin" if fmt == "bin" else "parquet"
    if fmt == "bin":
        write_bin(f"{root}/val.bin", np.arange(5000, 5400))
    else:
        write_parquet(f"{root}/val.parquet", [np.arange(5000, 5400)])
    return DataConfig(source="tokens", shards=[f"{root}/train-*.{suffix}"], val_shard=f"{root}/val.{suffix}", block_tokens=1024,
                      val_batches=2)


def epoch_windows(ds: TokenDataset, shard: int, num_shards: int, batch_size: int, seed: int = 0) -> list[int]:
    """The first input token of every window of one epoch of a stream."""
    lo, hi = ds.shard_range(shard, num_shards)
    windows = (hi - lo - 1) // T
    n_batches = -(-windows // batch_size)
    firsts = [int(x) for b in islice(ds.train_batches(shard, num_shards, batch_size, seed), n_batches) for x in b.inputs[:, 0]]
    return firsts[:windows]


@pytest.mark.parametrize("fmt", ["bin", "parquet"])
def test_token_shards_windows_disjoint_and_seekable(store_url, fmt):
    data = positions_corpus(store_url, fmt)
    ds = build_dataset(data, MODEL)
    assert isinstance(ds, TokenDataset) and ds.train.tokens == 3000 and ds.val.tokens == 400
    batch = next(ds.train_batches(0, 1, 4, seed=0))
    assert batch.inputs.shape == batch.targets.shape == (4, T) and batch.inputs.dtype == torch.long and batch.tokens == 4 * T
    # Every row is a contiguous run of positions (windows cross shard and document boundaries).
    rows = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)
    assert torch.equal(rows[:, 1:] - rows[:, :-1], torch.ones(4, T, dtype=torch.long))

    # 2 learners x 2 ranks: one epoch of each stream covers its own range, window by window, once.
    seen = []
    for s in range(4):
        lo, hi = ds.shard_range(s, 4)
        firsts = epoch_windows(ds, s, 4, batch_size=5)
        assert sorted(firsts) == list(range(lo, lo + len(firsts) * T, T))
        seen.append({t for f in firsts for t in range(f, f + T + 1)})
    assert all(not (seen[i] & seen[j]) for i in range(4) for j in range(i + 1, 4))
    assert all(max(a) < min(b) for a, b in zip(seen, seen[1:]))

    # start_batch = n yields exactly the stream from its (n+1)-th batch on, across an epoch boundary.
    full = [b.inputs for b in islice(ds.train_batches(1, 3, 6, seed=9), 20)]
    for n in (0, 3, 17):
        tail = [b.inputs for b in islice(ds.train_batches(1, 3, 6, seed=9, start_batch=n), 20 - n)]
        assert all(torch.equal(x, y) for x, y in zip(full[n:], tail, strict=True))
    assert not torch.equal(full[0], next(ds.train_batches(1, 3, 6, seed=10)).inputs)

    val = ds.val_batches(3)
    assert len(val) == 2 and all(int(b.inputs.min()) >= 5000 for b in val)
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(val, build_dataset(data, MODEL).val_batches(3), strict=True))


def test_seek_reads_only_the_blocks_it_serves(tmp_path):
    write_bin(f"{tmp_path}/a.bin", np.arange(200_000) % 8000)
    write_bin(f"{tmp_path}/v.bin", np.arange(100))
    ds = build_dataset(DataConfig(source="tokens", shards=[f"{tmp_path}/a.bin", f"{tmp_path}/v.bin"], block_tokens=4096), MODEL)
    reads: list[tuple[int, int]] = []
    read = ds.train.read
    ds.train.read = lambda a, b: reads.append((a, b)) or read(a, b)  # type: ignore[method-assign]
    next(ds.train_batches(0, 1, 8, seed=0, start_batch=5000))
    assert sum(b - a for a, b in reads) <= 2 * (4096 + 1)


def test_one_epoch_of_an_unaligned_stream_visits_every_window_once(tmp_path):
    # 3 full blocks of 64 windows and a tail of 37: the tail closes the epoch.
    n_windows = 3 * 64 + 37
    write_bin(f"{tmp_path}/a.bin", np.arange(n_windows * T + 1))
    write_bin(f"{tmp_path}/v.bin", np.arange(100))
    ds = build_dataset(DataConfig(source="tokens", shards=[f"{tmp_path}/a.bin", f"{tmp_path}/v.bin"], block_tokens=64 * T), MODEL)
    firsts = epoch_windows(ds, 0, 1, batch_size=7)
    assert sorted(firsts) == list(range(0, n_windows * T, T))
    assert firsts != sorted(firsts)


def test_permutations_are_bijections():
    for n in (1, 2, 3, 17, 64, 1000):
        assert sorted(permute(np.arange(n), n, "k").tolist()) == list(range(n))
    with pytest.raises(ValueError, match="outside"):
        permute(np.array([5]), 5, "k")  # cycle-walking from outside [0, n) may never return
    assert permute(np.arange(100), 100, "a").tolist() != permute(np.arange(100), 100, "b").tolist()
    two_epochs = epoch_order(np.arange(20), 10, "k")
    assert sorted(two_epochs[:10].tolist()) == sorted(two_epochs[10:].tolist()) == list(range(10))


def test_window_order_is_an_epoch_for_many_shapes_and_keys():
    """Every (windows, block) shape and key: positions of two epochs map to every window once each (block tails included)."""
    from ddiloco.platform.data.tokens import _WindowStream

    for windows, k in ((1, 1), (5, 1), (5, 8), (40, 8), (41, 8), (47, 8), (1000, 64), (1037, 64)):
        for key in range(20):
            ws = _WindowStream(None, 0, windows * T + 1, T, k, f"k{key}")  # type: ignore[arg-type]
            ids = ws.window_ids(np.arange(2 * windows, dtype=np.int64))
            assert sorted(ids[:windows].tolist()) == sorted(ids[windows:].tolist()) == list(range(windows))


def test_uint32_shards_and_the_manifestless_last_shard_validates(tmp_path):
    for i in range(3):
        write_bin(f"{tmp_path}/s{i}.bin", np.full(500, 70_000 + i), "uint32")
    data = DataConfig(source="tokens", shards=[f"{tmp_path}/s*.bin"], dtype="uint32")
    ds = build_dataset(data, ModelConfig(seq_len=T, vocab_size=80_000))
    assert ds.train.tokens == 1000 and int(ds.val_batches(2)[0].inputs[0, 0]) == 70_002
    assert int(next(ds.train_batches(0, 1, 2, 0)).inputs.max()) <= 70_001


@pytest.mark.parametrize(
    "case, match",
    [
        ("odd_size", "not a multiple of uint16"),
        ("out_of_vocab", "token id 9000, not below model.vocab_size 8192"),
        ("no_shards", "need at least one training shard"),
        ("one_shard", "need at least one training shard"),
        ("bad_parquet", "not a readable parquet token file"),
        ("text_parquet", "no list column 'tokens'"),
        ("missing_manifest", "does not exist"),
        ("missing_shard", "does not exist"),
    ],
)
def test_bad_shards_fail_before_training_with_one_line(tmp_path, case, match):
    root = f"file://{tmp_path}"
    write_bin(f"{root}/val.bin", np.arange(100))
    shards = [f"{root}/t.bin"]
    extra: dict = {}
    if case == "odd_size":
        with fsspec.open(f"{root}/t.bin", "wb") as f:
            f.write(b"\0" * 301)
    elif case == "out_of_vocab":
        write_bin(f"{root}/t.bin", np.r_[np.arange(100), 9000])
    elif case == "no_shards":
        shards = [f"{root}/nothing-*.bin"]
    elif case == "one_shard":
        shards, extra = [f"{root}/val.bin"], {}
    elif case == "bad_parquet":
        with fsspec.open(f"{root}/t.parquet", "wb") as f:
            f.write(b"not parquet at all")
        shards = [f"{root}/t.parquet"]
    elif case == "text_parquet":
        with fsspec.open(f"{root}/t.parquet", "wb") as f:
            pq.write_table(pa.table({"text": ["hello"]}), f)
        shards = [f"{root}/t.parquet"]
    elif case == "missing_shard":
        shards = [f"{root}/absent.bin"]
    if case != "one_shard":
        extra = {"val_shard": f"{root}/val.bin"}
    data = DataConfig(source="tokens", manifest=f"{root}/absent/manifest.json") if case == "missing_manifest" else DataConfig(
        source="tokens", shards=shards, **extra)
    with pytest.raises(ConfigError, match=match) as err:
        build_dataset(data, MODEL)
    assert "\n" not in str(err.value)
    if case in ("odd_size", "out_of_vocab", "bad_parquet"):
        assert isinstance(err.value, CorruptShardError)


def test_config_needs_shards_or_manifest():
    with pytest.raises(ValueError, match="needs data.manifest or data.shards"):
        DataConfig(source="tokens")
    with pytest.raises(ValueError, match="exclusive"):
        DataConfig(source="tokens", manifest="m.json", shards=["a.bin"])
