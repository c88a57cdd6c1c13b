"""The one liveness rule (``platform.liveness``): pure verdicts of (snapshots, now, policy), time moved by editing timestamps."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pytest

from ddiloco.platform import liveness
from ddiloco.platform.liveness import (
    ALIVE,
    CUT_OFF,
    DEAD,
    RECOVERING,
    REGION_DOWN,
    REGION_UP,
    STRAGGLING,
    LearnerSnapshot,
    LivenessPolicy,
)

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
POLICY = LivenessPolicy(dead_after_s=10, straggler_factor=2.0)


def snap(
    lid: str, silent_s: float | None, step_s: float = 1.0, *, status: str = ALIVE, step: int = 5, started_s: float = 3600,
    region: str = "",
) -> LearnerSnapshot:
    """A learner last heard of ``silent_s`` ago (None: no heartbeat yet), started ``started_s`` ago."""
    heartbeat = None if silent_s is None else T0 - timedelta(seconds=silent_s)
    return LearnerSnapshot(lid, heartbeat, T0 - timedelta(seconds=started_s), step, step_s, status, region)


def statuses(*snaps: LearnerSnapshot, now: datetime = T0) -> dict[str, str]:
    return {lid: v.status for lid, v in liveness.learner_verdicts(snaps, now, POLICY).items()}


def test_each_status_with_its_reason():
    verdicts = liveness.learner_verdicts(
        [
            snap("a", 1),
            snap("b", 2),
            snap("slow", 1, step_s=2.5),
            snap("gone", 11),
            snap("back", 0.5, step_s=0.0, status=RECOVERING, step=0),
        ],
        T0,
        POLICY,
    )
    expected = {"a": ALIVE, "b": ALIVE, "slow": STRAGGLING, "gone": DEAD, "back": RECOVERING}
    assert {k: v.status for k, v in verdicts.items()} == expected
    assert verdicts["a"].reason == "last heartbeat 1.0s ago"
    assert verdicts["slow"].reason == "step time 2.50s is 2.5x the live median 1.00s"
    assert verdicts["gone"].reason == "no heartbeat for 11s (limit 10s)"
    assert verdicts["back"].reason == "restarted; rejoining from the newest global state"


def test_dead_beats_straggling_beats_recovering_beats_alive():
    peers = [snap("p1", 1), snap("p2", 1), snap("p3", 1)]
    # Silent too long and slow: dead.
    assert statuses(*peers, snap("x", 11, step_s=9.0))["x"] == DEAD
    # Silent too long and just restarted: dead.
    assert statuses(*peers, snap("x", 11, status=RECOVERING, step=0))["x"] == DEAD
    # Just restarted but slow: straggling.
    assert statuses(*peers, snap("x", 1, step_s=9.0, status=RECOVERING, step=0))["x"] == STRAGGLING
    # Restarted and not stepped yet: recovering; once it has stepped it is alive again.
    assert statuses(*peers, snap("x", 1, status=RECOVERING, step=0))["x"] == RECOVERING
    assert statuses(*peers, snap("x", 1, status=RECOVERING, step=1))["x"] == ALIVE
    # The status the ledger holds does not decide: a learner written as dead that heartbeats is alive.
    assert statuses(*peers, snap("x", 1, status=DEAD))["x"] == ALIVE


def test_the_limits_are_strict():
    assert statuses(snap("a", 10), snap("b", 10.001)) == {"a": ALIVE, "b": DEAD}
    # Exactly the straggler factor times the median is not yet straggling.
    assert statuses(snap("a", 1), snap("b", 1), snap("c", 1, step_s=2.0))["c"] == ALIVE
    assert statuses(snap("a", 1), snap("b", 1), snap("c", 1, step_s=2.01))["c"] == STRAGGLING


def test_the_start_counts_as_a_sign_of_life():
    # No heartbeat yet: judged by when the incarnation started.
    assert statuses(snap("new", None, started_s=5))["new"] == ALIVE
    assert statuses(snap("new", None, started_s=11))["new"] == DEAD
    assert liveness.silent_s(snap("new", None, started_s=5), T0) == 5.0
    assert liveness.silent_s(snap("old", 2, started_s=500), T0) == 2.0


def test_the_median_counts_live_learners_that_have_stepped():
    live = [snap("a", 1, step_s=1.0), snap("b", 1, step_s=1.0), snap("c", 1, step_s=2.5)]
    dead_and_slow = [snap("d1", 20, step_s=100.0), snap("d2", 20, step_s=100.0)]
    not_stepped = [snap("n1", 1, step_s=0.0), snap("n2", 1, step_s=0.0), snap("n3", 1, step_s=0.0)]
    assert liveness.median_live_step_s([*live, *dead_and_slow, *not_stepped], T0, POLICY) == 1.0
    # Were the dead counted, the median would be 2.5 and c would look healthy.
    assert statuses(*live, *dead_and_slow)["c"] == STRAGGLING
    # Were the learners without a step counted, the median would be 0 and nobody could straggle.
    assert statuses(*live, *not_stepped)["c"] == STRAGGLING
    # Nobody live has a step time: there is no median, and nobody straggles.
    assert liveness.median_live_step_s([snap("x", 20, step_s=3.0), snap("y", 1, step_s=0.0)], T0, POLICY) == 0.0


def test_move_time_not_the_learners():
    learners = [snap("a", 1), snap("b", 2)]
    assert set(statuses(*learners).values()) == {ALIVE}
    assert statuses(*learners, now=T0 + timedelta(seconds=9)) == {"a": ALIVE, "b": DEAD}
    assert set(statuses(*learners, now=T0 + timedelta(seconds=10)).values()) == {DEAD}


def test_live_ids_are_every_learner_not_dead_sorted():
    verdicts = liveness.learner_verdicts(
        [snap("z", 1), snap("slow", 1, step_s=5.0), snap("m", 1), snap("back", 1, status=RECOVERING, step=0), snap("gone", 30)],
        T0,
        POLICY,
    )
    assert liveness.live_ids(verdicts) == ["back", "m", "slow", "z"]
    assert liveness.live_ids({}) == []


@dataclass
class _Learners:
    dead_after_s: float = 45.0


@pytest.mark.parametrize(
    "learners, expected",
    [
        ({"dead_after_s": 40, "straggler_factor": 3}, LivenessPolicy(40.0, 3.0)),
        ({}, LivenessPolicy()),
        (_Learners(), LivenessPolicy(45.0, LivenessPolicy.straggler_factor)),
    ],
)
def test_policy_from_the_run_config_or_its_recorded_dict(learners, expected):
    assert LivenessPolicy.from_learners_config(learners) == expected


# --- regions ---------------------------------------------------------------------------------------


def regions(*snaps: LearnerSnapshot, now: datetime = T0) -> dict[str, liveness.Verdict]:
    return liveness.region_verdicts(snaps, now, POLICY)


def test_a_region_whose_learners_fell_silent_together_is_cut_off_with_since_when():
    verdicts = regions(snap("eu-0", 41, region="eu"), snap("eu-1", 41.8, region="eu"), snap("us-0", 1, region="us"))
    assert verdicts["eu"] == liveness.Verdict(CUT_OFF, "all 2 learners silent since 11:59:19 (41s): cut off from the ledger?")
    assert verdicts["us"] == liveness.Verdict(REGION_UP, "1 of 1 learners live")
    # Silences that began up to dead_after_s apart are together; one more and they are deaths one by one.
    assert regions(snap("a", 11, region="r"), snap("b", 21, region="r"))["r"].status == CUT_OFF
    assert regions(snap("a", 11, region="r"), snap("b", 21.5, region="r"))["r"].status == REGION_DOWN
    # A learner that never heartbeat is judged by its start, as the liveness rule judges it.
    assert regions(snap("a", None, started_s=30, region="r"), snap("b", 25, region="r"))["r"].status == CUT_OFF


def test_one_dead_learner_of_two_is_not_a_cut():
    verdict = regions(snap("eu-0", 41, region="eu"), snap("eu-1", 1, region="eu"))["eu"]
    assert verdict == liveness.Verdict(REGION_UP, "1 of 2 learners live")


def test_learners_that_died_minutes_apart_are_not_a_cut():
    verdict = regions(snap("eu-0", 400, region="eu"), snap("eu-1", 100, region="eu"))["eu"]
    assert verdict == liveness.Verdict(REGION_DOWN, "all 2 learners dead, the last fallen silent 5m 00s after the one before "
                                                    "it (more than 10s): separate deaths, not a cut")
    # Three deaths one by one, each more than dead_after_s after the one before: still not a cut.
    assert regions(snap("a", 100, region="r"), snap("b", 60, region="r"), snap("c", 30, region="r"))["r"].status == REGION_DOWN


def test_a_learner_dead_long_before_does_not_hide_a_cut_of_the_others():
    verdict = regions(snap("old", 3600, region="r"), snap("a", 41, region="r"), snap("b", 42, region="r"))["r"]
    assert verdict == liveness.Verdict(CUT_OFF, "2 of 3 learners (the rest dead before) silent since 11:59:19 (41s): "
                                                "cut off from the ledger?")


def test_a_region_with_a_live_learner_is_up_whatever_the_others_do():
    # Two fell silent together, but a third still heartbeats: not cut off from the ledger.
    verdict = regions(snap("a", 30, region="r"), snap("b", 30, region="r"), snap("c", 0.5, region="r"))["r"]
    assert verdict == liveness.Verdict(REGION_UP, "1 of 3 learners live")
    # A straggler or a learner just back from a cut is live too.
    assert regions(snap("a", 30, region="r"), snap("b", 1, step_s=9.0, region="r"))["r"].status == REGION_UP
    assert regions(snap("a", 30, region="r"), snap("b", 1, status=RECOVERING, step=0, region="r"))["r"].status == REGION_UP


def test_a_lone_learner_cannot_tell_a_cut_from_its_death():
    verdict = regions(snap("ap-0", 60, region="ap"))["ap"]
    assert verdict == liveness.Verdict(REGION_DOWN, "its only learner is dead (silent 1m 00s): one learner's death and a cut look alike")


def test_a_cut_heals_when_one_learner_heartbeats_again_and_time_moves_the_verdict():
    cut = [snap("a", 5, region="r"), snap("b", 5.5, region="r")]
    assert regions(*cut)["r"].status == REGION_UP  # silent, but not yet dead
    assert regions(*cut, now=T0 + timedelta(seconds=6))["r"].status == CUT_OFF
    # a heartbeats again after the cut: the ledger may still say dead, the heartbeat decides.
    back = [snap("a", -5.9, region="r", status=DEAD), cut[1]]  # heard at T0 + 5.9 s
    assert regions(*back, now=T0 + timedelta(seconds=6))["r"] == liveness.Verdict(REGION_UP, "1 of 2 learners live")
    assert list(regions(snap("z", 1, region="z"), snap("a", 1, region="a"))) == ["a", "z"]
