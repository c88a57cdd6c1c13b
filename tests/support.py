"""Small configs and helpers shared by the core tests."""

from __future__ import annotations

from typing import Any

from ddiloco.platform.config import RunConfig, build_config
from ddiloco.testing.net import wait_for
from ddiloco.testing.processes import ProcessRun

# ProcessRun and wait_for live in ddiloco.testing; re-exported for the tests that import them from here.
__all__ = ["TINY_LLAMA", "ProcessRun", "sim_run", "tiny_config", "wait_for"]

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
"""A two-layer Llama's Hugging Face config, small enough to train in milliseconds (model.kind: hf)."""


def tiny_config(**sections: Any) -> RunConfig:
    """A one-layer byte GPT small enough to train in milliseconds per step; sections override."""
    data: dict[str, Any] = {
        "name": "t",
        "model": {"kind": "gpt", "n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32},
        "data": {"max_bytes": 400_000, "val_batches": 2},
        "learners": {"batch_size": 4, "regions": [{"name": "us", "learners": 2}], "heartbeat_s": 1.0},
        "inner": {"lr": 3e-3, "warmup_steps": 3},
        "fragments": {"count": 4},
        "compression": {"codec": "none"},
        "ledger": {"url": "sqlite://"},
        "storage": {"url": "memory://unused"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return build_config(data)


def sim_run(**sections: Any):  # noqa: ANN201 - (cfg, clock, ctx, synchronizer)
    """A tiny_config run in memory on a simulated clock, with version 0 published: (cfg, clock, ctx, sync)."""
    from ddiloco.inprocess import SimClock, in_memory_config
    from ddiloco.platform.ledger import open_ledger
    from ddiloco.platform.runtime import RunContext
    from ddiloco.synchronizer.service import Synchronizer

    cfg = in_memory_config(tiny_config(**sections))
    clock = SimClock()
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=clock)
    sync = Synchronizer(ctx, holder="sync", evaluate_every_s=0)
    sync.poll_once(clock.t)
    return cfg, clock, ctx, sync
