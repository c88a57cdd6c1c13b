"""Small configs and helpers shared by the core tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddiloco.platform.config import RunConfig, build_config
from ddiloco.testing.net import wait_for
from ddiloco.testing.processes import ProcessRun

# ProcessRun and wait_for live in ddiloco.testing; re-exported for the tests that import them from here.
__all__ = ["TINY_LLAMA", "ProcessRun", "drive", "eos_bpe", "setup_run", "shapes_of", "sim_run", "slow_tokenizer_dir", "submit_raw",
           "tiny_config", "upload", "wait_for"]

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


def eos_bpe(texts: list[str], vocab_size: int = 300, eos: str = "</s>") -> str:
    """A trained byte-level BPE's tokenizer.json whose end-of-text token is ``eos`` (id 0), not ``<|endoftext|>``."""
    from ddiloco.platform.tokenize import EOT, train_bpe

    return train_bpe(texts, vocab_size).replace(json.dumps(EOT), json.dumps(eos))


def slow_tokenizer_dir(tokenizer_json: str, out: Path, eos: str = "</s>") -> Path:
    """A GPT-2 tokenizer folder without a tokenizer.json (vocab.json, merges.txt, tokenizer_config.json naming ``eos``)."""
    model = json.loads(tokenizer_json)["model"]
    out.mkdir(parents=True)
    (out / "vocab.json").write_text(json.dumps(model["vocab"]))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in model["merges"]))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": eos, "unk_token": eos, "bos_token": eos, "add_prefix_space": False}))
    return out


def upload(local: Path, url: str) -> str:
    """Copy a local folder's files to ``url`` (any fsspec URL); the URL."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    for path in sorted(local.iterdir()):
        fs.put_file(str(path), f"{root}/{path.name}")
    return url


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
    sync = Synchronizer(ctx, holder="sync")
    sync.poll_once(clock.t)
    return cfg, clock, ctx, sync


# --- a live in-process run that a second, hostile identity (us-1) writes into ----------------------


def setup_run():  # noqa: ANN201 - (cfg, clock, ctx, synchronizer, honest learner)
    """Two learners configured; us-0 trains honestly (quorum 1, no grace window), us-1 exists only in the config."""
    from ddiloco.inprocess import SimClock, in_memory_config, sim_learner
    from ddiloco.platform.ledger import open_ledger
    from ddiloco.platform.runtime import RunContext
    from ddiloco.synchronizer.service import Synchronizer

    cfg = in_memory_config(
        tiny_config(learners={"regions": [{"name": "us", "learners": 2}], "heartbeat_s": 1.0}, quorum={"min_count": 1},
                    grace={"enabled": False})
    )
    clock = SimClock()
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=clock)
    sync = Synchronizer(ctx, holder="sync")
    sync.poll_once(clock.t)
    good = sim_learner(ctx, "us-0", index=0, num_learners=2)
    good.start(clock.t)
    return cfg, clock, ctx, sync, good


def submit_raw(ctx, clock, fragment: int, tensors: dict, *, learner: str = "us-1", base: int = 0, corrupt_after: bool = False,  # noqa: ANN001
               c_steps: int = 3, c_tokens: int = 300, tokens_new: int = 300, incarnation: int = 0) -> int:
    """Register a submission with whatever counts it likes (a well-formed blob unless ``corrupt_after``)."""
    import uuid

    from ddiloco.platform.compression import encode_delta
    from ddiloco.platform.ids import submission_key
    from ddiloco.platform.ledger import learner as learner_q
    from ddiloco.platform.runtime import to_datetime

    store = ctx.store("us")
    enc, meta = encode_delta(tensors, "none")
    uid = uuid.uuid4().hex[:12]
    blob = store.put(submission_key(ctx.run_id, fragment, learner, uid), enc, meta)
    if corrupt_after:
        store.fs.pipe_file(store.path(blob.key), b"\x00garbage" * 10)
    sub = learner_q.SubmissionIn(uid, fragment, base, c_steps, c_tokens, tokens_new, 300, blob.key, blob.sha256, blob.nbytes, "none")
    with ctx.transaction() as s:
        return learner_q.register_submission(s, ctx.run_id, learner, incarnation, sub, to_datetime(clock.t))[0]


def shapes_of(sync, fragment: int) -> dict:  # noqa: ANN001
    return sync.layout.shapes(fragment)


def drive(clock, sync, learner, steps: int) -> None:  # noqa: ANN001
    """``steps`` simulated seconds: the learner steps, then the synchronizer polls."""
    from ddiloco.inprocess import sim_step

    for _ in range(steps):
        clock.t += 1.0
        sim_step(learner, clock.t)
        sync.poll_once(clock.t)


def run_ranks(script: str, workdir: Path, world: int, rank0: Callable[[Path, int, int], None]) -> None:
    """A gloo job of ``world`` ranks: ``rank0(workdir, 0, world)`` here, each other rank r as ``python script rank
    workdir r world`` (its log in ``workdir/rank-r.log``); fails with a rank's log when it does not exit 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    others = []
    for r in range(1, world):
        with open(workdir / f"rank-{r}.log", "wb") as log:
            others.append(subprocess.Popen([sys.executable, script, "rank", str(workdir), str(r), str(world)], stdout=log,
                                           stderr=subprocess.STDOUT, env=env, cwd=Path(script).parent))
    try:
        # Rank 0 here (its collectives time out after 60 s if a rank never comes), the others in subprocesses.
        rank0(workdir, 0, world)
        for r, other in enumerate(others, start=1):
            code = other.wait(timeout=60)
            assert code == 0, f"rank {r} exited {code}:\n" + (workdir / f"rank-{r}.log").read_text(errors="replace")[-3000:]
    finally:
        for other in others:
            if other.poll() is None:
                other.kill()
                other.wait(timeout=10)


def run_rank_pair(script: str, workdir: Path, rank0: Callable[[Path, int, int], None]) -> None:
    """A 2-rank gloo job (see :func:`run_ranks`)."""
    run_ranks(script, workdir, 2, rank0)
