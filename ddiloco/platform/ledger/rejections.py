"""How rejected work is decided and counted: the statements both a synchronizer (a failed validation) and a learner
(its own superseded submissions, through ``ledger.roles``' function) reject with, and the reason classes it is counted by."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from ddiloco.platform.ledger._common import _insert
from ddiloco.platform.ledger.errors import AlreadyDecidedError
from ddiloco.platform.ledger.models import (
    PENDING,
    REJECTED,
    RejectionTotal,
    Run,
    Submission,
)


def decide_rejected(session: Session, run_id: str, ids: Iterable[int], reason: str, now: datetime) -> None:
    """Reject pending submissions of the run, adding them to the run's running totals of rejected work and to
    each learner id's total for the reason's class."""
    ids = list(ids)
    if not ids:
        return
    decided = session.execute(rejection(run_id, Submission.id.in_(ids), reason, now)).all()
    if len(decided) != len(ids):
        raise AlreadyDecidedError(f"{len(ids) - len(decided)} of submissions {ids} already have a fate")
    tokens = sum(int(t) for _, t, _ in decided)
    session.execute(count_rejected(run_id, tokens, len(decided)).execution_options(synchronize_session=False))
    by_learner: dict[str, tuple[int, int, int]] = {}
    for learner_id, t, b in decided:
        n0, t0, b0 = by_learner.get(learner_id, (0, 0, 0))
        by_learner[learner_id] = (n0 + 1, t0 + int(t), b0 + int(b))
    rows = [{"run_id": run_id, "learner_id": lid, "reason": reason_class(reason), "submissions": n, "tokens": t,
             "nbytes": b} for lid, (n, t, b) in by_learner.items()]
    session.execute(count_rejected_by(_insert(session, RejectionTotal), rows))


def rejection(run_id: Any, which: Any, reason: Any, now: Any) -> Any:
    """UPDATE … RETURNING (learner_id, tokens_new, nbytes): the run's pending submissions that ``which`` picks become
    rejected.

    The arguments are values or SQL expressions: ``ledger.roles`` compiles this same statement into the
    learners' SECURITY DEFINER function."""
    return (
        update(Submission)
        .where(which, Submission.run_id == run_id, Submission.status == PENDING)
        .values(status=REJECTED, reject_reason=reason, decided_at=now)
        .returning(Submission.learner_id, Submission.tokens_new, Submission.nbytes)
    )


def count_rejected(run_id: Any, tokens: Any, submissions: Any) -> Any:
    """UPDATE: add rejected work to the run's running totals (values or SQL expressions, as :func:`rejection`)."""
    return (
        update(Run)
        .where(Run.id == run_id)
        .values(tokens_rejected=Run.tokens_rejected + tokens, submissions_rejected=Run.submissions_rejected + submissions)
    )


def count_rejected_by(insert_: Any, rows: Sequence[Mapping[str, Any]]) -> Any:
    """INSERT … ON CONFLICT: add rejected work to (run, learner id, reason class) totals; ``insert_`` is the dialect's
    ``insert(RejectionTotal)`` and the rows' values may be SQL expressions (as :func:`rejection`)."""
    stmt = insert_.values(list(rows))
    return stmt.on_conflict_do_update(
        index_elements=["run_id", "learner_id", "reason"],
        set_={c: getattr(RejectionTotal, c) + getattr(stmt.excluded, c) for c in ("submissions", "tokens", "nbytes")},
    )


UNKNOWN_REASON = "unknown"


def reason_class(reason: str | None) -> str:
    """A rejection reason without its figures and names ('stale: based on v3, now v5' -> 'stale', "unknown learner
    'x'" -> 'unknown learner'): the few words rejected work is counted by in the ledger, the summary and the metrics."""
    if not reason:
        return UNKNOWN_REASON
    words = re.split(r"[\d:(=<>'\"]", reason, maxsplit=1)[0].lower()
    return " ".join(re.sub(r"[^a-z]+", " ", words).split())[:48] or "other"
