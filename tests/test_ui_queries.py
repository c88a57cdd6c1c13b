"""The dashboard's reads and verdicts, without Streamlit: against a real in-process run's ledger on
SQLite and on PostgreSQL, and pure health decisions with time moved by editing timestamps."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, insert, select, text
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session
from ui_support import RunLedger, build_run_ledger, copy_ledger_to

from ddiloco.platform import liveness
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import (
    Evaluation,
    Event,
    FragmentVersion,
    Heartbeat,
    Learner,
    Merge,
    Submission,
)
from ddiloco.platform.summary import run_summary
from ddiloco.ui import health as h
from ddiloco.ui import queries as uq

pytestmark = pytest.mark.timeout(120)
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def run_ledger(tmp_path_factory) -> RunLedger:
    return build_run_ledger(tmp_path_factory.getbasetemp() / "ui-run")


@pytest.fixture(scope="module")
def ro(run_ledger):
    engine = uq.read_only_engine(run_ledger.url)
    yield engine
    engine.dispose()


def now_of(ledger: RunLedger, after_s: float = 1.0) -> datetime:
    return ledger.end + timedelta(seconds=after_s)


# --- against the real run ------------------------------------------------------------------------------


def test_learners_frame_matches_the_ledger(ro, run_ledger):
    now = now_of(run_ledger)
    with Session(ro) as s:
        df = uq.learners_frame(s, run_ledger.run_id, now).set_index("learner")
        learners = {x.id: x for x in s.scalars(select(Learner).where(Learner.run_id == run_ledger.run_id))}
        fates = {
            (lid, status): n
            for lid, status, n in s.execute(
                select(Submission.learner_id, Submission.status, func.count()).group_by(Submission.learner_id, Submission.status)
            )
        }
        last_sub = dict(
            s.execute(select(Submission.learner_id, func.max(Submission.created_at)).group_by(Submission.learner_id)).all()
        )
        merged_tokens = dict(
            s.execute(
                select(Submission.learner_id, func.sum(Submission.tokens_new)).where(Submission.status == "merged")
                .group_by(Submission.learner_id)
            ).all()
        )
        newest_history_at = dict(s.execute(select(Heartbeat.learner_id, func.max(Heartbeat.at)).group_by(Heartbeat.learner_id)).all())
    assert sorted(df.index) == sorted(learners) == ["eu-0", "eu-1", "us-0", "us-1"]
    for lid, lrow in learners.items():
        row = df.loc[lid]
        assert row["region"] == lrow.region
        assert row["step"] == lrow.step
        assert row["tokens_per_s"] == pytest.approx(lrow.tokens_per_s)
        assert row["merged"] == fates.get((lid, "merged"), 0)
        assert row["rejected"] == fates.get((lid, "rejected"), 0)
        assert row["pending"] == fates.get((lid, "pending"), 0)
        assert row["tokens_trained"] == lrow.tokens_trained + lrow.inc_tokens_trained
        assert row["last_submission_at"] == last_sub[lid]
        assert row["tokens_merged"] == merged_tokens.get(lid, 0)  # from running totals, equal to the scan
        # The newest loss reported: every exchange writes it to the row, a heartbeat row keeps it every heartbeat_s.
        assert row["loss"] == pytest.approx(lrow.loss) and lrow.last_heartbeat_at >= newest_history_at[lid]
        assert row["incarnation"] == lrow.incarnation
        # Its upload link as its newest exchange reported it (adaptive, on a simulated link that takes no time: unchanged).
        assert row["queue_depth"] == lrow.queue_depth and row["oldest_unsent_s"] == pytest.approx(lrow.oldest_unsent_s)
        assert row["cadence"] == "every 4 steps, none (adaptive)" and row["cadence_reason"].startswith("start: every H steps")
    # eu-1 was taken down for good; eu-0 runs at 0.4x the speed of the others.
    assert df.loc["eu-1", "status"] == liveness.DEAD and "no heartbeat for" in df.loc["eu-1", "reason"]
    assert df.loc["eu-0", "status"] == liveness.STRAGGLING and "the live median" in df.loc["eu-0", "reason"]
    assert set(df.loc[["us-0", "us-1"], "status"]) == {liveness.ALIVE}
    assert df.loc["us-1", "incarnation"] == 1  # restarted once
    regions = uq.regions_frame(df.reset_index()).set_index("region")
    assert (regions.loc["eu", "dead"], regions.loc["eu", "straggling"], regions.loc["us", "alive"]) == (1, 1, 2)
    assert regions["tokens_merged"].sum() == df["tokens_merged"].sum()
    assert regions["share_merged"].sum() == pytest.approx(1.0)
    assert regions["status"].isna().all()  # no verdicts given


def test_the_regions_table_shows_a_region_cut_off_and_why(ro, run_ledger):
    # A minute after the end every learner is silent: us-0 and us-1 fell silent together, eu-1 had died long before eu-0.
    now = now_of(run_ledger, 60)
    with Session(ro) as s:
        page = uq.run_page(s, run_ledger.run_id, now)
        heard = dict(s.execute(select(Learner.id, Learner.last_heartbeat_at).where(Learner.run_id == run_ledger.run_id)).all())
    regions = page.regions.set_index("region")
    assert regions.loc["us", "status"] == liveness.CUT_OFF and regions.loc["eu", "status"] == liveness.REGION_DOWN
    last = max(heard["us-0"], heard["us-1"])
    silent = liveness.format_duration((now - last).total_seconds())
    assert regions.loc["us", "reason"] == f"all 2 learners silent since {last:%H:%M:%S} ({silent}): cut off from the ledger?"
    assert "separate deaths" in regions.loc["eu", "reason"]
    assert page.snapshot.regions == {"eu": liveness.Verdict(regions.loc["eu", "status"], regions.loc["eu", "reason"]),
                                     "us": liveness.Verdict(liveness.CUT_OFF, regions.loc["us", "reason"])}
    # The run's badge says why its learners are dead.
    assert page.snapshot.health.level == h.DOWN
    assert page.snapshot.health.reasons[-2:] == ["all 4 learners are dead", f"region us {regions.loc['us', 'reason']}"]
    # A second earlier, us was up: one learner heard within dead_after_s is enough.
    with Session(ro) as s:
        earlier = uq.run_page(s, run_ledger.run_id, now_of(run_ledger, 1)).regions.set_index("region")
    assert earlier.loc["us", "status"] == liveness.REGION_UP and earlier.loc["us", "reason"] == "2 of 2 learners live"


def test_a_learners_link_report_is_read_field_by_field():
    good = json.dumps({"adaptive": True, "every": 16, "codec": "int4", "reason": "uploads  need\n1.3", "since": 1_700_000_000.5,
                       "up_bps": 250_000.0, "down_bps": None})
    view = uq.link_view(good)
    assert (view.cadence, view.reason, view.up_mbit_s) == ("every 16 steps, int4 (adaptive)", "uploads need 1.3", 2.0)
    assert view.since == datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=timezone.utc) and math.isnan(view.down_mbit_s)
    # Whatever a learner wrote that is not a report shows as blank, never as an error.
    hostile = [None, 7, "", "not json", "[1, 2]", "1e999", json.dumps({"every": True, "codec": 3, "since": -5, "up_bps": "fast"}),
               json.dumps({"every": 2**40, "codec": "int8", "reason": ["x"], "since": 1e300}), "{" * 100_000]
    for raw in hostile:
        view = uq.link_view(raw)
        assert view.cadence is None and view.reason is None and view.since is None and math.isnan(view.up_mbit_s), raw
    assert len(uq.link_view(json.dumps({"reason": "x" * 5000})).reason) == uq.REASON_CHARS


def test_overview_shows_the_run_summary(ro, run_ledger):
    now = now_of(run_ledger)
    with Session(ro) as s:
        overview = uq.runs_overview(s, now)
        expected = run_summary(s, run_ledger.run_id, now)
        snap = uq.health_snapshot(s, run_ledger.run_id, now)
    row = overview.set_index("run").loc[run_ledger.run_id]
    assert row["tokens"] == expected.tokens
    assert row["versions"] == sum(expected.versions.values())
    assert row["goodput"] == pytest.approx(expected.goodput)
    assert row["downtime_s"] == pytest.approx(expected.longest_version_gap_s)
    assert row["val_loss"] == pytest.approx(expected.val_loss_end)
    assert (row["learners_alive"], row["learners"]) == (3, 4)
    assert row["health"] == h.DEGRADED and row["reason"] == "1 of 4 learners dead; 1 straggling"
    assert snap.sync.status == "active" and snap.sync.holder == "sync-inprocess"


def test_progress_frames_match_the_ledger(ro, run_ledger):
    run = run_ledger.run_id
    with Session(ro) as s:
        versions = uq.versions_frame(s, run)
        merges = uq.merges_frame(s, run)
        staleness = uq.staleness_frame(s, run)
        evals = uq.evaluations_frame(s, run)
        events = uq.events_frame(s, run)
        holders = uq.synchronizer_holders(s, run)
        n_versions = s.scalar(select(func.count()).select_from(FragmentVersion))
        n_merges = s.scalar(select(func.count()).select_from(Merge))
        n_merged = s.scalar(select(func.count()).select_from(Submission).where(Submission.status == "merged"))
        n_evals = s.scalar(select(func.count()).select_from(Evaluation))
        kinds = set(s.scalars(select(Event.kind)))
        quorums = list(s.scalars(select(Merge.quorum).order_by(Merge.at, Merge.id)))
        thin = uq.versions_frame(s, run, max_points=5)
        newest = runs_q.latest_version_numbers(s, run)
    assert len(versions) == n_versions and len(merges) == n_merges and len(evals) == n_evals
    assert list(merges["quorum"]) == quorums
    assert merges["at"].is_monotonic_increasing
    assert staleness["submissions"].sum() == n_merged
    assert set(events["kind"]) == kinds
    assert events["at"].is_monotonic_decreasing
    assert {"learner_dead": "failure", "learner_restarted": "restart"}.items() <= dict(
        zip(events["kind"], events["category"])
    ).items()
    assert list(holders["holder"]) == ["sync-inprocess"] and holders["versions"].sum() == n_versions
    # Thinning keeps every fragment's newest version, so the timeline still ends where the run is.
    assert len(thin) < len(versions)
    assert thin.groupby("fragment")["version"].max().to_dict() == newest


def test_training_loss_is_sampled_from_heartbeats(ro, run_ledger):
    with Session(ro) as s:
        loss = uq.training_loss_frame(s, run_ledger.run_id)
        few = uq.training_loss_frame(s, run_ledger.run_id, per_learner=3)
        last = {
            lid: s.scalar(
                select(Heartbeat.loss)
                .where(Heartbeat.learner_id == lid, Heartbeat.loss.is_not(None))
                .order_by(Heartbeat.at.desc())
                .limit(1)
            )
            for lid in ("us-0", "us-1", "eu-0", "eu-1")
        }
        hb = s.execute(select(Heartbeat.learner_id, Heartbeat.at, Heartbeat.loss, Heartbeat.tokens_per_s)
                       .where(Heartbeat.loss.is_not(None))).all()
    real = {(who, at): (loss_, rate) for who, at, loss_, rate in hb}
    # Every point is a real heartbeat (its loss and its tokens/s), and each learner's line ends at its newest reported loss.
    assert all(real[(r.learner, r.at)] == pytest.approx((r.loss, r.tokens_per_s)) for r in loss.itertuples())
    assert (loss["tokens_per_s"] > 0).any() and loss["mfu"].isna().all()  # in-process learners count no FLOPs
    assert {who: g.sort_values("at")["loss"].iloc[-1] for who, g in loss.groupby("learner")} == pytest.approx(last)
    assert few.groupby("learner").size().max() <= 10  # the floor of the grid
    assert set(loss[loss["learner"] == "us-1"]["incarnation"]) == {0, 1}


def test_rejection_reasons_are_grouped(tmp_path, run_ledger):
    from ui_support import copy_ledger

    ledger = copy_ledger(run_ledger, tmp_path)
    engine = open_ledger(ledger.url)
    with session_factory(engine).begin() as s:
        for uid in ("a", "b"):
            sub = learner_q.SubmissionIn(uid, 0, 0, 1, 128, 128, 128, f"k/{uid}", "0" * 64, 10, "none")
            learner_q.register_submission(s, ledger.run_id, "ghost", 0, sub, ledger.end)
    engine.dispose()
    ro = uq.read_only_engine(ledger.url)
    with Session(ro) as s:
        summary = run_summary(s, ledger.run_id, ledger.end)
        rejected = uq.rejections_frame(s, ledger.run_id)
    ro.dispose()
    # Grouped by class: the learner's name is not part of it (a thousand ghosts are one row).
    assert uq.rejection_reasons(summary).to_dict("records") == [{"reason": "unknown learner", "submissions": 2}]
    assert set(rejected["learner"]) == {"ghost"} and len(rejected) == 2


def test_a_finished_run_is_judged_as_of_its_end(tmp_path, run_ledger):
    from ui_support import copy_ledger

    ledger = copy_ledger(run_ledger, tmp_path)
    engine = open_ledger(ledger.url)
    with session_factory(engine).begin() as s:
        runs_q.set_run_status(s, ledger.run_id, "finished", ledger.end)
    engine.dispose()
    ro = uq.read_only_engine(ledger.url)
    later = ledger.end + timedelta(days=3)
    with Session(ro) as s:
        snap = uq.health_snapshot(s, ledger.run_id, later)
        # The summary's clock stops at the end too.
        assert run_summary(s, ledger.run_id, later) == run_summary(s, ledger.run_id, ledger.end)
    ro.dispose()
    # A post-mortem: three days later the learners are shown as they were when the run ended.
    assert snap.as_of == ledger.end and snap.health.level == h.FINISHED
    assert {k: v.status for k, v in snap.verdicts.items()} == {
        "us-0": liveness.ALIVE,
        "us-1": liveness.ALIVE,
        "eu-0": liveness.STRAGGLING,
        "eu-1": liveness.DEAD,
    }


def test_a_failed_run_says_why_on_its_badge(tmp_path, run_ledger):
    from ui_support import copy_ledger

    ledger = copy_ledger(run_ledger, tmp_path)
    engine = open_ledger(ledger.url)
    with session_factory(engine).begin() as s:
        runs_q.set_run_status(s, ledger.run_id, runs_q.FAILED, ledger.end,
                              detail="the training flow failed: OSError: cannot start sync-a")
    engine.dispose()
    ro = uq.read_only_engine(ledger.url)
    with Session(ro) as s:
        snap = uq.health_snapshot(s, ledger.run_id, ledger.end + timedelta(hours=1))
    ro.dispose()
    assert snap.health.level == h.FAILED
    assert snap.health.headline == "failed: the run failed: the training flow failed: OSError: cannot start sync-a"


# --- the engine never writes ----------------------------------------------------------------------------


def test_read_only_engine_refuses_writes_on_sqlite(ro, run_ledger):
    with pytest.raises(OperationalError, match="readonly|read-only|query_only"):
        with ro.begin() as conn:
            conn.execute(insert(Event).values(run_id=run_ledger.run_id, at=T0, kind="x", actor=None, detail=""))


def test_missing_file_and_missing_schema_are_reported_not_created(tmp_path):
    missing = tmp_path / "nope" / "ledger.db"
    with pytest.raises(uq.LedgerUnavailable, match="no ledger file"):
        uq.read_only_engine(f"sqlite:///{missing}")
    assert not missing.exists() and not missing.parent.exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    engine = uq.read_only_engine(f"sqlite:///{empty}")
    with pytest.raises(uq.LedgerUnavailable, match="ledger upgrade"):
        uq.check_schema(engine)
    engine.dispose()
    with pytest.raises(uq.LedgerUnavailable, match="unsupported"):
        uq.read_only_engine("mysql://root@localhost/x")


def test_empty_ledger_and_run_without_heartbeats(tmp_path):
    url = f"sqlite:///{tmp_path}/ledger.db"
    engine = open_ledger(url)
    ro = uq.read_only_engine(url)
    with Session(ro) as s:
        assert uq.runs_overview(s, T0).empty
        assert uq.run_page(s, "nothing", T0) is None
    with session_factory(engine).begin() as s:
        runs_q.create_run(s, "fresh", config_json="{}", code_version="t", git_commit=None, num_fragments=2, token_budget=100, now=T0)
    with Session(ro) as s:
        page = uq.run_page(s, "fresh", T0 + timedelta(seconds=5))
        assert (page.summary.tokens, page.summary.versions, page.summary.submissions) == (0, {}, 0)
    assert page.learners.empty and page.training_loss.empty and page.versions.empty and page.merges.empty
    assert page.snapshot.health.level == h.STARTING
    assert page.snapshot.sync.status == "never" and "no synchronizer has ever held" in page.snapshot.sync.message
    ro.dispose()
    engine.dispose()


# --- PostgreSQL: the same answers -----------------------------------------------------------------------


@pytest.mark.postgres
def test_queries_give_the_same_answers_on_postgresql(run_ledger, fresh_postgres_database):
    copy_ledger_to(run_ledger.url, fresh_postgres_database)
    now = now_of(run_ledger)
    answers = {}
    for name, url in (("sqlite", run_ledger.url), ("postgres", fresh_postgres_database)):
        engine = uq.read_only_engine(url)
        uq.check_schema(engine)
        with Session(engine) as s:
            page = uq.run_page(s, run_ledger.run_id, now)
            overview = uq.runs_overview(s, now)
            # The sampled reads too (each backend has its own grid statement), not only what fits the page whole.
            thin = (uq.versions_frame(s, run_ledger.run_id, max_points=5), uq.evaluations_frame(s, run_ledger.run_id, points=3),
                    uq.training_loss_frame(s, run_ledger.run_id, per_learner=3))
        answers[name] = (page, overview, thin)
        if name == "postgres":
            with pytest.raises(SQLAlchemyError, match="read-only"):
                with engine.begin() as conn:
                    conn.execute(text("INSERT INTO events (run_id, at, kind, detail) VALUES ('x', now(), 'x', '')"))
        engine.dispose()
    (a, ov_a, thin_a), (b, ov_b, thin_b) = answers["sqlite"], answers["postgres"]
    assert a.summary == b.summary
    assert a.snapshot.health == b.snapshot.health and a.snapshot.verdicts == b.snapshot.verdicts
    for field in (
        "learners",
        "regions",
        "holders",
        "versions",
        "merges",
        "staleness",
        "evaluations",
        "training_loss",
        "events",
        "rejections",
        "rejection_reasons",
    ):
        fa, fb = getattr(a, field), getattr(b, field)
        assert fa.shape == fb.shape, field
        assert fa.astype(str).equals(fb.astype(str)), field
    assert ov_a.drop(columns=["age_s"]).astype(str).equals(ov_b.drop(columns=["age_s"]).astype(str))
    for fa, fb in zip(thin_a, thin_b, strict=True):
        assert len(fa) > 1 and fa.astype(str).equals(fb.astype(str))
    assert len(thin_a[1]) < len(a.evaluations)  # sampled


# --- pure health decisions -------------------------------------------------------------------------------

POLICY = h.HealthPolicy(dead_after_s=10, straggler_factor=2.0, stall_after_s=30)


def test_synchronizer_and_run_health():
    lease = h.LeaseSnapshot("sync-a", 3, T0 - timedelta(minutes=5), T0 + timedelta(seconds=2))
    active = h.synchronizer_verdict([lease], T0 - timedelta(seconds=1), T0)
    assert active.status == "active" and active.holder == "sync-a" and "token 3" in active.message
    died = h.synchronizer_verdict([lease], T0 - timedelta(seconds=1), T0 + timedelta(seconds=12))
    assert died.status == "none" and "expired 10s ago" in died.message and "no standby" in died.message
    alive = {"a": liveness.Verdict(liveness.ALIVE, ""), "b": liveness.Verdict(liveness.ALIVE, "")}
    assert h.run_health("running", alive, active, POLICY).level == h.HEALTHY
    assert h.run_health("running", alive, died, POLICY).level == h.DOWN
    one_dead = {**alive, "c": liveness.Verdict(liveness.DEAD, "")}
    degraded = h.run_health("running", one_dead, active, POLICY)
    assert degraded.level == h.DEGRADED and degraded.reasons == ["1 of 3 learners dead"]
    # Two learners of a region dead together: the cut is named before the dead learners it explains.
    two_dead = {**one_dead, "d": liveness.Verdict(liveness.DEAD, "")}
    regions = {"eu": liveness.Verdict(liveness.CUT_OFF, "all 2 learners silent since 11:59:19 (41s): cut off from the ledger?"),
               "us": liveness.Verdict(liveness.REGION_UP, "2 of 2 learners live")}
    assert h.run_health("running", two_dead, active, POLICY, regions).reasons == [
        "region eu all 2 learners silent since 11:59:19 (41s): cut off from the ledger?", "2 of 4 learners dead"]
    all_dead = {"c": liveness.Verdict(liveness.DEAD, "")}
    assert "all 1 learners are dead" in h.run_health("running", all_dead, active, POLICY).reasons
    stalled = h.synchronizer_verdict([lease], T0 - timedelta(seconds=31), T0)
    assert h.run_health("running", alive, stalled, POLICY).level == h.DOWN
    assert h.run_health("running", {}, active, POLICY).level == h.STARTING
    never = h.synchronizer_verdict([], None, T0)
    assert h.run_health("running", {}, never, POLICY).level == h.STARTING
    assert h.run_health("running", alive, never, POLICY).level == h.DOWN
    assert h.run_health("finished", one_dead, died, POLICY).level == h.FINISHED
    assert h.run_health("failed", alive, active, POLICY).level == h.FAILED
    # An ended run's lease, live or not at its end, is named as its last holder's: nothing is due any more.
    ended = h.synchronizer_verdict([lease], T0 - timedelta(seconds=1), T0, run_running=False)
    assert (ended.status, ended.message) == ("ended", "the run has ended; sync-a held the lease last (token 3)")
    assert h.run_health("stopped", alive, ended, POLICY).reasons == ["the run was stopped"]


def test_a_sharded_run_is_healthy_only_while_every_shard_has_a_live_lease():
    live = h.LeaseSnapshot("sync-a", 3, T0 - timedelta(minutes=5), T0 + timedelta(seconds=2), shard=0)
    lapsed = h.LeaseSnapshot("sync-b", 1, T0 - timedelta(minutes=5), T0 - timedelta(seconds=10), shard=1)
    renewed = h.LeaseSnapshot("sync-b", 1, lapsed.acquired_at, T0 + timedelta(seconds=1), shard=1)
    both = h.synchronizer_verdict([live, renewed], T0, T0, shards=2)
    assert both.status == "active" and both.holder == "sync-a, sync-b"
    assert both.message.startswith("shard 0: sync-a holds the lease (token 3") and "shard 1: sync-b" in both.message
    one = h.synchronizer_verdict([live, lapsed], T0, T0, shards=2)
    assert one.status == "none" and one.message == (
        "no active synchronizer: shard 1: the lease of sync-b (token 1) expired 10s ago and no standby has taken over")
    assert h.run_health("running", {"a": liveness.Verdict(liveness.ALIVE, "")}, one, POLICY).level == h.DOWN
    never = h.synchronizer_verdict([live], T0, T0, shards=2)  # shard 1 never held yet
    assert never.status == "none" and "shard 1: no synchronizer has ever held its lease" in never.message


def test_policy_comes_from_the_run_config_and_formatting():
    policy = h.HealthPolicy.from_config({"learners": {"dead_after_s": 40, "straggler_factor": 3}})
    assert (policy.dead_after_s, policy.straggler_factor, policy.stall_after_s) == (40, 3, 80)
    assert h.HealthPolicy.from_config({}) == h.HealthPolicy()
    assert [liveness.format_duration(x) for x in (4.24, 42, 185, 7300, 200_000)] == ["4.2s", "42s", "3m 05s", "2h 01m", "2d 7h"]
    assert (h.format_count(1234), h.format_count(12_345_678), h.format_bytes(928_600)) == ("1,234", "12.3M", "929 kB")
    assert (
        h.event_category("chaos") == "chaos"
        and h.event_category("run_failed") == "failure"
        and h.event_category("learner_exited") == "failure"
        and h.event_category("zzz") == "other"
    )


@pytest.mark.postgres
def test_the_staleness_read_is_planned_the_same_whatever_the_history_on_postgresql(fresh_postgres_database):
    """The staleness chart reads each fragment's newest versions. Bounded only by the head (a correlated value),
    PostgreSQL guessed a third of the fragment's history per seek: the estimate grew with the run, and past ~4M
    submissions it crossed the JIT threshold and compiled the statement at every refresh (#15)."""
    from sqlalchemy import event

    engine = open_ledger(fresh_postgres_database)
    with session_factory(engine).begin() as s:
        runs_q.create_run(s, "long", config_json="{}", code_version="t", git_commit=None, num_fragments=4, token_budget=10**12, now=T0)
    costs = {}
    for versions in (2_000, 20_000):
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM submissions"))
            conn.execute(text("DELETE FROM fragment_heads"))
            conn.execute(text(
                "INSERT INTO submissions (run_id, learner_id, uid, fragment, base_version, c_steps, c_tokens, tokens_new, blob_key, "
                "sha256, nbytes, codec, created_at, status, merged_version, decided_at, staleness, blob_deleted) "
                "SELECT 'long', 'l' || k, 'u' || f || '-' || v || '-' || k, f, v - 1, 1, 1, 1, 'k', 'c', 1, 'int8', :t0, 'merged', v, "
                ":t0, v % 3, true FROM generate_series(0, 3) AS f, generate_series(1, :n) AS v, generate_series(0, 1) AS k"),
                {"t0": T0, "n": versions})
            conn.execute(text(
                "INSERT INTO fragment_heads (run_id, fragment, version, created_at, blob_key, sha256, nbytes, state_key, state_sha256, "
                "lease_token, synchronizer, published_s, tokens_merged, submissions_merged, longest_gap_s) "
                "SELECT 'long', f, :n, :t0, 'g', 'a', 1, 'o', 'b', 1, 's', 0, 0, 0, 0 FROM generate_series(0, 3) AS f"),
                {"t0": T0, "n": versions})
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE submissions"))
        captured = []

        def capture(conn, cursor, statement, parameters, context, executemany, captured=captured):
            if "staleness" in statement:
                captured.append((statement, parameters))

        ro = uq.read_only_engine(fresh_postgres_database)
        event.listen(ro, "before_cursor_execute", capture)
        try:
            with Session(ro) as s:
                frame = uq.staleness_frame(s, "long", versions=100)
            raw = ro.raw_connection()
            try:
                cur = raw.cursor()
                cur.execute("EXPLAIN (FORMAT JSON) " + captured[-1][0], captured[-1][1])
                costs[versions] = cur.fetchone()[0][0]["Plan"]["Total Cost"]
            finally:
                raw.close()
        finally:
            ro.dispose()
        assert frame["submissions"].sum() == 4 * 100 * 2  # 4 fragments x their newest 100 versions x 2 merged each
    engine.dispose()
    assert costs[20_000] <= 1.5 * costs[2_000], costs
