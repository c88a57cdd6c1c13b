"""Learners and synchronizers as real OS processes, really killed; started warm (forked from the fork server that
has imported torch once), as the flows' launcher starts them."""

from __future__ import annotations

import json
import time

import pytest
import torch
from sqlalchemy import select
from support import tiny_config

from ddiloco.platform.compression import decode_delta
from ddiloco.platform.fragments import shard_fragments
from ddiloco.platform.invariants import check_run
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import FragmentVersion, Learner, Merge, Submission
from ddiloco.platform.run_state import build_layout
from ddiloco.platform.store import FragmentStore
from ddiloco.synchronizer.merge import GlobalFragment, Member, MergePolicy, merge_fragment
from ddiloco.synchronizer.outer import momentum_from_blob
from ddiloco.testing.net import wait_for
from ddiloco.testing.processes import ProcessRun

pytestmark = pytest.mark.slow


def process_config(name: str, **extra):
    # A lease long enough that a holder starved of CPU (the suite runs 3 workers on 2 cores) keeps it: with 1.5 s a
    # live holder lost its shard to a standby mid-test. The kills below must be taken over well inside it, which only
    # the presence lock can do (a renewed lease has over 5 s left), so the failover bounds test that path, not expiry.
    return tiny_config(
        name=name,
        learners={"regions": [{"name": "us", "learners": 2}], "heartbeat_s": 0.5, "poll_s": 0.2, "dead_after_s": 5.0},
        fragments={"count": 4, "overlap": 2},
        synchronizer={"poll_s": 0.1, "lease_ttl_s": 8.0, "eval_every_s": 1000.0,
                      "retention": {"keep_last": 100000, "keep_submission_blobs": True}},
        compression={"codec": "int8"},
        **extra,
    )


def v0_published(run: ProcessRun) -> bool:
    with run.ctx.reading() as s:
        return len(runs_q.latest_version_numbers(s, run.ctx.run_id)) == run.cfg.fragments.count


def test_learner_killed_mid_upload_leaves_no_dangling_row_and_rejoins(tmp_path):
    run = ProcessRun(tmp_path, process_config("killmid"), warm=True)
    try:
        run.synchronizer("sync-a")
        wait_for(lambda: v0_published(run), 120, "version 0")
        run.learner("us-0", faults="learner.after_blob:3")
        run.learner("us-1")
        wait_for(lambda: run.fault_reached("us-0", "learner.after_blob"), 120, "us-0 to stop between blob and ledger row")
        run.kill("us-0")
        store = FragmentStore(run.cfg.storage.url)
        with run.ctx.reading() as s:
            rows = list(s.scalars(select(Submission).where(Submission.run_id == "killmid")))
        referenced = {r.blob_key for r in rows}
        on_disk = {k for k in store.list("killmid/submissions") if "/us-0/" in k}
        assert on_disk - referenced, "the killed upload's blob should exist without a row"
        for r in rows:
            assert store.verify(r.blob_key, r.sha256), f"row {r.id} points to a missing or bad blob"

        run.learner("us-0")

        def rejoined_and_merged() -> bool:
            with run.ctx.reading() as s:
                learner = s.get(Learner, ("killmid", "us-0"))
                merged = s.scalar(
                    select(Submission.id).where(
                        Submission.learner_id == "us-0", Submission.uid.like("i1-%"), Submission.status == "merged"
                    )
                )
            return learner.incarnation == 1 and merged is not None

        wait_for(rejoined_and_merged, 180, "the restarted learner's work to be merged")
        with run.ctx.reading() as s:
            kinds = [e.kind for e in runs_q.events(s, "killmid")]
            assert "learner_restarted" in kinds
            acct = reports_q.token_accounting(s, "killmid")
        assert acct.balanced and acct.merged > 0
        assert check_run(run.ctx) == []
    finally:
        run.stop_all()


def recompute_version(run: ProcessRun, fragment: int, version: int) -> tuple[dict, dict]:
    """Redo a merge from the ledger and the blobs alone: (params, momentum) it must have produced."""
    cfg = run.cfg
    store = FragmentStore(cfg.storage.url)
    with run.ctx.reading() as s:
        prev = runs_q.get_version(s, cfg.name, fragment, version - 1)
        merge = s.scalar(select(Merge).where(Merge.run_id == cfg.name, Merge.fragment == fragment, Merge.version == version))
        detail = json.loads(merge.detail_json)
        subs = {sb.id: sb for sb in s.scalars(select(Submission).where(Submission.id.in_([m["submission"] for m in detail["members"]])))}
    current = GlobalFragment(version - 1, store.get(prev.blob_key, prev.sha256),
                             momentum_from_blob(store.get(prev.state_key, prev.state_sha256)))
    members = []
    for m in detail["members"]:
        sb = subs[m["submission"]]
        tensors, meta = store.get_with_metadata(sb.blob_key, sb.sha256)
        members.append(Member(sb.id, sb.learner_id, decode_delta(tensors, meta), m["norm"], sb.c_steps, sb.c_tokens, sb.base_version))
    out = merge_fragment(current, members, MergePolicy.from_config(cfg), live_learners=merge.live_learners)
    assert out.detail["members"] == detail["members"] and out.detail["participation_scale"] == detail["participation_scale"]
    return out.params, out.momentum


def test_synchronizer_killed_mid_merge_standby_resumes_exactly(tmp_path):
    run = ProcessRun(tmp_path, process_config("failover"), warm=True)
    P = run.cfg.fragments.count
    try:
        # Its first P publishes are version 0; the (P + 3)-th is its third merge.
        run.synchronizer("sync-a", faults=f"sync.before_commit:{P + 3}")
        wait_for(lambda: v0_published(run), 120, "version 0")
        run.synchronizer("sync-b")
        run.learner("us-0")
        run.learner("us-1")
        wait_for(lambda: run.fault_reached("sync-a", "sync.before_commit"), 180, "sync-a to stop mid-merge")
        killed_at = time.time()
        run.kill("sync-a")

        def published_by_b():
            with run.ctx.reading() as s:
                return s.scalar(
                    select(FragmentVersion)
                    .where(FragmentVersion.run_id == "failover", FragmentVersion.synchronizer.like("sync-b@%"))
                    .order_by(FragmentVersion.created_at)
                    .limit(1)
                )

        first_b = wait_for(published_by_b, 60, "the standby to publish", interval_s=0.05)
        failover_s = time.time() - killed_at  # when the new version is visible in the ledger
        assert failover_s < 5.0, f"failover took {failover_s:.1f}s"
        # Let sync-b merge a few more, with the learners still going.
        wait_for(lambda: len(_versions_by(run, "sync-b")) >= 2 * P, 120, "more merges by the standby")
        with run.ctx.reading() as s:
            versions = s.execute(select(FragmentVersion.fragment, FragmentVersion.version, FragmentVersion.lease_token)
                                 .where(FragmentVersion.run_id == "failover")).all()
            merged = s.execute(select(Submission.id, Submission.merged_version, Submission.fragment)
                               .where(Submission.run_id == "failover", Submission.status == "merged")).all()
            merges = list(s.scalars(select(Merge).where(Merge.run_id == "failover")))
        assert check_run(run.ctx) == []  # dense versions, fencing, fates, blobs, accounting
        listed = [m["submission"] for mg in merges for m in json.loads(mg.detail_json)["members"]]
        assert len(listed) == len(set(listed)), "a submission was merged twice"
        by_id = {sid: (v, f) for sid, v, f in merged}
        for mg in merges:
            for m in json.loads(mg.detail_json)["members"]:
                assert by_id[m["submission"]] == (mg.version, mg.fragment)
        assert {t for _, _, t in versions if t > 1}, "the standby should publish with a newer fencing token"
        # The standby's first merge continues from the persisted momentum exactly.
        params, momentum = recompute_version(run, first_b.fragment, first_b.version)
        store = FragmentStore(run.cfg.storage.url)
        got = store.get(first_b.blob_key, first_b.sha256)
        got_m = momentum_from_blob(store.get(first_b.state_key, first_b.state_sha256))
        for n in params:
            torch.testing.assert_close(got[n], params[n], rtol=0, atol=1e-6)
            torch.testing.assert_close(got_m[n], momentum[n], rtol=0, atol=1e-6)
    finally:
        run.stop_all()


def _versions_by(run: ProcessRun, holder: str) -> list:
    with run.ctx.reading() as s:
        mine = (FragmentVersion.run_id == run.cfg.name, FragmentVersion.synchronizer.like(f"{holder}@%"))
        return list(s.scalars(select(FragmentVersion.version).where(*mine)))


def test_a_killed_shard_is_taken_over_while_the_other_shard_keeps_publishing(tmp_path):
    """Two shards, three synchronizer processes: SIGKILL one shard's holder mid-merge; the standby takes
    that shard over within seconds, the other shard's holder keeps its lease and goes on publishing."""
    cfg = process_config("shards")
    cfg = cfg.model_copy(update={"synchronizer": cfg.synchronizer.model_copy(update={"shards": 2})})
    run = ProcessRun(tmp_path, cfg, warm=True)

    def lease_of(label: str):
        with run.ctx.reading() as s:
            return next((lease for lease in sync_q.leases(s, "shards") if lease.holder.startswith(f"{label}@")), None)

    try:
        run.synchronizer("sync-a", faults="sync.mid_merge:3")  # stops dead in its third merge
        held_a = wait_for(lambda: lease_of("sync-a"), 120, "sync-a to take a shard")
        # The other two start together: whichever comes first takes the other shard, the last is the standby.
        for name in ("sync-b", "sync-c", "us-0", "us-1"):
            (run.synchronizer if name.startswith("sync") else run.learner)(name)
        wait_for(lambda: lease_of("sync-b") or lease_of("sync-c"), 120, "a second synchronizer to take the other shard")
        other, standby = ("sync-b", "sync-c") if lease_of("sync-b") else ("sync-c", "sync-b")
        held_other = lease_of(other)
        assert held_other.shard != held_a.shard
        wait_for(lambda: run.fault_reached("sync-a", "sync.mid_merge"), 180, "sync-a to stop mid-merge")
        before = len(_versions_by(run, other))
        killed_at = time.time()
        run.kill("sync-a")
        first = wait_for(lambda: _versions_by(run, standby), 60, "the standby to publish", interval_s=0.05)
        failover_s = time.time() - killed_at
        assert failover_s < 5.0, f"shard {held_a.shard}'s next version came {failover_s:.1f}s after the kill"
        taken = lease_of(standby)
        assert (taken.shard, taken.token) == (held_a.shard, held_a.token + 1) and first
        # The other shard never stopped: same holder, same token, versions published across the takeover.
        wait_for(lambda: len(_versions_by(run, other)) > before, 30, f"{other} to keep publishing")
        still = lease_of(other)
        assert (still.shard, still.token) == (held_other.shard, held_other.token)
        wait_for(lambda: len(_versions_by(run, standby)) >= 2, 120, "more merges by the standby")
        with run.ctx.reading() as s:
            merges = list(s.scalars(select(Merge).where(Merge.run_id == "shards")))
            publishers = set(s.execute(select(FragmentVersion.fragment, FragmentVersion.synchronizer)
                                       .where(FragmentVersion.run_id == "shards", FragmentVersion.version > 0)).all())
        assert check_run(run.ctx) == []  # dense versions, fencing, fates, blobs, accounting
        listed = [m["submission"] for mg in merges for m in json.loads(mg.detail_json)["members"]]
        assert len(listed) == len(set(listed)), "a submission was merged twice"
        shard_of = {f: k for k, frags in enumerate(shard_fragments([f.nbytes for f in build_layout(run.ctx).fragments], 2))
                    for f in frags}
        for fragment, holder in publishers:
            assert shard_of[fragment] == (held_other.shard if holder.startswith(f"{other}@") else held_a.shard), (fragment, holder)
    finally:
        run.stop_all()


# --- failover at the speed of the failure ------------------------------------------------------------------


def _stop_outside_a_transaction(run: ProcessRun, name: str) -> None:
    """SIGSTOP ``name`` at a moment it holds no ledger lock (a process frozen inside a write would hold SQLite's one
    write lock, or PostgreSQL's lease row, and stall the others for reasons this test is not about): stop it, and if
    a write cannot get through at once, let it run on and try again."""
    import signal
    import sqlite3

    from pydantic import SecretStr
    from sqlalchemy.exc import OperationalError

    url = run.cfg.ledger.url
    url = url.get_secret_value() if isinstance(url, SecretStr) else url

    def write_gets_through() -> bool:
        if url.startswith("sqlite"):
            conn = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=0.3, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
                return True
            except sqlite3.OperationalError:
                return False
            finally:
                conn.close()
        with run.ctx.engine.connect() as conn:
            conn.exec_driver_sql("SET LOCAL lock_timeout = '300ms'")
            try:
                conn.exec_driver_sql("SELECT 1 FROM synchronizer_leases FOR UPDATE")
                return True
            except OperationalError:  # the lock wait timed out
                return False
            finally:
                conn.rollback()

    def stopped_and_clear() -> bool:
        run.signal(name, signal.SIGSTOP)
        if write_gets_through():
            return True
        run.signal(name, signal.SIGCONT)
        return False

    wait_for(stopped_and_clear, 60, f"{name} stopped outside a ledger transaction", interval_s=0.05)


def test_a_killed_holder_is_replaced_before_its_lease_expires_and_a_hung_one_only_after(tmp_path, ledger_url):
    """SIGKILL the lease holder: its presence lock dies with it, and a standby takes over well before the lease's
    expiry (read from the ledger, not timed). SIGSTOP the new holder (hung, still holding its lock): nobody takes over
    before its lease expires; then a standby does, by expiry, without the lock; the woken holder cannot publish
    (fenced), stands down and lets the lock go, and the new holder claims it."""
    import signal

    cfg = process_config("presence")
    cfg = cfg.model_copy(update={"synchronizer": cfg.synchronizer.model_copy(update={"lease_ttl_s": 4.0})})
    run = ProcessRun(tmp_path, cfg, warm=True, ledger_url=ledger_url)

    def lease():
        with run.ctx.reading() as s:
            return sync_q.current_lease(s, "presence")

    def took_over(holder: str):
        with run.ctx.reading() as s:
            return next((e for e in runs_q.events(s, "presence")
                         if e.kind == "lease_acquired" and f"took over from {holder}" in e.detail), None)

    try:
        run.synchronizer("sync-a")
        wait_for(lambda: v0_published(run), 120, "version 0")
        for name in ("sync-b", "sync-c", "us-0"):
            (run.synchronizer if name.startswith("sync") else run.learner)(name)
        wait_for(lambda: len(_versions_by(run, "sync-a")) > run.cfg.fragments.count, 180, "sync-a to merge")
        wait_for(lambda: all(" is standby" in run.log(x) for x in ("sync-b", "sync-c")), 120, "two standbys")

        # 1. SIGKILL: the takeover comes before the dead holder's lease would have expired.
        held = lease()
        assert held.holder.startswith("sync-a@") and held.presence
        run.kill("sync-a")
        event = wait_for(lambda: took_over(held.holder), 30, "a standby to take over", interval_s=0.05)
        assert event.detail.endswith("(its session ended)") and event.at < held.expires_at
        new = lease()
        assert new.token == held.token + 1 and new.presence and event.actor == new.holder
        label = new.holder.partition("@")[0]
        other = ({"sync-b", "sync-c"} - {label}).pop()
        wait_for(lambda: _versions_by(run, label), 60, f"{label} to publish")

        # 2. SIGSTOP: hung, alive, still holding its lock; taken over only by expiry.
        _stop_outside_a_transaction(run, label)
        frozen = lease()
        assert frozen.holder == new.holder
        event = wait_for(lambda: took_over(new.holder), 60, "the standby to take the hung holder's lease")
        assert event.at >= frozen.expires_at and "(its session ended)" not in event.detail
        taken = lease()
        assert taken.holder.startswith(f"{other}@") and taken.token == new.token + 1
        assert not taken.presence  # the hung holder still has the lock
        run.signal(label, signal.SIGCONT)
        wait_for(lambda: "lost the lease" in run.log(label), 60, f"{label} to find its lease gone")
        wait_for(lambda: lease().presence, 30, f"{other} to claim the presence lock")
        assert lease().token == taken.token  # claimed without a change of holder
        wait_for(lambda: _versions_by(run, other), 60, f"{other} to publish")
        with run.ctx.reading() as s:
            late = s.scalars(select(FragmentVersion).where(
                FragmentVersion.run_id == "presence", FragmentVersion.synchronizer == new.holder,
                FragmentVersion.created_at >= taken.acquired_at)).all()
        assert late == []  # the woken holder published nothing after the takeover
        assert check_run(run.ctx) == []  # dense versions, fencing, fates, blobs, accounting
    finally:
        run.stop_all()

