"""The paper's table, how a simulated grid compares with it, the rule of thumb, and the plot."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from ddiloco.simulator.config import SimulationConfig
from ddiloco.simulator.regimes import Row, simulate_dp_elastic, trace_for

TARGET_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
TARGET_GOODPUT: dict[tuple[str, int], tuple[float, ...]] = {
    ("dp", 1): (72, 57, 38, 27, 18),
    ("dp_elastic", 1): (88, 80, 69, 58, 40),
    ("decoupled", 2): (94, 88, 80, 70, 54),
    ("decoupled", 4): (96, 93, 89, 82, 73),
    ("decoupled", 8): (98, 96, 94, 88, 80),
    ("decoupled", 16): (99, 98, 96, 93, 86),
}
"""Goodput in % at MTBI = 1 year, reconstructed from secondary reports of the paper (issue text)."""
TOLERANCE_POINTS = 4.0

LABELS = {
    "dp": "DP, no elasticity",
    "dp_elastic": "DP, elastic",
    "diloco_sync": "DiLoCo (sync)",
    "decoupled": "Decoupled",
}


def row_label(regime: str, learners: int) -> str:
    if regime in ("dp", "dp_elastic"):
        return LABELS[regime]
    return f"{LABELS[regime]} M={learners}"


def target_for(regime: str, learners: int, chips: int) -> float | None:
    series = TARGET_GOODPUT.get((regime, learners))
    if series is None or chips not in TARGET_CHIPS:
        return None
    return float(series[TARGET_CHIPS.index(chips)])


def compare_to_target(rows: Iterable[Row], tolerance: float = TOLERANCE_POINTS) -> list[dict]:
    """Every simulated cell that has a target: goodput %, target %, delta in points, PASS or FAIL."""
    out = []
    for r in rows:
        target = target_for(r.regime, r.learners, r.chips)
        if target is None:
            continue
        got = 100.0 * r.goodput
        delta = got - target
        out.append(
            {
                "regime": r.regime,
                "learners": r.learners,
                "chips": r.chips,
                "goodput_pct": round(got, 2),
                "target_pct": target,
                "delta_points": round(delta, 2),
                "result": "PASS" if abs(delta) <= tolerance else "FAIL",
            }
        )
    return out


def rule_of_thumb(cfg: SimulationConfig, rows: Sequence[Row]) -> list[dict]:
    """Paper: M learners on N chips ~ one learner on N / M chips.

    For every decoupled cell with M > 1, the simulated goodput next to a single elastic learner
    (dp_elastic) simulated on N / M chips, and, where both exist, the same comparison inside the
    target table itself."""
    out = []
    for r in rows:
        if r.regime != "decoupled" or r.learners == 1:
            continue
        small = r.chips // r.learners
        single = simulate_dp_elastic(cfg, trace_for(cfg, small, 1)).row.goodput
        paper_m = target_for("decoupled", r.learners, r.chips)
        paper_1 = target_for("dp_elastic", 1, small)
        out.append(
            {
                "learners": r.learners,
                "chips": r.chips,
                "decoupled_pct": round(100 * r.goodput, 2),
                "one_learner_on_n_over_m_pct": round(100 * single, 2),
                "delta_points": round(100 * (r.goodput - single), 2),
                "paper_delta_points": None if paper_m is None or paper_1 is None else paper_m - paper_1,
            }
        )
    return out


def save_plot(rows: Sequence[Row], path: str | Path, title: str = "Goodput vs chips (MTBI 1 year)") -> Path:
    """Goodput vs chips, one line per regime (and per M), targets as open markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        series.setdefault((r.regime, r.learners), []).append(r)
    fig, ax = plt.subplots(figsize=(8.5, 5.8), dpi=110)
    order = {"diloco_sync": 0, "decoupled": 1, "dp": 2, "dp_elastic": 3}  # data-parallel drawn on top
    ms = sorted({m for (_, m) in series})
    shade = {m: 0.35 + 0.6 * (i / max(1, len(ms) - 1)) for i, m in enumerate(ms)}

    def color(regime: str, m: int):
        if regime == "dp":
            return "black"
        if regime == "dp_elastic":
            return "tab:orange"
        return plt.get_cmap("Blues" if regime == "decoupled" else "Reds")(shade[m])

    for key in sorted(series, key=lambda k: (order[k[0]], k[1])):
        regime, m = key
        pts = sorted(series[key], key=lambda r: r.chips)
        xs, ys = [p.chips for p in pts], [100 * p.goodput for p in pts]
        style = ":" if regime == "diloco_sync" else "-"
        marker = {"dp": "s", "dp_elastic": "D", "diloco_sync": "x", "decoupled": "o"}[regime]
        c = color(regime, m)
        ax.plot(xs, ys, style, marker=marker, color=c, label=row_label(regime, m), lw=1.8, ms=5)
        tx = [x for x in xs if target_for(regime, m, x) is not None]
        if tx:
            ty = [target_for(regime, m, x) for x in tx]
            ax.plot(tx, ty, linestyle="none", marker="o", mfc="none", mec=c, ms=11, mew=1.3)
    chips = sorted({r.chips for r in rows})
    ax.set_xscale("log")
    ax.set_xticks(chips)
    ax.set_xticklabels([f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k" for n in chips])
    ax.minorticks_off()
    ax.plot([], [], linestyle="none", marker="o", mfc="none", mec="grey", ms=10, label="paper (target)")
    ax.set_xlabel("chips (log scale)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize=8, loc="lower left", ncol=3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
