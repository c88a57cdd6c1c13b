"""A run's headline figures (CLI summary, demo, dashboard, flows): one pure ``summarize`` of the ledger's aggregates."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from ddiloco.platform.config import ModelConfig, tokens_per_step
from ddiloco.platform.ledger import reports as reports_q

DP_BYTES_PER_PARAM = 4
"""Data-parallel baseline: every replica sends a float32 gradient of every parameter each step."""

# Where a learner-second went (``time_breakdown``); the buckets sum to the run's learner-seconds.
MERGED_S = "merged"
"""Stepping, on tokens that were merged: goodput."""
DOWN_S = "down"
"""The learner's process was not running: from its exit (or, unseen, its last heartbeat) to its relaunch or the end."""
START_UP_S = "start_up"
"""Before the learner's first step: waiting to be launched, process start, imports, model, first download, joining."""
RESTART_S = "restart"
"""From a relaunch (or a replacement's registration) to the new incarnation's first step."""
IDLE_S = "idle"
"""Up and past its first step, yet not stepping: waiting for a merge (overlap 0), stopped, work lost at a kill, clock slop."""
REJECTED_S = "rejected"
"""Stepping, on tokens the synchronizer rejected."""
LOST_S = "lost"
"""Stepping, on tokens a dead incarnation never submitted."""
UNMERGED_S = "unmerged"
"""Stepping, on tokens still pending or unsent at the end: the final drain did not merge them."""
TIME_BUCKETS = (MERGED_S, DOWN_S, START_UP_S, RESTART_S, IDLE_S, REJECTED_S, LOST_S, UNMERGED_S)


@dataclass(frozen=True)
class RunSummary:
    run: str
    status: str
    tokens: int
    tokens_merged: int
    tokens_rejected: int
    tokens_pending: int
    tokens_lost: int
    tokens_in_flight: int
    accounting_balanced: bool
    versions: dict[int, int]
    val_loss_start: float | None
    val_loss_end: float | None
    val_accuracy_end: float | None
    goodput: float
    learner_s: float
    """Learner-seconds of the run: learners x wall-clock, what goodput is a share of."""
    time_breakdown: dict[str, float]
    """The learner-seconds by where they went (``TIME_BUCKETS``): they sum to ``learner_s``; merged / learner_s is goodput."""
    availability_bound: float
    """The goodput the learners' availability allows: the share of learner-seconds their processes were not down."""
    goodput_of_bound: float
    """goodput / availability_bound: 1 when every second a learner was available produced merged progress."""
    longest_version_gap_s: float
    bytes_sent: int
    bytes_data_parallel: int
    rejected_by_reason: dict[str, int]
    submissions: int
    learners: int
    wall_s: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def step_tokens(config: Mapping[str, Any]) -> int:
    """Tokens one learner step trains, from a run's recorded config (1 when the config does not say)."""
    try:
        return tokens_per_step(ModelConfig.model_validate(config["model"]), int(config["learners"]["batch_size"]))
    except (KeyError, TypeError, ValueError):  # a pydantic ValidationError is a ValueError
        return 1


def learner_states(moments: Sequence[reports_q.Moment], start: datetime, end: datetime) -> dict[str, float]:
    """Seconds of [start, end] one learner spent starting up, up, down and restarting, from its timeline (in time order).

    Up runs from an incarnation's first heartbeat to its process's exit; without a seen exit, to its last heartbeat
    before the next incarnation (``SILENT``)."""
    spent = {START_UP_S: 0.0, "up": 0.0, DOWN_S: 0.0, RESTART_S: 0.0}
    state, since, stepped = START_UP_S, start, False
    for i, m in enumerate(moments):
        if m.kind == reports_q.SILENT and any(n.kind == reports_q.EXITED for n in _until_next_start(moments, i)):
            continue  # the exit the supervisor saw ends it, not the last heartbeat
        if m.kind == reports_q.READY:
            new, stepped = "up", True
        elif m.kind in (reports_q.EXITED, reports_q.SILENT):
            new = DOWN_S
        elif m.kind == reports_q.LAUNCHED or (m.kind == reports_q.JOINED and state in (DOWN_S, "up")):
            new = RESTART_S if stepped else START_UP_S
        else:
            new = state
        spent[state] += _overlap(since, m.at, start, end)
        state, since = new, max(since, m.at)
    spent[state] += _overlap(since, end, start, end)
    return spent


def _until_next_start(moments: Sequence[reports_q.Moment], i: int) -> Sequence[reports_q.Moment]:
    """The moments after ``i`` up to the next launch, registration or first step."""
    rest = moments[i + 1:]
    for j, m in enumerate(rest):
        if m.kind in (reports_q.LAUNCHED, reports_q.JOINED, reports_q.READY):
            return rest[:j]
    return rest


def _overlap(a: datetime, b: datetime, start: datetime, end: datetime) -> float:
    return max(0.0, (min(b, end) - max(a, start)).total_seconds())


def time_breakdown(agg: reports_q.RunAggregates, end: datetime) -> dict[str, float]:
    """Where the run's learner-seconds (learners x [created, end]) went, by ``TIME_BUCKETS``; they sum to the total.

    Time not up comes from each learner's timeline; a learner without one counts as up throughout. Busy seconds (capped
    at the total) are split by the fate of the tokens trained in them; what is up but not busy is idle."""
    total = max(0.0, (end - agg.created_at).total_seconds()) * max(1, agg.learners)
    out = dict.fromkeys(TIME_BUCKETS, 0.0)
    for moments in agg.timelines.values():
        spent = learner_states(moments, agg.created_at, end)
        for bucket in (DOWN_S, START_UP_S, RESTART_S):
            out[bucket] += spent[bucket]
    busy = min(agg.busy_s, total)
    for bucket, share in _token_shares(agg.tokens).items():
        out[bucket] = busy * share
    out[IDLE_S] = total - sum(out.values())
    return out


def _token_shares(acct: reports_q.TokenAccounting) -> dict[str, float]:
    """The share of trained tokens by fate; with nothing trained, busy time merged nothing."""
    if not acct.trained:
        return {UNMERGED_S: 1.0}
    return {
        MERGED_S: acct.merged / acct.trained,
        REJECTED_S: acct.rejected / acct.trained,
        LOST_S: acct.lost / acct.trained,
        UNMERGED_S: (acct.pending + acct.in_flight) / acct.trained,
    }


def summarize(agg: reports_q.RunAggregates, now: datetime) -> RunSummary:
    """The summary of a run as of ``now`` (its end, once it has finished)."""
    acct = agg.tokens
    end = agg.finished_at or now
    wall = max(1e-9, (end - agg.created_at).total_seconds())
    # Downtime is counted from the first merge: before it, learners are still starting up.
    gap = 0.0
    if agg.last_merged_at is not None:
        gap = max(agg.longest_merge_gap_s, (end - agg.last_merged_at).total_seconds(), 0.0)
    steps = acct.trained / max(1, step_tokens(agg.config))
    allocated = wall * max(1, agg.learners)
    spent = time_breakdown(agg, end)
    goodput = spent[MERGED_S] / allocated
    bound = 1.0 - spent[DOWN_S] / allocated
    return RunSummary(
        run=agg.run,
        status=agg.status,
        tokens=acct.trained,
        tokens_merged=acct.merged,
        tokens_rejected=acct.rejected,
        tokens_pending=acct.pending,
        tokens_lost=acct.lost,
        tokens_in_flight=acct.in_flight,
        accounting_balanced=acct.balanced,
        versions=agg.versions,
        val_loss_start=agg.val_loss_start,
        val_loss_end=agg.val_loss_end,
        val_accuracy_end=agg.val_accuracy_end,
        goodput=goodput,
        learner_s=allocated,
        time_breakdown=spent,
        availability_bound=bound,
        goodput_of_bound=goodput / bound if bound > 0 else 0.0,
        longest_version_gap_s=gap,
        bytes_sent=agg.bytes_sent,
        bytes_data_parallel=int(steps * agg.parameters * DP_BYTES_PER_PARAM),
        rejected_by_reason=dict(agg.rejected_reasons),
        submissions=agg.submissions,
        learners=agg.learners,
        wall_s=wall,
    )


def breakdown_line(summary: RunSummary) -> str:
    """'merged 512 s (69.4%), down 30 s (4.1%), … of 738 s': the learner-seconds by where they went, empty buckets left out."""
    total = summary.learner_s or 1.0
    parts = [f"{name.replace('_', '-')} {s:.0f} s ({s / total:.1%})" for name, s in summary.time_breakdown.items() if abs(s) >= 0.5]
    return f"{', '.join(parts)} of {summary.learner_s:.0f} s"


def run_summary(session: Session, run_id: str, now: datetime) -> RunSummary:
    """``summarize`` of the run's aggregates as the ledger holds them now."""
    return summarize(reports_q.run_aggregates(session, run_id), now)
