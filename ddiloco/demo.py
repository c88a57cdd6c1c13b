"""``ddiloco demo``: a real multi-process run on embedded defaults, with real failures.

A synchronizer and a hot standby, learners in two regions (one 2x slower), a SQLite ledger and
a local fragment store under ``./ddiloco-runs/``. The chaos schedule SIGKILLs a learner and
restarts it later, and SIGKILLs the active synchronizer once; the run keeps going throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ddiloco.platform.config import ChaosEvent, RunConfig, build_config
from ddiloco.platform.ledger import queries as q
from ddiloco.platform.runtime import RunContext, to_datetime
from ddiloco.platform.summary import RunSummary, run_summary

STOP_TIMEOUT_S = 60.0
"""How long processes get to finish their uploads and the final merge after the run ends."""


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
            ChaosEvent(at_s=0.30 * opts.seconds, action="kill_learner", target=victim),
            ChaosEvent(at_s=0.45 * opts.seconds, action="kill_synchronizer"),
            ChaosEvent(at_s=0.55 * opts.seconds, action="restart_learner", target=victim),
        ]
    if not opts.chaos:
        cfg.chaos.events = []
    return cfg


@dataclass
class Cluster:
    """The demo's processes, by name."""

    cfg: RunConfig
    run_id: str
    config_path: Path
    logdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.logdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "ddiloco", *args, "--config", str(self.config_path), "--run", self.run_id],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def start_synchronizer(self, name: str) -> None:
        self._spawn(name, ["synchronizer", "--holder", name])

    def start_learner(self, lid: str) -> None:
        self._spawn(lid, ["learner", "--learner", lid])

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def stop_all(self, timeout_s: float) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def run_demo(opts: DemoOptions, console: Console | None = None) -> RunSummary:
    console = console or Console()
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    cfg = demo_config(opts, run_id)
    rundir = (opts.workdir / run_id).resolve()
    logdir = rundir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    config_path = rundir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    ctx = RunContext.open(cfg, run_id)
    cluster = Cluster(cfg, run_id, config_path, logdir)
    console.print(f"[bold]ddiloco demo[/bold] run [cyan]{run_id}[/cyan]: {cfg.learners.count} learners in "
                  f"{len(cfg.learners.regions)} regions, {cfg.fragments.count} fragments, {cfg.compression.codec} outer gradients")
    console.print(f"ledger and store under {rundir}; process logs in {logdir}")
    cluster.start_synchronizer("sync-a")

    def versions_ready() -> bool:
        with ctx.transaction() as s:
            return len(q.latest_version_numbers(s, run_id)) == cfg.fragments.count

    try:
        _wait_for(versions_ready, 120, "the synchronizer to publish version 0")
        cluster.start_synchronizer("sync-b")
        for lid, _, _ in cfg.learners.learner_ids():
            cluster.start_learner(lid)
        _drive(cluster, ctx, opts.seconds, console)
        with ctx.transaction() as s:
            q.set_run_status(s, run_id, "finished", ctx.now_dt())
        cluster.stop_all(STOP_TIMEOUT_S)
        # A last pass in this process merges whatever the stopped learners left pending.
        from ddiloco.synchronizer.service import Synchronizer

        final = Synchronizer(ctx, holder="demo-final")
        _wait_for(lambda: final.poll_once(drain=True).role == "active", cfg.synchronizer.lease_ttl_s * 4, "the lease for the final merge")
        final.evaluate_now(ctx.now())
    finally:
        cluster.stop_all(5.0)
    with ctx.transaction() as s:
        result = run_summary(s, run_id, ctx.now_dt())
    console.print(summary_table(result))
    return result


def _drive(cluster: Cluster, ctx: RunContext, seconds: float, console: Console) -> None:
    """Run the chaos schedule and show progress until the time is up."""
    cfg = cluster.cfg
    run_id = cluster.run_id
    pending = sorted(cfg.chaos.events, key=lambda e: e.at_s)
    t0 = time.monotonic()
    standby_names = iter(f"sync-{c}" for c in "cdefghijklmnopqrstuvwxyz")
    with Progress(
        TextColumn("[bold]training"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console, transient=False,
    ) as progress:
        task = progress.add_task("run", total=seconds, status="")
        while (elapsed := time.monotonic() - t0) < seconds:
            while pending and pending[0].at_s <= elapsed:
                event = pending.pop(0)
                _apply_chaos(cluster, ctx, event, standby_names, console)
            with ctx.transaction() as s:
                versions = sum(q.latest_version_numbers(s, run_id).values())
                evals = q.evaluations(s, run_id)
                acct = q.token_accounting(s, run_id)
            loss = f"{evals[-1].val_loss:.3f}" if evals else "-"
            progress.update(task, completed=elapsed, status=f"versions {versions}  tokens {acct.trained:,}  val loss {loss}")
            time.sleep(1.0)
        progress.update(task, completed=seconds)


def _apply_chaos(cluster: Cluster, ctx: RunContext, event: ChaosEvent, standby_names, console: Console) -> None:
    now = ctx.now_dt()
    if event.action == "kill_learner" and event.target:
        cluster.kill(event.target)
        detail = f"SIGKILL learner {event.target}"
    elif event.action == "restart_learner" and event.target:
        cluster.start_learner(event.target)
        detail = f"restarted learner {event.target}"
    elif event.action == "kill_synchronizer":
        with ctx.transaction() as s:
            lease = q.current_lease(s, cluster.run_id)
        holder = event.target or (lease.holder if lease else None)
        if holder is None or holder not in cluster.procs:
            return
        cluster.kill(holder)
        # Keep a hot standby around for the next failure.
        cluster.start_synchronizer(next(standby_names))
        detail = f"SIGKILL active synchronizer {holder}"
    else:
        return
    with ctx.transaction() as s:
        q.record_event(s, cluster.run_id, "chaos", "demo", detail, now)
    console.log(f"[yellow]chaos:[/yellow] {detail}")


def summary_table(result: RunSummary) -> Table:
    table = Table(title=f"run {result.run}", show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    versions = result.versions
    table.add_row("tokens trained", f"{result.tokens:,}")
    table.add_row("  merged / rejected / pending", f"{result.tokens_merged:,} / {result.tokens_rejected:,} / {result.tokens_pending:,}")
    table.add_row("  lost / in flight at stop", f"{result.tokens_lost:,} / {result.tokens_in_flight:,}")
    table.add_row("  accounting balanced", "yes" if result.accounting_balanced else "[red]NO[/red]")
    table.add_row("global versions per fragment", f"min {min(versions.values(), default=0)}, max {max(versions.values(), default=0)}, total {sum(versions.values())}")
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    table.add_row("validation loss start -> end", f"{fmt(result.val_loss_start)} -> {fmt(result.val_loss_end)}")
    table.add_row("goodput", f"{result.goodput:.1%}")
    table.add_row("longest gap between versions", f"{result.longest_version_gap_s:.1f} s")
    ratio = result.bytes_data_parallel / result.bytes_sent if result.bytes_sent else float("nan")
    table.add_row("bytes sent vs data-parallel", f"{result.bytes_sent / 1e6:.1f} MB vs {result.bytes_data_parallel / 1e6:.1f} MB ({ratio:.0f}x less)")
    table.add_row("submissions rejected by reason", ", ".join(f"{k}: {v}" for k, v in result.rejected_by_reason.items()) or "none")
    return table
