"""What every role reads or writes of a run: the run row and its recorded config, fragment specs, learner rows,
the fragments' newest versions, events and evaluations. Each function takes a Session and never opens one; the caller
owns the transaction. ``now`` is always passed in (UTC, timezone-aware)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from ddiloco.platform import liveness
from ddiloco.platform.ids import validate_id
from ddiloco.platform.ledger._common import INT64_MAX, _insert, _inserted, check_count
from ddiloco.platform.ledger.errors import UnknownRunError
from ddiloco.platform.ledger.models import (
    Evaluation,
    Event,
    FragmentHead,
    FragmentSpec,
    FragmentVersion,
    Learner,
    Run,
)

# --- runs -----------------------------------------------------------------------------------------


def create_run(
    session: Session,
    run_id: str,
    *,
    config_json: str,
    code_version: str,
    git_commit: str | None,
    num_fragments: int,
    token_budget: int,
    now: datetime,
    flow_run_url: str | None = None,
) -> bool:
    """Register a run; a second call with the same id is a no-op. Returns True if it was created."""
    validate_id(run_id, "run")  # ids are shown and become store keys: no markup, no path tricks
    check_count(num_fragments, "num_fragments", least=1), check_count(token_budget, "token_budget", least=1, most=INT64_MAX)
    stmt = (
        _insert(session, Run)
        .values(
            id=run_id,
            created_at=now,
            status="running",
            config_json=config_json,
            code_version=code_version,
            git_commit=git_commit,
            num_fragments=num_fragments,
            token_budget=token_budget,
            flow_run_url=flow_run_url,
        )
        .on_conflict_do_nothing(index_elements=["id"])
    )
    created = _inserted(session, stmt.returning(Run.id))
    if created:
        record_event(session, run_id, "run_created", None, f"{num_fragments} fragments", now)
    return created


def get_run(session: Session, run_id: str) -> Run | None:
    return session.get(Run, run_id)


def require_run(session: Session, run_id: str) -> Run:
    run = get_run(session, run_id)
    if run is None:
        raise UnknownRunError(f"run {run_id!r} is not in the ledger")
    return run


def list_runs(session: Session) -> list[Run]:
    return list(session.scalars(select(Run).order_by(Run.created_at.desc())))


RUNNING = "running"
FINISHED = "finished"
"""Ended as planned: at its token budget, its time box, or by ``ddiloco run finish``; what is pending is still merged."""
STOPPED = "stopped"
"""Ended by ``ddiloco run stop``: every process of the run exits, and nothing more is merged."""
FAILED = "failed"
RUN_ENDS = (FINISHED, STOPPED, FAILED)
"""The statuses a run ends in. A run is created running and ends once: learners, synchronizers and the evaluator
exit when they see any status but running."""


def set_run_status(session: Session, run_id: str, status: str, now: datetime, detail: str = "") -> bool:
    """End a running run as ``status`` (one of :data:`RUN_ENDS`) at ``now``; returns whether it was running. An ended
    run keeps its first end: a supervisor finishing a run an operator stopped leaves it stopped, and its end time."""
    if status not in RUN_ENDS:
        raise ValueError(f"a run ends as one of {', '.join(RUN_ENDS)}, not {status!r}")
    ended = session.execute(
        update(Run).where(Run.id == run_id, Run.status == RUNNING).values(status=status, finished_at=now).returning(Run.id)
    ).first()
    if ended is not None:
        record_event(session, run_id, f"run_{status}", None, detail, now)
    return ended is not None


def tokens_merged(session: Session, run_id: str) -> int:
    """Tokens merged into the run's global versions so far, from the fragments' running totals (P rows)."""
    total = session.scalar(select(func.coalesce(func.sum(FragmentHead.tokens_merged), 0)).where(FragmentHead.run_id == run_id))
    return int(total or 0)


def recorded_config(run: Run) -> dict[str, Any]:
    """The config the run recorded, as a dict (empty when it cannot be read): what reports and the
    dashboard read of it. ``export.recorded_config`` validates it into a RunConfig instead."""
    try:
        config = json.loads(run.config_json) if run.config_json else {}
    except ValueError:
        config = {}
    return config if isinstance(config, dict) else {}


def recorded_shards(config: Mapping[str, Any]) -> int:
    """The run's synchronizer shards, as its recorded config (:func:`recorded_config`) says (1 when it does not say)."""
    shards = (config.get("synchronizer") or {}).get("shards", 1)
    return shards if isinstance(shards, int) and not isinstance(shards, bool) and shards >= 1 else 1


def set_fragment_specs(session: Session, run_id: str, specs: Sequence[tuple[int, list[Any], int, int]]) -> None:
    """Record (fragment, tensors, numel, nbytes) once; later calls leave the first record."""
    for fragment, tensors, numel, nbytes in specs:
        stmt = (
            _insert(session, FragmentSpec)
            .values(run_id=run_id, fragment=fragment, tensors_json=json.dumps(tensors), numel=numel, nbytes=nbytes)
            .on_conflict_do_nothing(index_elements=["run_id", "fragment"])
        )
        session.execute(stmt)


def fragment_specs(session: Session, run_id: str) -> dict[int, list[Any]]:
    rows = session.scalars(select(FragmentSpec).where(FragmentSpec.run_id == run_id).order_by(FragmentSpec.fragment))
    return {r.fragment: json.loads(r.tensors_json) for r in rows}


# --- learner rows and newest versions -------------------------------------------------------------


def learners(session: Session, run_id: str) -> list[Learner]:
    return list(session.scalars(select(Learner).where(Learner.run_id == run_id).order_by(Learner.region, Learner.id)))


def learner_snapshots(rows: Sequence[Any]) -> list[liveness.LearnerSnapshot]:
    """What the liveness rule needs of each learner: from its rows, or from rows of just the columns it needs
    (:func:`read_learner_snapshots`)."""
    return [
        liveness.LearnerSnapshot(
            id=r.id, last_heartbeat_at=r.last_heartbeat_at, started_at=r.started_at,
            step=int(r.step), step_time_s=float(r.step_time_s or 0.0), ledger_status=r.status, region=r.region,
        )
        for r in rows
    ]


def read_learner_snapshots(session: Session, run_id: str) -> list[liveness.LearnerSnapshot]:
    """:func:`learner_snapshots` of the run's learners, reading only the columns the liveness rule needs."""
    rows = session.connection().execute(
        select(Learner.id, Learner.last_heartbeat_at, Learner.started_at, Learner.step, Learner.step_time_s, Learner.status,
               Learner.region)
        .where(Learner.run_id == run_id)
        .order_by(Learner.region, Learner.id)
    )
    return learner_snapshots(rows.all())


def latest_versions(session: Session, run_id: str) -> dict[int, FragmentHead]:
    """The newest published version of every fragment (its head row: the version's own columns)."""
    return {h.fragment: h for h in session.scalars(select(FragmentHead).where(FragmentHead.run_id == run_id))}


def latest_version_numbers(session: Session, run_id: str) -> dict[int, int]:
    return dict(session.execute(select(FragmentHead.fragment, FragmentHead.version).where(FragmentHead.run_id == run_id)).all())


def get_version(session: Session, run_id: str, fragment: int, version: int) -> FragmentVersion | None:
    check_count(fragment, "fragment"), check_count(version, "version")
    return session.get(FragmentVersion, (run_id, fragment, version))


# --- events and evaluations -----------------------------------------------------------------------


LEARNER_JOINED = "learner_joined"


LEARNER_RESTARTED = "learner_restarted"


LEARNER_LAUNCHED = "learner_launched"
"""A supervisor started a learner's process (its actor is the learner)."""


LEARNER_EXITED = "learner_exited"
"""A supervisor saw a learner's process end, or ended it (its actor is the learner)."""


def record_event(session: Session, run_id: str, kind: str, actor: str | None, detail: str, now: datetime) -> None:
    session.add(Event(run_id=run_id, at=now, kind=kind, actor=actor, detail=detail))


def events(session: Session, run_id: str, limit: int = 500) -> list[Event]:
    check_count(limit, "limit")
    return list(session.scalars(select(Event).where(Event.run_id == run_id).order_by(Event.at.desc(), Event.id.desc()).limit(limit)))


def record_evaluation(
    session: Session, run_id: str, *, now: datetime, tokens: int, versions_total: int, val_loss: float, val_accuracy: float | None
) -> None:
    session.add(
        Evaluation(run_id=run_id, at=now, tokens=tokens, versions_total=versions_total, val_loss=val_loss, val_accuracy=val_accuracy)
    )


def evaluations(session: Session, run_id: str) -> list[Evaluation]:
    return list(session.scalars(select(Evaluation).where(Evaluation.run_id == run_id).order_by(Evaluation.at, Evaluation.id)))
