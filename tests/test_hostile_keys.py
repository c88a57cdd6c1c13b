"""Keys are derived, not trusted: a submission naming another blob is rejected, and GC deletes only what the
run wrote or what a submission's own ids give; an id registered again with other content is refused."""

from __future__ import annotations

import fnmatch
import json
import uuid
from pathlib import Path

import pytest
import torch
from support import setup_run, shapes_of

from ddiloco.inprocess import sim_step
from ddiloco.platform.compression import encode_delta
from ddiloco.platform.ids import global_key, learner_state_key, outer_state_key, submission_key
from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import Submission
from ddiloco.platform.runtime import to_datetime
from ddiloco.platform.store import encode_tensors, sha256_hex
from ddiloco.synchronizer.gc import collect_garbage


def register(ctx, clock, fragment: int, key: str, data: bytes, learner: str = "us-1", uid: str | None = None) -> int:
    sub = learner_q.SubmissionIn(uid or uuid.uuid4().hex[:12], fragment, 0, 3, 300, 300, 300, key, sha256_hex(data), len(data), "none")
    with ctx.transaction() as s:
        return learner_q.register_submission(s, ctx.run_id, learner, 0, sub, to_datetime(clock.t))[0]


def test_a_submission_naming_other_blobs_is_rejected_and_gc_deletes_none_of_them():
    cfg, clock, ctx, sync, good = setup_run()
    with ctx.transaction() as s:
        learner_q.register_learner(s, ctx.run_id, "us-1", "us", to_datetime(clock.t))
        learner_q.register_learner(s, ctx.run_id, "us-2", "us", to_datetime(clock.t))
        newest = runs_q.latest_versions(s, ctx.run_id)[0]
    store = ctx.store("us")
    enc, meta = encode_delta({n: torch.full(s_, 1e-4) for n, s_ in shapes_of(sync, 0).items()}, "none")
    data = encode_tensors(enc, meta)
    # An honest pending submission of us-2, and blobs of another run, written where they belong.
    honest_uid = uuid.uuid4().hex[:12]
    honest_key = submission_key(ctx.run_id, 0, "us-2", honest_uid)
    store.put_bytes(honest_key, data)
    other_run = global_key("other-run", 0, 0)
    store.put_bytes(other_run, data)
    victims = {
        "this run's global version": newest.blob_key,
        "another run's global version": other_run,
        "another learner's pending submission": honest_key,
    }
    victims = {what: key for what, key in victims.items() if store.exists(key)}
    assert len(victims) == 3, victims
    before = {key: store.get_bytes(key) for key in victims.values()}
    hostile = {what: register(ctx, clock, 0, key, before[key]) for what, key in victims.items()}
    honest = register(ctx, clock, 0, honest_key, data, learner="us-2", uid=honest_uid)
    for _ in range(2 * cfg.fragments.count):
        clock.t += 1.0
        sim_step(good, clock.t)
        sync.poll_once(clock.t)
    with ctx.transaction() as s:
        for what, sid in hostile.items():
            row = s.get(Submission, sid)
            assert row.status == "rejected" and "that its ids give" in row.reject_reason, (what, row.status, row.reject_reason)
        assert s.get(Submission, honest).status == "merged"
    collect_garbage(ctx)
    for what, key in victims.items():
        if what == "another learner's pending submission":
            continue  # merged now: its own (derived) blob is the one GC may delete
        assert store.get_bytes(key) == before[key], f"GC deleted {what}"


def test_gc_deletes_a_decided_submissions_own_blob_under_its_derived_key():
    cfg, clock, ctx, sync, good = setup_run()
    with ctx.transaction() as s:
        learner_q.register_learner(s, ctx.run_id, "us-1", "us", to_datetime(clock.t))
    store = ctx.store("us")
    uid = uuid.uuid4().hex[:12]
    key = submission_key(ctx.run_id, 0, "us-1", uid)
    data = b"not a blob"
    store.put_bytes(key, data)
    sid = register(ctx, clock, 0, key, data, uid=uid)
    clock.t += 1.0
    sync.poll_once(clock.t)
    with ctx.transaction() as s:
        assert s.get(Submission, sid).status == "rejected"
    collect_garbage(ctx)
    assert not store.exists(key)


def test_an_id_registered_again_with_other_content_is_refused(ledger_url):
    engine = open_ledger(ledger_url)
    now = to_datetime(1_700_000_000.0)
    try:
        with session_factory(engine).begin() as s:
            runs_q.create_run(s, "r", config_json="{}", code_version="t", git_commit=None, num_fragments=2, token_budget=10, now=now)
            learner_q.register_learner(s, "r", "a", "us", now)
        first = learner_q.SubmissionIn("u1", 0, 0, 3, 300, 300, 300, submission_key("r", 0, "a", "u1"), "0" * 64, 100, "none")
        with session_factory(engine).begin() as s:
            sid, created = learner_q.register_submission(s, "r", "a", 0, first, now)
        assert created
        with session_factory(engine).begin() as s:
            assert learner_q.register_submission(s, "r", "a", 0, first, now) == (sid, False)  # a retry: a no-op
        for change in ({"fragment": 1}, {"c_tokens": 600, "tokens_new": 600, "tokens_total": 600}, {"sha256": "1" * 64}):
            other = learner_q.SubmissionIn(**{**first.__dict__, **change})
            with pytest.raises(errors_q.SubmissionConflictError, match="already registered with other content"), \
                    session_factory(engine).begin() as s:
                learner_q.register_submission(s, "r", "a", 0, other, now)
        with session_factory(engine)() as s:
            row = s.get(Submission, sid)
            assert (row.fragment, row.c_tokens, row.sha256) == (0, 300, "0" * 64)
    finally:
        engine.dispose()


# --- the store policies in infra/iam against the keys the code writes -------------------------------------

IAM = Path(__file__).resolve().parent.parent / "infra" / "iam"


def allowed(policy: str, action: str, key: str, user: str, run: str = "r1", bucket: str = "b") -> bool:
    """What an IAM policy of Allow statements grants (``*`` spans '/', as in IAM), for ``user`` on ``bucket/key``."""
    doc = json.loads((IAM / f"{policy}.json").read_text())
    arn = f"arn:aws:s3:::{bucket}/{key}"
    for st in doc["Statement"]:
        assert st["Effect"] == "Allow"
        resources = [r.replace("BUCKET", bucket).replace("RUN", run).replace("${aws:username}", user) for r in st["Resource"]]
        if action in st["Action"] and any(fnmatch.fnmatchcase(arn, r) for r in resources):
            return True
    return False


def test_store_policies_grant_each_role_its_own_keys_and_nothing_else():
    own = submission_key("r1", 3, "us-0", "u1")
    other = submission_key("r1", 3, "us-1", "u2")
    state = learner_state_key("r1", "us-0", "optim-i0-s100")
    version, outer = global_key("r1", 3, 7), outer_state_key("r1", 3, 7)
    assert allowed("learner", "s3:PutObject", own, "us-0") and allowed("learner", "s3:GetObject", own, "us-0")
    assert allowed("learner", "s3:PutObject", state, "us-0") and allowed("learner", "s3:GetObject", version, "us-0")
    assert not allowed("learner", "s3:PutObject", other, "us-0")
    assert not allowed("learner", "s3:PutObject", version, "us-0") and not allowed("learner", "s3:PutObject", outer, "us-0")
    assert not any(allowed("learner", "s3:DeleteObject", k, "us-0") for k in (own, other, version))
    assert not allowed("learner", "s3:PutObject", submission_key("r2", 3, "us-0", "u1"), "us-0")  # another run
    for key in (own, version, outer):
        assert allowed("synchronizer", "s3:DeleteObject", key, "sync") and allowed("synchronizer", "s3:GetObject", key, "sync")
    assert allowed("synchronizer", "s3:PutObject", version, "sync") and not allowed("synchronizer", "s3:PutObject", own, "sync")
    assert not allowed("synchronizer", "s3:DeleteObject", global_key("r2", 3, 7), "sync")
    assert allowed("evaluator", "s3:GetObject", version, "e") and not allowed("evaluator", "s3:GetObject", own, "e")
