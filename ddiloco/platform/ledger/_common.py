"""Helpers the ledger's query modules share (not for callers outside ``platform.ledger``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ddiloco.platform.ledger.errors import LedgerError


def _insert(session: Session, model: type) -> Any:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(model)
    if dialect == "sqlite":
        return sqlite.insert(model)
    raise LedgerError(f"unsupported ledger backend {dialect!r}: use sqlite or postgresql")


def _inserted(session: Session, stmt: Any) -> bool:
    """Run an insert … on conflict do nothing … returning; True when a row was written."""
    return session.execute(stmt).first() is not None


def _greatest(session: Session) -> Any:
    return func.max if session.get_bind().dialect.name == "sqlite" else func.greatest
