"""Altair charts of the dashboard: DataFrame in, chart out (no Streamlit, no SQL).

Every encoding is an explicit channel object with its type (``alt.X("at:T")``, never the bare
shorthand ``"at:T"``): Altair turns a bare string into a channel through schema lookups that cost
~30 ms each, which adds up to a second on a page of ten charts."""

from __future__ import annotations

import altair as alt
import pandas as pd

from ddiloco.platform import liveness
from ddiloco.platform.ledger.dashboard import STALENESS_VERSIONS
from ddiloco.ui import health as h

LEARNER_STATUS_SCALE = alt.Scale(domain=list(liveness.LEARNER_STATUSES), range=[h.hex_of(s) for s in liveness.LEARNER_STATUSES])
CATEGORY_ORDER = ["failure", "restart", "chaos", "rejection", "synchronizer", "learner", "run", "other"]
CATEGORY_SCALE = alt.Scale(domain=CATEGORY_ORDER, range=[h.HEX[h.CATEGORY_COLORS[c]] for c in CATEGORY_ORDER])
FIXED_SQUARES = 6
"""Regions of at most this many learners get fixed-size squares instead of squares stretched to the width."""
LABELLED_LEARNERS = 40
"""Up to this many learners, each square of the status grid is labelled with its id."""


FIT_WIDTH = alt.AutoSizeParams(type="fit-x", contains="padding")
"""Fill the container's width; the height is the plot's own (Streamlit's default "fit" squeezes
legends and axes into the given height, which collapses charts with a few discrete rows)."""


def _time(field: str = "at", title: str = "time (UTC)") -> alt.X:
    return alt.X(f"{field}:T", title=title, axis=alt.Axis(labelOverlap=True, tickCount=8))


def learner_grid(learners: pd.DataFrame) -> alt.Chart:
    """One square per learner, a row per region, coloured by status: who is down, at a glance."""
    df = learners[["learner", "region", "status", "reason", "step", "tokens_per_s"]].copy()
    df["slot"] = df.groupby("region").cumcount()
    base = alt.Chart(df).encode(
        x=alt.X("slot:O", axis=None),
        y=alt.Y("region:N", title=None, sort="ascending", axis=alt.Axis(labelFontSize=13, labelFontWeight="bold")),
    )
    squares = base.mark_rect(cornerRadius=4, stroke="white", strokeWidth=2).encode(
        color=alt.Color("status:N", scale=LEARNER_STATUS_SCALE, legend=alt.Legend(orient="top", title=None)),
        tooltip=[
            alt.Tooltip("learner:N"),
            alt.Tooltip("region:N"),
            alt.Tooltip("status:N"),
            alt.Tooltip("reason:N"),
            alt.Tooltip("step:Q", format=","),
            alt.Tooltip("tokens_per_s:Q", format=",.0f", title="tokens/s"),
        ],
    )
    chart = squares
    if len(df) <= LABELLED_LEARNERS:
        chart = squares + base.mark_text(color="white", fontSize=11, fontWeight="bold").encode(text=alt.Text("learner:N"))
    if int(df["slot"].max()) + 1 <= FIXED_SQUARES:
        return chart.properties(height=alt.Step(46), width=alt.Step(110))
    return chart.properties(height=alt.Step(46), autosize=FIT_WIDTH)


def region_tokens(regions: pd.DataFrame) -> alt.Chart:
    """Merged tokens per region, with each region's share."""
    df = regions.copy()
    df["label"] = [f"{h.format_count(t)}  ({s:.0%})" for t, s in zip(df["tokens_merged"], df["share_merged"])]
    base = alt.Chart(df).encode(y=alt.Y("region:N", title=None, sort="ascending"))
    bars = base.mark_bar(color=h.HEX["blue"], cornerRadiusEnd=3).encode(
        x=alt.X("tokens_merged:Q", title="tokens merged", axis=alt.Axis(format="~s")),
        tooltip=[
            alt.Tooltip("region:N"),
            alt.Tooltip("tokens_merged:Q", format=","),
            alt.Tooltip("share_merged:Q", format=".1%"),
            alt.Tooltip("tokens_per_s:Q", format=",.0f"),
        ],
    )
    text = base.mark_text(align="left", dx=4).encode(x=alt.X("tokens_merged:Q"), text=alt.Text("label:N"))
    return (bars + text).properties(height=alt.Step(34), autosize=FIT_WIDTH)


def version_timeline(versions: pd.DataFrame) -> alt.Chart:
    """Global version of every fragment over time: flat lines are fragments that stopped merging."""
    many = versions["fragment"].nunique() > 12
    return (
        alt.Chart(versions)
        .mark_line(interpolate="step-after", point=not many and len(versions) <= 400)
        .encode(
            x=_time(),
            y=alt.Y("version:Q", title="global version", axis=alt.Axis(tickMinStep=1, format="d")),
            color=alt.Color(
                "fragment:N",
                legend=None if many else alt.Legend(title="fragment", orient="right"),
                scale=alt.Scale(scheme="tableau20"),
            ),
            tooltip=[alt.Tooltip("fragment:N"), alt.Tooltip("version:Q"), alt.Tooltip("at:T", format="%H:%M:%S")],
        )
        .properties(height=240, autosize=FIT_WIDTH)
    )


def quorum_chart(merges: pd.DataFrame) -> alt.Chart:
    """Per merge: the quorum it needed and the learners it included."""
    df = merges.melt(
        id_vars=["at", "fragment", "version", "reason"],
        value_vars=["quorum", "included", "live_learners"],
        var_name="what",
        value_name="learners",
    )
    return (
        alt.Chart(df)
        .mark_line(point=len(merges) <= 300, interpolate="step-after", strokeWidth=1.5)
        .encode(
            x=_time(),
            y=alt.Y("learners:Q", title="learners", axis=alt.Axis(tickMinStep=1, format="d")),
            color=alt.Color(
                "what:N",
                scale=alt.Scale(
                    domain=["quorum", "included", "live_learners"], range=[h.HEX["orange"], h.HEX["blue"], h.HEX["gray"]]
                ),
                legend=alt.Legend(orient="top", title=None),
            ),
            tooltip=[
                alt.Tooltip("fragment:N"),
                alt.Tooltip("version:Q"),
                alt.Tooltip("what:N"),
                alt.Tooltip("learners:Q"),
                alt.Tooltip("reason:N"),
            ],
        )
        .properties(height=200, autosize=FIT_WIDTH)
    )


def grace_chart(merges: pd.DataFrame) -> alt.Chart:
    """Per merge: the grace window allowed and how long the synchronizer actually waited."""
    df = merges.melt(
        id_vars=["at", "fragment", "version", "reason"],
        value_vars=["grace_window_s", "grace_waited_s"],
        var_name="what",
        value_name="seconds",
    )
    df["what"] = df["what"].map({"grace_window_s": "window", "grace_waited_s": "waited"})
    return (
        alt.Chart(df.dropna(subset=["seconds"]))
        .mark_circle(size=28, opacity=0.75)
        .encode(
            x=_time(),
            y=alt.Y("seconds:Q", title="seconds"),
            color=alt.Color(
                "what:N",
                scale=alt.Scale(domain=["window", "waited"], range=[h.HEX["gray"], h.HEX["violet"]]),
                legend=alt.Legend(orient="top", title=None),
            ),
            tooltip=[
                alt.Tooltip("fragment:N"),
                alt.Tooltip("version:Q"),
                alt.Tooltip("what:N"),
                alt.Tooltip("seconds:Q", format=".2f"),
                alt.Tooltip("reason:N"),
            ],
        )
        .properties(height=200, autosize=FIT_WIDTH)
    )


def staleness_histogram(staleness: pd.DataFrame) -> alt.Chart:
    return (
        alt.Chart(staleness)
        .mark_bar(color=h.HEX["blue"], cornerRadiusEnd=3, size=40)
        .encode(
            x=alt.X("staleness:O", title="versions behind when merged", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("submissions:Q", title=f"merged submissions (newest {STALENESS_VERSIONS} versions per fragment)"),
            tooltip=[alt.Tooltip("staleness:O"), alt.Tooltip("submissions:Q", format=",")],
        )
        .properties(height=200, autosize=FIT_WIDTH)
    )


def validation_loss(evals: pd.DataFrame) -> alt.Chart:
    return (
        alt.Chart(evals)
        .mark_line(point=True, color=h.HEX["green"])
        .encode(
            x=alt.X("tokens:Q", title="tokens merged", axis=alt.Axis(format="~s")),
            y=alt.Y("val_loss:Q", title="validation loss", scale=alt.Scale(zero=False)),
            tooltip=[
                alt.Tooltip("tokens:Q", format=","),
                alt.Tooltip("val_loss:Q", format=".4f"),
                alt.Tooltip("versions_total:Q"),
                alt.Tooltip("at:T", format="%H:%M:%S"),
            ],
        )
        .properties(height=220, autosize=FIT_WIDTH)
    )


def _per_learner(samples: pd.DataFrame, y: alt.Y, shown: list[alt.Tooltip]) -> alt.Chart:
    """A line per learner (and incarnation) over time, coloured by region, with ``shown`` in its tooltip."""
    df = samples.copy()
    df["series"] = df["learner"] + "#" + df["incarnation"].astype(str)
    return (
        alt.Chart(df)
        .mark_line(strokeWidth=1.2, opacity=0.8)
        .encode(
            x=_time(),
            y=y,
            color=alt.Color("region:N", legend=alt.Legend(orient="top", title=None), scale=alt.Scale(scheme="category10")),
            detail=alt.Detail("series:N"),
            tooltip=[alt.Tooltip("learner:N"), alt.Tooltip("region:N"), alt.Tooltip("incarnation:Q"),
                     alt.Tooltip("step:Q", format=","), *shown],
        )
        .properties(height=220, autosize=FIT_WIDTH)
    )


def training_loss(loss: pd.DataFrame) -> alt.Chart:
    """Each learner's reported loss (an EMA) over time."""
    return _per_learner(loss, alt.Y("loss:Q", title="training loss (learner EMA)", scale=alt.Scale(zero=False)),
                        [alt.Tooltip("loss:Q", format=".4f")])


def throughput(samples: pd.DataFrame) -> alt.Chart:
    """Each learner's tokens/s over time; the tooltip has its MFU where it reported one."""
    return _per_learner(samples, alt.Y("tokens_per_s:Q", title="tokens/s"),
                        [alt.Tooltip("tokens_per_s:Q", title="tokens/s", format=",.0f"), alt.Tooltip("mfu:Q", title="MFU", format=".1%")])


def bytes_chart(bytes_sent: int, bytes_dp: int) -> alt.Chart:
    """What the learners uploaded next to what data-parallel training would have exchanged."""
    df = pd.DataFrame(
        {
            "what": ["sent", "data-parallel"],
            "bytes": [bytes_sent, bytes_dp],
            "label": [h.format_bytes(bytes_sent), h.format_bytes(bytes_dp)],
        }
    )
    base = alt.Chart(df).encode(y=alt.Y("what:N", title=None, sort=None))
    bars = base.mark_bar(cornerRadiusEnd=3).encode(
        x=alt.X("bytes:Q", title="bytes", axis=alt.Axis(format="~s")),
        color=alt.Color(
            "what:N", scale=alt.Scale(domain=["sent", "data-parallel"], range=[h.HEX["green"], h.HEX["gray"]]), legend=None
        ),
        tooltip=[alt.Tooltip("what:N"), alt.Tooltip("bytes:Q", format=",")],
    )
    text = base.mark_text(align="left", dx=4).encode(x=alt.X("bytes:Q"), text=alt.Text("label:N"))
    return (bars + text).properties(height=alt.Step(30), autosize=FIT_WIDTH)


def events_timeline(events: pd.DataFrame) -> alt.Chart:
    """Events over time, one lane per category (failure, restart, chaos, rejection …)."""
    return (
        alt.Chart(events)
        .mark_circle(size=90, opacity=0.85)
        .encode(
            x=_time(),
            y=alt.Y("category:N", title=None, sort=CATEGORY_ORDER),
            color=alt.Color("category:N", scale=CATEGORY_SCALE, legend=None),
            tooltip=[
                alt.Tooltip("at:T", format="%Y-%m-%d %H:%M:%S"),
                alt.Tooltip("kind:N"),
                alt.Tooltip("actor:N"),
                alt.Tooltip("detail:N"),
            ],
        )
        .properties(height=alt.Step(28), autosize=FIT_WIDTH)
    )


def rejection_reasons(reasons: pd.DataFrame) -> alt.Chart:
    return (
        alt.Chart(reasons)
        .mark_bar(color=h.HEX["yellow"], cornerRadiusEnd=3)
        .encode(
            x=alt.X("submissions:Q", title="rejected submissions"),
            y=alt.Y("reason:N", title=None, sort="-x"),
            tooltip=[alt.Tooltip("reason:N"), alt.Tooltip("submissions:Q")],
        )
        .properties(height=alt.Step(28), autosize=FIT_WIDTH)
    )
