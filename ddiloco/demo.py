"""``ddiloco demo``: a real multi-process run on embedded defaults, with real failures.

The ``training-run`` Prefect flow (local ephemeral mode, no server to start) launches a
synchronizer, a hot standby and learners in two regions (one 2x slower) as OS processes, on a
SQLite ledger and a local fragment store under ``./ddiloco-runs/``. The chaos schedule SIGKILLs a
learner (the supervisor relaunches it later) and the active synchronizer (the standby takes over)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ddiloco.flows.launchers import warm_up
from ddiloco.platform.config import ChaosEvent, RunConfig, build_config
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.summary import RunSummary, breakdown_line, run_summary

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    # The temporary server takes ~16 s to start on 2 busy cores; the 20 s default is too tight.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}
NOTEWORTHY = {"chaos", "learner_relaunched", "learner_restarted", "learner_dead", "lease_acquired", "synchronizer_launched"}


@dataclass
class DemoOptions:
    learners: int = 4
    seconds: float = 150.0
    chaos: bool = True
    workdir: Path = Path("ddiloco-runs")
    base_config: RunConfig | None = None


def demo_config(opts: DemoOptions, run_id: str) -> RunConfig:
    """The demo's run config: the user's config (or defaults) with the demo's learners, ledger and store."""
    base = opts.base_config.model_dump(mode="json") if opts.base_config else {}
    rundir = (opts.workdir / run_id).resolve()
    n_us = (opts.learners + 1) // 2
    n_eu = opts.learners - n_us
    regions = [{"name": "us", "learners": n_us}]
    if n_eu:
        regions.append({"name": "eu", "learners": n_eu, "speeds": [1.0] * (n_eu - 1) + [0.5]})
    else:
        regions[0]["speeds"] = [1.0] * (n_us - 1) + [0.5]
    base.update(
        name=run_id,
        ledger={"url": f"sqlite:///{rundir / 'ledger.db'}"},
        storage={"url": f"file://{rundir / 'store'}"},
    )
    base.setdefault("learners", {})
    base["learners"]["regions"] = regions
    if not opts.base_config:
        base["token_budget"] = 10**12  # the demo is time-boxed, not token-boxed
    cfg = build_config(base)
    if opts.chaos and not cfg.chaos.events:
        victim = cfg.learners.learner_ids()[min(1, cfg.learners.count - 1)][0]
        cfg.chaos.events = [
            # Killed at 30% and kept down for 20% of the run before the supervisor relaunches it.
            ChaosEvent(at_s=0.30 * opts.seconds, action="kill_learner", target=victim, duration_s=0.20 * opts.seconds),
            ChaosEvent(at_s=0.45 * opts.seconds, action="kill_synchronizer"),
        ]
    if not opts.chaos:
        cfg.chaos.events = []
    return cfg


def run_demo(opts: DemoOptions, console: Console | None = None) -> RunSummary:
    """Run the ``training-run`` flow in Prefect's local ephemeral mode, showing progress from the ledger."""
    console = console or Console()
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # The fork server the run's processes start from imports torch while Prefect's temporary server starts.
    warm_up()
    try:
        from ddiloco.flows.training import training_run
    except ModuleNotFoundError as err:
        if err.name != "prefect":
            raise
        console.print("Prefect is not installed (extra 'flows'): the same supervisor runs without it")
        from ddiloco.flows.runner import train_locally as training_run

    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    cfg = demo_config(opts, run_id)
    rundir = (opts.workdir / run_id).resolve()
    console.print(
        f"[bold]ddiloco demo[/bold] run [cyan]{run_id}[/cyan]: {cfg.learners.count} learners in "
        f"{len(cfg.learners.regions)} regions, {cfg.fragments.count} fragments, {cfg.compression.codec} outer gradients"
    )
    console.print(f"ledger, store and process logs under {rundir}")
    result: dict = {}
    failure: list[BaseException] = []

    def _run() -> None:
        try:
            result.update(training_run(config=cfg, run_id=run_id, launcher="local", seconds=opts.seconds, workdir=str(opts.workdir)))
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            failure.append(err)

    thread = threading.Thread(target=_run, name="training-run", daemon=True)
    thread.start()
    _show_progress(cfg, run_id, opts.seconds, thread, console)
    thread.join()
    if failure:
        raise failure[0]
    ctx = RunContext.open(cfg, run_id)
    with ctx.transaction() as s:
        summary = run_summary(s, run_id, ctx.now_dt())
    console.print(summary_table(summary))
    return summary


def _show_progress(cfg: RunConfig, run_id: str, seconds: float, thread: threading.Thread, console: Console) -> None:
    """A progress bar fed from the ledger (the flow runs in another thread)."""
    ctx = RunContext.open(cfg, run_id)
    shown_events: set[int] = set()
    started: float | None = None
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console,
    ) as progress:
        task = progress.add_task("starting", total=seconds, status="starting Prefect and the processes…")
        while thread.is_alive():
            thread.join(timeout=1.0)
            try:
                with ctx.transaction() as s:
                    if runs_q.get_run(s, run_id) is None:
                        continue
                    versions = runs_q.latest_version_numbers(s, run_id)
                    evals = runs_q.evaluations(s, run_id)
                    acct = reports_q.token_accounting(s, run_id)
                    events = [e for e in runs_q.events(s, run_id, limit=50) if e.kind in NOTEWORTHY and e.id not in shown_events]
            except Exception:  # noqa: BLE001 - the ledger may not exist for the first second
                continue
            for e in reversed(events):
                shown_events.add(e.id)
                progress.console.log(f"[yellow]{e.kind}[/yellow] {e.actor or ''} {e.detail}")
            if acct.trained and started is None:
                started = time.monotonic()
            elapsed = 0.0 if started is None else time.monotonic() - started
            loss = f"{evals[-1].val_loss:.3f}" if evals else "-"
            progress.update(
                task, description="training" if started else "starting", completed=min(elapsed, seconds),
                status=f"versions {sum(versions.values())}  tokens {acct.trained:,}  val loss {loss}",
            )
        progress.update(task, description="done", completed=seconds)


def summary_table(result: RunSummary) -> Table:
    table = Table(title=f"run {result.run}", show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    versions = result.versions
    table.add_row("tokens trained", f"{result.tokens:,}")
    table.add_row("  merged / rejected / pending", f"{result.tokens_merged:,} / {result.tokens_rejected:,} / {result.tokens_pending:,}")
    table.add_row("  lost / in flight at stop", f"{result.tokens_lost:,} / {result.tokens_in_flight:,}")
    table.add_row("  accounting balanced", "yes" if result.accounting_balanced else "[red]NO[/red]")
    table.add_row(
        "global versions per fragment",
        f"min {min(versions.values(), default=0)}, max {max(versions.values(), default=0)}, total {sum(versions.values())}",
    )
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    table.add_row("validation loss start -> end", f"{fmt(result.val_loss_start)} -> {fmt(result.val_loss_end)}")
    table.add_row("goodput", f"{result.goodput:.1%}")
    table.add_row(
        "  of the availability bound", f"{result.goodput_of_bound:.1%} (learners available {result.availability_bound:.1%} of the time)"
    )
    table.add_row("  learner-seconds by where they went", breakdown_line(result))
    table.add_row("longest gap between versions", f"{result.longest_version_gap_s:.1f} s")
    less = f" ({result.bytes_data_parallel / result.bytes_sent:.0f}x less)" if result.bytes_sent else ""
    table.add_row("bytes sent vs data-parallel", f"{result.bytes_sent / 1e6:.1f} MB vs {result.bytes_data_parallel / 1e6:.1f} MB{less}")
    table.add_row("submissions rejected by reason", ", ".join(f"{k}: {v}" for k, v in result.rejected_by_reason.items()) or "none")
    return table
