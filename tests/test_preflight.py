"""``ddiloco config`` checks what a run will touch: shards, tokenizer, Hugging Face config, init_from, stores, ledger."""

from __future__ import annotations

import threading
import uuid

import fsspec
import pytest
import yaml
from support import TINY_LLAMA, upload
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.data_prepare import file_corpus, prepare
from ddiloco.platform.config import ModelConfig, build_config
from ddiloco.platform.preflight import Check, Outcome, local_path_notes, report, run_checks, shown_config
from ddiloco.platform.redact import redact_url
from ddiloco.testing.net import free_port

DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # number {i}\n" * (1 + i % 5) for i in range(40)]


def config_file(tmp_path, body: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_report_says_what_was_checked_and_one_line_per_problem():
    lines, ok = report([Outcome("store s3://b/r", found="reachable"),
                        Outcome("data.manifest s3://b/m.json", problem="data.manifest 's3://b/m.json' does not exist"),
                        Outcome("ledger postgresql://u:pw@h/db", problem="connection to postgresql://u:pw@h/db refused")],
                       notes=["model.hf_path ./x is on this machine only"])
    assert not ok
    assert lines == [
        "checked store s3://b/r: reachable",
        "error: data.manifest 's3://b/m.json' does not exist",  # the message names its field already
        "error: ledger postgresql://u:***@h/db: connection to postgresql://u:***@h/db refused",
        "note: model.hf_path ./x is on this machine only",
        "3 things checked, 2 problems",
    ]
    assert report([Outcome("store memory://x", found="in memory")], [])[1]


def test_a_probe_that_does_not_answer_is_reported_at_its_timeout():
    release = threading.Event()
    try:
        outcomes = run_checks([Check("ledger postgresql://h/db", lambda: str(release.wait(60)), 0.2),
                               Check("store file:///s", lambda: "a local folder", 30.0),
                               Check("data.manifest m", lambda: (_ for _ in ()).throw(OSError("no\nsuch\tfile")), 30.0)])
    finally:
        release.set()  # the abandoned probe's daemon thread ends here
    assert outcomes == [Outcome("ledger postgresql://h/db", problem="no answer within 0.2s"),
                        Outcome("store file:///s", found="a local folder"),
                        Outcome("data.manifest m", problem="no such file")]


def test_local_paths_are_noted_only_where_processes_may_run_on_other_machines():
    body = {"model": {"kind": "hf", "hf_path": "./my-llama", "init_from": "s3://w/model", "vocab_size": 300, "seq_len": 32},
            "data": {"source": "text", "shards": ["s3://d/*.jsonl"], "tokenizer": "./my-tokenizer"},
            "storage": {"url": "s3://runs/x"}}
    assert local_path_notes(build_config(body)) == []  # a SQLite ledger: every process is on this machine
    shared = build_config({**body, "ledger": {"url": "postgresql+psycopg://db/ledger"}})
    notes = local_path_notes(shared)
    assert [n.split(" is on this machine")[0] for n in notes] == ["model.hf_path ./my-llama", "data.tokenizer ./my-tokenizer"]


def test_only_the_fields_of_the_model_kind_are_shown():
    gpt = shown_config(build_config({}))["model"]
    assert set(gpt) == {"kind", "init_from", "n_layer", "d_model", "n_head", "seq_len", "vocab_size", "dropout"}
    hf = shown_config(build_config({"model": {"kind": "hf", "hf_config": TINY_LLAMA, "seq_len": 32}}))["model"]
    assert set(hf) == {"kind", "init_from", "hf_config", "seq_len", "vocab_size"}
    assert ModelConfig(kind="moe_gpt").in_use()["n_experts"] == 4


@pytest.fixture(scope="module")
def s3_run(s3_endpoint, tmp_path_factory):
    """On a fresh bucket: prepared token shards, a tiny Llama's save_pretrained folder (the hf_path and init_from)."""
    import s3fs

    from ddiloco.platform.models import build_model

    tmp = tmp_path_factory.mktemp("s3run")
    bucket = f"pre-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    root = f"s3://{bucket}"
    for i, text in enumerate(DOCS):
        with fsspec.open(f"{root}/in/{i:03d}.py", "w") as f:
            f.write(text)
    prepare(file_corpus(f"{root}/in/*.py"), f"{root}/prepared", train_tokenizer=300, shard_tokens=2000, val_fraction=0.1)
    model = ModelConfig(kind="hf", hf_config={**TINY_LLAMA, "vocab_size": 320}, vocab_size=320, seq_len=32)
    build_model(model, seed=0).save_pretrained(tmp / "llama")
    upload(tmp / "llama", f"{root}/llama")
    return root


def test_config_checks_what_a_run_touches_and_exits_non_zero_on_each_problem(s3_run, ledger_url, tmp_path):
    good = {"model": {"kind": "hf", "hf_path": f"{s3_run}/llama", "init_from": f"{s3_run}/llama", "vocab_size": 320, "seq_len": 32},
            "data": {"source": "tokens", "manifest": f"{s3_run}/prepared/manifest.json", "block_tokens": 1024},
            "learners": {"regions": [{"name": "us"}, {"name": "eu", "storage_url": f"{s3_run}/eu"}]},
            "storage": {"url": f"{s3_run}/store"}, "ledger": {"url": ledger_url}}
    code, out, err = invoke("config", "-c", config_file(tmp_path, good))
    assert code == 0, err
    checked = [line.split(": ")[0] for line in err.splitlines() if line.startswith("checked ")]
    assert checked == [f"checked data.manifest {s3_run}/prepared/manifest.json", f"checked model.hf_path {s3_run}/llama",
                       f"checked model.init_from {s3_run}/llama", f"checked store {s3_run}/store", f"checked store {s3_run}/eu",
                       f"checked ledger {redact_url(ledger_url)}"]
    assert "training shard" in err and "a llama config" in err and "1 safetensors file" in err
    assert err.splitlines()[-1] == "6 things checked, no problem"
    assert "n_layer" not in out and "hf_path" in out  # the fields of kind hf only

    gone = "s3://no-such-bucket-here"
    bad = {**good, "model": {**good["model"], "hf_path": f"{s3_run}/nowhere", "init_from": f"{s3_run}/no-model"},
           "data": {"source": "tokens", "manifest": f"{s3_run}/no-manifest.json"},
           "learners": {"regions": [{"name": "us", "storage_url": f"{gone}/us"}]},
           "ledger": {"url": f"postgresql+psycopg://postgres:planted-pw@127.0.0.1:{free_port()}/ledger"}}
    code, out, err = invoke("config", "-c", config_file(tmp_path, bad))
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 5, err
    assert f"error: data.manifest '{s3_run}/no-manifest.json' does not exist" in errors[0]
    assert errors[1].startswith(f"error: model.hf_path '{s3_run}/nowhere': no config.json there")
    assert errors[2] == f"error: model.init_from {s3_run}/no-model: no such file or directory"
    assert errors[3] == f"error: store {gone}/us: its bucket does not exist or cannot be reached"
    assert errors[4].startswith("error: ledger postgresql+psycopg://postgres:***@127.0.0.1:") and "planted-pw" not in err
    assert f"checked store {s3_run}/store" in err and err.splitlines()[-1] == "6 things checked, 5 problems"

    offline = invoke("config", "-c", config_file(tmp_path, bad), "--offline")
    assert offline[0] == 0 and "nothing was read" in offline[2]


def test_config_checks_text_files_and_the_tokenizer(s3_run, tmp_path):
    with fsspec.open(f"{s3_run}/text/a.jsonl.gz", "wt", compression="gzip") as f:
        f.write('{"text": "hello"}\n')
    body = {"model": {"vocab_size": 512},
            "data": {"source": "text", "shards": [f"{s3_run}/text/*.jsonl.gz"], "tokenizer": f"{s3_run}/no-tokenizer"},
            "storage": {"url": f"file://{tmp_path}/store"}, "ledger": {"url": f"sqlite:///{tmp_path}/ledger.db"}}
    code, _, err = invoke("config", "-c", config_file(tmp_path, body))
    assert code == 2
    assert f"error: data.source text ['{s3_run}/text/*.jsonl.gz']: text file '{s3_run}/text/a.jsonl.gz' is gzip-compressed" in err
    assert f"error: data.tokenizer '{s3_run}/no-tokenizer' does not exist" in err
    body["data"] = {**body["data"], "shards": [f"{s3_run}/in/00*.py"], "tokenizer": f"{s3_run}/prepared/tokenizer.json"}
    code, _, err = invoke("config", "-c", config_file(tmp_path, body))
    assert code == 0, err
    assert "checked data.source text" in err and "10 files" in err
    assert "vocabulary 300, documents end with '<|endoftext|>'" in err
