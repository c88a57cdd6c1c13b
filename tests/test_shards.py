"""A sharded synchronizer: each shard leases a fixed subset of the fragments; one shard is today's synchronizer."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import Engine, event, select
from support import tiny_config

from ddiloco.inprocess import SimClock, in_memory_config, run_inprocess
from ddiloco.platform.config import ConfigError, RunConfig
from ddiloco.platform.fragments import shard_fragments
from ddiloco.platform.invariants import check_run
from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import open_ledger
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import FragmentVersion, Merge, SynchronizerLease
from ddiloco.platform.runtime import RunContext
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.ui import queries as uq


def test_shards_split_the_fragments_by_bytes_deterministically():
    assert shard_fragments([5, 5, 5, 5], 1) == [(0, 1, 2, 3)]
    assert shard_fragments([5, 5, 5, 5], 2) == [(0, 2), (1, 3)]
    # Largest first to the lightest shard: 9 | 4+3+2 (never 9+2 | 4+3).
    assert shard_fragments([4, 9, 3, 2], 2) == [(1,), (0, 2, 3)]
    # Zero-byte fragments still spread, so no shard is empty.
    assert shard_fragments([0, 0, 0], 3) == [(0,), (1,), (2,)]
    with pytest.raises(ValueError, match="between 1 and the 3 fragments"):
        shard_fragments([1, 2, 3], 4)


def test_more_shards_than_fragments_is_refused_at_load():
    with pytest.raises(ValueError, match=r"synchronizer.shards \(5\) exceeds fragments.count \(4\)"):
        RunConfig.model_validate({"fragments": {"count": 4}, "synchronizer": {"shards": 5}})


def sharded_ctx(name: str, shards: int) -> tuple[RunContext, SimClock]:
    cfg = in_memory_config(tiny_config(name=name, fragments={"count": 4}, synchronizer={"shards": shards, "lease_ttl_s": 3.0}))
    clock = SimClock()
    return RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(cfg.ledger.url), clock=clock), clock


def test_each_shard_publishes_only_its_own_fragments_under_its_own_lease():
    ctx, clock = sharded_ctx("own", 2)
    a, b, c = (Synchronizer(ctx, holder=h) for h in ("a", "b", "c"))
    assert a.poll_once(clock.t).role == "active" and b.poll_once(clock.t).role == "active"
    assert c.poll_once(clock.t).role == "standby"  # both shards held: a third process waits
    assert (a.shard, b.shard) == (0, 1)
    with ctx.reading() as s:
        by_fragment = {v.fragment: v for v in s.scalars(select(FragmentVersion).where(FragmentVersion.run_id == "own"))}
        leases = {lease.shard: (lease.holder, lease.token) for lease in sync_q.leases(s, "own")}
    assert leases == {0: ("a", 1), 1: ("b", 1)}
    assert {f: by_fragment[f].synchronizer for f in by_fragment} == {
        **{f: "a" for f in a.assignment[0]}, **{f: "b" for f in a.assignment[1]}}
    # A holder cannot publish under another shard's fence: the ledger refuses it.
    blob = sync_q.BlobRef("own/x", "0" * 64, 1)
    with pytest.raises(errors_q.LeaseLostError, match="shard 1"), ctx.transaction() as s:
        sync_q.publish_version(s, "own", a.assignment[1][0], 1, blob=blob, state=blob, holder="a", token=1, now=ctx.now_dt(),
                          shard=1)


def test_a_standby_takes_over_whichever_shard_lapsed_and_nothing_else():
    ctx, clock = sharded_ctx("lapse", 2)
    a, b, c = (Synchronizer(ctx, holder=h) for h in ("a", "b", "c"))
    for sync in (a, b, c):
        sync.poll_once(clock.t)
    # b stops (a dead process renews nothing); a and c keep polling past the lease's TTL.
    clock.t += 5.0
    assert a.poll_once(clock.t).role == "active" and a.shard == 0
    assert c.poll_once(clock.t).role == "active" and (c.shard, c.token) == (1, 2)
    assert b.poll_once(clock.t).role == "standby"  # back from the dead: both shards are held now
    with ctx.reading() as s:
        events = [e.detail for e in runs_q.events(s, "lapse") if e.kind == "lease_acquired"]
    assert "shard 1; token 2; took over from b" in events


def test_a_standby_neither_waits_behind_nor_locks_the_live_holders_and_takes_over_in_one_write(ledger_url):
    """A standby polls every pass: while every shard is held it only reads. It must not queue for SQLite's one
    write lock (behind the holders' publishes and the learners' sends) or lock the holders' lease rows on
    PostgreSQL; and taking over a lapsed shard with nothing to merge is one write transaction (the lease's)."""
    cfg = tiny_config(name="idle", ledger={"url": ledger_url}, storage={"url": f"memory://idle-{uuid.uuid4().hex[:8]}"},
                      synchronizer={"shards": 2, "lease_ttl_s": 3.0})
    clock = SimClock()
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(ledger_url), clock=clock)
    writes: list[str] = []

    def on_begin(conn) -> None:  # noqa: ANN001 - the read-only engine's transactions are not ctx.engine's
        if conn.engine is ctx.engine:
            writes.append("write")

    event.listen(Engine, "begin", on_begin)
    try:
        a, b, c = (Synchronizer(ctx, holder=h) for h in ("a", "b", "c"))
        for sync in (a, b, c):
            sync.poll_once(clock.t)
        assert (a.shard, b.shard, c.shard) == (0, 1, None)
        # A writer holds the write lock (SQLite: BEGIN IMMEDIATE) and both lease rows (PostgreSQL) meanwhile.
        with ThreadPoolExecutor(1) as pool, ctx.transaction() as s:
            for shard in (0, 1):
                s.get(SynchronizerLease, ("idle", shard), with_for_update=True)
            writes.clear()
            standby = pool.submit(c.poll_once, clock.t + 1.0)
            assert standby.result(timeout=10).role == "standby"
        assert writes == []
        # b stops renewing; past its TTL c takes shard 1 over: one write, and a takes nothing.
        clock.t += 5.0
        assert a.poll_once(clock.t).role == "active"
        writes.clear()
        assert c.poll_once(clock.t).role == "active" and (c.shard, c.token) == (1, 2)
        assert writes == ["write"]
    finally:
        event.remove(Engine, "begin", on_begin)
        ctx.engine.dispose()


def test_a_pinned_synchronizer_serves_its_shard_only_and_bad_shards_are_refused():
    ctx, clock = sharded_ctx("pinned", 2)
    with pytest.raises(ConfigError, match="shard 2: the run has 2 synchronizer shard"):
        Synchronizer(ctx, holder="x", shard=2)
    one = Synchronizer(ctx, holder="one", shard=1)
    assert one.poll_once(clock.t).role == "active" and one.shard == 1
    other = Synchronizer(ctx, holder="other", shard=1)
    assert other.poll_once(clock.t).role == "standby"  # shard 0 is free, but it is pinned to 1


def test_a_process_with_another_shard_count_than_the_run_is_refused():
    ctx, clock = sharded_ctx("fixed", 2)
    Synchronizer(ctx, holder="a").poll_once(clock.t)
    cfg = ctx.cfg.model_copy(update={"synchronizer": ctx.cfg.synchronizer.model_copy(update={"shards": 1})})
    other = RunContext(cfg=cfg, run_id="fixed", engine=ctx.engine, clock=clock)
    with pytest.raises(ConfigError, match="synchronizer.shards is 1, but run 'fixed' was started with 2"):
        Synchronizer(other, holder="b").poll_once(clock.t)


def test_a_two_shard_run_trains_with_dense_versions_and_every_submission_merged_once():
    cfg = tiny_config(name="two", fragments={"count": 4}, synchronizer={"shards": 2})
    tokens_per_step = cfg.learners.batch_size * cfg.model.seq_len
    run = run_inprocess(cfg, total_tokens=48 * tokens_per_step)
    assert check_run(run.ctx) == []  # dense versions per fragment, fencing, fates, blobs, token accounting
    with run.ctx.reading() as s:
        merges = list(s.scalars(select(Merge).where(Merge.run_id == "two")))
        heads = runs_q.latest_version_numbers(s, "two")
    members = [m["submission"] for mg in merges for m in json.loads(mg.detail_json)["members"]]
    assert len(members) == len(set(members)), "a submission was merged twice"
    assert min(heads.values()) >= 2, f"every fragment should have merged: {heads}"
    shard_of = {f: k for k, frags in enumerate(run.sync.assignment) for f in frags}
    with run.ctx.reading() as s:
        publishers = set(s.execute(select(FragmentVersion.fragment, FragmentVersion.synchronizer)
                                   .where(FragmentVersion.run_id == "two")).all())
    assert publishers == {(f, "sync-inprocess" if shard_of[f] == 0 else "sync-inprocess-1") for f in heads}
    # The dashboard lists each shard's holder, and the run is healthy only with both leases live.
    with run.ctx.reading() as s:
        holders = uq.synchronizer_holders(s, "two")
        snap = uq.health_snapshot(s, "two", run.ctx.now_dt())
    assert set(zip(holders["shard"], holders["holder"], strict=True)) == {(0, "sync-inprocess"), (1, "sync-inprocess-1")}
    assert holders["versions"].sum() == sum(heads.values()) + len(heads)
    assert snap.sync.status == "active" and snap.sync.holder == "sync-inprocess, sync-inprocess-1"
