"""Bad input is rejected with a reason in the ledger, and the run goes on (real components, one process)."""

from __future__ import annotations

import pytest
import torch
from support import drive, setup_run, shapes_of, submit_raw

from ddiloco.inprocess import sim_step
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import Submission
from ddiloco.platform.runtime import to_datetime


def test_corrupt_nan_wrong_shape_stale_and_unknown_are_rejected_while_training_continues():
    cfg, clock, ctx, sync, good = setup_run()
    with ctx.transaction() as s:
        learner_q.register_learner(s, ctx.run_id, "us-1", "us", to_datetime(clock.t))
    zeros = {n: torch.full(shape, 0.01) for n, shape in shapes_of(sync, 0).items()}
    bad = {
        submit_raw(ctx, clock, 0, zeros, corrupt_after=True): "bytes, not the",  # a size mismatch: refused before reading
        submit_raw(ctx, clock, 1, {n: torch.full(s_, float("nan")) for n, s_ in shapes_of(sync, 1).items()}): "non-finite",
        submit_raw(ctx, clock, 2, {n: torch.zeros(3) for n in shapes_of(sync, 2)}): "bad update",
        submit_raw(ctx, clock, 0, zeros, learner="ghost"): "unknown learner",
    }
    # Counts no honest learner sends never reach the ledger: refused at registration, with the reason.
    with pytest.raises(ValueError, match="implausible counts"):
        submit_raw(ctx, clock, 3, {n: torch.zeros(s_) for n, s_ in shapes_of(sync, 3).items()}, c_steps=0)
    drive(clock, sync, good, 3 * cfg.fragments.count)
    with ctx.transaction() as s:
        for sid, needle in bad.items():
            row = s.get(Submission, sid)
            assert row.status == "rejected", (sid, row.status, row.reject_reason)
            assert needle in row.reject_reason, (needle, row.reject_reason)
        versions = runs_q.latest_version_numbers(s, ctx.run_id)
        events = [e.detail for e in runs_q.events(s, ctx.run_id) if e.kind == "submission_rejected"]
        good_merged = s.query(Submission).filter(Submission.learner_id == "us-0", Submission.status == "merged").count()
    assert len(events) >= len(bad)
    assert good_merged >= cfg.fragments.count
    assert all(v >= 2 for v in versions.values()), versions


def test_stale_submission_is_rejected_and_a_duplicate_registration_is_a_no_op():
    cfg, clock, ctx, sync, good = setup_run()
    for _ in range((cfg.merge.max_staleness + 2) * cfg.fragments.count):
        clock.t += 1.0
        sim_step(good, clock.t)
        sync.poll_once(clock.t)
    with ctx.transaction() as s:
        learner_q.register_learner(s, ctx.run_id, "us-1", "us", to_datetime(clock.t))
        current = runs_q.latest_version_numbers(s, ctx.run_id)[0]
    assert current > cfg.merge.max_staleness
    sid = submit_raw(ctx, clock, 0, {n: torch.zeros(s_) + 0.01 for n, s_ in shapes_of(sync, 0).items()}, base=0)
    with ctx.transaction() as s:
        row = s.get(Submission, sid)
        again = learner_q.SubmissionIn(row.uid, 0, 0, 3, 300, 300, 300, row.blob_key, row.sha256, row.nbytes, "none")
        sid2, created = learner_q.register_submission(s, ctx.run_id, "us-1", 0, again, to_datetime(clock.t))
    assert (sid2, created) == (sid, False)
    clock.t += 1.0
    sync.poll_once(clock.t)
    with ctx.transaction() as s:
        row = s.get(Submission, sid)
        assert row.status == "rejected" and row.reject_reason.startswith("stale: based on v0")
