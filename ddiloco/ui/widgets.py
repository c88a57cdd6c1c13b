"""Small Streamlit building blocks shared by the pages: badges, coloured tables, error guards."""

from __future__ import annotations

import re
import string
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from urllib.parse import urlsplit

import pandas as pd
import streamlit as st
from pandas.io.formats.style import Styler
from sqlalchemy.exc import SQLAlchemyError

from ddiloco.platform import liveness
from ddiloco.platform.redact import redact_url
from ddiloco.ui import health as h
from ddiloco.ui import loaders
from ddiloco.ui.queries import LedgerUnavailable

LEVEL_ICONS = {
    h.HEALTHY: ":material/check_circle:",
    h.DEGRADED: ":material/warning:",
    h.DOWN: ":material/error:",
    h.FAILED: ":material/error:",
    h.STARTING: ":material/hourglass_top:",
    h.FINISHED: ":material/flag:",
}


# Every ASCII punctuation character may be backslash-escaped in CommonMark; escaping them all leaves no
# link, emphasis, directive (``:red[…]``), HTML or LaTeX. GFM's literal autolinks (``www.x.y``,
# ``https://x.y``, ``a@x.y``) are found in the text after escapes are resolved, so an invisible
# zero-width space breaks each of their openings instead.
_MD_ESCAPES = str.maketrans({c: "\\" + c for c in string.punctuation})
_AUTOLINK_OPENINGS = re.compile(r"(://|(?i:www)(?=\.)|@)")
ZWSP = "\u200b"
SHOWN_CHARS = 1000
"""Longest piece of ledger or URL text shown in one line; the rest is cut."""


def md(text: object) -> str:
    """Ledger- or URL-sourced text made inert for st.markdown / caption / title / alerts: shown as written, never as markup."""
    flat = " ".join(str(text).split())
    if len(flat) > SHOWN_CHARS:
        flat = flat[:SHOWN_CHARS] + "…"
    return _AUTOLINK_OPENINGS.sub(lambda m: m.group(0)[0] + ZWSP + m.group(0)[1:], flat).translate(_MD_ESCAPES)


def safe_link(url: object) -> str | None:
    """``url`` when it is an absolute http(s) link, else None: a ``javascript:`` or ``data:`` URL is never rendered."""
    if not isinstance(url, str) or any(c.isspace() or ord(c) < 32 for c in url):
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    return url if parts.scheme.lower() in ("http", "https") and parts.hostname else None


def refresh_interval() -> float | None:
    """Seconds between automatic refreshes as chosen in the sidebar (None: off)."""
    return loaders.REFRESH_CHOICES.get(st.session_state.get("refresh", loaders.DEFAULT_REFRESH), None)


@contextmanager
def ledger_errors() -> Iterator[None]:
    """Turn a ledger that went away mid-page into a message instead of a traceback."""
    try:
        yield
    except LedgerUnavailable as err:
        st.error(md(err), icon=":material/database_off:")
    except SQLAlchemyError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        st.error(f"Could not read the ledger: {md(redact_url(first))}. The page retries at the next refresh.",
                 icon=":material/database_off:")


def badge_markup(level: str) -> str:
    """Markdown for an inline health badge (e.g. beside a title)."""
    icon = LEVEL_ICONS.get(level, "")
    return f":{h.color_of(level)}-badge[{icon} {level.upper()}]"


def status_css(value: object) -> str:
    """Cell style of a status: white text on the status colour."""
    color = h.STATUS_COLORS.get(str(value))
    if color is None:
        return ""
    return f"background-color: {h.HEX[color]}; color: white; font-weight: 600"


def category_css(value: object) -> str:
    """Cell style of an event category: its colour, bold."""
    return f"color: {h.HEX[h.CATEGORY_COLORS.get(str(value), 'gray')]}; font-weight: 600"


def styled(df: pd.DataFrame, status_columns: Sequence[str] = ("status",)) -> Styler:
    """The table with its status cells coloured (styling only the status columns keeps it cheap)."""
    sty = df.style
    present = [c for c in status_columns if c in df.columns]
    if present:
        sty = sty.map(status_css, subset=present)
    return sty


def ago(when: datetime | None, now: datetime, *, ended: bool = False) -> str:
    """How long before ``now`` something happened: '3.2s ago' while the run runs; for an ended run ``now`` is its end,
    and it reads '3.2s before the end' (or 'after', for a last heartbeat that came in as the run was ending)."""
    if when is None or pd.isna(when):
        return "never"
    seconds = (now - when).total_seconds()
    if not ended:
        return f"{liveness.format_duration(seconds)} ago"
    return f"{liveness.format_duration(abs(seconds))} {'before' if seconds >= 0 else 'after'} the end"


def no_data(message: str) -> None:
    st.info(message, icon=":material/info:")
