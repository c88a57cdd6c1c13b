"""``ddiloco bench …``: benchmarks that ship with the package.

Registered by the main command with ``app.add_typer(bench_app, name="bench")``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ddiloco.bench.quality.plan import GPU_FOLLOW_UPS, GPU_REGIMES, GPU_SEEDS

if TYPE_CHECKING:
    from ddiloco.bench.quality.output import Destination
    from ddiloco.bench.quality.plan import RunSpec, Scale

DEFAULT_MODELS = "dense,moe,vision,llama"

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
    models: str = typer.Option(DEFAULT_MODELS, "--models",
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
    scale_name: str = typer.Option(
        "cpu", "--scale", help="cpu: the plan above, the quick check on a CPU. gpu: issue #26's plan, a 25.7M-parameter "
        "(non-embedding) Llama on the installed packages' Python sources, 251.7M tokens per regime, 8 learners: "
        f"{', '.join(GPU_REGIMES)}; each regime its own resumable step (--only), --quick its tiny CPU form. Rows trained only "
        f"when named in --only: {', '.join(GPU_FOLLOW_UPS)} (the decoupled and chaos rows with the CPU proxy's best settings), "
        f"and any row at seed {' or '.join(map(str, GPU_SEEDS))} as ROW_seedN (ratios to that seed's data_parallel_seedN)."
    ),
    device: str = typer.Option("auto", "--device", help="--scale gpu: where it trains: auto (the GPU when there is one), cuda, cpu."),
    force: bool = typer.Option(
        False, "--force", help="Train every row asked for again. Without it a row the results file (--out, or --publish's) "
        "already holds at the same scale, code (sha256 of ddiloco/**/*.py) and corpus is kept and not trained again."
    ),
) -> None:
    """Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel: same model, tokens and seed; prints the
    table and PASS/FAIL lines, writes the results and plots where it says (never over the published
    ones unless --publish; --add-to-published adds its rows beside them). The results file is written
    after every row: a command cut short keeps what it finished, and the same command goes on from there."""
    from ddiloco.bench.quality import plan as P
    from ddiloco.bench.quality.output import add_targeted, checkout, destination

    found = checkout(repo if repo is not None else Path.cwd())
    if repo is not None and found is None:
        raise typer.BadParameter(f"{repo} is not a ddiloco checkout (ddiloco/, docs/quality.md, benchmarks/results/)", param_hint="--repo")
    if scale_name not in ("cpu", "gpu"):
        raise typer.BadParameter(f"must be cpu or gpu, got {scale_name!r}", param_hint="--scale")
    if device not in ("auto", "cuda", "cpu"):
        raise typer.BadParameter(f"must be auto, cuda or cpu, got {device!r}", param_hint="--device")
    gpu = scale_name == "gpu"
    if gpu and (models != DEFAULT_MODELS or not ablations or not sweep or add_to_published):
        raise typer.BadParameter("--scale gpu runs its own four rows: leave out --models, --no-ablations, --no-sweep and "
                                 "--add-to-published (choose rows with --only)", param_hint="--scale")
    if add_to_published and (render is not None or publish or quick or not only or found is None):
        raise typer.BadParameter("adds a targeted run to the published results: it needs --only at full scale (no --quick, "
                                 "--publish or --render) and a ddiloco checkout", param_hint="--add-to-published")
    if render is not None:
        data = json.loads(render.read_text())
        gpu = data["scale"]["name"] in P.GPU_SCALES
        full = data["scale"]["name"] in (P.FULL.name, P.GPU.name)
    else:
        chosen = [m.strip() for m in models.split(",") if m.strip()]
        bad = [m for m in chosen if m not in P.MODELS]
        if bad or not chosen:
            raise typer.BadParameter(f"must list some of {', '.join(P.MODELS)}; got {models!r}", param_hint="--models")
        if gpu:
            scale = P.GPU_QUICK if quick else P.GPU
            every = P.gpu_specs(scale) + P.gpu_follow_up_specs(scale) + P.gpu_seed_specs(scale)
        else:
            scale = P.QUICK if quick else P.FULL
            every = P.plan(chosen, scale, quick, ablations=ablations, sweep=sweep)
        try:
            specs = P.select(every, only) if only or not gpu else P.gpu_specs(scale)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--only") from None
        full = not quick if gpu else P.is_published_plan(chosen, quick, ablations, sweep, only)
    try:
        dest = destination(out, publish=publish, full_plan=full, repo=found, gpu=gpu)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    print(f"results go to {dest.results}", flush=True)
    if render is not None:
        _write_rescored(data, dest)
        return
    result = _run_benchmark(specs, scale, quick, jobs, dest, device=device, force=force, plan_order=every)
    if add_to_published:
        assert found is not None
        for path in add_targeted(result, found):
            print(f"wrote {path}")


def _run_benchmark(specs: list[RunSpec], scale: Scale, quick: bool, jobs: int, dest: Destination, *, device: str = "auto",
                   force: bool = False, plan_order: list[RunSpec] | None = None) -> dict[str, Any]:
    """Train ``specs`` (less the rows ``dest`` already holds at this scale, code and corpus, unless ``force``), writing the
    results file after every row; rows are listed in ``plan_order`` (the whole plan's, of which ``specs`` may be a part)."""
    from datetime import datetime, timezone

    from ddiloco.bench.provenance import code_digest, git_state, machine_info
    from ddiloco.bench.quality import output, report, run
    from ddiloco.bench.quality.plan import is_gpu

    print(f"quality benchmark ({scale.name}): {len(specs)} runs, {scale.learners} learners x {scale.steps} steps, jobs={jobs}", flush=True)
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    corpus_digest = None
    if is_gpu(scale):
        url, record, prepared = run.prepare_gpu_data(quick)
        corpus_digest = record.get("corpus_sha256")
        extra = {"corpus": record, "prepared": prepared, "prepare_s": round(time.perf_counter() - t0, 1)}
        print(f"{'prepared' if prepared else 'reusing'} BPE shards of {record['train_files'] + record['val_files']:,} source files of "
              f"{len(record['packages'])} installed packages at {url} ({extra['prepare_s']} s)", flush=True)
    elif any(s.model == "llama" for s in specs):
        print(f"llama rows read BPE shards at {run.prepare_bench_data(quick)}", flush=True)
    # Rows already trained at this scale, code and corpus are kept (the plan goes on where it stopped); the others are
    # dropped, since their figures would not compare with the new ones.
    code = code_digest()
    before = output.read_rows(dest)
    kept = [r for r in before if r.scale == scale.name and r.code == code and (r.corpus or {}).get("corpus_sha256") == corpus_digest]
    asked = {(s.model, s.regime) for s in specs}
    if force:
        kept = [r for r in kept if (r.model, r.regime) not in asked]
    have = {(r.model, r.regime) for r in kept}
    todo = [s for s in specs if (s.model, s.regime) not in have]
    if before:
        print(f"{dest.results} holds {len(before)} row(s): keeping {len(kept)} of this scale, code and corpus "
              f"({', '.join(r.regime for r in kept) or 'none'}), training {len(todo)}", flush=True)
    order = {(s.model, s.regime): i for i, s in enumerate(plan_order or specs)}
    provenance = {**git_state(), "machine": machine_info()}

    def result_of(rows: list[Any]) -> dict[str, Any]:
        rows = sorted(rows, key=lambda r: order.get((r.model, r.regime), len(order)))
        return report.results(rows, scale=scale, jobs=jobs, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              total_real_s=time.perf_counter() - t0, cpu_s=run.cpu_seconds(), provenance=provenance, extra=extra)

    trained: list[Any] = []

    def done(row: Any) -> None:
        trained.append(row)
        output.write_results(result_of(kept + trained), dest)

    run.run_all(todo, scale, quick, jobs, device=device, done=done)
    rows = sorted(kept + trained, key=lambda r: order.get((r.model, r.regime), len(order)))
    result = result_of(rows)
    print("\n".join(report.summary_lines(result, rows)))
    for path in output.write(result, rows, dest):
        print(f"wrote {path}")
    return result


def _write_rescored(data: dict[str, Any], dest: Destination) -> None:
    from ddiloco.bench.quality import output, report

    result = report.rescored(data)
    for path in output.write(result, report.rows_from_json(result), dest):
        print(f"wrote {path}")
