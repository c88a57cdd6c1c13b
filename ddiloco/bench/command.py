"""``ddiloco bench …``: benchmarks that ship with the package.

Registered by the main command with ``app.add_typer(bench_app, name="bench")``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from ddiloco.bench.quality.output import Destination
    from ddiloco.bench.quality.plan import RunSpec, Scale

bench_app = typer.Typer(help="Benchmarks: training quality of every regime.", no_args_is_help=True)


@bench_app.command("quality")
def quality_command(
    quick: bool = typer.Option(False, "--quick", help="Tiny models and few steps: checks the benchmark runs (a few minutes)."),
    out: Path | None = typer.Option(
        None, "--out", help="Folder for the results (quality.json and the quality-*.png plots). Default: a new temporary directory."
    ),
    publish: bool = typer.Option(
        False, "--publish", help="Write the checkout's published results instead: benchmarks/results/quality.json, docs/quality-*.png "
        "and the generated part of docs/quality.md. Only with the full plan (no --quick, --only, --no-ablations, --no-sweep, "
        "and every model)."
    ),
    repo: Path | None = typer.Option(None, "--repo", help="The checkout --publish writes to (default: the current directory)."),
    models: str = typer.Option("dense,moe,vision,llama", "--models",
                               help="Comma-separated models: dense, moe, vision, llama (a Hugging Face Llama on BPE shards)."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Worker processes (runs are independent and seeded: same results)."),
    ablations: bool = typer.Option(True, "--ablations/--no-ablations", help="Run the ablation rows (on the dense model)."),
    sweep: bool = typer.Option(True, "--sweep/--no-sweep", help="Run the outer-lr / gamma sweep rows (on the dense model)."),
    only: str | None = typer.Option(None, "--only", help="Run only these rows: comma-separated regime or model:regime names."),
    render: Path | None = typer.Option(
        None, "--render", help="Train nothing: redo the plots (and with --publish the docs page) from this results file."
    ),
    add_to_published: bool = typer.Option(
        False, "--add-to-published", help="With --only at full scale: also add these rows to the published results as a "
        "targeted run, apart from the full run's rows (which are kept), and show them in the docs page's generated block; "
        "a targeted run of the same rows is replaced."
    ),
) -> None:
    """Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel: same model, tokens and seed; prints the
    table and PASS/FAIL lines, writes the results and plots where it says (never over the published
    ones unless --publish; --add-to-published adds its rows beside them)."""
    from ddiloco.bench.quality import plan as P
    from ddiloco.bench.quality.output import add_targeted, checkout, destination

    found = checkout(repo if repo is not None else Path.cwd())
    if repo is not None and found is None:
        raise typer.BadParameter(f"{repo} is not a ddiloco checkout (ddiloco/, docs/quality.md, benchmarks/results/)", param_hint="--repo")
    if add_to_published and (render is not None or publish or quick or not only or found is None):
        raise typer.BadParameter("adds a targeted run to the published results: it needs --only at full scale (no --quick, "
                                 "--publish or --render) and a ddiloco checkout", param_hint="--add-to-published")
    if render is not None:
        data = json.loads(render.read_text())
        full = data["scale"]["name"] == P.FULL.name
    else:
        chosen = [m.strip() for m in models.split(",") if m.strip()]
        bad = [m for m in chosen if m not in P.MODELS]
        if bad or not chosen:
            raise typer.BadParameter(f"must list some of {', '.join(P.MODELS)}; got {models!r}", param_hint="--models")
        scale = P.QUICK if quick else P.FULL
        try:
            specs = P.select(P.plan(chosen, scale, quick, ablations=ablations, sweep=sweep), only)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--only") from None
        full = P.is_published_plan(chosen, quick, ablations, sweep, only)
    try:
        dest = destination(out, publish=publish, full_plan=full, repo=found)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    print(f"results go to {dest.results}", flush=True)
    if render is not None:
        _write_rescored(data, dest)
        return
    result = _run_benchmark(specs, scale, quick, jobs, dest)
    if add_to_published:
        assert found is not None
        for path in add_targeted(result, found):
            print(f"wrote {path}")


def _run_benchmark(specs: list[RunSpec], scale: Scale, quick: bool, jobs: int, dest: Destination) -> dict[str, Any]:
    from datetime import datetime, timezone

    from ddiloco.bench.provenance import git_state, machine_info
    from ddiloco.bench.quality import output, report, run

    print(f"quality benchmark ({scale.name}): {len(specs)} runs, {scale.learners} learners x {scale.steps} steps, jobs={jobs}", flush=True)
    t0 = time.perf_counter()
    if any(s.model == "llama" for s in specs):
        print(f"llama rows read BPE shards at {run.prepare_bench_data(quick)}", flush=True)
    rows = run.run_all(specs, scale, quick, jobs)
    result = report.results(
        rows, scale=scale, jobs=jobs, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        total_real_s=time.perf_counter() - t0, cpu_s=run.cpu_seconds(), provenance={**git_state(), "machine": machine_info()},
    )
    print("\n".join(report.summary_lines(result, rows)))
    for path in output.write(result, rows, dest):
        print(f"wrote {path}")
    return result


def _write_rescored(data: dict[str, Any], dest: Destination) -> None:
    from ddiloco.bench.quality import output, report

    result = report.rescored(data)
    for path in output.write(result, report.rows_from_json(result), dest):
        print(f"wrote {path}")
