"""Garbage collection: deleting the blobs the run's retention policy lets go, then recording them deleted.

Shard 0's holder runs it for the whole run (one collector, never two racing); ``ledger.synchronizer`` says
which versions and submissions are due."""

from __future__ import annotations

from ddiloco.platform import compact
from ddiloco.platform.ids import InvalidIdError, submission_key
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.runtime import RunContext


def collect_garbage(ctx: RunContext) -> tuple[int, int]:
    """Delete blobs the retention policy lets go; returns (versions, submissions) deleted."""
    rcfg = ctx.cfg.synchronizer.retention
    with ctx.transaction() as s:
        versions = sync_q.versions_for_gc(s, ctx.run_id, rcfg.keep_last, rcfg.checkpoint_every)
        subs = [] if rcfg.keep_submission_blobs else sync_q.submissions_for_gc(s, ctx.run_id)
        owner = {row.id: row.region for row in runs_q.learners(s, ctx.run_id)}
    store = ctx.store()
    # Only keys under this run's own prefixes (versions: what the synchronizer wrote) or derived from a
    # submission's ids are ever deleted: a row's key could name another run's, or a pending, blob.
    written_here = (f"{ctx.run_id}/global/", f"{ctx.run_id}/outer/")
    for v in versions:
        ref = compact.CompactRef.readable(v.compact_json)
        for key in [v.blob_key, v.state_key, *(ref.own_keys(v.version) if ref else [])]:
            if key.startswith(written_here):
                store.delete(key)
    for sb in subs:
        try:
            key = submission_key(ctx.run_id, sb.fragment, sb.learner_id, sb.uid)
        except InvalidIdError:
            continue
        ctx.store(owner.get(sb.learner_id)).delete(key)
    with ctx.transaction() as s:
        sync_q.mark_blobs_deleted(s, versions, subs)
    return len(versions), len(subs)
