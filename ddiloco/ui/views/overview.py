"""Runs overview: every run with its health badge, progress and headline figures."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from ddiloco.platform import liveness
from ddiloco.ui import health as h
from ddiloco.ui import loaders, widgets

# Runs shown as cards (newest first); every run is in the table below them. (No bare string
# literals in page scripts: Streamlit's "magic" would print them.)
CARDS = 9

URL = loaders.ledger_url()

st.title("Runs overview")


def run_card(row) -> None:  # noqa: ANN001 - a pandas row
    with st.container(border=True):
        st.markdown(f"#### {widgets.md(row.run)} &nbsp; {widgets.badge_markup(row.health)}")
        st.caption(widgets.md(row.reason or row.status))
        val_loss = "—" if pd.isna(row.val_loss) else f"{row.val_loss:.3f}"
        # An ended run's learners are counted, not called up: liveness means nothing after the end.
        learners = f"**{row.learners_alive}/{row.learners}** learners up" if row.status == "running" else (
            f"**{row.learners}** learners · {widgets.md(row.status)}")
        st.markdown(
            f"**{h.format_count(row.tokens)}** tokens · **{row.versions:,}** versions · **{row.goodput:.0%}** goodput  \n"
            f"{learners} · val loss **{val_loss}** · age **{liveness.format_duration(row.age_s)}**"
        )
        st.page_link(
            "views/run_health.py", label="Open run health", icon=":material/arrow_forward:", query_params={"run": row.run}
        )


@st.fragment(run_every=widgets.refresh_interval())
def overview() -> None:
    with widgets.ledger_errors():
        runs, now = loaders.runs_overview(URL)
        st.caption(f"As of {now:%Y-%m-%d %H:%M:%S} UTC")
        if runs.empty:
            widgets.no_data(
                "This ledger has no runs yet. Start one (`ddiloco demo`, or the training flow); "
                "this page picks it up at the next refresh."
            )
            return
        counts = runs["health"].value_counts()
        cols = st.columns(5)
        cols[0].metric("Runs", len(runs))
        cols[1].metric("Running", int((runs["status"] == "running").sum()))
        cols[2].metric("Healthy", int(counts.get(h.HEALTHY, 0)))
        cols[3].metric("Degraded", int(counts.get(h.DEGRADED, 0)))
        cols[4].metric("Down", int(counts.get(h.DOWN, 0) + counts.get(h.FAILED, 0)))
        shown = runs.head(CARDS)
        for start in range(0, len(shown), 3):
            for col, row in zip(st.columns(3), shown.iloc[start : start + 3].itertuples()):
                with col:
                    run_card(row)
        st.subheader("All runs")
        table = runs.drop(columns=["created_at"]).assign(
            age=[liveness.format_duration(s) for s in runs["age_s"]],
            downtime=[liveness.format_duration(s) for s in runs["downtime_s"]],
        )
        table = table[
            [
                "run",
                "health",
                "status",
                "age",
                "tokens",
                "versions",
                "goodput",
                "downtime",
                "val_loss",
                "learners_alive",
                "learners",
                "reason",
            ]
        ]
        st.dataframe(
            widgets.styled(table, status_columns=("health",)).format(
                {"goodput": "{:.1%}", "val_loss": "{:.4f}", "tokens": "{:,}"}, na_rep="—"
            ),
            hide_index=True,
            column_config={
                "run": st.column_config.TextColumn("run"),
                "tokens": st.column_config.NumberColumn("tokens trained"),
                "versions": st.column_config.NumberColumn("global versions"),
                "downtime": st.column_config.TextColumn("global downtime", help="Longest gap between two global versions"),
                "val_loss": st.column_config.NumberColumn("validation loss"),
                "learners_alive": st.column_config.NumberColumn("learners up"),
                "reason": st.column_config.TextColumn("why", width="large"),
            },
        )


overview()
