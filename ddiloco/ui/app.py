"""The dashboard's entry point: ``streamlit run ddiloco/ui/app.py -- --ledger URL`` (what ``ddiloco ui`` runs).

The ledger comes from ``--ledger`` or the ``DDILOCO_LEDGER_URL`` environment variable. The page only
reads it, through a read-only engine; a ledger that is missing, unreachable or has no schema yet
gets a message saying what to do, never a traceback."""

from __future__ import annotations

import streamlit as st

from ddiloco.platform.redact import redact_url
from ddiloco.ui import LEDGER_URL_ENV, loaders, widgets

st.set_page_config(page_title="ddiloco · run health", page_icon=":material/monitor_heart:", layout="wide")
# Less blank space above the title: on-call screens are for numbers.
st.html("<style>[data-testid='stMainBlockContainer'] { padding-top: 2.5rem; }</style>")

OVERVIEW = st.Page("views/overview.py", title="Runs overview", icon=":material/dashboard:", url_path="runs", default=True)
RUN_HEALTH = st.Page("views/run_health.py", title="Run health", icon=":material/monitor_heart:", url_path="health")
page = st.navigation([OVERVIEW, RUN_HEALTH])

url = loaders.ledger_url()
with st.sidebar:
    st.selectbox(
        "Auto-refresh",
        list(loaders.REFRESH_CHOICES),
        index=list(loaders.REFRESH_CHOICES).index(loaders.DEFAULT_REFRESH),
        key="refresh",
        help="How often the page re-reads the ledger.",
    )
    if url:
        st.caption(f"Ledger (read-only): {widgets.md(redact_url(url))}")

if not url:
    st.title("ddiloco operations dashboard")
    st.error(
        f"No ledger chosen. Start the dashboard with `ddiloco ui --ledger URL`, or set {LEDGER_URL_ENV} "
        "(e.g. `sqlite:///./ddiloco-runs/ledger.db` or `postgresql+psycopg://user@host/db`).",
        icon=":material/database_off:",
    )
    st.stop()

problem = loaders.ledger_problem(url)
if problem:
    st.title("ddiloco operations dashboard")
    st.error(widgets.md(problem), icon=":material/database_off:")
    st.stop()

page.run()
