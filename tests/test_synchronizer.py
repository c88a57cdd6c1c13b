"""The synchronizer's pass as a whole: its timing spans; and the global model's evaluation (tests/test_evaluator.py: off the pass)."""

from __future__ import annotations

import math

import pytest
import torch
from sqlalchemy import func, select
from support import tiny_config

from ddiloco.inprocess import SimClock, in_memory_config, run_inprocess
from ddiloco.platform import spans
from ddiloco.platform.data import build_dataset
from ddiloco.platform.ledger import open_ledger
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import Merge
from ddiloco.platform.models import build_model, evaluate
from ddiloco.platform.runtime import RunContext
from ddiloco.synchronizer.evaluation import evaluate_and_record, evaluate_global
from ddiloco.synchronizer.service import Synchronizer


def fresh_run(name: str, **sections) -> tuple[RunContext, SimClock]:
    cfg = in_memory_config(tiny_config(name=name, **sections))
    clock = SimClock()
    return RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=clock), clock


def test_a_run_is_timed_by_the_named_spans():
    cfg = tiny_config(name="spans", fragments={"count": 2})
    tokens_per_step = cfg.learners.batch_size * cfg.model.seq_len
    with spans.collecting() as totals:
        run = run_inprocess(cfg, total_tokens=24 * tokens_per_step, eval_every_tokens=12 * tokens_per_step)
    with run.ctx.reading() as s:
        merges = s.scalar(select(func.count()).select_from(Merge).where(Merge.run_id == "spans"))
    assert merges > 0
    calls = {name: totals.get(name + ".calls", 0) for name in
             ("sync.poll_once", "sync.fetch", "sync.merge", "sync.publish", "sync.gc", "sync.eval")}
    assert calls["sync.merge"] == calls["sync.fetch"] == merges
    assert calls["sync.publish"] == merges + cfg.fragments.count  # each merge, and version 0 of each fragment
    assert calls["sync.eval"] == len(run.evals)
    assert calls["sync.poll_once"] > merges and calls["sync.gc"] >= 1
    assert all(totals[name] >= 0 for name in calls)


def test_evaluation_is_a_plain_function_of_the_published_fragments():
    ctx, clock = fresh_run("evalfn")
    Synchronizer(ctx, holder="s").poll_once(clock.t)  # publishes version 0
    cfg = ctx.cfg
    loss, acc = evaluate_and_record(ctx, clock.t)
    want, _ = evaluate(build_model(cfg.model, seed=cfg.seed), build_dataset(cfg.data, cfg.model).val_batches(cfg.learners.batch_size))
    assert loss == pytest.approx(want, rel=1e-6) and acc is None
    with ctx.reading() as s:
        assert [e.val_loss for e in runs_q.evaluations(s, "evalfn")] == [loss]
    # The parameters given are the ones evaluated: all zero gives uniform logits, loss ln(vocab).
    zeros = {n: torch.zeros_like(p) for n, p in build_model(cfg.model).named_parameters()}
    zero_loss, _ = evaluate_global(cfg, zeros)
    assert zero_loss == pytest.approx(math.log(cfg.model.vocab_size), rel=1e-5)
