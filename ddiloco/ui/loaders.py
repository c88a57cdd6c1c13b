"""Streamlit's side of the data: which ledger, the cached read-only engine, cached query results, the clock.

The reads live in :mod:`ddiloco.ui.queries` (frames) and the ledger's report modules (plain functions of a Session); this module
only decides how long their results may be reused (``CACHE_TTL_S``) and opens the sessions. A session
here is never committed: it reads one snapshot and is rolled back when it closes."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone

import pandas as pd
import streamlit as st
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ddiloco.platform.ledger import dashboard as dash_q
from ddiloco.ui import LEDGER_URL_ENV
from ddiloco.ui import queries as uq

CACHE_TTL_S = 4.0
"""Query results are reused this long: shorter than the fastest auto-refresh, so each refresh reads fresh data."""
REFRESH_CHOICES: dict[str, float | None] = {"5 s": 5.0, "10 s": 10.0, "30 s": 30.0, "1 min": 60.0, "off": None}
DEFAULT_REFRESH = "10 s"


def utcnow() -> datetime:
    """The dashboard's clock (tests replace it to look at a simulated run as of its own time)."""
    return datetime.now(timezone.utc)


def ledger_url(argv: list[str] | None = None) -> str | None:
    """``--ledger URL`` after ``streamlit run app.py --``, else the ``DDILOCO_LEDGER_URL`` environment variable."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--ledger", default=None)
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args.ledger or os.environ.get(LEDGER_URL_ENV) or None


@st.cache_resource(show_spinner=False)
def engine(url: str) -> Engine:
    """One read-only engine (and its pool) per ledger URL for the whole server."""
    return uq.read_only_engine(url)


def _read(url: str, fn, *args):  # noqa: ANN001, ANN202 - a thin pass-through
    with Session(engine(url)) as session:
        try:
            return fn(session, *args)
        finally:
            session.rollback()


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def ledger_problem(url: str) -> str | None:
    """Why the ledger cannot be shown (no file, no server, no schema), or None when it can."""
    try:
        uq.check_schema(engine(url))
    except uq.LedgerUnavailable as err:
        return str(err)
    return None


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def run_ids(url: str) -> list[str]:
    return _read(url, dash_q.run_ids)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)  # no spinner flicker at every auto-refresh
def runs_overview(url: str) -> tuple[pd.DataFrame, datetime]:
    now = utcnow()
    return _read(url, uq.runs_overview, now), now


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)  # no spinner flicker at every auto-refresh
def run_page(url: str, run_id: str) -> uq.RunPage | None:
    return _read(url, uq.run_page, run_id, utcnow())
