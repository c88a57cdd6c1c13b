"""A run's headline figures (CLI summary, demo, dashboard, flows): one pure ``summarize`` of the ledger's aggregates."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from ddiloco.platform.config import ModelConfig, tokens_per_step
from ddiloco.platform.ledger import queries as q
from ddiloco.platform.ledger.queries import RunAggregates

DP_BYTES_PER_PARAM = 4
"""Data-parallel baseline: every replica sends a float32 gradient of every parameter each step."""


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
    longest_version_gap_s: float
    bytes_sent: int
    bytes_data_parallel: int
    rejected_by_reason: dict[str, int]
    submissions: int
    learners: int
    wall_s: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def reason_class(reason: str | None) -> str:
    """Group reasons by their first words ('stale: based on v3 …' -> 'stale')."""
    if not reason:
        return "unknown"
    head = reason.split(":", 1)[0]
    return head if len(head) <= 48 else head[:48]


def step_tokens(config: Mapping[str, Any]) -> int:
    """Tokens one learner step trains, from a run's recorded config (1 when the config does not say)."""
    try:
        return tokens_per_step(ModelConfig.model_validate(config["model"]), int(config["learners"]["batch_size"]))
    except (KeyError, TypeError, ValueError):  # a pydantic ValidationError is a ValueError
        return 1


def summarize(agg: RunAggregates, now: datetime) -> RunSummary:
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
    merged_share = acct.merged / acct.trained if acct.trained else 0.0
    reasons: Counter[str] = Counter()
    for reason, n in agg.rejected_reasons.items():
        reasons[reason_class(reason)] += n
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
        goodput=merged_share * min(1.0, agg.busy_s / allocated),
        longest_version_gap_s=gap,
        bytes_sent=agg.bytes_sent,
        bytes_data_parallel=int(steps * agg.parameters * DP_BYTES_PER_PARAM),
        rejected_by_reason=dict(reasons),
        submissions=agg.submissions,
        learners=agg.learners,
        wall_s=wall,
    )


def run_summary(session: Session, run_id: str, now: datetime) -> RunSummary:
    """``summarize`` of the run's aggregates as the ledger holds them now."""
    return summarize(q.run_aggregates(session, run_id), now)
