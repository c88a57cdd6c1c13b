"""A run's summary and token accounting: one pure ``summarize`` of the ledger's aggregates, one ``tokens_per_step``."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from ddiloco.platform.config import DataConfig, ModelConfig, build_config, tokens_per_step
from ddiloco.platform.data import build_dataset
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.models import Learner
from ddiloco.platform.summary import DP_BYTES_PER_PARAM, TIME_BUCKETS, breakdown_line, learner_states, run_summary, summarize

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
GPT = {"kind": "gpt", "seq_len": 64}

LAUNCHED, JOINED, READY, SILENT, EXITED = (reports_q.LAUNCHED, reports_q.JOINED, reports_q.READY, reports_q.SILENT, reports_q.EXITED)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def aggregates(**changes) -> reports_q.RunAggregates:
    """Two learners, 100 s of a running run: 6,400 tokens trained, 4,096 merged."""
    base = reports_q.RunAggregates(
        run="r",
        status="running",
        created_at=T0,
        finished_at=None,
        config={"model": GPT, "learners": {"batch_size": 4}},
        tokens=reports_q.TokenAccounting(trained=6400, merged=4096, rejected=1024, pending=256, lost=512, in_flight=512),
        versions={0: 3, 1: 2},
        longest_merge_gap_s=40.0,  # merged at 20, 30 and 70 s
        last_merged_at=at(70),
        val_loss_start=5.5,
        val_loss_end=3.25,
        val_accuracy_end=None,
        submissions=9,
        bytes_sent=12_345,
        rejected_reasons={"stale": 3, "norm outlier": 1, "unknown": 1},
        parameters=1000,
        learners=2,
        busy_s=150.0,
    )
    return replace(base, **changes)


# --- summarize: a pure function of the aggregates ------------------------------------------------------


def test_summarize_reports_the_aggregates():
    s = summarize(aggregates(), at(100))
    assert (s.run, s.status, s.tokens) == ("r", "running", 6400)
    assert (s.tokens_merged, s.tokens_rejected, s.tokens_pending) == (4096, 1024, 256)
    assert (s.tokens_lost, s.tokens_in_flight, s.accounting_balanced) == (512, 512, True)
    assert (s.versions, s.val_loss_start, s.val_loss_end, s.val_accuracy_end) == ({0: 3, 1: 2}, 5.5, 3.25, None)
    assert (s.submissions, s.bytes_sent, s.learners, s.wall_s) == (9, 12_345, 2, 100.0)
    assert s.rejected_by_reason == {"stale": 3, "norm outlier": 1, "unknown": 1}
    assert not summarize(aggregates(tokens=replace(aggregates().tokens, lost=0)), at(100)).accounting_balanced


def test_goodput_is_the_merged_share_times_the_busy_share():
    # 4096 / 6400 merged, 150 busy of 2 x 100 allocated learner-seconds.
    assert summarize(aggregates(), at(100)).goodput == pytest.approx(0.64 * 0.75)
    # Busier than allocated (clock skew) caps at 1; nothing trained is no goodput.
    assert summarize(aggregates(busy_s=500.0), at(100)).goodput == pytest.approx(0.64)
    assert summarize(aggregates(tokens=reports_q.TokenAccounting(0, 0, 0, 0, 0, 0)), at(100)).goodput == 0.0


def test_without_timelines_every_second_not_busy_is_idle_and_busy_seconds_split_by_token_fate():
    s = summarize(aggregates(), at(100))
    # 150 busy of 200 learner-seconds; of 6400 tokens 4096 merged, 1024 rejected, 512 lost, 256 + 512 pending or unsent.
    assert s.learner_s == 200.0
    assert s.time_breakdown == pytest.approx(
        {"merged": 96.0, "down": 0.0, "start_up": 0.0, "restart": 0.0, "idle": 50.0, "rejected": 24.0, "lost": 12.0, "unmerged": 18.0}
    )
    assert list(s.time_breakdown) == list(TIME_BUCKETS)
    assert (s.availability_bound, s.goodput_of_bound) == (1.0, pytest.approx(s.goodput))
    # Busy seconds with nothing trained merged nothing.
    assert summarize(aggregates(tokens=reports_q.TokenAccounting(0, 0, 0, 0, 0, 0)), at(100)).time_breakdown["unmerged"] == 150.0


def moments(*pairs: tuple[float, str]) -> list[reports_q.Moment]:
    return [reports_q.Moment(at(t), kind) for t, kind in pairs]


def test_a_learners_seconds_follow_its_launches_first_steps_and_exits():
    # Launched at 0, joined at 4, first step at 5; killed at 40, relaunched at 60, registered at 63, stepping from 64.
    timeline = moments((0, LAUNCHED), (4, JOINED), (5, READY), (40, EXITED), (60, LAUNCHED), (63, JOINED), (64, READY))
    assert learner_states(timeline, at(0), at(100)) == {"start_up": 5.0, "up": 71.0, "down": 20.0, "restart": 4.0}
    # Only [start, end] counts: a run summarised at 50 s has seen 10 s of the outage.
    assert learner_states(timeline, at(0), at(50)) == {"start_up": 5.0, "up": 35.0, "down": 10.0, "restart": 0.0}
    # Its last heartbeat (38) ends it only when no exit was seen: the exit at 40 wins; without it, it went silent at 38.
    with_silence = sorted(timeline + moments((38, SILENT)), key=lambda m: m.at)
    assert learner_states(with_silence, at(0), at(100))["down"] == 20.0
    silent = moments((0, LAUNCHED), (4, JOINED), (5, READY), (38, SILENT), (60, LAUNCHED), (63, JOINED), (64, READY))
    assert learner_states(silent, at(0), at(100)) == {"start_up": 5.0, "up": 69.0, "down": 22.0, "restart": 4.0}
    # No launches recorded (a learner started by hand): down until its replacement registered, restart until it stepped.
    by_hand = moments((4, JOINED), (5, READY), (38, SILENT), (63, JOINED), (64, READY))
    assert learner_states(by_hand, at(0), at(100)) == {"start_up": 5.0, "up": 69.0, "down": 25.0, "restart": 1.0}
    # A hung learner relaunched without an exit of its own: restarting from the relaunch.
    hung = moments((0, LAUNCHED), (4, JOINED), (5, READY), (60, LAUNCHED), (63, JOINED), (64, READY))
    assert learner_states(hung, at(0), at(100)) == {"start_up": 5.0, "up": 91.0, "down": 0.0, "restart": 4.0}
    # A process that died before its first step and was relaunched is still starting up; one that never got there, all along.
    failed = moments((0, LAUNCHED), (3, EXITED), (4, LAUNCHED), (9, JOINED), (10, READY))
    assert learner_states(failed, at(0), at(100)) == {"start_up": 9.0, "up": 90.0, "down": 1.0, "restart": 0.0}
    assert learner_states(moments((0, LAUNCHED), (4, JOINED)), at(0), at(100))["start_up"] == 100.0


def test_the_breakdown_sums_to_the_learner_seconds_and_the_bound_leaves_out_the_down_time():
    timelines = {
        "a": moments((0, LAUNCHED), (4, JOINED), (5, READY), (40, EXITED), (60, LAUNCHED), (63, JOINED), (64, READY)),
        "b": moments((0, LAUNCHED), (2, JOINED), (3, READY)),
    }
    agg = aggregates(timelines=timelines, busy_s=155.0, tokens=reports_q.TokenAccounting(6400, 6400, 0, 0, 0, 0))
    s = summarize(agg, at(100))
    # Up 71 + 97 = 168 s, of which 155 stepping (all merged): 13 s idle.
    assert s.time_breakdown == pytest.approx(
        {"merged": 155.0, "down": 20.0, "start_up": 8.0, "restart": 4.0, "idle": 13.0, "rejected": 0.0, "lost": 0.0, "unmerged": 0.0}
    )
    assert sum(s.time_breakdown.values()) == pytest.approx(s.learner_s) == 200.0
    assert s.goodput == pytest.approx(155 / 200)
    assert s.availability_bound == pytest.approx(180 / 200)
    assert s.goodput_of_bound == pytest.approx(155 / 180)
    assert breakdown_line(s) == (
        "merged 155 s (77.5%), down 20 s (10.0%), start-up 8 s (4.0%), restart 4 s (2.0%), idle 13 s (6.5%) of 200 s"
    )


def test_the_longest_gap_counts_from_the_first_merge_to_now_or_the_end():
    assert summarize(aggregates(), at(100)).longest_version_gap_s == 40.0  # 30 -> 70
    assert summarize(aggregates(), at(200)).longest_version_gap_s == 130.0  # 70 -> now
    finished = aggregates(status="finished", finished_at=at(80))
    assert summarize(finished, at(10_000)) == summarize(finished, at(80))
    assert summarize(finished, at(10_000)).wall_s == 80.0
    assert summarize(aggregates(longest_merge_gap_s=0.0, last_merged_at=None), at(100)).longest_version_gap_s == 0.0


def test_the_data_parallel_baseline_sends_every_parameter_every_step():
    # 6400 tokens in steps of 4 x 64 tokens: 25 steps of 1000 float32 gradients.
    assert summarize(aggregates(), at(100)).bytes_data_parallel == 25 * 1000 * DP_BYTES_PER_PARAM
    # A vision step trains on 4 examples: 1600 steps.
    vision = aggregates(config={"model": {"kind": "vision"}, "learners": {"batch_size": 4}})
    assert summarize(vision, at(100)).bytes_data_parallel == 1600 * 1000 * DP_BYTES_PER_PARAM
    # A config that does not say counts one token per step.
    assert summarize(aggregates(config={}), at(100)).bytes_data_parallel == 6400 * 1000 * DP_BYTES_PER_PARAM


def test_token_accounting_of_learner_rows():
    def row(status: str, trained: int, lost: int, inc_trained: int, inc_submitted: int) -> SimpleNamespace:
        return SimpleNamespace(
            status=status,
            tokens_trained=trained,
            tokens_lost=lost,
            inc_tokens_trained=inc_trained,
            inc_tokens_submitted=inc_submitted,
        )

    rows = [row("alive", 100, 10, 50, 20), row("dead", 0, 0, 40, 10), row("straggling", 0, 0, 5, 9)]
    acct = reports_q.account_tokens(rows, {"merged": 60, "rejected": 20, "pending": 19})
    # Unsubmitted tokens of a live learner are in flight; a dead learner's are lost.
    assert acct == reports_q.TokenAccounting(trained=195, merged=60, rejected=20, pending=19, lost=10 + 30, in_flight=30 + 0)


# --- tokens per step: one rule, the one the batches follow --------------------------------------------


def test_tokens_per_step_counts_examples_for_vision_and_positions_for_language():
    assert tokens_per_step(ModelConfig(kind="gpt", seq_len=64), 8) == 512
    assert tokens_per_step(ModelConfig(kind="moe_gpt", seq_len=32), 8, world=4) == 1024
    assert tokens_per_step(ModelConfig(kind="vision"), 8) == 8
    assert tokens_per_step(ModelConfig(kind="vision"), 8, world=2) == 16


@pytest.mark.parametrize(
    "data, model",
    [
        (DataConfig(source="digits"), ModelConfig(kind="vision")),
        (DataConfig(source="stdlib", max_bytes=200_000), ModelConfig(kind="gpt", seq_len=32)),
    ],
)
def test_tokens_per_step_is_what_a_batch_holds(data, model):
    dataset = build_dataset(data, model)
    batch = next(dataset.train_batches(0, 2, batch_size=6, seed=0))
    assert batch.tokens == tokens_per_step(model, 6)


# --- through the ledger ----------------------------------------------------------------------------------


def test_a_vision_runs_data_parallel_baseline_counts_examples_not_seq_len(tmp_path):
    cfg = build_config({"name": "v", "model": {"kind": "vision"}, "data": {"source": "digits"}, "learners": {"batch_size": 8}})
    engine = open_ledger(f"sqlite:///{tmp_path}/ledger.db")
    with session_factory(engine).begin() as s:
        runs_q.create_run(
            s, "v", config_json=cfg.to_json(), code_version="t", git_commit=None, num_fragments=1, token_budget=10**6, now=T0
        )
        runs_q.set_fragment_specs(s, "v", [(0, ["w"], 1000, 4000)])
        learner_q.register_learner(s, "v", "us-0", "us", T0)
        # 10 steps of 8 images: 80 examples trained.
        learner_q.record_heartbeat(s, "v", "us-0", 0, now=at(1), step=10, tokens=80, loss=1.0, tokens_per_s=80, step_time_s=0.1)
    with session_factory(engine)() as s:
        summary = run_summary(s, "v", at(2))
    engine.dispose()
    # Data-parallel would have sent a float32 gradient of all 1000 parameters at each of the 10 steps.
    assert summary.tokens == 80
    assert summary.bytes_data_parallel == 10 * 1000 * 4


def test_a_ledgers_launches_registrations_heartbeats_and_exits_give_the_breakdown(ledger_url):
    engine = open_ledger(ledger_url)
    S = session_factory(engine)

    def beat(s, lid: str, incarnation: int, t: float, busy: float) -> None:
        learner_q.record_heartbeat(s, "r", lid, incarnation, now=at(t), step=int(t), tokens=0, loss=None, tokens_per_s=0.0, step_time_s=0.1,
                           busy_s=busy)

    with S.begin() as s:
        runs_q.create_run(s, "r", config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=10, now=T0)
        for lid in ("a", "b"):
            runs_q.record_event(s, "r", runs_q.LEARNER_LAUNCHED, lid, "launched", T0)
        # b joins at 2 and steps from 3 to the end, 95 s of it busy.
        learner_q.register_learner(s, "r", "b", "us", at(2))
        beat(s, "b", 0, 3, 0.0)
        beat(s, "b", 0, 99, 95.0)
        # a joins at 4, steps from 5, is last heard of at 38, exits at 40; relaunched at 60, it registers at 63 and steps from 64.
        learner_q.register_learner(s, "r", "a", "us", at(4))
        beat(s, "a", 0, 5, 0.0)
        beat(s, "a", 0, 38, 30.0)
        runs_q.record_event(s, "r", runs_q.LEARNER_EXITED, "a", "its process or flow run ended", at(40))
        runs_q.record_event(s, "r", runs_q.LEARNER_LAUNCHED, "a", "relaunched", at(60))
        learner_q.register_learner(s, "r", "a", "us", at(63))
        beat(s, "a", 1, 64, 0.0)
        beat(s, "a", 1, 99, 30.0)
        runs_q.record_event(s, "r", "learner_dead", "b", "not a timeline event", at(70))
        runs_q.set_run_status(s, "r", "finished", at(100))
    with S() as s:
        summary = run_summary(s, "r", at(1000))
        timeline = reports_q.run_aggregates(s, "r").timelines["a"]
    engine.dispose()
    assert [(m.kind, (m.at - T0).total_seconds()) for m in timeline] == [
        ("launched", 0.0), ("joined", 4.0), ("ready", 5.0), ("silent", 38.0), ("exited", 40.0), ("launched", 60.0), ("joined", 63.0),
        ("ready", 64.0),
    ]
    # Up 35 + 36 + 97 = 168 s, 155 of them busy; nothing was submitted, so the busy seconds' tokens are all unmerged.
    assert summary.time_breakdown == pytest.approx(
        {"merged": 0.0, "down": 20.0, "start_up": 8.0, "restart": 4.0, "idle": 13.0, "rejected": 0.0, "lost": 0.0, "unmerged": 155.0}
    )
    assert summary.availability_bound == pytest.approx(0.9)


def test_a_ledger_without_launch_events_counts_from_registrations_and_last_heartbeats(tmp_path):
    engine = open_ledger(f"sqlite:///{tmp_path}/ledger.db")
    with session_factory(engine).begin() as s:
        runs_q.create_run(s, "r", config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=10, now=T0)
        learner_q.register_learner(s, "r", "a", "us", at(4))
        for t, inc in ((5, 0), (38, 0), (64, 1), (80, 1)):
            if t == 64:
                learner_q.register_learner(s, "r", "a", "us", at(63))
            learner_q.record_heartbeat(s, "r", "a", inc, now=at(t), step=1, tokens=0, loss=None, tokens_per_s=0.0, step_time_s=0.1)
        # The learner is dead at the end: down from its last heartbeat (80).
        s.get(Learner, ("r", "a")).status = "dead"
        runs_q.set_run_status(s, "r", "finished", at(100))
    with session_factory(engine)() as s:
        summary = run_summary(s, "r", at(100))
    engine.dispose()
    spent = summary.time_breakdown
    assert (spent["start_up"], spent["down"], spent["restart"], spent["idle"]) == (5.0, 25.0 + 20.0, 1.0, 33.0 + 16.0)
