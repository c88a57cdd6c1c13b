"""An adaptive learner's send period and codec (learner_worker/cadence.py) with literal figures; its link's
meter; and the choice applied by real learners on a simulated clock with a modelled upload link."""

from __future__ import annotations

import json
import math
import random

import pytest
from sqlalchemy import select
from support import tiny_config

from ddiloco.learner_worker.cadence import (
    WEIGH_EVERY_S,
    Cadence,
    CadencePolicy,
    LinkRates,
    QueueState,
    choose_cadence,
    measure_window_s,
    upload_share,
)
from ddiloco.learner_worker.link import CADENCE_EVENT
from ddiloco.learner_worker.meter import LinkMeter
from ddiloco.platform.config import ConfigError, build_config, codec_ladder, tokens_per_step

pytestmark = pytest.mark.timeout(300)

# H = P = 8 (one fragment sent per step), 65 kB per fragment in int8 and 33 kB in int4, 0.25 s steps:
# sending every fragment every H steps in int8 takes 8 x 65,000 / (8 x 0.25) = 260,000 bytes/s.
POLICY = CadencePolicy(period=8, fragments=8, codecs=("int8", "int4"), fragment_bytes=(65_000.0, 33_000.0), max_periods=4)
STEP_S = 0.25
T0 = 1000.0
START = Cadence(8, "int8", "start", T0)
LATER = T0 + 60.0
"""Long after any hold."""
EMPTY = QueueState(0, 0.0)


def rates(up: float | None, down_busy: float = 0.0, down: float | None = 1e7) -> LinkRates:
    return LinkRates(up_bps=up, down_bps=down, up_busy=0.5, down_busy=down_busy, window_s=10.0)


def test_the_ladder_prefers_short_periods_and_at_each_the_run_codec():
    assert POLICY.ladder() == [(8, "int8"), (8, "int4"), (16, "int8"), (16, "int4"), (24, "int8"), (24, "int4"),
                               (32, "int8"), (32, "int4")]
    assert codec_ladder("int8", "int4") == ("int8", "int4")
    assert codec_ladder("none", "int8") == ("none", "bf16", "int8")
    assert codec_ladder("int8", "bf16") == ("int8",)  # never more precise than the run's codec
    assert upload_share(POLICY, 8, "int8", STEP_S, 260_000.0) == pytest.approx(1.0)
    assert upload_share(POLICY, 16, "int4", STEP_S, math.inf) == 0.0


def test_a_fast_link_keeps_every_h_steps_and_the_run_codec():
    got = choose_cadence(LATER, rates(10_000_000.0), EMPTY, STEP_S, START, POLICY)
    assert got is START


def test_nothing_changes_before_the_choice_was_held_for_its_window_or_anything_was_measured():
    assert measure_window_s(8, STEP_S) == 5.0  # a period is 2 s: the floor
    assert measure_window_s(32, 1.0) == 32.0
    saturated = rates(50_000.0)
    assert choose_cadence(T0 + 4.9, saturated, EMPTY, STEP_S, START, POLICY) is START
    assert choose_cadence(LATER, rates(None), EMPTY, STEP_S, START, POLICY) is START
    assert choose_cadence(LATER, saturated, EMPTY, 0.0, START, POLICY) is START  # no step time yet


def test_a_learner_weighs_its_cadence_at_most_every_weigh_every_s():
    """A learner stepping in milliseconds does not measure its link and weigh the ladder at each step; once the interval
    is over it does, and a queue that fell behind changes the cadence."""
    from support import sim_run

    from ddiloco.inprocess import sim_learner
    from ddiloco.learner_worker.outbox import Outgoing

    _cfg, clock, ctx, _sync = sim_run()
    learner = sim_learner(ctx, "us-0")
    learner.start(clock.t)
    link = learner.link
    assert link.cadence_policy is not None
    measured: list[float] = []
    rates = link.meter.rates
    link.meter.rates = lambda now, window_s: measured.append(now) or rates(now, window_s)
    t, step_s = clock.t + 100.0, 0.005  # long after the start: the first cadence's hold is over
    first = link.choose(t, step_s)
    link.outbox.submit(Outgoing(0, 0, [], 1, 8, 8, 8, 1, created_at=t - 50.0))  # behind by far more than a period
    assert link.choose(t + WEIGH_EVERY_S / 2, step_s) is first
    assert measured == [t]
    changed = link.choose(t + 2 * WEIGH_EVERY_S, step_s)
    assert measured == [t, t + 2 * WEIGH_EVERY_S]
    assert changed is not first and changed.reason.startswith("uploads behind") and link.cadence is changed
    ctx.engine.dispose()


def test_a_saturated_upload_takes_the_cheaper_codec_first_then_longer_periods():
    # int8 every 8 steps needs 1.3 of 200 kB/s; int4 every 8 needs 0.66 (under the 0.7 target).
    got = choose_cadence(LATER, rates(200_000.0), EMPTY, STEP_S, START, POLICY)
    assert (got.every, got.codec, got.since) == (8, "int4", LATER)
    assert got.reason == (
        "every 8 steps with int8: uploads 1.30, downloads 0.00 of the link, over 0.7 (65.0 kB per fragment, uploads at "
        "1.6 Mbit/s, downloads at 80 Mbit/s, 0.25 s steps); every 8 steps with int4: uploads 0.66, downloads 0.00 of the link"
    )
    # At 100 kB/s int4 every 8 needs 1.32 and int8 every 16 1.3: every 16 steps with int4 (0.66).
    got = choose_cadence(LATER, rates(100_000.0), EMPTY, STEP_S, START, POLICY)
    assert (got.every, got.codec) == (16, "int4")


def test_a_link_too_thin_for_any_choice_takes_the_cheapest_and_says_so():
    got = choose_cadence(LATER, rates(10_000.0), EMPTY, STEP_S, START, POLICY)
    assert (got.every, got.codec) == (32, "int4")
    assert got.reason.startswith("link saturated (65.0 kB per fragment, uploads at 0.08 Mbit/s")
    assert got.reason.endswith("even every 32 steps with int4: uploads 3.30, downloads 0.00 of the link")
    cheapest = Cadence(32, "int4", got.reason, LATER)
    assert choose_cadence(LATER + 100, rates(10_000.0), EMPTY, STEP_S, cheapest, POLICY) is cheapest


def test_saturated_downloads_lengthen_the_period_and_keep_the_codec():
    # Downloads took 0.9 of the link at every 8 steps; at every 16 the versions (and downloads) halve: 0.45.
    got = choose_cadence(LATER, rates(10_000_000.0, down_busy=0.9), EMPTY, STEP_S, START, POLICY)
    assert (got.every, got.codec) == (16, "int8")
    assert "downloads 0.90 of the link, over 0.7" in got.reason and "every 16 steps with int8: uploads 0.01, downloads 0.45" in got.reason


def test_saturated_downloads_count_double_what_was_measured():
    # Busy all the time at every 8 steps: the demand is at least 2.0, so every 24 steps (0.67) is the first under 0.7.
    got = choose_cadence(LATER, rates(10_000_000.0, down_busy=1.0), EMPTY, STEP_S, START, POLICY)
    assert (got.every, got.codec) == (24, "int8")
    assert "downloads 2.00 of the link, over 0.7" in got.reason
    assert got.reason.endswith("every 24 steps with int8: uploads 0.01, downloads 0.67 of the link")


def test_a_queue_behind_by_more_than_a_period_halves_the_bytes_per_step_whatever_the_figures():
    behind = QueueState(depth=6, oldest_unsent_s=2.5)  # a period is 8 x 0.25 = 2 s
    got = choose_cadence(LATER, rates(None), behind, STEP_S, START, POLICY)
    assert (got.every, got.codec) == (16, "int8")  # int4's 33 kB (scales included) is a little over half of 65 kB
    assert got.reason == ("uploads behind: the oldest unsent increment waited 2.5 s, more than a send period (2.0 s), "
                          "6 fragments queued: half the bytes per step")
    at_int4 = Cadence(8, "int4", "x", T0)
    got = choose_cadence(LATER, rates(None), behind, STEP_S, at_int4, POLICY)
    assert (got.every, got.codec) == (16, "int4")  # exactly half the bytes per step
    assert choose_cadence(LATER, rates(10_000_000.0), QueueState(2, 1.9), STEP_S, START, POLICY) is START


def test_a_dearer_choice_comes_back_only_when_the_link_has_plenty_of_room():
    slow = Cadence(16, "int4", "x", T0)
    # int4 every 8 steps would need 0.53 of 250 kB/s: under the target but over relax (0.35): stay.
    assert choose_cadence(LATER, rates(250_000.0), EMPTY, STEP_S, slow, POLICY) is slow
    # At 1 MB/s int8 every 8 needs 0.26: back to the start, saying why.
    got = choose_cadence(LATER, rates(1_000_000.0), EMPTY, STEP_S, slow, POLICY)
    assert (got.every, got.codec) == (8, "int8")
    assert got.reason.startswith("link has room") and got.reason.endswith("every 8 steps with int8: uploads 0.26, downloads 0.00 "
                                                                          "of the link, under 0.35")


def test_a_policy_is_checked():
    with pytest.raises(ValueError):
        CadencePolicy(period=8, fragments=8, codecs=("int8",), fragment_bytes=(1.0, 2.0))
    with pytest.raises(ValueError):
        CadencePolicy(period=8, fragments=8, codecs=("int8",), fragment_bytes=(1.0,), relax=0.8, target=0.7)


# --- the link's meter --------------------------------------------------------------------------------


def test_the_meter_measures_rates_while_transferring_and_the_busy_share_of_its_window():
    m = LinkMeter(start=0.0)
    for end in (10.0, 20.0):
        m.end(m.begin("up", end - 2.0), 200_000, 2.0, end)
    m.end(m.begin("down", 29.0), 50_000, 0.5, 29.5)
    r = m.rates(30.0, 20.0)
    assert (r.up_bps, r.down_bps, r.window_s) == (100_000.0, 100_000.0, 20.0)
    # The window is (10, 30]: the first upload ended as it opened (no busy time in it), the second lies inside.
    assert (r.up_busy, r.down_busy) == (pytest.approx(2.0 / 20), pytest.approx(0.5 / 20))
    # Under way for 5 s at 35 s: busy, though nothing finished in the window; the rate falls back to the last transfers.
    token = m.begin("up", 30.0)
    r = m.rates(35.0, 10.0)
    assert r.up_busy == pytest.approx(0.5) and r.up_bps == 100_000.0
    m.end(token, 0, 9.0, 39.0)  # it failed: nothing counts, nothing stays under way
    assert m.rates(40.0, 10.0).up_busy == 0.0
    # A transfer that took no time on the clock (a simulation without a link model) is infinitely fast.
    m.end(m.begin("up", 40.0), 1000, 0.0, 40.0)
    assert m.rates(40.0, 1.0).up_bps == math.inf
    # Before anything: None.
    assert LinkMeter(start=0.0).rates(1.0, 10.0).up_bps is None


def _rates_by_hand(transfers: list[tuple[float, float, int]], keep: int, now: float, window_s: float) -> tuple:
    """What a meter of the newest ``keep`` completed transfers (end, seconds, bytes) says of one direction, summed
    transfer by transfer: bytes/s while transferring, and the share of the window spent transferring."""
    kept = sorted(transfers)[-keep:]
    window_s = min(window_s, now)  # a meter started at 0 has no longer window
    opens = now - window_s
    recent = [t for t in kept if t[0] >= opens] or kept[-4:]
    busy = sum(min(sec, end - opens) for end, sec, _ in kept if end >= opens)
    seconds, nbytes = sum(t[1] for t in recent), sum(t[2] for t in recent)
    return (None if not recent else nbytes / seconds if seconds else math.inf), min(1.0, busy / window_s)


def test_the_meters_running_totals_give_what_summing_every_transfer_gives():
    rng = random.Random(7)
    for trial in range(200):
        keep = rng.choice([4, 16, 256])
        m, fed, t = LinkMeter(start=0.0, keep=keep), [], 0.0
        for _ in range(rng.randint(1, 400)):
            sec = rng.choice([0.0, rng.random() * 0.01, rng.random() * 3])
            t += sec + rng.random() * 0.05
            # Now and then a clock steps back a little: the meter keeps its transfers in the order they ended.
            end = t - rng.random() * 0.02 if rng.random() < 0.05 else t
            nbytes = rng.randint(1, 10**6)
            m.end(m.begin("up", end - sec), nbytes, sec, end)
            fed.append((end, sec, nbytes))
        now, window = t + rng.random(), rng.choice([0.5, 5.0, 20.0])
        want_bps, want_busy = _rates_by_hand(fed, keep, now, window)
        got = m.rates(now, window)
        assert got.up_bps == pytest.approx(want_bps, rel=1e-6), trial
        assert got.up_busy == pytest.approx(want_busy, rel=1e-6, abs=1e-9), trial


# --- configuration -----------------------------------------------------------------------------------


def test_adaptive_bounds_are_checked_against_the_merge_and_the_codec():
    with pytest.raises(ConfigError, match="adaptive_max_periods"):
        tiny_config(fragments={"count": 4, "adaptive": True, "adaptive_max_periods": 9}, merge={"max_periods": 8})
    with pytest.raises(ConfigError, match="adaptive_min_codec"):
        tiny_config(fragments={"count": 4, "adaptive": True, "adaptive_min_codec": "int8"}, compression={"codec": "int4"})
    # Off, they are not judged; on, a period cap at merge.max_periods is fine.
    tiny_config(fragments={"count": 4, "adaptive": False, "adaptive_max_periods": 9}, merge={"max_periods": 8})
    assert build_config({"fragments": {"adaptive": True, "adaptive_max_periods": 8}}).fragments.adaptive


# --- real learners on a simulated clock with a modelled upload link ----------------------------------------


def thin_run(adaptive: bool, bandwidth: float, steps: int = 48):  # noqa: ANN201 - InProcessRun
    """Two learners of the tiny model (int8 fragments of ~8 kB, H = P = 4, 1 s steps), both uploading at
    ``bandwidth``; the global model evaluated at the end."""
    from ddiloco.inprocess import run_inprocess

    cfg = tiny_config(fragments={"count": 4, "adaptive": adaptive}, compression={"codec": "int8"})
    total = 2 * steps * tokens_per_step(cfg.model, cfg.learners.batch_size)
    return run_inprocess(cfg, total_tokens=total, step_time_s=1.0, upload_bps={"us-0": bandwidth, "us-1": bandwidth},
                         eval_every_tokens=total)


def test_an_adaptive_learner_on_a_fast_link_trains_exactly_as_a_fixed_one():
    from ddiloco.platform.ledger.models import Submission

    figures = []
    for adaptive in (False, True):
        run = thin_run(adaptive, 1e9, steps=24)
        with run.ctx.reading() as s:
            subs = s.execute(select(Submission.learner_id, Submission.uid, Submission.c_steps, Submission.codec, Submission.nbytes,
                                    Submission.status).order_by(Submission.id)).all()
        figures.append(([tuple(x) for x in subs], [e.val_loss for e in run.evals]))
        assert all(f.cadence_changes == 0 for f in run.links.values())
    assert figures[0] == figures[1]


def test_a_thin_link_makes_an_adaptive_learner_send_less_often_and_every_honest_update_is_merged():
    """At 2 kB/s a learner can upload a quarter of its int8 sends (8 kB a step): it goes to int4 every 4 H
    steps, records each choice as an event and in its heartbeats, and nothing it sends is rejected (the
    synchronizer weighs and judges updates of up to adaptive_max_periods periods as honest)."""
    from ddiloco.platform.ledger import reports as reports_q
    from ddiloco.platform.ledger.models import Event, Heartbeat, Learner, Submission
    from ddiloco.platform.summary import run_summary

    run = thin_run(True, 2_000.0, steps=72)
    H = run.ctx.cfg.fragments.period
    with run.ctx.reading() as s:
        subs = list(s.scalars(select(Submission)))
        events = list(s.scalars(select(Event).where(Event.kind == CADENCE_EVENT).order_by(Event.id)))
        rows = {r.id: r for r in s.scalars(select(Learner))}
        beats = list(s.scalars(select(Heartbeat).where(Heartbeat.link_json.is_not(None))))
        summary = run_summary(s, run.ctx.run_id, run.ctx.now_dt())
        assert reports_q.token_accounting(s, run.ctx.run_id).balanced
    assert not [x.reject_reason for x in subs if x.status == "rejected"]
    assert {x.codec for x in subs} == {"int8", "int4"} and max(x.c_steps for x in subs) > 2 * H
    assert {e.actor for e in events} == {"us-0", "us-1"}
    # int8 every 4 steps needs 4.0 of the link, int4 every 16 steps 0.53 (the first choice under 0.7).
    assert events[0].detail.startswith("every 16 steps with int4 (was every 4 with int8): every 4 steps with int8: uploads 4.01")
    for lid, row in rows.items():
        link = json.loads(row.link_json)
        assert link["adaptive"] and link["every"] > H and link["codec"] == "int4", link
        assert link["up_bps"] == 2_000.0 and link["reason"] == run.learners[lid].link.cadence.reason
        assert row.queue_depth is not None and row.oldest_unsent_s is not None
        assert run.links[lid].cadence_changes >= 1
    assert beats and all(b.queue_depth is not None and b.oldest_unsent_s is not None for b in beats)
    assert summary.tokens_rejected == 0


def test_a_fixed_learner_on_a_thin_link_reports_its_growing_queue():
    from ddiloco.platform.ledger.models import Heartbeat

    run = thin_run(False, 2_000.0, steps=24)
    with run.ctx.reading() as s:
        beats = s.execute(select(Heartbeat.queue_depth, Heartbeat.oldest_unsent_s, Heartbeat.link_json)).all()
    assert max(depth for depth, _, _ in beats) == 4  # every fragment waits (the one on the wire with a newer increment)
    assert max(oldest for _, oldest, _ in beats) > run.ctx.cfg.fragments.period  # longer than a send period
    assert {json.loads(link)["every"] for _, _, link in beats} == {4}
    assert max(f.max_oldest_unsent_s for f in run.links.values()) > 4


def test_a_longer_period_spreads_the_sends_and_a_shorter_one_never_resends_a_fragment_within_h_steps():
    from support import sim_run

    from ddiloco.inprocess import sim_learner

    _cfg, _clock, ctx, _sync = sim_run(fragments={"count": 4})  # H = P = 4
    learner = sim_learner(ctx, "us-0")

    def steps(first: int, last: int, every: int) -> dict[int, list[int]]:
        out = {}
        for step in range(first, last + 1):
            learner.step_count = step
            out[step] = sent = learner.due(every)
            for p in sent:
                learner.fragments[p].last_sent = step
        return out

    # Every 8 steps: one fragment every other step (p at 2p mod 8), not four in a row.
    assert steps(1, 10, 8) == {1: [], 2: [1], 3: [], 4: [2], 5: [], 6: [3], 7: [], 8: [0], 9: [], 10: [1]}
    # Back to every 4 steps (p at p mod 4): fragment 1 was sent at step 10, so not at 13; again at 17.
    assert steps(11, 17, 4) == {11: [3], 12: [0], 13: [], 14: [2], 15: [3], 16: [0], 17: [1]}
    ctx.engine.dispose()


def test_the_upload_thread_registers_a_slow_batch_as_it_goes():
    """Four queued sends taken as one batch: on a fast link one transaction registers them all; when the blobs
    take long to cross, what is written is registered every REGISTER_WITHIN_S, not after the whole batch."""
    from support import sim_run

    from ddiloco.inprocess import SimClock, sim_learner, sim_step
    from ddiloco.learner_worker.uploader import REGISTER_WITHIN_S
    from ddiloco.platform.ledger.models import Submission

    registered_at = []
    for tick in (0.0, 0.25 * REGISTER_WITHIN_S):
        _cfg, clock, ctx, _sync = sim_run(fragments={"count": 4})
        learner = sim_learner(ctx, "us-0")
        learner.start(clock.t)
        for _ in range(4):  # one fragment is due a step: four sends wait in the queue
            clock.t += 1.0
            sim_step(learner, clock.t, pump=False)
        uploader = learner.link.uploader

        def transfer_clock(tick: float = tick, clock: SimClock = clock) -> float:
            """A slow link: every reading of the transfer clock finds the simulated time ``tick`` later."""
            clock.t += tick
            return clock.t

        uploader.elapsed = transfer_clock
        items = uploader.outbox.take(4)
        assert len(items) == 4
        uploader.handle(items)
        with ctx.reading() as s:
            registered_at.append(s.scalars(select(Submission.created_at).where(Submission.learner_id == "us-0")).all())
        ctx.engine.dispose()
    fast, slow = registered_at
    assert len(fast) == len(slow) == 4
    assert len(set(fast)) == 1  # one transaction
    assert len(set(slow)) == 2 and slow[0] < slow[-1]  # two blobs, then the other two
