"""Text tokenized on the fly (``data.source: text`` and ``hf``) with a real tokenizer; the vocabulary check."""

from __future__ import annotations

import json
import re
from itertools import islice
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support import eos_bpe, slow_tokenizer_dir, upload
from typer.testing import CliRunner

from ddiloco.platform.config import ConfigError, DataConfig, ModelConfig
from ddiloco.platform.data import build_dataset, check_vocab
from ddiloco.platform.data.text import TextDataset
from ddiloco.platform.tokenize import load_tokenizer, train_bpe

T = 16
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def doc(i: int) -> str:
    """Document i: a short sentence that names its index."""
    return f"doc {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(5 + i % 9))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_bpe((doc(i) for i in range(400)), 300))
    return str(path)


def write_corpus(root: str) -> list[str]:
    """60 jsonl records, a 30-row parquet file and a text file; the globs that name them."""
    with fsspec.open(f"{root}/a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": doc(i), "n": i}) + "\n" for i in range(60))
    with fsspec.open(f"{root}/b.parquet", "wb") as f:
        pq.write_table(pa.table({"text": [doc(i) for i in range(60, 90)]}), f, row_group_size=8)
    with fsspec.open(f"{root}/c.txt", "w") as f:
        f.write("\n".join(doc(i) for i in range(90, 140)))
    return [f"{root}/*.jsonl", f"{root}/*.parquet", f"{root}/*.txt"]


def check_stream(ds: TextDataset, model: ModelConfig) -> None:
    batch = next(ds.train_batches(0, 2, 4, seed=0))
    assert batch.inputs.shape == (4, model.seq_len) and torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    assert int(batch.inputs.max()) < ds.vocab_size <= model.vocab_size
    # start_batch = n is the stream from its (n+1)-th batch on.
    full = [b.inputs for b in islice(ds.train_batches(1, 2, 3, seed=4), 12)]
    tail = [b.inputs for b in islice(ds.train_batches(1, 2, 3, seed=4, start_batch=9), 3)]
    assert all(torch.equal(a, b) for a, b in zip(full[9:], tail, strict=True))
    # 2 learners x 2 ranks own disjoint unit ranges that cover the training units.
    ranges = [ds.shard_range(s, 4) for s in range(4)]
    assert ranges[0][0] == 0 and ranges[-1][1] == ds.n_train and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    val = ds.val_batches(4)
    assert len(val) == 2 and all(torch.equal(a.inputs, b.inputs) for a, b in zip(val, ds.val_batches(4), strict=True))


def test_text_files_on_every_store(store_url, tokenizer_file):
    model = ModelConfig(seq_len=T, vocab_size=512)
    data = DataConfig(source="text", shards=write_corpus(store_url), tokenizer=tokenizer_file, val_every=10, val_batches=2)
    ds = build_dataset(data, model)
    assert isinstance(ds, TextDataset) and ds.kind == "text"
    assert len(ds.units) >= 90 + 1  # 60 records + 30 rows + the text file's chunks
    check_stream(ds, model)


def test_text_rows_decode_to_the_shard_owns_documents(tmp_path, tokenizer_file):
    from tokenizers import Tokenizer

    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"body": doc(i)}) + "\n" for i in range(40))
    data = DataConfig(source="text", shards=[str(tmp_path / "a.jsonl")], tokenizer=tokenizer_file, text_column="body", val_every=10)
    ds = build_dataset(data, ModelConfig(seq_len=T, vocab_size=512))
    lo, hi = ds.shard_range(1, 2)
    tok = Tokenizer.from_file(tokenizer_file)
    seen = set()
    for b in islice(ds.train_batches(1, 2, 4, seed=0), 5):
        for row in b.inputs.tolist():
            seen.update(int(i) for i in re.findall(r"doc (\d+):", tok.decode(row, skip_special_tokens=False)))
    assert seen and all(lo <= i < hi for i in seen)


def test_hf_dataset_from_disk_and_from_s3(tmp_path, tokenizer_file, s3_endpoint):
    import datasets
    import s3fs

    ds_local = datasets.Dataset.from_dict({"text": [doc(i) for i in range(80)]})
    ds_local.save_to_disk(str(tmp_path / "hf"))
    s3fs.S3FileSystem().mkdir("hf-data")
    ds_local.save_to_disk("s3://hf-data/set")
    model = ModelConfig(seq_len=T, vocab_size=512)
    for where in (str(tmp_path / "hf"), "s3://hf-data/set"):
        ds = build_dataset(DataConfig(source="hf", hf_dataset=where, tokenizer=tokenizer_file, val_batches=2), model)
        assert ds.kind == "hf" and len(ds.units) == 80 and ds.n_val == 4
        check_stream(ds, model)


def test_vocabulary_mismatch_is_one_line_at_config_time(tokenizer_file, tmp_path):
    data = DataConfig(source="text", shards=["unused.jsonl"], tokenizer=tokenizer_file)
    with pytest.raises(ConfigError) as err:
        check_vocab(ModelConfig(vocab_size=256), data)
    assert str(err.value) == f"model.vocab_size 256 is smaller than the tokenizer's vocabulary 300 (data.tokenizer {tokenizer_file})"
    assert check_vocab(ModelConfig(vocab_size=300), data) == 300
    with pytest.raises(ConfigError, match="smaller than the tokenizer's vocabulary 300"):
        build_dataset(data, ModelConfig(vocab_size=256))

    from ddiloco.cli import app

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{vocab_size: 256}}\ndata: {{source: text, shards: [x.jsonl], tokenizer: {tokenizer_file}}}\n")
    result = CliRunner().invoke(app, ["config", "-c", str(cfg)])
    assert result.exit_code == 2 and "smaller than the tokenizer's vocabulary 300" in result.output


def test_tokenizer_paths(tmp_path, tokenizer_file):
    from transformers import PreTrainedTokenizerFast

    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    # A save_pretrained directory and the bare file are the same tokenizer.
    fast = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "pretrained")
    a, b = load_tokenizer(str(tmp_path / "pretrained")), load_tokenizer(tokenizer_file)
    assert a.vocab_size == b.vocab_size == 300 and a.eot_id == b.eot_id == 0
    assert a.encode_batch([doc(3)]) == b.encode_batch([doc(3)])
    Path(tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no usable tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))


def test_text_errors(tmp_path, tokenizer_file):
    model = ModelConfig(seq_len=T, vocab_size=512)
    with pytest.raises(ConfigError, match="matched no files"):
        build_dataset(DataConfig(source="text", shards=[str(tmp_path / "*.jsonl")], tokenizer=tokenizer_file), model)
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n' * 30)
    with pytest.raises(ConfigError, match="no text field 'text'"):
        build_dataset(DataConfig(source="text", shards=[str(tmp_path / "a.jsonl")], tokenizer=tokenizer_file), model)
    with pytest.raises(ValueError, match="needs data.tokenizer"):
        DataConfig(source="text", shards=["a.jsonl"])


def test_a_tokenizer_folder_at_any_url_ends_documents_with_its_own_eos(store_url, tmp_path):
    """A save_pretrained folder without tokenizer.json, local or remote (copied once into a local folder for transformers)."""
    text = eos_bpe([doc(i) for i in range(400)])
    (tmp_path / "bare.json").write_text(text)
    local = slow_tokenizer_dir(text, tmp_path / "slow")
    remote = upload(local, f"{store_url}/slow")
    with fsspec.open(f"{remote}/train-00000.bin", "wb") as f:  # what else a folder holds is not a tokenizer file
        f.write(b"\0" * 64)
    here, there, bare = load_tokenizer(str(local)), load_tokenizer(remote), load_tokenizer(str(tmp_path / "bare.json"))
    assert here.eot == there.eot == "</s>" and here.eot_id == there.eot_id == 0 and there.json is None
    assert here.vocab_size == there.vocab_size == bare.vocab_size == 300 and here.sha256 == there.sha256
    assert there.encode_batch([doc(1), doc(2)]) == bare.encode_batch([doc(1), doc(2)])
    # A bare tokenizer.json names no end-of-text token unless it holds <|endoftext|>: say which, or be refused.
    assert bare.eot_id is None and load_tokenizer(str(tmp_path / "bare.json"), "</s>").eot_id == 0
    with pytest.raises(ConfigError, match="end-of-text token '<eos>' is not in the vocabulary"):
        load_tokenizer(remote, "<eos>")

    with fsspec.open(f"{store_url}/docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": doc(i)}) + "\n" for i in range(40))
    model = ModelConfig(seq_len=T, vocab_size=300)
    ds = build_dataset(DataConfig(source="text", shards=[f"{store_url}/docs.jsonl"], tokenizer=remote), model)
    assert ds.tokenizer.eot_id == 0
    bare_data = DataConfig(source="text", shards=[f"{store_url}/docs.jsonl"], tokenizer=str(tmp_path / "bare.json"))
    with pytest.raises(ConfigError, match="names no end-of-text token, so documents would run together: set data.eos"):
        TextDataset(bare_data, T)
    assert TextDataset(bare_data.model_copy(update={"eos": "</s>"}), T).tokenizer.eot_id == 0


def test_compressed_text_files_are_refused_with_what_to_do(tmp_path, tokenizer_file):
    with fsspec.open(str(tmp_path / "a.jsonl.gz"), "wt", compression="gzip") as f:
        f.writelines(json.dumps({"text": doc(i)}) + "\n" for i in range(40))
    data = DataConfig(source="text", shards=[str(tmp_path / "*.jsonl.gz")], tokenizer=tokenizer_file)
    with pytest.raises(ConfigError, match=r"is gzip-compressed: .* tokenize it with 'ddiloco data prepare' instead"):
        build_dataset(data, ModelConfig(seq_len=T, vocab_size=512))
