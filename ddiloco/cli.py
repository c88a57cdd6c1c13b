"""The ``ddiloco`` command: one entry point for every process and tool.

The process commands (``learner``, ``synchronizer``, ``evaluate``) are shells over :mod:`ddiloco.entry`, the mains
the flows and launchers call too; ``ledger``, ``store`` and ``data`` live in :mod:`ddiloco.admin`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ddiloco.admin import (
    ConfigOpt,
    LedgerOpt,
    OperatorErrors,
    StoreOpt,
    checked_id_or_exit,
    console,
    data_app,
    err_console,
    existing_ledger,
    ledger_app,
    ledger_url,
    plain,
    read_only_run,
    refuse,
    run_app,
    store_app,
)
from ddiloco.admin import load_or_exit as _config
from ddiloco.bench.command import bench_app
from ddiloco.entry import WAIT_S, ProcessSpec, main, setup_logging
from ddiloco.platform.config import ConfigError, RunConfig, build_config
from ddiloco.platform.redact import redact_url
from ddiloco.simulator.command import simulate_command
from ddiloco.ui.command import ui_command

# OperatorErrors: an operator's mistake in any command ends in one line, never a traceback.
app = typer.Typer(cls=OperatorErrors, help="Decoupled DiLoCo pre-training: learners, synchronizer, demo and tools.",
                  no_args_is_help=True)
app.add_typer(ledger_app, name="ledger")
app.add_typer(run_app, name="run")
app.add_typer(store_app, name="store")
app.add_typer(bench_app, name="bench")
app.add_typer(data_app, name="data")

InitFromOpt = typer.Option(
    None, "--init-from",
    help="Start a new run from an exported or pretrained model (a directory or a .safetensors file, local or any "
    "fsspec URL): version 0 of every fragment takes its weights (sets model.init_from).",
)


def _with_init_from(cfg: RunConfig, init_from: str | None) -> RunConfig:
    if init_from is None:
        return cfg
    data = cfg.model_dump()
    data["model"]["init_from"] = init_from
    return build_config(data)  # validated like a config file's model.init_from


WaitOpt = typer.Option(WAIT_S, "--wait-s", min=0.0, help="Give up when the ledger or the store cannot be reached for this long.")


@app.command("runs")
def runs(ledger: str | None = LedgerOpt, config: Path | None = ConfigOpt) -> None:
    """List the runs in the ledger (read-only: a missing or outdated ledger is refused, never created or migrated)."""
    from ddiloco.platform.ledger import reports as reports_q
    from ddiloco.platform.ledger import runs as runs_q
    from ddiloco.platform.ledger import session_factory

    engine = existing_ledger(plain(ledger_url(ledger, config)))
    table = Table("run", "status", "created", "fragments", "versions", "tokens")
    with session_factory(engine).begin() as s:
        for r in runs_q.list_runs(s):
            versions = sum(runs_q.latest_version_numbers(s, r.id).values())
            table.add_row(
                r.id,
                r.status,
                r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                str(r.num_fragments),
                str(versions),
                str(reports_q.token_accounting(s, r.id).trained),
            )
    console.print(table)


@app.command("learner")
def learner(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(
        None,
        "--run",
        "--run-id",
        help="Run id; defaults to the config's name. (Under torchrun write --run-id: torchrun reads --run as its --run-path.)",
    ),
    learner_id: str = typer.Option(..., "--learner", help="Learner id as listed by the config (e.g. us-0)."),
    max_steps: int | None = typer.Option(None, min=1, help="Stop after this many inner steps."),
    nproc_per_node: int | None = typer.Option(
        None,
        "--nproc-per-node",
        min=1,
        help="Ranks of this learner on this machine, launched through torchrun: every rank trains with DDP "
        "(gloo on CPU, NCCL on GPUs); rank 0 alone talks to the ledger and the store. Defaults to the "
        "config's learners.nproc_per_node. See docs/ddp.md.",
    ),
    summary_json: Path | None = typer.Option(None, "--summary-json", hidden=True, help="Rank 0 writes its job summary here."),
    flow_run_url: str | None = typer.Option(None, "--flow-run-url", hidden=True, help="Prefect flow run of this learner."),
    wait_s: float = WaitOpt,
    verbose: bool = False,
) -> None:
    """Run one learner until the run ends (SIGTERM finishes its uploads and stops it)."""
    spec = ProcessSpec.learner(learner_id, max_steps=max_steps, nproc_per_node=nproc_per_node, flow_run_url=flow_run_url,
                               summary_path=str(summary_json) if summary_json else None, wait_s=wait_s, verbose=verbose)
    raise typer.Exit(main(spec, config, run))


@app.command("synchronizer")
def synchronizer(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    label: str = typer.Option("sync", "--label", "--holder", help="Label in the lease holder name (label@host:pid)."),
    shard: int | None = typer.Option(None, "--shard", min=0, help="Serve only this shard (0..synchronizer.shards-1); "
                                     "default: whichever shard's lease is free."),
    init_from: str | None = InitFromOpt,
    wait_s: float = WaitOpt,
    verbose: bool = False,
) -> None:
    """Run a synchronizer: active while it holds a shard's lease (one shard unless synchronizer.shards > 1), else a hot standby."""
    cfg = _with_init_from(_config(config), init_from)
    raise typer.Exit(main(ProcessSpec.synchronizer(label, shard=shard, wait_s=wait_s, verbose=verbose), cfg, run))


@app.command("evaluate")
def evaluate_command(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    device: str = typer.Option("auto", "--device", help="auto (the GPU when torch sees one), cpu, cuda or cuda:N."),
    wait_s: float = WaitOpt,
    verbose: bool = False,
) -> None:
    """Run the evaluator: evaluate newly published global versions every synchronizer.eval_every_s, record them, stop when the run ends."""
    raise typer.Exit(main(ProcessSpec.evaluator(device=device, wait_s=wait_s, verbose=verbose), config, run))


@app.command("summary")
def summary(
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run"),
    ledger: str | None = LedgerOpt,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """A run's headline figures from the ledger."""
    import time

    from ddiloco.platform.ledger import session_factory
    from ddiloco.platform.runtime import to_datetime
    from ddiloco.platform.summary import run_summary

    cfg = _config(config)
    run = checked_id_or_exit(run or cfg.name, "run")
    engine = existing_ledger(ledger or plain(cfg.ledger.url))
    with session_factory(engine).begin() as s:
        result = run_summary(s, run or cfg.name, to_datetime(time.time()))
    if as_json:
        console.print_json(result.to_json())
    else:
        from ddiloco.demo import summary_table

        console.print(summary_table(result))


@app.command("export")
def export_command(
    to: str = typer.Option(..., "--to", help="Directory or fsspec URL to write; must not exist yet or be empty."),
    fmt: str = typer.Option("safetensors", "--format", help="hf (a save_pretrained directory; model.kind hf) or safetensors."),
    version: str = typer.Option("latest", "--version", help="latest, or N: every fragment's newest version <= N."),
    config: Path | None = ConfigOpt,
    run: str | None = typer.Option(None, "--run", help="Run id; defaults to the config's name."),
    ledger: str | None = LedgerOpt,
    store: str | None = StoreOpt,
) -> None:
    """Write a run's global model (newest or version N) as safetensors or a Hugging Face directory; read-only."""

    from ddiloco.export import ExportError, export_run
    from ddiloco.platform.models.weights import WeightsError
    from ddiloco.platform.store import StoreError

    if fmt not in ("hf", "safetensors"):
        err_console.print(f"[red]error:[/red] --format must be hf or safetensors, got {escape(repr(fmt))}")
        raise typer.Exit(2)
    if version != "latest" and not version.isdigit():
        err_console.print(f"[red]error:[/red] --version must be latest or a version number, got {escape(repr(version))}")
        raise typer.Exit(2)
    with read_only_run(config, run, ledger, store, refused=(ExportError, ConfigError, WeightsError, StoreError)) as ctx:
        done = export_run(ctx, to=to, fmt=fmt, version=None if version == "latest" else int(version))  # type: ignore[arg-type]
    versions = sorted(set(done.versions.values()))
    console.print(f"exported run {ctx.run_id} ({len(done.versions)} fragments, versions {versions[0]}..{versions[-1]}) "
                  f"to {redact_url(done.to)}: {', '.join(done.files)}")


@app.command("config")
def show_config(
    config: Path | None = ConfigOpt,
    offline: bool = typer.Option(False, "--offline", help="Validate the config alone: read no data, model file, store or ledger."),
) -> None:
    """Validate a config, print the effective values (file + env overrides), size the run (model, step, memory per
    rank, bytes sent) and check what a run will touch."""
    from ddiloco.platform.preflight import preflight, shown_config
    from ddiloco.sizing import plan_report

    cfg = _config(config)
    console.print_json(json.dumps(shown_config(cfg)))
    lines, ok = preflight(cfg, offline=offline)
    for line in [*plan_report(cfg, offline), *lines]:
        err_console.print(escape(line), highlight=False)
    if not ok:
        raise typer.Exit(2)


ENV_STORAGE = ("DDILOCO_LEDGER__URL", "DDILOCO_STORAGE__URL")
EnvStorageOpt = typer.Option(
    False, "--env-storage",
    help="Use DDILOCO_LEDGER__URL / DDILOCO_STORAGE__URL from the environment instead of a scratch ledger and store.",
)


def _scratch_storage_only(use_env: bool, what: str) -> None:
    """Drop exported ledger and store URLs (for this process and its children) unless told to use them:
    a scratch run must never write to, restart or kill what an exported URL points at."""
    if use_env:
        return
    for key in [k for k in os.environ if k.upper() in ENV_STORAGE]:
        del os.environ[key]
        err_console.print(f"{what} ignores {key} from the environment (its own scratch storage; --env-storage uses it)")


def _check_writable(path: Path, option: str) -> None:
    """Refuse an output path that cannot be written, before any work starts."""
    if path.is_dir():
        refuse(f"{option} {path} is a directory, not a file")
    parent = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if not parent.is_dir():
        refuse(f"{option} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        refuse(f"{option} {path}: {parent} is not writable")


@app.command("demo")
def demo(
    learners: int = typer.Option(4, "--learners", min=1, help="Learners, split over two regions (us, eu); one runs 2x slower."),
    seconds: float = typer.Option(150.0, "--seconds", min=10, help="Training time."),
    chaos: bool = typer.Option(True, "--chaos/--no-chaos", help="Kill a learner and the active synchronizer mid-run."),
    config: Path | None = ConfigOpt,
    workdir: Path = typer.Option(Path("ddiloco-runs"), help="Where the ledger and the store go."),
    summary_json: Path | None = typer.Option(None, "--summary-json", help="Also write the summary as JSON."),
    init_from: str | None = InitFromOpt,
    env_storage: bool = EnvStorageOpt,
) -> None:
    """Train a byte-level GPT with 4 learner processes in 2 regions, a synchronizer and a standby, surviving failures."""
    from ddiloco.demo import DemoOptions, run_demo

    if summary_json is not None:
        _check_writable(summary_json, "--summary-json")
    _scratch_storage_only(env_storage, "the demo")

    base = _with_init_from(_config(config), init_from) if config or init_from else None
    result = run_demo(DemoOptions(learners=learners, seconds=seconds, chaos=chaos, workdir=workdir, base_config=base), console)
    if summary_json:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary_json.write_text(result.to_json())
        console.print(f"summary written to {summary_json}")


@app.command("deploy")
def deploy_command(
    config: Path | None = ConfigOpt,
    cron: str | None = typer.Option(None, help="Cron schedule for the training-run deployment, e.g. '0 3 * * *'."),
    pool_type: str = typer.Option("process", help="Work pool type for the region pools (process, kubernetes, ecs, cloud-run)."),
    secret_block: list[str] = typer.Option([], "--secret-block", help="ENV_VAR=block-name: flow runs read ENV_VAR from that "
                                           "Prefect Secret block (e.g. DDILOCO_LEDGER__URL=ddiloco-ledger-url); repeatable."),
    base_job_template: Path | None = typer.Option(None, help="Base job template of new pools, e.g. infra/work-pools/kubernetes.json."),
    notify_block: str | None = typer.Option(None, help="TYPE/NAME of a Prefect notification block (e.g. slack-webhook/ops): "
                                            "create the alerts' automations, sending through it."),
    stall_minutes: float = typer.Option(10.0, help="Alert when a run publishes no global version for this many minutes "
                                         "(fractions allowed, at least 0.17: 10 s)."),
    relaunches_per_hour: int = typer.Option(3, help="Alert when a learner is relaunched more often than this within an hour."),
) -> None:
    """Create one work pool per region and the learner, synchronizer and training-run deployments (PREFECT_API_URL)."""
    try:
        from prefect.settings import PREFECT_API_URL
    except ModuleNotFoundError:
        refuse("Prefect is not installed: pip install 'ddiloco[flows]'")

    if not PREFECT_API_URL.value():
        # Otherwise Prefect starts a temporary server that vanishes, deployments and all, when this command exits.
        refuse("no Prefect API configured: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api) or log in to Prefect Cloud")
    from ddiloco.flows.alerts import AlertPolicy
    from ddiloco.flows.deploy import deploy, parse_secret_blocks, read_job_template

    cfg = _config(config)
    try:
        plan = deploy(cfg, cron=cron, pool_type=pool_type, secret_blocks=parse_secret_blocks(secret_block),
                      base_job_template=read_job_template(base_job_template) if base_job_template else None,
                      notify_block=notify_block, alert_policy=AlertPolicy(stall_minutes, relaunches_per_hour))
    except ValueError as err:
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(2) from None
    console.print(f"work pools: {', '.join(plan.pools)}")
    console.print(f"deployments: {', '.join(plan.deployments)}")
    if plan.automations:
        console.print(f"alerts: {', '.join(plan.automations)} -> {notify_block}")
    console.print("start one worker per region: prefect worker start --pool region-<name>")


@app.command("chaos-suite")
def chaos_suite_command(
    quick: bool = typer.Option(False, "--quick", help="The short version CI runs (shorter outages, fewer faults)."),
    json_path: Path | None = typer.Option(None, "--json", help="Write {faults: [...], invariants_ok} here."),
    postgres_url: str | None = typer.Option(None, help="Admin URL of the PostgreSQL server to create a scratch ledger on "
                                            "(default: a throwaway server of the suite's own, the one its restart fault restarts)."),
    workdir: Path | None = typer.Option(None, help="Where process logs go (a temporary folder by default)."),
    shards: int = typer.Option(1, "--shards", min=1, max=4, help="Synchronizer shards (each kill takes the next shard's holder)."),
    soak: str | None = typer.Option(None, "--soak", help="Instead of the matrix one by one: a soak this long (150s, 30m, 1h) "
                                    "of faults drawn at random, overlapping, on a PostgreSQL server of its own."),
    rate: float = typer.Option(125.0, "--rate", min=0.0, max=36000.0, help="With --soak: faults per hour (Poisson)."),
    seed: int = typer.Option(0, "--seed", help="With --soak: the schedule's seed (the same seed, the same schedule)."),
    check_every: float = typer.Option(60.0, "--check-every", min=5.0, help="With --soak: seconds between invariant checks."),
    speed: float = typer.Option(1.0, "--learner-speed", min=0.05, max=1.0,
                                help="With --soak: the learners run at this share of their speed (each step waits after it), leaving "
                                     "a small machine's cores to the faults."),
    env_storage: bool = EnvStorageOpt,
) -> None:
    """Inject faults into a live run on PostgreSQL + S3 (moto) + OS processes and check the invariants after each."""
    from ddiloco.testing.chaos_suite import report_json, run_suite

    if json_path is not None:
        _check_writable(json_path, "--json")
    # The suite restarts database servers and kills processes: never against an exported production URL.
    _scratch_storage_only(env_storage, "the chaos suite")
    setup_logging()
    if soak is not None:
        _soak(soak, rate, seed, check_every, speed, json_path, postgres_url, workdir)
        return
    report = run_suite(quick=quick, postgres_url=postgres_url, workdir=workdir, shards=shards)
    table = Table("fault", "injected", "survived", "lost", "recover s", "detail")
    for f in report.faults:
        table.add_row(
            f.fault, str(f.injected), str(f.survived), str(f.lost), f"{f.recover_s:.1f}" if f.recover_s is not None else "-", f.detail[:80]
        )
    console.print(table)
    console.print(f"invariants: {'ok' if report.invariants_ok else 'BROKEN'}")
    for problem in report.problems:
        console.print(f"  [red]{problem}[/red]")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(report_json(report))
    if not report.passed:
        raise typer.Exit(1)


def _soak(duration: str, rate: float, seed: int, check_every: float, speed: float, json_path: Path | None,
          postgres_url: str | None, workdir: Path | None) -> None:
    import tempfile

    from ddiloco.testing.soak import LONG_LIVED_S, parse_duration, run_growth, run_soak, soak_passed

    try:
        seconds = parse_duration(duration)
    except ValueError as err:
        refuse(str(err))
    try:
        report = run_soak(duration_s=seconds, rate_per_hour=rate, seed=seed, postgres_url=postgres_url, check_every_s=check_every,
                          speed=speed, workdir=workdir or Path(tempfile.mkdtemp(prefix="ddiloco-soak-")))
    except RuntimeError as err:
        err_console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(1) from None
    table = Table("at s", "fault", "target", "for s", "applied", "detail")
    for a in report.timeline:
        table.add_row(f"{a.fault.at_s:.0f}", a.fault.kind, a.fault.target, f"{a.fault.duration_s:.1f}", "yes" if a.applied else "NO",
                      a.detail[:70])
    console.print(table)
    for kind, why in report.skipped_kinds.items():
        console.print(f"not drawn: {kind}: {why}")
    console.print(f"goodput {report.goodput:.1%} of the learner-seconds; the schedule leaves {report.availability_bound:.1%}: "
                  f"{report.goodput_of_bound:.2f} of the bound")
    console.print("tokens " + ", ".join(f"{k} {v:,}" for k, v in report.tokens.items()))
    console.print("longest gap between versions: " + ", ".join(f"shard {g['shard']} {g['gap_s']:.1f} s" for g in report.longest_gap_s))
    judged = run_growth(report)
    worst = max(judged, key=lambda g: g["rss_ratio"], default=None)
    if worst:
        console.print(f"largest RSS growth after warm-up: {worst['process']} x{worst['rss_ratio']:.3f} "
                      f"(anonymous memory x{worst.get('anon_ratio', 1.0):.3f}) over {worst['lived_s']:.0f} s "
                      f"({len(judged)} of the run's processes judged: "
                      f"{sum(g['whole_soak'] for g in judged)} lived through the soak, "
                      f"the others {LONG_LIVED_S / 60:.0f}+ minutes)")
    console.print(f"invariants: {'ok' if report.invariants_ok else 'BROKEN'} ({len(report.invariant_checks)} checks)")
    for problem in report.problems:
        console.print(f"  [red]{escape(problem)}[/red]")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(report.to_json())
    if not soak_passed(report):
        raise typer.Exit(1)


app.command("simulate", help="Goodput of data-parallel vs Decoupled DiLoCo at scale, under chip failures.")(simulate_command)
app.command("ui", help="Serve the operations dashboard for a ledger (Streamlit, read-only).")(ui_command)


if __name__ == "__main__":
    app()
