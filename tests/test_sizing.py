"""``ddiloco config`` sizes a run from its config alone: the model, a learner's step, each rank's state, the bytes sent."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from support import TINY_LLAMA
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.platform.compression import codec_nbytes
from ddiloco.platform.config import build_config, load_config
from ddiloco.platform.fragments import partition_module
from ddiloco.platform.models import build_model
from ddiloco.platform.models.cost import count_flops_per_token, model_size
from ddiloco.platform.units import format_bytes, format_count, format_flops
from ddiloco.sizing import plan_report, run_size

ROOT = Path(__file__).resolve().parent.parent
LLAMA = {"kind": "hf", "hf_config": TINY_LLAMA, "vocab_size": 256, "seq_len": 32}


def plan(tmp_path, body: dict, *flags: str) -> tuple[int, list[str]]:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(body))
    result = CliRunner().invoke(app, ["config", "-c", str(path), "--offline", *flags])
    return result.exit_code, [line for line in result.stderr.splitlines() if line.startswith("plan: ")]


def test_config_sizes_a_sharded_learner_from_the_built_model(tmp_path):
    body = {"model": LLAMA, "token_budget": 10_000_000, "fragments": {"count": 4}, "compression": {"codec": "int8"},
            "inner": {"grad_accum_steps": 2},
            "learners": {"nproc_per_node": 4, "batch_size": 3, "parallelism": "fsdp", "regions": [{"name": "us", "learners": 2}]}}
    code, lines = plan(tmp_path, body)
    assert code == 0 and len(lines) == 4, lines
    # Every figure from the real model, built on the CPU, and the config's own numbers.
    cfg = build_config(body)
    model = build_model(cfg.model)
    params = sum(p.numel() for p in model.parameters())  # the tied embedding and head counted once
    embedding = model.get_input_embeddings().weight.numel()
    tokens = 4 * 3 * 2 * 32
    sent = sum(codec_nbytes(pc.numel, "int8", cfg.compression.block_size) for f in partition_module(model, 4) for pc in f.pieces)
    assert lines[0] == (f"plan: model hf, {format_count(params)} parameters ({format_count(embedding)} in embedding tables), "
                        f"{format_flops(count_flops_per_token(cfg.model))} per trained token (forward and backward at seq_len 32)")
    assert lines[1] == (f"plan: an inner step of a learner trains {tokens:,} tokens (4 ranks x 3 sequences x 2 micro-batches x "
                        f"32 tokens); the token budget is {10_000_000 // (2 * tokens):,} steps a learner (2 learners)")
    assert lines[2].startswith(f"plan: each rank keeps {format_bytes(20 * -(-params // 4))} of float32 state under fsdp over "
                               "4 ranks (weights, gradients, AdamW moments, outer snapshot: 20 bytes a parameter, a 1/4 row shard")
    assert lines[2].endswith("activations come on top; a job of several nodes shards it over all their ranks")
    assert lines[3] == (f"plan: 4 fragments, each sent every 4 inner steps: {format_bytes(sent)} per learner every 4 steps "
                        f"with int8, {sent / (4 * tokens):.3g} bytes per trained token (an adaptive learner sends less "
                        "often or smaller on a slow link)")


def test_a_ddp_learner_is_told_what_fsdp_would_keep():
    cfg = build_config({"model": LLAMA, "learners": {"nproc_per_node": 8}})
    size = run_size(cfg)
    assert size.state_bytes == 20 * size.model.params and size.sharded_state_bytes == 20 * -(-size.model.params // 8)
    (state,) = [line for line in plan_report(cfg) if "float32 state" in line]
    assert state.endswith(f"learners.parallelism fsdp would keep {format_bytes(size.sharded_state_bytes)}")
    assert "under ddp over 8 ranks" in state and "row shard" not in state


def test_hsdp_shards_the_state_over_its_shard_group():
    cfg = build_config({"model": LLAMA, "learners": {"nproc_per_node": 8, "parallelism": "hsdp", "shard_size": 2}})
    size = run_size(cfg)
    assert size.state_bytes == 20 * -(-size.model.params // 2)
    (state,) = [line for line in plan_report(cfg) if "float32 state" in line]
    assert "under hsdp over 8 ranks" in state and "a 1/2 row shard of them" in state and "would keep" not in state


def test_what_cannot_be_counted_or_built_is_said_and_fails_nothing(tmp_path):
    # A routed mixture of experts reads its data: its parameters are sized, its FLOPs are not.
    moe = build_config({"model": {"kind": "moe_gpt", "n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 16}})
    size = model_size(moe.model)
    assert size.flops_per_token is None and size.params == sum(p.numel() for p in build_model(moe.model).parameters())
    assert "FLOPs not counted (the model does not run on the meta device: " in plan_report(moe)[0]
    # A vision model trains on examples.
    vision = plan_report(build_config({"model": {"kind": "vision"}, "learners": {"batch_size": 5}}))
    assert "FLOPs not counted (model.kind vision trains on images, not tokens)" in vision[0]
    assert "trains 5 examples (1 rank x 5 examples)" in vision[1] and "bytes per trained example" in vision[3]
    fixed = plan_report(build_config({"model": LLAMA, "fragments": {"adaptive": False}}))
    assert fixed[3].endswith("bytes per trained token")
    # --offline reads no model file; a factory that fails is one line, and the config check goes on.
    code, lines = plan(tmp_path, {"model": {"kind": "hf", "hf_path": str(tmp_path / "absent"), "vocab_size": 256}})
    assert code == 0 and lines == ["plan: not sized with --offline (building the model reads model.hf_path or imports "
                                   "model.import_path)"]
    broken = build_config({"model": {"kind": "import", "import_path": "json:loads"}})
    (line,) = plan_report(broken)
    assert line.startswith("plan: not sized: model.import_path 'json:loads'") and "\n" not in line
    # A model's error that names a URL with credentials is shown masked.
    secret = build_config({"model": {"kind": "hf", "hf_path": "s3://KEYID:s3cr3t@bucket/llama", "vocab_size": 256}})
    (line,) = plan_report(secret)
    assert line.startswith("plan: not sized: ") and "s3cr3t" not in line


def test_the_readmes_plan_of_the_gpu_cluster_example_is_what_config_prints(monkeypatch):
    for key in [k for k in os.environ if k.upper().startswith("DDILOCO_")]:
        monkeypatch.delenv(key)
    shown = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("plan: ")]
    assert shown == plan_report(load_config(ROOT / "examples" / "gpu-cluster.yaml"), offline=True)
