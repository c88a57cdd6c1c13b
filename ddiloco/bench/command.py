"""``ddiloco bench …``: benchmarks that ship with the package.

Registered by the main command with ``app.add_typer(bench_app, name="bench")``."""

from __future__ import annotations

from pathlib import Path

import typer

bench_app = typer.Typer(help="Benchmarks: training quality of every regime.", no_args_is_help=True)


@bench_app.command("quality")
def quality_command(
    quick: bool = typer.Option(False, "--quick", help="Tiny models and few steps: checks the benchmark runs (about a minute)."),
    json_path: Path | None = typer.Option(None, "--json", help="Where to write the results (default benchmarks/results/quality.json)."),
    models: str = typer.Option("dense,moe,vision", "--models", help="Comma-separated models: dense, moe, vision."),
    docs: bool = typer.Option(False, "--docs/--no-docs", help="Rewrite the generated part of docs/quality.md and the docs/quality-*.png plots."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Worker processes (runs are independent and seeded: same results)."),
    ablations: bool = typer.Option(True, "--ablations/--no-ablations", help="Run the ablation rows (on the dense model)."),
    sweep: bool = typer.Option(True, "--sweep/--no-sweep", help="Run the outer-lr / gamma sweep rows (on the dense model)."),
    only: str | None = typer.Option(None, "--only", help="Run only these rows: comma-separated regime or model:regime names."),
) -> None:
    """Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel: same model, tokens and seed; prints the
    table and PASS/FAIL lines, writes JSON and plots."""
    from ddiloco.bench.quality import FULL, MODELS, QUICK, plan, run_benchmark, select

    chosen = [m.strip() for m in models.split(",") if m.strip()]
    bad = [m for m in chosen if m not in MODELS]
    if bad or not chosen:
        raise typer.BadParameter(f"--models must list some of {', '.join(MODELS)}; got {models!r}")
    try:
        select(plan(chosen, QUICK if quick else FULL, quick, ablations=ablations, sweep=sweep), only)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--only") from None
    run_benchmark(quick=quick, models=chosen, json_path=json_path, docs=docs, jobs=jobs, ablations=ablations, sweep=sweep, only=only)
