"""The ledger invariants (ddiloco/platform/invariants.py): the pure checks on literal rows, then
``check_run`` and ``ddiloco ledger check`` on a real ledger (SQLite and PostgreSQL) and a file store,
sound and then corrupted."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import torch
from sqlalchemy import delete, inspect, update
from support import tiny_config
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.platform.ids import global_key, outer_state_key, submission_key
from ddiloco.platform.invariants import (
    MovedOn,
    Problem,
    Snapshot,
    SubmissionRow,
    VersionRow,
    accounting_problems,
    blob_problems,
    check_run,
    check_snapshot,
    fate_problems,
    newest_versions,
    version_problems,
)
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import make_engine
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import FragmentVersion, Learner
from ddiloco.testing.processes import watcher_context, write_config

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def v(fragment: int, version: int, token: int = 1) -> VersionRow:
    return VersionRow(fragment, version, token, f"r/global/f{fragment}/v{version}.safetensors", "ab" * 32)


def sub(sid: int, status: str, merged: int | None = None, reason: str | None = None, fragment: int = 0, nbytes: int = 10) -> SubmissionRow:
    return SubmissionRow(sid, fragment, status, merged, reason, f"r/submissions/f{fragment}/us-0/{sid}.safetensors", nbytes)


def acct(
    trained: int, merged: int = 0, rejected: int = 0, pending: int = 0, lost: int = 0, in_flight: int = 0
) -> reports_q.TokenAccounting:
    return reports_q.TokenAccounting(trained, merged, rejected, pending, lost, in_flight)


# --- the pure checks -----------------------------------------------------------------------------------


def test_dense_versions_with_rising_tokens_pass():
    assert version_problems([v(0, 0), v(0, 1), v(0, 2, token=2), v(1, 0)]) == []


def test_a_gap_a_duplicate_and_a_token_going_back_are_each_named():
    gap = version_problems([v(0, 0), v(0, 2)])
    assert [p.what for p in gap] == ["fragment 0: versions not dense (missing [1], 0 duplicated)"]
    dup = version_problems([v(3, 0), v(3, 1), v(3, 1)])
    assert len(dup) == 1 and "fragment 3" in dup[0].what and "1 duplicated" in dup[0].what
    fenced = version_problems([v(0, 0, token=2), v(0, 1, token=1)])
    assert len(fenced) == 1 and "v1 has fencing token 1 < 2 of v0" in fenced[0].what


def test_every_submission_has_exactly_one_fate():
    newest = {0: 3}
    sound = [sub(1, "merged", merged=3), sub(2, "rejected", reason="stale: 5 behind"), sub(3, "pending")]
    assert fate_problems(sound, newest) == []
    bad = fate_problems(
        [
            sub(4, "merged", merged=4),  # a version that does not exist
            sub(5, "merged"),  # merged into nothing
            sub(6, "rejected"),  # no reason
            sub(7, "rejected", merged=2, reason="x"),  # two fates
            sub(8, "pending", reason="x"),
            sub(9, "lost"),
            sub(10, "merged", merged=0, fragment=7),  # fragment without versions
        ],
        newest,
    )
    assert [p.what.split(":")[0] for p in bad] == [f"submission {i}" for i in (4, 5, 6, 7, 8, 9, 10)]
    assert "rejected without a reason" in bad[2].what and "no fate (status 'lost')" in bad[5].what
    assert all(p.lost == 0 for p in bad)


def test_missing_or_wrong_blobs_count_as_lost():
    newest = newest_versions([v(0, 0), v(0, 1), v(1, 0)])
    assert {f: r.version for f, r in newest.items()} == {0: 1, 1: 0}
    pending = [sub(1, "pending", nbytes=10), sub(2, "pending", nbytes=10), sub(3, "pending", nbytes=10)]
    problems = blob_problems(newest, {0: True, 1: False}, pending, {1: 10, 2: None, 3: 7})
    assert [p.what.split(":")[0] for p in problems] == ["fragment 1", "pending submission 2", "pending submission 3"]
    assert "is missing" in problems[1].what and "has 7 bytes, not 10" in problems[2].what
    assert [p.lost for p in problems] == [1, 1, 1]
    assert blob_problems(newest, {0: True, 1: True}, pending, {1: 10, 2: 10, 3: 10}) == []
    # Decided or superseded since the snapshot excuses a blob that is gone, never one of the wrong size.
    since = MovedOn(decided=frozenset({2, 3}), superseded=frozenset({1}))
    assert [p.what.split(":")[0] for p in blob_problems(newest, {0: True, 1: False}, pending, {1: 10, 2: None, 3: 7}, since)] == [
        "pending submission 3"]


def test_token_accounting_must_balance_and_the_gap_is_lost():
    assert accounting_problems(acct(100, merged=40, rejected=10, pending=20, lost=5, in_flight=25)) == []
    (p,) = accounting_problems(acct(100, merged=40))
    assert p.lost == 60 and "trained 100 != merged 40" in str(p)


def test_check_snapshot_gathers_every_check():
    snap = Snapshot([v(0, 0), v(0, 2)], [sub(1, "rejected"), sub(2, "pending")], acct(10, pending=5))
    problems = check_snapshot(snap, intact={0: True}, listed_size={2: None})
    assert len(problems) == 4
    assert all(isinstance(p, Problem) for p in problems)
    assert sum(p.lost for p in problems) == 1 + 5


# --- on a real ledger and store ------------------------------------------------------------------------


class Run:
    """A small run written through the ledger's own queries: fragment 0 at v1 (one merged, one
    rejected submission), fragment 1 at v0, one submission pending; every token accounted for."""

    def __init__(self, ledger_url: str, tmp_path) -> None:
        self.cfg = tiny_config(name="inv", ledger={"url": ledger_url}, storage={"url": f"file://{tmp_path}/store"},
                               fragments={"count": 2})
        self.config_path = write_config(self.cfg, tmp_path / "config.yaml")
        # The test writes the run itself; a pause of its own mid-transaction must not end the session (it once did, 5 s).
        self.ctx = watcher_context(self.cfg, self.cfg.name)
        self.store = self.ctx.store()
        self.token = 0
        with self.ctx.transaction() as s:
            runs_q.create_run(s, "inv", config_json=self.cfg.to_json(), code_version="test", git_commit=None, num_fragments=2,
                         token_budget=10**9, now=NOW)
            learner_q.register_learner(s, "inv", "us-0", "us", NOW)
            self.token = sync_q.acquire_lease(s, "inv", "sync", 3600, NOW)
        self.publish(0, 0)
        self.publish(1, 0)
        self.subs = [self.submit(f"u{i}", tokens_total=100 * (i + 1)) for i in range(3)]
        self.publish(0, 1, merged=[sync_q.MergedIn(self.subs[0], 1.0, 1.0, 0)], rejected=[(self.subs[1], "norm outlier")])

    def blob(self, key: str, value: float) -> sync_q.BlobRef:
        info = self.store.put(key, {"w": torch.full((4,), value)})
        return sync_q.BlobRef(info.key, info.sha256, info.nbytes)

    def publish(self, fragment: int, version: int, **decided) -> None:
        blob = self.blob(global_key("inv", fragment, version), float(version))
        state = self.blob(outer_state_key("inv", fragment, version), 0.0)
        with self.ctx.transaction() as s:
            sync_q.publish_version(s, "inv", fragment, version, blob=blob, state=state, holder="sync", token=self.token, now=NOW, **decided)

    def submit(self, uid: str, tokens_total: int) -> int:
        blob = self.blob(submission_key("inv", 0, "us-0", uid), 1e-3)
        with self.ctx.transaction() as s:
            sid, _ = learner_q.register_submission(s, "inv", "us-0", 0, learner_q.SubmissionIn(
                uid, 0, 0, 2, 100, 100, tokens_total, blob.key, blob.sha256, blob.nbytes, "none"), NOW)
        return sid

    def check(self, *args: str):
        return CliRunner().invoke(app, ["ledger", "check", "-c", str(self.config_path), "--run", "inv", *args])


@pytest.fixture
def run(ledger_url, tmp_path):
    r = Run(ledger_url, tmp_path)
    yield r
    r.ctx.engine.dispose()


def test_a_sound_run_holds_every_invariant(run):
    assert check_run(run.ctx) == []
    result = run.check()
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok")


def test_a_corrupted_ledger_is_reported_and_the_command_exits_1(run):
    run.publish(0, 2)
    pending = run.subs[2]
    with run.ctx.transaction() as s:
        s.execute(delete(FragmentVersion).where(FragmentVersion.fragment == 0, FragmentVersion.version == 1))
        s.execute(update(Learner).values(tokens_trained=Learner.tokens_trained + 7))
        pending_key = sync_q.pending_submissions(s, "inv")[0].blob_key
        newest_f1 = runs_q.get_version(s, "inv", 1, 0)
    run.store.delete(pending_key)
    run.store.fs.pipe_file(run.store.path(newest_f1.blob_key), b"\0" * 32)

    problems = check_run(run.ctx)
    text = [p.what for p in problems]
    assert len(problems) == 4, text
    assert text[0] == "fragment 0: versions not dense (missing [1], 0 duplicated)"
    assert any(t.startswith(f"pending submission {pending}: its blob") and "is missing" in t for t in text)
    assert any(t.startswith("fragment 1: v0's blob") for t in text)
    assert any(t.startswith("token accounting does not balance: trained 307") for t in text)
    assert sum(p.lost for p in problems) == 1 + 1 + 7

    result = run.check()
    assert result.exit_code == 1
    assert result.output.splitlines() == text


def test_a_blob_collected_after_the_rows_were_read_is_not_lost(run):
    """The run goes on between the check's read and its look at the store: the pending submission is
    merged and its blob collected, fragment 1 moves on and its old head's blob goes. Nothing is lost."""
    pending, moved = run.subs[2], []

    def store_for(region):
        if not moved:
            moved.append(True)
            with run.ctx.transaction() as s:
                key = sync_q.pending_submissions(s, "inv")[0].blob_key
                old_head = runs_q.get_version(s, "inv", 1, 0).blob_key
            run.publish(0, 2, merged=[sync_q.MergedIn(pending, 1.0, 1.0, 1)])
            run.publish(1, 1)
            run.store.delete(key)
            run.store.delete(old_head)
        return run.ctx.store(region)

    assert check_run(run.ctx, store_for) == []
    assert moved
    # Read again, the same store now holds a run that is sound; a pending blob deleted is still lost.
    assert check_run(run.ctx) == []
    late = run.submit("u9", tokens_total=400)
    with run.ctx.transaction() as s:
        run.store.delete(next(p.blob_key for p in sync_q.pending_submissions(s, "inv") if p.id == late))
    assert [p.lost for p in check_run(run.ctx)] == [1]


def test_the_check_reads_the_store_it_is_given(run, tmp_path):
    result = run.check("--store", f"file://{tmp_path}/elsewhere")
    assert result.exit_code == 1
    assert "fragment 0: v1's blob" in result.output and f"pending submission {run.subs[2]}" in result.output


def test_an_unknown_run_is_an_error_not_a_clean_bill(run):
    result = CliRunner().invoke(app, ["ledger", "check", "-c", str(run.config_path), "--run", "nope"])
    assert result.exit_code == 2
    assert "'nope' is not in the ledger" in result.output


def test_the_check_never_creates_or_migrates_a_ledger(ledger_url, tmp_path):
    cfg = tiny_config(name="inv", ledger={"url": ledger_url}, storage={"url": f"file://{tmp_path}/store"})
    path = write_config(cfg, tmp_path / "config.yaml")
    result = CliRunner().invoke(app, ["ledger", "check", "-c", str(path)])
    assert result.exit_code == 2
    if ledger_url.startswith("sqlite"):
        assert "no ledger file" in result.output
        assert not (tmp_path / "ledger.db").exists()
    else:
        assert "holds no ledger" in result.output
        engine = make_engine(ledger_url)
        try:
            assert inspect(engine).get_table_names() == []
        finally:
            engine.dispose()


def test_running_totals_must_equal_the_full_scan(run):
    """The per-step reads trust the heads and learner totals: the check recomputes them from every row."""
    from ddiloco.platform.ledger.models import FragmentHead

    with run.ctx.transaction() as s:
        s.execute(update(FragmentHead).where(FragmentHead.fragment == 0).values(tokens_merged=FragmentHead.tokens_merged + 5))
        s.execute(update(FragmentHead).where(FragmentHead.fragment == 1).values(version=3))
        s.execute(update(Learner).values(submissions=Learner.submissions + 1))
    text = [p.what for p in check_run(run.ctx)]
    assert len(text) == 4, text
    assert text[0].startswith("token accounting does not balance: trained 300 != merged 105")  # totals feed the balance
    assert text[1].startswith("fragment 1: head v3") and "newest version is v0" in text[1]
    assert text[2] == "fragment 0: running totals say 105 tokens in 1 merged submissions, the submissions say 100 in 1"
    assert text[3].startswith("learner us-0: row counts 4 submissions") and "the submissions say 3" in text[3]
