"""Run health: is the run progressing, who is down or straggling, is the synchronizer merging,
what each region contributes, and what went wrong."""

from __future__ import annotations

import math

import streamlit as st

from ddiloco.platform import liveness
from ddiloco.platform.summary import breakdown_line
from ddiloco.platform.units import format_flops
from ddiloco.ui import charts, loaders, widgets
from ddiloco.ui import health as h
from ddiloco.ui.queries import RunPage

URL = loaders.ledger_url()
SEVERITY = {liveness.DEAD: 0, liveness.STRAGGLING: 1, liveness.RECOVERING: 2, liveness.ALIVE: 3}
EVENT_ROWS = 200  # newest events listed in the table (the timeline shows more)
ENDED_AT = {"finished": "Finished at", "stopped": "Stopped at", "failed": "Failed at"}
"""The label of an ended run's end-time tile, by status."""


def pick_run() -> str | None:
    with widgets.ledger_errors():
        ids = loaders.run_ids(URL)
        if not ids:
            st.title("Run health")
            widgets.no_data("This ledger has no runs yet. Start one (`ddiloco demo`, or the training flow) and reload.")
            return None
        wanted = st.query_params.get("run")
        if wanted is not None and wanted not in ids:
            # The parameter comes from whoever made the link: shown as text, never as markup.
            st.warning(f"Run {widgets.md(repr(wanted))} is not in this ledger; showing the newest run instead.")
        index = ids.index(wanted) if wanted in ids else 0
        run_id = st.sidebar.selectbox("Run", ids, index=index, help="Runs in the ledger, newest first.")
        st.query_params["run"] = run_id
        return run_id
    return None


def ended_line(page: RunPage) -> str:
    """When and after how long an ended run ended, e.g. 'finished at 2026-11-25 14:03:22 UTC, after 2m 31s'."""
    info = page.snapshot.info
    if info.finished_at is None:
        return f"{info.status} (no end time recorded)"
    ran = liveness.format_duration((info.finished_at - info.created_at).total_seconds())
    return f"{info.status} at {info.finished_at:%Y-%m-%d %H:%M:%S} UTC, after {ran}"


def header(page: RunPage) -> None:
    snap, s = page.snapshot, page.summary
    running = snap.info.running
    left, right = st.columns([4, 1], vertical_alignment="center")
    with left:
        st.title(f"Run {widgets.md(snap.info.id)} {widgets.badge_markup(snap.health.level)}")
        started = f"started {snap.info.created_at:%Y-%m-%d %H:%M:%S} UTC"
        st.caption(
            f"status **{widgets.md(snap.info.status)}** · "
            + (f"{started} ({liveness.format_duration((page.now - snap.info.created_at).total_seconds())} ago)" if running
               else f"{started}, {widgets.md(ended_line(page))}")
            + f" · {snap.info.num_fragments} fragments · code {widgets.md(snap.info.code_version)}"
            + (f" @ {widgets.md(snap.info.git_commit[:10])}" if snap.info.git_commit else "")
            + (f" · as of {page.now:%H:%M:%S} UTC" if running else " · every figure as of its end")
        )
    with right:
        link = widgets.safe_link(snap.info.flow_run_url)
        if link:
            st.link_button("Prefect flow run", link, icon=":material/open_in_new:", width="stretch")
        elif snap.info.flow_run_url:
            st.caption("The recorded Prefect flow run URL is not an http(s) link: not shown.")
        else:
            st.caption("No Prefect flow run recorded for this run (started outside Prefect).")
    reasons = widgets.md(" · ".join(snap.health.reasons))
    if not running:
        reasons = widgets.md(f"The run {ended_line(page)}. Learners, heartbeats and the synchronizer are shown as they were at its end.")
    if snap.health.level in (h.DOWN, h.FAILED):
        st.error(reasons, icon=":material/error:")
    elif snap.health.level == h.DEGRADED:
        st.warning(reasons, icon=":material/warning:")
    elif snap.health.level in (h.STARTING, h.FINISHED):
        st.info(reasons, icon=":material/info:")
    else:
        st.success(reasons, icon=":material/check_circle:")

    counts = h.count_statuses(snap.verdicts.values())
    up = counts[liveness.ALIVE] + counts[liveness.STRAGGLING] + counts[liveness.RECOVERING]
    evals = page.evaluations
    cols = st.columns(7)
    budget = snap.info.token_budget
    # Every value fits its tile (Streamlit cuts a longer one off with '…'); the exact figures are in the help.
    cols[0].metric(
        "Tokens trained",
        h.format_count(s.tokens),
        help=f"{s.tokens:,} trained: {s.tokens_merged:,} merged · {s.tokens_rejected:,} rejected · {s.tokens_pending:,} pending · "
        f"{s.tokens_lost:,} lost · {s.tokens_in_flight:,} in flight" + (f" · budget {budget:,}" if budget else ""),
    )
    versions = sum(s.versions.values())
    cols[1].metric("Global versions", h.format_count(versions), help=f"{versions:,} versions published, over every fragment")
    cols[2].metric(
        "Goodput",
        f"{s.goodput:.1%}",
        help=f"Share of allocated learner time that produced merged progress: {s.goodput_of_bound:.1%} of the "
        f"{s.availability_bound:.1%} the learners were available. Learner-seconds: {breakdown_line(s)}",
    )
    cols[3].metric(
        "Max downtime",
        liveness.format_duration(s.longest_version_gap_s),
        help="Global downtime: the longest gap between two new global versions",
    )
    if len(evals):
        delta = float(evals["val_loss"].iloc[-1] - evals["val_loss"].iloc[-2]) if len(evals) > 1 else None
        cols[4].metric(
            "Validation loss",
            f"{evals['val_loss'].iloc[-1]:.4f}",
            delta=None if delta is None else f"{delta:+.4f}",
            delta_color="inverse",
        )
    else:
        cols[4].metric("Validation loss", "—")
    if running:
        cols[5].metric("Learners up", f"{up}/{len(snap.verdicts)}")
        cols[6].metric("Since new version", liveness.format_duration(snap.sync.last_version_age_s))
        return
    # An ended run: when it ended and how long it ran, never a liveness figure against a clock past its end.
    end = snap.info.finished_at
    cols[5].metric(
        ENDED_AT.get(snap.info.status, "Ended at"),
        f"{end:%H:%M}" if end is not None else "—",
        help=f"The run {ended_line(page)}; {len(snap.verdicts)} learners had joined, {up} of them up at the end.",
    )
    cols[6].metric(
        "Ran for",
        liveness.format_duration((end - snap.info.created_at).total_seconds()) if end is not None else "—",
        help=f"From its start, {snap.info.created_at:%Y-%m-%d %H:%M:%S} UTC, to its end",
    )


def learners_section(page: RunPage) -> None:
    st.header("Learners by region", divider="gray")
    df = page.learners
    if df.empty:
        widgets.no_data(
            "No learner has joined this run yet: there are no heartbeats to judge. Learners appear here when they start."
        )
        return
    if df["loss"].isna().all() and (df["step"] == 0).all():
        widgets.no_data("Learners have joined but none has reported a training step yet.")
    ended = not page.snapshot.info.running
    if ended:
        st.caption("As they were when the run ended: status, last heartbeat and last submission are judged at its end.")
        # An alive learner's reason is its heartbeat's age, which the 'last heartbeat' column gives against the end.
        df = df.assign(reason=df["reason"].where(df["status"] != liveness.ALIVE, "alive when the run ended"))
    for region, verdict in page.snapshot.regions.items():
        if verdict.status == liveness.CUT_OFF:
            # A partition reads as dead learners one by one: say what they have in common.
            st.error(f"Region **{widgets.md(region)}** {widgets.md(verdict.reason)}", icon=":material/cloud_off:")
    grid, regions = st.columns([3, 2])
    with grid:
        st.altair_chart(charts.learner_grid(df), width="stretch")
    with regions:
        st.altair_chart(charts.region_tokens(page.regions), width="stretch")
    table = df.assign(
        severity=df["status"].map(SEVERITY),
        last_heartbeat=[widgets.ago(t, page.snapshot.as_of, ended=ended) for t in df["last_heartbeat_at"]],
        last_submission=[widgets.ago(t, page.snapshot.as_of, ended=ended) for t in df["last_submission_at"]],
    ).sort_values(["region", "severity", "learner"])
    table = table[
        [
            "learner",
            "region",
            "status",
            "step",
            "tokens_per_s",
            "model_flops_per_s",
            "mfu",
            "last_heartbeat",
            "last_submission",
            "merged",
            "rejected",
            "pending",
            "tokens_trained",
            "tokens_merged",
            "loss",
            "queue_depth",
            "oldest_unsent_s",
            "cadence",
            "up_mbit_s",
            "down_mbit_s",
            "reason",
            "cadence_reason",
        ]
        + (["flow_run_url"] if df["flow_run_url"].notna().any() else [])
    ]
    if "flow_run_url" in table:
        table = table.assign(flow_run_url=table["flow_run_url"].map(widgets.safe_link))
    st.dataframe(
        widgets.styled(table).format(
            {"tokens_per_s": "{:,.0f}", "model_flops_per_s": lambda v: f"{format_flops(v)}/s", "mfu": "{:.1%}",
             "loss": "{:.3f}", "tokens_trained": "{:,}", "tokens_merged": "{:,}", "step": "{:,}",
             "queue_depth": "{:.0f}", "oldest_unsent_s": "{:.1f}", "up_mbit_s": "{:.3g}", "down_mbit_s": "{:.3g}"},
            na_rep="—",
        ),
        hide_index=True,
        height=min(600, 38 + 35 * len(table)),
        column_config={
            "status": st.column_config.TextColumn("status at the end" if ended else "status"),
            "tokens_per_s": st.column_config.NumberColumn("tokens/s"),
            "model_flops_per_s": st.column_config.TextColumn(
                "model FLOP/s", help="One device's model FLOPs a second, forward and backward (recomputed activations do not count)"),
            "mfu": st.column_config.NumberColumn(
                "MFU", help="Those FLOP/s against the device's dense bf16 peak; none for a CPU or a GPU without a published peak"),
            "last_heartbeat": st.column_config.TextColumn("last heartbeat"),
            "last_submission": st.column_config.TextColumn("last submission"),
            "tokens_trained": st.column_config.NumberColumn("tokens trained"),
            "tokens_merged": st.column_config.NumberColumn("tokens merged"),
            "loss": st.column_config.NumberColumn("train loss"),
            "reason": st.column_config.TextColumn("why", width="large"),
            "queue_depth": st.column_config.NumberColumn("upload queue", help="Fragments with an increment waiting to be uploaded"),
            "oldest_unsent_s": st.column_config.NumberColumn("oldest unsent (s)", help="How long the oldest waiting increment has waited"),
            "cadence": st.column_config.TextColumn("sends", help="How often each fragment is sent, and its codec"),
            "up_mbit_s": st.column_config.NumberColumn("up Mbit/s", help="What the learner's completed uploads moved while they ran"),
            "down_mbit_s": st.column_config.NumberColumn("down Mbit/s", help="The same for its downloads of global versions"),
            "cadence_reason": st.column_config.TextColumn("why these sends", width="large"),
            "flow_run_url": st.column_config.LinkColumn("Prefect", display_text="flow run"),
        },
    )
    st.markdown("**Tokens/s per learner** (its MFU in the tooltip where its device has a published peak)")
    if page.training_loss.empty:
        widgets.no_data("No heartbeat with a loss yet.")
    else:
        st.altair_chart(charts.throughput(page.training_loss), width="stretch")
    with st.expander("Regions in numbers"):
        st.dataframe(
            widgets.styled(page.regions).format(
                {"tokens_per_s": "{:,.0f}", "share_merged": "{:.1%}", "tokens_trained": "{:,}", "tokens_merged": "{:,}"}
            ),
            hide_index=True,
            column_config={"reason": st.column_config.TextColumn("why", width="large")},
        )


def synchronizer_section(page: RunPage) -> None:
    st.header("Synchronizer", divider="gray")
    sync = page.snapshot.sync
    ended = not page.snapshot.info.running
    left, right = st.columns([2, 3])
    with left:
        top = st.columns([1, 2], vertical_alignment="center")
        with top[0]:
            badge = "RUN ENDED" if ended else "ACTIVE" if sync.status == "active" else "NO ACTIVE SYNCHRONIZER"
            st.badge(badge, color=h.color_of(sync.status))
        top[1].markdown(f"**{widgets.md(sync.holder)}**" if sync.holder else "")
        if sync.status == "active" or ended:
            st.caption(widgets.md(sync.message))
        else:
            st.error(widgets.md(sync.message), icon=":material/error:")
        a, b = st.columns(2)
        last = page.last_merge_at
        if ended:  # a time of day fits the tile; the seconds, and how long before the end, go in its help
            a.metric("Last merge", f"{last:%H:%M}" if last is not None else "never",
                     help=f"{last:%Y-%m-%d %H:%M:%S} UTC, {widgets.ago(last, page.snapshot.as_of, ended=True)}"
                     if last is not None else None)
        else:
            a.metric("Last merge", widgets.ago(last, page.snapshot.as_of))
        b.metric(
            "Fencing token",
            str(int(page.holders["token"].max())) if len(page.holders) else "—",
            help="Grows by one at every change of holder",
        )
        merges = page.merges
        if len(merges):
            c, d = st.columns(2)
            c.metric(
                "Median quorum", f"{merges['quorum'].median():g}", help="Submissions a merge needed (per merge, newest merges)"
            )
            d.metric("Median grace waited", f"{merges['grace_waited_s'].median():.2f}s")
    with right:
        st.markdown("**Lease holders** (fencing token order)")
        if page.holders.empty:
            widgets.no_data("No synchronizer has published a version yet.")
        else:
            active = set((sync.holder or "").split(", ")) if sync.status == "active" else set()
            newest = page.holders.groupby("shard")["token"].transform("max")
            holders = page.holders.assign(
                role=[
                    "last holder" if ended and r.token == top else "active" if r.holder in active and r.token == top
                    else "former (standby or gone)"
                    for r, top in zip(page.holders.itertuples(), newest, strict=True)
                ]
            )
            if holders["shard"].max() == 0:  # one shard: the column says nothing
                holders = holders.drop(columns="shard")
            st.dataframe(
                holders,
                hide_index=True,
                column_config={
                    "first_publish": st.column_config.DatetimeColumn("first publish (UTC)", format="YYYY-MM-DD HH:mm:ss"),
                    "last_publish": st.column_config.DatetimeColumn("last publish (UTC)", format="YYYY-MM-DD HH:mm:ss"),
                },
            )
        st.caption(
            "A standby writes nothing to the ledger until it takes over the lease, so only synchronizers that held it are listed."
        )


def progress_section(page: RunPage) -> None:
    st.header("Global progress", divider="gray")
    left, right = st.columns(2)
    with left:
        st.markdown("**Version of each fragment over time**")
        if page.versions.empty:
            widgets.no_data("No global version published yet.")
        else:
            st.altair_chart(charts.version_timeline(page.versions), width="stretch")
    with right:
        if page.merges.empty:
            st.markdown("**Merges**")
            widgets.no_data("No merge yet: the synchronizer has not closed a quorum.")
        else:
            quorum, grace = st.tabs(["Quorum per merge", "Grace window per merge"])
            with quorum:
                st.altair_chart(charts.quorum_chart(page.merges), width="stretch")
            with grace:
                st.altair_chart(charts.grace_chart(page.merges), width="stretch")
    left, right = st.columns(2)
    with left:
        st.markdown("**Staleness of merged submissions**")
        if page.staleness.empty:
            widgets.no_data("No submission merged yet.")
        else:
            st.altair_chart(charts.staleness_histogram(page.staleness), width="stretch")
    with right:
        s = page.summary
        st.markdown("**Bytes sent vs data-parallel equivalent**")
        ratio = s.bytes_data_parallel / s.bytes_sent if s.bytes_sent else math.nan
        a, b, c = st.columns(3)
        a.metric("Sent", h.format_bytes(s.bytes_sent))
        b.metric("Data-parallel", h.format_bytes(s.bytes_data_parallel))
        c.metric("Saving", f"{ratio:,.0f}×" if math.isfinite(ratio) else "—", help="Data-parallel bytes / bytes sent")
        if s.bytes_sent or s.bytes_data_parallel:
            st.altair_chart(charts.bytes_chart(s.bytes_sent, s.bytes_data_parallel), width="stretch")
    if len(page.merges):
        with st.expander("Latest merges"):
            st.dataframe(page.merges.iloc[::-1].head(50), hide_index=True)


def loss_section(page: RunPage) -> None:
    st.header("Loss", divider="gray")
    left, right = st.columns(2)
    with left:
        st.markdown("**Validation loss vs tokens merged** (global model)")
        if page.evaluations.empty:
            widgets.no_data("No evaluation recorded yet.")
        else:
            st.altair_chart(charts.validation_loss(page.evaluations), width="stretch")
    with right:
        st.markdown("**Training loss per learner**")
        if page.training_loss.empty:
            widgets.no_data("No heartbeat with a loss yet.")
        else:
            st.altair_chart(charts.training_loss(page.training_loss), width="stretch")


def events_section(page: RunPage) -> None:
    st.header("Events", divider="gray")
    events = page.events
    if events.empty:
        widgets.no_data("No events recorded.")
        return
    st.altair_chart(charts.events_timeline(events), width="stretch")
    categories = [c for c in charts.CATEGORY_ORDER if c in set(events["category"])]
    chosen = st.pills("Show", categories, default=categories, selection_mode="multi", key="event_categories")
    shown = events[events["category"].isin(chosen or categories)]
    shown = shown.head(EVENT_ROWS)
    st.dataframe(
        shown.style.map(widgets.category_css, subset=["category"]),
        hide_index=True,
        height=min(420, 38 + 35 * len(shown)),
        column_config={
            "at": st.column_config.DatetimeColumn("at (UTC)", format="YYYY-MM-DD HH:mm:ss"),
            "detail": st.column_config.TextColumn(width="large"),
        },
    )
    st.markdown("**Rejected submissions**")
    if page.rejection_reasons.empty:
        st.success("No submission rejected.", icon=":material/check_circle:")
    else:
        left, right = st.columns([2, 3])
        with left:
            st.altair_chart(charts.rejection_reasons(page.rejection_reasons), width="stretch")
        with right:
            st.dataframe(
                page.rejections.head(50),
                hide_index=True,
                height=min(320, 38 + 35 * min(50, len(page.rejections))),
                column_config={
                    "decided_at": st.column_config.DatetimeColumn("decided (UTC)", format="YYYY-MM-DD HH:mm:ss"),
                    "reason": st.column_config.TextColumn(width="large"),
                },
            )


@st.fragment(run_every=widgets.refresh_interval())
def run_health(run_id: str) -> None:
    with widgets.ledger_errors():
        page = loaders.run_page(URL, run_id)
        if page is None:
            st.warning(f"Run {widgets.md(repr(run_id))} is no longer in the ledger.")
            return
        header(page)
        learners_section(page)
        synchronizer_section(page)
        progress_section(page)
        loss_section(page)
        events_section(page)


RUN = pick_run()
if RUN is not None:
    run_health(RUN)
