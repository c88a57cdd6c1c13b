"""``ddiloco data prepare``: shards and manifest round trip on file:// and s3://, and a short run trained on them."""

from __future__ import annotations

import hashlib
import json

import fsspec
import numpy as np
import pytest
from support import eos_bpe, upload
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.data_prepare import file_corpus, is_val, prepare
from ddiloco.platform.config import ConfigError, DataConfig, ModelConfig
from ddiloco.platform.data import build_dataset
from ddiloco.platform.manifest import read_manifest
from ddiloco.platform.tokenize import load_tokenizer

DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # number {i}\n" * (1 + i % 5) for i in range(60)]


def write_docs(root: str) -> str:
    for i, text in enumerate(DOCS):
        with fsspec.open(f"{root}/in/{i:03d}.py", "w") as f:
            f.write(text)
    return f"{root}/in/*.py"


@pytest.mark.parametrize("fmt", ["bin", "parquet"])
def test_prepare_round_trip(store_url, fmt):
    pattern = write_docs(store_url)
    out = f"{store_url}/prepared"
    manifest = prepare(file_corpus(pattern), out, train_tokenizer=300, shard_tokens=1000, val_fraction=0.1, fmt=fmt)

    assert read_manifest(f"{out}/manifest.json") == manifest
    tok = load_tokenizer(f"{out}/tokenizer.json")
    with fsspec.open(f"{out}/tokenizer.json", "rb") as f:
        assert manifest.tokenizer_sha256 == tok.sha256 == hashlib.sha256(f.read()).hexdigest()
    assert manifest.vocab_size == tok.vocab_size == 300 and manifest.dtype == "uint16" and manifest.eot_id == 0
    # Every document once, in order, each followed by end-of-text; the validation ones in the validation shard.
    encoded = [ids + [0] for ids in tok.encode_batch(DOCS)]
    want_val = [t for i, ids in enumerate(encoded) if is_val(i, 0.1) for t in ids]
    want_train = [t for i, ids in enumerate(encoded) if not is_val(i, 0.1) for t in ids]
    assert 0 < len(want_val) < len(want_train)
    assert manifest.val.tokens == len(want_val) and manifest.train_tokens == len(want_train)
    assert len(manifest.train) > 1 and all(s.tokens >= 1000 for s in manifest.train[:-1])
    # .bin shards carry the sha256 of their bytes as written (a parquet writer's bytes are not seen).
    for entry in [*manifest.train, manifest.val]:
        with fsspec.open(f"{out}/{entry.path}", "rb") as f:
            assert entry.sha256 == (hashlib.sha256(f.read()).hexdigest() if fmt == "bin" else None)

    data = DataConfig(source="tokens", manifest=f"{out}/manifest.json", block_tokens=1024)
    ds = build_dataset(data, ModelConfig(seq_len=16, vocab_size=300))
    assert ds.train.read(0, ds.train.tokens).tolist() == want_train
    assert ds.val.read(0, ds.val.tokens).tolist() == want_val


def test_prepare_errors(tmp_path):
    with pytest.raises(ConfigError, match="matched no files"):
        file_corpus(str(tmp_path / "*.txt"))
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ConfigError, match="exactly one of --tokenizer and --train-tokenizer"):
        prepare(file_corpus(str(tmp_path / "a.txt")), str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="does not exist"):
        prepare(file_corpus(str(tmp_path / "a.txt")), str(tmp_path / "out"), tokenizer=str(tmp_path / "no-tokenizer"))
    with pytest.raises(ConfigError, match="too few for a training and a validation shard"):
        prepare(file_corpus(str(tmp_path / "a.txt")), str(tmp_path / "out"), train_tokenizer=260)


def test_cli_prepares_the_stdlib_and_config_checks_the_manifest_vocabulary(tmp_path):
    out = tmp_path / "bpe"
    result = CliRunner().invoke(app, ["data", "prepare", "--input", "stdlib", "--max-bytes", "300000", "--train-tokenizer", "512",
                                      "--out", str(out), "--shard-tokens", "20000", "--val-fraction", "0.1"])
    assert result.exit_code == 0, result.output
    body = json.loads((out / "manifest.json").read_text())
    assert body["vocab_size"] == 512 and len(body["train"]) > 1 and body["val"]["tokens"] > 0
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{vocab_size: 256}}\ndata: {{source: tokens, manifest: {out}/manifest.json}}\n")
    result = CliRunner().invoke(app, ["config", "-c", str(cfg)])
    assert result.exit_code == 2 and "model.vocab_size 256 is smaller than the tokenizer's vocabulary 512" in result.output
    result = CliRunner().invoke(app, ["data", "prepare", "--input", "stdlib", "--out", str(out)])
    assert result.exit_code == 2 and "exactly one of --tokenizer and --train-tokenizer" in result.output


def test_training_on_prepared_shards_lowers_the_loss(ledger_url, tmp_path):
    """Two learners and the synchronizer, in process, on BPE shards of the standard library."""
    from support import tiny_config

    from ddiloco.inprocess import SimClock, sim_learner, sim_step
    from ddiloco.platform.ledger import open_ledger
    from ddiloco.platform.runtime import RunContext
    from ddiloco.synchronizer.evaluation import evaluate
    from ddiloco.synchronizer.service import Synchronizer

    out = f"file://{tmp_path}/bpe"
    manifest = prepare(file_corpus("stdlib", max_bytes=200_000), out, train_tokenizer=512, shard_tokens=30_000, val_fraction=0.05)
    cfg = tiny_config(
        model={"vocab_size": manifest.vocab_size, "seq_len": 32},
        data={"source": "tokens", "manifest": f"{out}/manifest.json", "val_batches": 2, "block_tokens": 4096},
        ledger={"url": ledger_url}, storage={"url": f"file://{tmp_path}/store"},
    )
    clock = SimClock()
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=clock)
    sync = Synchronizer(ctx, holder="sync")
    sync.poll_once(clock.t)
    learners = [sim_learner(ctx, lid) for lid in ("us-0", "us-1")]
    for learner in learners:
        learner.start(clock.t)
    val = build_dataset(cfg.data, cfg.model).val_batches(cfg.learners.batch_size)
    before, _ = evaluate(sync.global_model(), val)
    for _ in range(30):
        clock.t += 1.0
        for learner in learners:
            sim_step(learner, clock.t)
        sync.poll_once(clock.t)
    after, _ = evaluate(sync.global_model(), val)
    assert np.log(512) - 0.5 < before and after < before - 0.25


def test_prepare_from_a_saved_hf_dataset(tmp_path):
    import datasets

    from ddiloco.data_prepare import hf_corpus

    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="no column 'text'"):
        hf_corpus(str(tmp_path / "hf"))
    corpus = hf_corpus(str(tmp_path / "hf"), column="body")
    assert corpus.count == len(DOCS)
    tokenizer = prepare(file_corpus(write_docs(f"file://{tmp_path}")), str(tmp_path / "tok"), train_tokenizer=300)
    manifest = prepare(corpus, str(tmp_path / "out"), tokenizer=str(tmp_path / "tok" / "tokenizer.json"), val_fraction=0.1, fmt="parquet")
    assert manifest.tokenizer_sha256 == tokenizer.tokenizer_sha256
    tok = load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    assert manifest.train_tokens + manifest.val.tokens == sum(len(ids) + 1 for ids in tok.encode_batch(DOCS))


def test_compressed_input_and_the_tokenizers_own_end_of_text(store_url, tmp_path):
    """.jsonl.gz and .txt.gz are read as what they hold; documents end with the tokenizer's eos_token (here </s>, id 0)."""
    from transformers import PreTrainedTokenizerFast

    with fsspec.open(f"{store_url}/in/a.jsonl.gz", "wt", compression="gzip") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS[:30])
    with fsspec.open(f"{store_url}/in/b.txt.gz", "wt", compression="gzip") as f:
        f.write(DOCS[30])
    (tmp_path / "bare.json").write_text(eos_bpe(DOCS))
    PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "bare.json"), eos_token="</s>").save_pretrained(tmp_path / "tok")
    tokenizer = upload(tmp_path / "tok", f"{store_url}/tok")

    corpus = file_corpus(f"{store_url}/in/*")
    manifest = prepare(corpus, f"{store_url}/out", tokenizer=tokenizer, val_fraction=0.1)
    tok = load_tokenizer(tokenizer)
    assert manifest.eot_id == tok.eot_id == 0 and manifest.extra["documents"] == 31
    encoded = [ids + [0] for ids in tok.encode_batch(DOCS[:31])]
    ds = build_dataset(DataConfig(source="tokens", manifest=f"{store_url}/out/manifest.json", block_tokens=1024),
                       ModelConfig(seq_len=16, vocab_size=300))
    val = {i for i in range(31) if is_val(i, 0.1)} or {30}  # the last document validates when no other does
    assert ds.train.read(0, ds.train.tokens).tolist() == [t for i, ids in enumerate(encoded) if i not in val for t in ids]
    assert ds.val.read(0, ds.val.tokens).tolist() == [t for i, ids in enumerate(encoded) if i in val for t in ids]

    # A bare tokenizer.json names no end of text (it lacks <|endoftext|>): refused, unless --eos says which token it is.
    with pytest.raises(ConfigError, match="names no end-of-text token, so documents would run together: pass --eos"):
        prepare(corpus, f"{store_url}/refused", tokenizer=str(tmp_path / "bare.json"))
    args = ["data", "prepare", "--input", f"{store_url}/in/*", "--tokenizer", str(tmp_path / "bare.json"), "--val-fraction", "0.1"]
    result = CliRunner().invoke(app, [*args, "--eos", "</s>", "--out", f"{store_url}/eos"])
    assert result.exit_code == 0, result.output
    assert read_manifest(f"{store_url}/eos/manifest.json").train == manifest.train  # the same shards, byte for byte
    result = CliRunner().invoke(app, [*args, "--eos", "<eos>", "--out", f"{store_url}/unknown"])
    assert result.exit_code == 2 and "end-of-text token '<eos>' is not in the vocabulary" in result.output


def test_site_packages_corpus_splits_whole_packages():
    from ddiloco.data_prepare import PROJECT, site_packages_corpus, validation_packages

    sizes = {f"pkg{i}": 1000 * (1 + i % 7) for i in range(40)}
    val = validation_packages(sizes, 0.1)
    assert val == validation_packages(dict(reversed(sizes.items())), 0.1)  # the order of the listing does not matter
    assert 0 < sum(sizes[p] for p in val) <= 0.1 * sum(sizes.values())

    corpus = site_packages_corpus(max_bytes=200_000, val_share=0.1)
    record = corpus.record
    assert record["corpus_sha256"] == site_packages_corpus(max_bytes=200_000, val_share=0.1).record["corpus_sha256"]
    split = {p["name"]: p["split"] for p in record["packages"]}
    assert PROJECT not in split and set(split.values()) == {"train", "val"}
    assert corpus.count == record["train_files"] + record["val_files"]
    # Training documents first, then validation ones, each a whole file of its package.
    assert [corpus.validation(i) for i in range(corpus.count)] == [False] * record["train_files"] + [True] * record["val_files"]
    assert all(p["version"] and p["files"] > 0 and p["bytes"] > 0 for p in record["packages"])
    assert "/" not in json.dumps(record["packages"])  # no path of this machine is recorded
