"""The supervisor's decision: which learners to relaunch, and why. Pure: ``now`` is passed in."""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco.platform.liveness import LivenessPolicy, is_dead


@dataclass(frozen=True)
class LearnerView:
    learner_id: str
    running: bool
    """Its process or flow run is still running."""
    started_at: float
    """When the supervisor (re)launched it."""
    last_heartbeat: float | None
    """The newest heartbeat of the incarnation started after ``started_at``, if any."""


def relaunch_decisions(now: float, learners: list[LearnerView], *, liveness: LivenessPolicy, startup_grace_s: float) -> dict[str, str]:
    """Learners to relaunch, each with its reason: ended, never heard of ``startup_grace_s`` after launch, or dead by
    the same rule as the synchronizer's verdicts (``platform.liveness.is_dead``)."""
    out = {}
    for lv in learners:
        if not lv.running:
            out[lv.learner_id] = "its process or flow run ended"
        elif lv.last_heartbeat is None:
            if now - lv.started_at > startup_grace_s:
                out[lv.learner_id] = f"no heartbeat {startup_grace_s:.0f}s after launch"
        elif is_dead(now - lv.last_heartbeat, liveness):
            out[lv.learner_id] = f"heartbeat stopped {now - lv.last_heartbeat:.1f}s ago"
    return out
