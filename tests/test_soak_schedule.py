"""The soak's decisions, pure: the seeded fault schedule, the availability bound it leaves, RSS growth, version gaps."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys

import pytest

from ddiloco.testing.soak import (
    DOWN_KINDS,
    EVAL_KILL,
    LEARNER_KILL,
    LEARNER_STOP,
    MATRIX,
    PARTITION,
    PG_RESTART,
    STORE_OUTAGE,
    SYNC_KILL,
    TRACE_POINTS,
    UNREACHABLE_KINDS,
    Fault,
    Sample,
    Soak,
    availability_bound,
    draw_schedule,
    longest_gaps,
    parse_duration,
    read_proc,
    resource_growth,
    trace,
    unavailable,
)

TARGETS = {"learner": ["us-0", "us-1", "eu-0", "eu-1"], "shard": ["0", "1"], "evaluator": ["evaluator"], "ledger": ["postgresql"],
           "store": ["s3"], "region": ["eu", "us"]}
LEARNERS = {"us-0": "us", "us-1": "us", "eu-0": "eu", "eu-1": "eu"}


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another():
    a = draw_schedule(7, 1800, 125, TARGETS)
    assert a == draw_schedule(7, 1800, 125, TARGETS)
    assert a != draw_schedule(8, 1800, 125, TARGETS)


def test_arrivals_are_a_poisson_stream_at_the_rate_asked():
    hours = 40
    faults = draw_schedule(3, hours * 3600, 125, TARGETS)
    # A Poisson count of mean 5,000 has a standard deviation of 71: within 4 of them.
    assert abs(len(faults) - 125 * hours) < 4 * (125 * hours) ** 0.5
    gaps = [b.at_s - a.at_s for a, b in zip(faults, faults[1:])]
    # Exponential gaps: mean = standard deviation = 28.8 s, each estimated within ~1.4% and ~2% (one sigma) from
    # 5,000 gaps; a draw that finds every target held is skipped, which is rare at this rate.
    assert statistics.mean(gaps) == pytest.approx(3600 / 125, rel=0.07)
    assert statistics.stdev(gaps) == pytest.approx(3600 / 125, rel=0.10)
    assert all(0 <= f.at_s < hours * 3600 for f in faults)


def test_every_kind_of_the_matrix_is_drawn_with_its_durations():
    faults = draw_schedule(1, 4 * 3600, 125, TARGETS)
    by_kind = {k.name: [f for f in faults if f.kind == k.name] for k in MATRIX}
    for kind in MATRIX:
        drawn = by_kind[kind.name]
        assert len(drawn) > 0.5 * len(faults) / len(MATRIX), kind.name
        assert all(kind.min_s <= f.duration_s <= kind.max_s for f in drawn)
        assert all(f.target in TARGETS[kind.hits] for f in drawn)


def test_faults_overlap_but_never_two_at_once_on_one_target():
    faults = draw_schedule(5, 2 * 3600, 600, TARGETS)
    hits = {k.name: k.hits for k in MATRIX}
    overlapping = 0
    for i, a in enumerate(faults):
        for b in faults[i + 1:]:
            if b.at_s >= a.end_s:
                break  # in time order: no later one overlaps a either
            overlapping += 1
            assert (hits[a.kind], a.target) != (hits[b.kind], b.target), (a, b)
    assert overlapping > 50  # at 600/h the draw does overlap them


def test_a_kind_with_nothing_to_hit_is_never_drawn():
    faults = draw_schedule(2, 3600 * 5, 125, {k: v for k, v in TARGETS.items() if k != "ledger"})
    assert faults and all(f.kind != PG_RESTART for f in faults)
    assert draw_schedule(2, 3600, 0, TARGETS) == []


def test_the_bound_subtracts_each_learners_down_time_once_and_clips_at_the_window():
    schedule = [
        Fault(10, LEARNER_KILL, "us-0", 10),  # 10-20
        Fault(15, LEARNER_STOP, "us-0", 10),  # 15-25: overlaps the kill, 15 s in all
        Fault(0, PARTITION, "eu", 10),  # cut off, not down
        Fault(95, LEARNER_STOP, "eu-1", 10),  # 5 s of it inside the 100 s window
        Fault(50, EVAL_KILL, "evaluator", 30),  # no learner's
    ]
    assert unavailable(schedule, LEARNERS, 100)["us-0"] == [(10, 25)]
    assert availability_bound(schedule, LEARNERS, 100) == pytest.approx(1 - (15 + 5) / 400)
    # Counting the partition too: eu-0 and eu-1 lose 10 s each.
    assert availability_bound(schedule, LEARNERS, 100, DOWN_KINDS | UNREACHABLE_KINDS) == pytest.approx(1 - (15 + 5 + 20) / 400)
    # A backend outage takes every learner: 4 x 3 s.
    outage = [Fault(40, STORE_OUTAGE, "s3", 3)]
    assert availability_bound(outage, LEARNERS, 100, UNREACHABLE_KINDS) == pytest.approx(1 - 12 / 400)
    assert availability_bound(outage, LEARNERS, 100) == 1.0


def test_growth_is_judged_only_for_processes_that_lived_through_the_soak_from_their_warm_sample():
    def s(at: float, rss: int) -> Sample:
        return Sample(at, rss, 10, 4, 1)

    series = {
        ("us-0", 1): [s(0, 100), s(30, 200), s(60, 210), s(100, 220)],  # warm at 30: 220 / 200
        ("us-1", 2): [s(50, 100), s(100, 500)],  # relaunched mid-soak: not long-lived
        ("sync-0", 3): [s(0, 100), s(30, 100), s(60, 100)],  # killed at 60
    }
    grown = resource_growth(series, warmup_s=30, end_s=100, slack_s=5)
    assert [(g.process, g.pid) for g in grown] == [("us-0", 1)]
    assert grown[0].rss_ratio == pytest.approx(1.1)
    assert grown[0].lived_s == 100


def test_a_judged_process_keeps_a_short_trace_of_rss_and_its_anonymous_part_from_its_warm_sample():
    series = {("us-0", 1): [Sample(float(t), (100 + t) << 20, 10, 4, 1, None, (50 + t // 10) << 20) for t in range(0, 1001, 5)]}
    (g,) = resource_growth(series, warmup_s=30, end_s=1000, slack_s=5)
    assert g.trace[0] == (30.0, 130, 53) and g.trace[-1] == (1000.0, 1100, 150)
    assert len(g.trace) == TRACE_POINTS and [p[0] for p in g.trace] == sorted({p[0] for p in g.trace})
    # Judged between the median samples of the first and last 15 s (35 s and 990 s), with their anonymous parts.
    assert (g.start.at_s, g.end.at_s) == (35.0, 990.0)
    assert g.rss_ratio == pytest.approx(1090 / 135) and g.anon_ratio == pytest.approx(149 / 53)
    assert g.to_dict()["trace"][-1] == [1000.0, 1100, 150]
    assert trace([Sample(1.0, 1 << 20, 1, 1)]) == ((1.0, 1, 0),)
    # Fewer samples than points: every one of them, the last included.
    few = [Sample(float(t), t << 20, 1, 1) for t in range(13)]
    assert [p[0] for p in trace(few)] == [float(t) for t in range(13)]


def test_a_swing_at_either_end_is_not_growth_and_a_climb_is():
    def s(at: float, rss: int) -> Sample:
        return Sample(at, rss, 10, 4, 1)

    flat = [424, 424, 424, 417, 418, 420, 423, 419, 421, 418, 420, 422, 424]  # MiB every 5 s from warm-up
    series = {
        ("eu-1", 1): [s(0, 400)] + [s(30 + 5 * i, r) for i, r in enumerate([*flat[:-1], 470])],  # a save's copy at the end
        ("us-0", 2): [s(0, 400)] + [s(30 + 5 * i, r) for i, r in enumerate([520, *flat[1:]])],  # at the start
        ("us-1", 3): [s(0, 400)] + [s(30 + 5 * i, 420 + 4 * i) for i in range(13)],  # a leak: 4 MiB every 5 s
    }
    grown = {g.process: g for g in resource_growth(series, warmup_s=30, end_s=90, slack_s=10)}
    # Medians: 424 MiB in the first 15 s, 420 MiB in the last (sample to sample: 470 / 424 = 1.108 and 424 / 520 = 0.815).
    assert grown["eu-1"].rss_ratio == pytest.approx(420 / 424)
    assert grown["us-0"].rss_ratio == pytest.approx(420 / 424)
    assert grown["us-1"].rss_ratio == pytest.approx((420 + 4 * 10) / (420 + 4)) and grown["us-1"].rss_ratio > 1.08


def test_growth_of_the_peak_ignores_a_trim_and_follows_a_leak():
    def s(at: float, rss: int, peak: int) -> Sample:
        return Sample(at, rss, 10, 4, 1, peak=peak)

    series = {
        # A suite soak's eu-1, stepping a few times a minute: sampled after a trim (422), then 464 and 474; its peak
        # barely moved.
        ("eu-1", 1): [s(0, 470, 470), s(37, 422, 476), s(57, 464, 476), s(95, 474, 481)],
        ("us-1", 2): [s(0, 470, 470)] + [s(30 + 5 * i, 470 + 6 * i, 470 + 6 * i) for i in range(14)],  # a leak
    }
    grown = {g.process: g for g in resource_growth(series, warmup_s=30, end_s=95, slack_s=10)}
    assert grown["eu-1"].rss_ratio > 1.1 and grown["eu-1"].peak_ratio == pytest.approx(481 / 476)
    assert grown["us-1"].peak_ratio == pytest.approx((470 + 6 * 13) / 470) and grown["us-1"].peak_ratio > 1.1
    assert grown["eu-1"].to_dict()["peak_ratio"] == round(481 / 476, 4)


def test_an_incarnation_relaunched_mid_soak_is_judged_from_its_own_warm_up_once_it_lived_long_enough():
    def s(at: float, rss: int) -> Sample:
        return Sample(at, rss, 10, 4, 1)

    series = {
        ("us-0", 1): [s(0, 100), s(30, 200), s(100, 210)],  # lived through: judged as before
        ("us-1", 2): [s(10, 100), s(20, 300), s(40, 330), s(80, 360)],  # relaunched at 10, warm at 40, 40 s after it: judged
        ("us-1", 3): [s(85, 100), s(100, 400)],  # relaunched at 85: 15 s is not long-lived
        ("eu-0", 4): [s(0, 100), s(30, 200), s(50, 200)],  # killed 20 s after its warm-up: not long-lived
    }
    grown = {(g.process, g.pid): g for g in resource_growth(series, warmup_s=30, end_s=100, slack_s=5, min_life_s=40)}
    assert sorted(grown) == [("us-0", 1), ("us-1", 2)]
    assert grown["us-0", 1].whole_soak and not grown["us-1", 2].whole_soak
    assert grown["us-1", 2].start.at_s == 40 and grown["us-1", 2].rss_ratio == pytest.approx(360 / 330)
    assert grown["us-1", 2].lived_s == 70
    assert ("us-1", 2) not in {(g.process, g.pid) for g in resource_growth(series, warmup_s=30, end_s=100, slack_s=5)}


def test_a_standby_that_took_a_shard_over_is_judged_from_its_warm_up_as_the_holder():
    def s(at: float, rss: int, role: str | None) -> Sample:
        return Sample(at, rss, 10, 4, 1, role)

    series = {
        # Took shard 0 over at 50 s: loading its state and its first merges grow it then, once (warm at 80 s).
        ("sync-2", 1): [s(0, 100, "standby"), s(30, 100, "standby"), s(55, 112, "active"), s(85, 120, "active"),
                        s(100, 121, "active")],
        # A holder that grows after its takeover's warm-up is still caught.
        ("sync-3", 2): [s(0, 100, "standby"), s(40, 100, "active"), s(70, 120, None), s(100, 140, "active")],
        ("sync-0", 3): [s(0, 100, "active"), s(30, 100, "active"), s(100, 115, "active")],
        # Took over 10 s before the end: not warm in its role yet, judged from its last sample.
        ("sync-4", 4): [s(0, 100, "standby"), s(30, 100, "standby"), s(92, 130, "active"), s(100, 131, "active")],
    }
    grown = {g.process: g for g in resource_growth(series, warmup_s=30, end_s=100, slack_s=5)}
    assert grown["sync-2"].start.at_s == 85 and grown["sync-2"].rss_ratio == pytest.approx(121 / 120)
    assert grown["sync-3"].start.at_s == 70 and grown["sync-3"].rss_ratio == pytest.approx(140 / 120)
    assert grown["sync-0"].start.at_s == 30 and grown["sync-0"].rss_ratio == pytest.approx(1.15)
    assert grown["sync-4"].start.at_s == 100 and grown["sync-4"].rss_ratio == 1.0


def test_the_longest_gap_is_per_shard():
    times = {0: [0, 1, 2], 1: [10, 11], 2: [0, 5], 3: [6]}
    assert longest_gaps(times, [(0, 1), (2, 3)]) == [(8, 2), (5, 0)]


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("1h", 3600), ("2.5m", 150)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-5m", "0", "48h", "5x"])
def test_a_bad_duration_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="--soak"):
        parse_duration(text)


def test_proc_reads_a_live_process_and_none_for_a_gone_one():
    rss, fds, threads, anon, peak = read_proc(os.getpid())
    assert rss > 10 << 20 and fds >= 3 and threads >= 1 and 0 < anon < rss <= peak
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert read_proc(child.pid) is None


def test_a_shard_kill_waiting_for_a_holder_does_not_hold_back_the_schedule(tmp_path):
    """A PostgreSQL restart drawn for 0.4 s and a shard SIGKILL 0.05 s into it: the kill finds no holder while the ledger
    is down, so it looks again later, and the restart still ends on time (a blocking lookup stretched a 4.9 s restart to
    23.6 s in the hour's soak). The holder is a real process, SIGKILLed once the ledger answers."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    class Cluster:
        procs = {"sync-0": holder}

        def signal(self, name: str, sig: int) -> None:
            self.procs[name].send_signal(sig)
            self.procs[name].wait(10)

    class Probe(Soak):
        ledger_down = False

        def holder(self, shard: int) -> str | None:
            if self.ledger_down:
                raise ConnectionError("the ledger is restarting")
            return "sync-0"

        def running(self, name: str) -> bool:
            return Cluster.procs[name].poll() is None

        def start_synchronizer(self, name: str) -> None:
            self.standbys.append(name)

        def begin(self, a):  # noqa: ANN001, ANN202
            if a.fault.kind != PG_RESTART:
                return super().begin(a)
            a.started_s, self.ledger_down, a.applied = self.now(), True, True
            return None

        def end(self, a):  # noqa: ANN001, ANN202
            a.ended_s = self.now()
            if a.fault.kind == PG_RESTART:
                self.ledger_down = False

    soak = Probe(duration_s=1.0, rate_per_hour=1.0, seed=1, workdir=tmp_path)
    soak.cluster, soak.standbys = Cluster(), []
    try:
        soak.apply([Fault(0.0, PG_RESTART, "postgresql", 0.4), Fault(0.05, SYNC_KILL, "0", 1.0)])
    finally:
        holder.kill()
    restart, kill = soak.report.timeline
    assert restart.ended_s - restart.started_s < 0.4 + 0.3, restart  # ended on time, not after the kill's lookup
    assert kill.applied and holder.returncode == -signal.SIGKILL, kill
    assert restart.ended_s <= kill.started_s < restart.ended_s + 1.0, (restart, kill)  # killed once the ledger answered
    assert soak.standbys == ["sync-s1"] and "sync-0" in kill.detail
