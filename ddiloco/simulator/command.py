"""`ddiloco simulate`: the goodput table for your own cluster numbers, a plot and a JSON file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ddiloco.platform.config import ConfigError, format_validation_error
from ddiloco.simulator.config import REGIMES, SimulationConfig
from ddiloco.simulator.regimes import Row, simulate_table
from ddiloco.simulator.report import compare_to_target, row_label, save_plot, target_for

_DEFAULT = SimulationConfig()


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise typer.BadParameter(f"{name} must be a comma-separated list of numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"{name} must list positive numbers, got {text!r}")
    return values


def _table(rows: list[Row], chips: list[int], metric: str, with_target: bool) -> Table:
    table = Table(title=f"{metric} (%)" + (" — simulated (paper target, delta)" if with_target else ""))
    table.add_column("regime")
    for n in chips:
        table.add_column(f"{n:,}", justify="right")
    keys = sorted({(r.regime, r.learners) for r in rows}, key=lambda k: (REGIMES.index(k[0]), k[1]))
    for regime, m in keys:
        cells = []
        for n in chips:
            r = next((x for x in rows if (x.regime, x.learners, x.chips) == (regime, m, n)), None)
            if r is None:
                cells.append("")
                continue
            value = 100 * getattr(r, metric)
            target = target_for(regime, m, n) if with_target else None
            cells.append(f"{value:.1f}" if target is None else f"{value:.1f} ({target:.0f}, {value - target:+.1f})")
        table.add_row(row_label(regime, m), *cells)
    return table


def simulate_command(
    chips: str = typer.Option("150000,300000,600000,1200000,2400000", help="Cluster sizes, comma-separated."),
    learners: str = typer.Option("1,2,4,8,16", help="Learner counts M for the DiLoCo regimes."),
    mtbi_years: float = typer.Option(_DEFAULT.mtbi_years, help="Per-chip mean time between interruptions, years."),
    days: float = typer.Option(_DEFAULT.days, help="Simulated span, days."),
    seed: int = typer.Option(_DEFAULT.seed, help="Seed of the failure trace."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the rows as JSON here."),
    plot: Path = typer.Option(Path("goodput.png"), "--plot", help="Where to save the goodput-vs-chips plot."),
    regimes: str = typer.Option(",".join(REGIMES), help="Regimes to run: dp, dp_elastic, diloco_sync, decoupled."),
    slice_chips: int = typer.Option(_DEFAULT.slice_chips, help="Chips per slice (failure domain, elastic unit)."),
    repair_s: float = typer.Option(_DEFAULT.repair_s, help="Seconds a failed slice stays out."),
    restart_s: float = typer.Option(_DEFAULT.restart_s, help="Non-elastic restart cost, seconds."),
    downscale_s: float = typer.Option(_DEFAULT.downscale_s, help="Elastic pause to drop a slice, seconds."),
    upscale_s: float = typer.Option(_DEFAULT.upscale_s, help="Elastic pause to take a slice back, seconds."),
    checkpoint_s: float = typer.Option(_DEFAULT.checkpoint_s, help="Blocking cost of one snapshot, seconds."),
    checkpoint_interval_s: float | None = typer.Option(None, help="Compute seconds between snapshots (Young's rule)."),
    chip_speed_cv: float = typer.Option(_DEFAULT.chip_speed_cv, help="Per-step chip speed coefficient of variation."),
    step_s: float = typer.Option(_DEFAULT.step_s, help="Inner step time, seconds."),
    inner_steps: int = typer.Option(_DEFAULT.inner_steps, help="H: inner steps per outer round."),
    quorum: int = typer.Option(1, help="K: minimum learners per merge (decoupled)."),
    quorum_fraction: float | None = typer.Option(None, help="K as a fraction of live learners (overrides --quorum)."),
    grace_max_s: float | None = typer.Option(_DEFAULT.grace.max_s, help="Upper bound of the grace window, seconds."),
    grace: bool = typer.Option(True, "--grace/--no-grace", help="Use the adaptive grace window."),
) -> None:
    """Simulate goodput, uptime and the physical bound of DP and (Decoupled) DiLoCo under chip failures."""
    console = Console()
    chip_list = _int_list(chips, "--chips")
    learner_list = _int_list(learners, "--learners")
    regime_list = [r.strip() for r in regimes.split(",") if r.strip()]
    bad = [r for r in regime_list if r not in REGIMES]
    if bad:
        raise typer.BadParameter(f"unknown regime(s) {', '.join(bad)}; choose from {', '.join(REGIMES)}")
    try:
        cfg = SimulationConfig(
            mtbi_years=mtbi_years,
            days=days,
            seed=seed,
            slice_chips=slice_chips,
            repair_s=repair_s,
            restart_s=restart_s,
            downscale_s=downscale_s,
            upscale_s=upscale_s,
            checkpoint_s=checkpoint_s,
            checkpoint_interval_s=checkpoint_interval_s,
            chip_speed_cv=chip_speed_cv,
            step_s=step_s,
            inner_steps=inner_steps,
            quorum={"min_count": quorum, "min_fraction": quorum_fraction},
            grace={"enabled": grace, "max_s": grace_max_s},
        )
    except ValidationError as err:
        raise ConfigError(format_validation_error(err).replace("configuration", "simulation settings", 1)) from None

    started = time.perf_counter()
    try:
        results = simulate_table(cfg, chip_list, learner_list, regime_list)  # type: ignore[arg-type]
    except ValueError as err:
        raise ConfigError(str(err)) from None
    elapsed = time.perf_counter() - started
    rows = [r.row for r in results]

    with_target = mtbi_years == 1.0 and any(target_for(r.regime, r.learners, r.chips) is not None for r in rows)
    console.print(_table(rows, chip_list, "goodput", with_target))
    console.print(_table(rows, chip_list, "uptime", False))
    bounds = {r.chips: r.bound for r in rows}
    console.print(
        "physical bound (chips up): "
        + ", ".join(f"{n:,}: {100 * b:.2f}%" for n, b in sorted(bounds.items()))
    )
    if with_target:
        cells = compare_to_target(rows)
        passed = sum(c["result"] == "PASS" for c in cells)
        console.print(f"paper cells within ±4 points: {passed}/{len(cells)}")
    console.print(f"simulated {len(rows)} rows, {cfg.days:g} days each, in {elapsed:.1f} s")

    save_plot(rows, plot)
    console.print(f"plot: {plot}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "rows": [r.to_dict() for r in rows],
            "config": cfg.model_dump(mode="json"),
            "seconds": round(elapsed, 3),
        }
        json_path.write_text(json.dumps(payload, indent=2))
        console.print(f"json: {json_path}")
