"""A learner SIGKILLed mid-run on token shards resumes its data where its last registered submission left off.

The corpus's tokens are their own positions, so a batch says which part of the stream it is."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support import tiny_config

from ddiloco.entry import ProcessSpec
from ddiloco.platform.data import build_dataset
from ddiloco.platform.ledger.models import Learner as LearnerRow
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.testing.net import wait_for
from ddiloco.testing.processes import ProcessRun

pytestmark = pytest.mark.slow

N_TRAIN, N_VAL, T, B = 24_000, 2_000, 16, 2


def positions_config(tmp_path):
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    np.arange(N_TRAIN, dtype=np.uint32).tofile(train)
    np.arange(N_TRAIN, N_TRAIN + N_VAL, dtype=np.uint32).tofile(val)
    return tiny_config(
        name="resume",
        model={"kind": "gpt", "n_layer": 1, "d_model": 8, "n_head": 1, "seq_len": T, "vocab_size": N_TRAIN + N_VAL},
        data={"source": "tokens", "shards": [f"file://{train}"], "val_shard": f"file://{val}", "dtype": "uint32",
              "block_tokens": 1024, "val_batches": 1},
        learners={"batch_size": B, "regions": [{"name": "us", "learners": 1}], "heartbeat_s": 0.5, "poll_s": 0.2,
                  "dead_after_s": 5.0, "save_optimizer_every": 0},
        fragments={"count": 2},
        synchronizer={"poll_s": 0.1, "eval_every_s": 1000.0},
    )


def data_position(run: ProcessRun) -> tuple[int, int]:
    with run.ctx.reading() as s:
        row = s.get(LearnerRow, (run.cfg.name, "us-0"))
        return (row.incarnation, row.data_batches or 0) if row is not None else (-1, 0)


def test_sigkilled_learner_continues_at_the_next_unseen_position(tmp_path):
    (tmp_path / "run").mkdir()
    run = ProcessRun(tmp_path / "run", positions_config(tmp_path), warm=True)
    stop = threading.Event()
    sync = threading.Thread(target=Synchronizer(run.ctx, holder="sync-t").run, args=(stop,), daemon=True)
    try:
        sync.start()
        run.learner("us-0")
        wait_for(lambda: data_position(run)[1] >= 6, 120, "the learner's first registered submissions")
        run.kill("us-0")
        incarnation, saved = data_position(run)
        assert incarnation == 0 and saved >= 6
        relaunch = run.start("us-0", ProcessSpec.learner("us-0", max_steps=4))
        assert relaunch.wait(timeout=120) == 0, run.log("us-0")[-3000:]
        assert f"resumes its data at micro-batch {saved}" in run.log("us-0")
        incarnation, after = data_position(run)
        assert incarnation == 1 and after == saved + 4  # one fragment sent every step
    finally:
        stop.set()
        sync.join(timeout=10)
        run.stop_all()
    # What each incarnation trained on: batches [0, saved) were registered by the first, the second
    # drew [saved, saved + 4). Tokens are positions: no input token trained twice, none skipped.
    data = build_dataset(run.cfg.data, run.cfg.model)
    stream = data.train_batches(0, 1, B, seed=run.cfg.seed * 1_000_003)
    first = [next(stream).inputs for _ in range(saved)]
    second = [next(stream).inputs for _ in range(4)]
    resumed = data.train_batches(0, 1, B, seed=run.cfg.seed * 1_000_003, start_batch=saved)
    assert all(np.array_equal(next(resumed).inputs, b) for b in second)
    seen = {int(t) for b in first for t in b.flatten()}
    later = {int(t) for b in second for t in b.flatten()}
    assert len(seen) == saved * B * T and len(later) == 4 * B * T and seen.isdisjoint(later)
