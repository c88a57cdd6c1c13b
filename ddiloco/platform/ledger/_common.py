"""Helpers the ledger's query modules share (not for callers outside ``platform.ledger``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sqlalchemy import BigInteger, Float, Integer
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ddiloco.platform.ledger.errors import InvalidArgumentError, LedgerError


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


INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1


def column_problem(model: type, values: Mapping[str, Any]) -> str | None:
    """Why ``values`` cannot be stored in ``model``'s columns of the same names (an integer beyond its column's range,
    a float that is not finite), or None. Both backends store what fits: PostgreSQL's INTEGER is 32 bits and raised
    a DataError past it, SQLite an OverflowError past 64."""
    columns = model.__table__.columns  # type: ignore[attr-defined]
    for name, value in values.items():
        column = columns.get(name)
        if column is None or value is None or isinstance(value, bool):
            continue
        if isinstance(column.type, Integer) and isinstance(value, int):
            most = INT64_MAX if isinstance(column.type, BigInteger) else INT32_MAX
            if not -most - 1 <= value <= most:
                return f"{name}={value} does not fit the ledger's {most.bit_length() + 1}-bit column"
        elif isinstance(column.type, Float) and isinstance(value, float) and not math.isfinite(value):
            return f"{name}={value} is not finite"
    return None


def check_count(value: Any, what: str, *, least: int = 0, most: int = INT32_MAX) -> int:
    """``value`` if it is an integer in [least, most], else an :class:`InvalidArgumentError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise InvalidArgumentError(f"{what} must be an integer from {least} to {most}, got {value!r}")
    return value


def check_seconds(value: Any, what: str, *, positive: bool = True, most: float = 1e9) -> float:
    """``value`` if it is a finite number of seconds (above 0 when ``positive``, else at least 0) up to ``most``."""
    return check_figure(value, what, positive=positive, most=most, unit=" of seconds")


def check_figure(value: Any, what: str, *, positive: bool = False, most: float, unit: str = "") -> float:
    """``value`` if it is a finite number (above 0 when ``positive``, else at least 0) up to ``most``."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value <= most
    if not ok or (value <= 0 if positive else value < 0):
        bound = "above 0" if positive else "at least 0"
        raise InvalidArgumentError(f"{what} must be a finite number{unit} {bound} and at most {most:g}, got {value!r}")
    return float(value)
