"""Prefect flows: training-run (provision, supervise, finish), learner, synchronizer, chaos, evaluate.

Flows sequence calls into the packages; they hold no training state. Everything that matters
is in the ledger and the store, so a flow run can crash and a new one picks up the run."""

from __future__ import annotations

import base64
import io
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run as current_flow_run

from ddiloco.flows.chaos import apply_event, seeded_schedule
from ddiloco.flows.launchers import DeploymentLauncher, Handle, Launcher, SubprocessLauncher
from ddiloco.flows.supervise import LearnerView, budget_reached, relaunch_decisions
from ddiloco.platform.config import RunConfig
from ddiloco.platform.ledger import queries as q
from ddiloco.platform.run_state import build_layout, register_run
from ddiloco.platform.runtime import RunContext, to_timestamp
from ddiloco.platform.summary import RunSummary, run_summary
from ddiloco.synchronizer.evaluation import evaluate_and_record
from ddiloco.synchronizer.service import Synchronizer, holder_name

SUPERVISE_EVERY_S = 1.0
STOP_TIMEOUT_S = 60.0
"""How long processes get to finish their uploads when the run ends."""
STANDBYS = 1

log = logging.getLogger("ddiloco.flows")

Progress = Callable[[float, dict], None]


def _flow_run_url() -> str | None:
    try:
        url = current_flow_run.ui_url
    except Exception:  # noqa: BLE001 - outside a flow run there is no URL
        return None
    return url or None


@task(retries=3, retry_delay_seconds=[2, 5, 15])
def register_run_task(cfg: RunConfig, run_id: str, flow_run_url: str | None) -> bool:
    ctx = RunContext.open(cfg, run_id)
    return register_run(ctx, build_layout(ctx), flow_run_url=flow_run_url)


def _versions_ready(ctx: RunContext) -> bool:
    with ctx.transaction() as s:
        return len(q.latest_version_numbers(s, ctx.run_id)) == ctx.cfg.fragments.count


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def supervise(
    cfg: RunConfig,
    run_id: str,
    launcher: Launcher,
    *,
    seconds: float | None = None,
    progress: Progress | None = None,
) -> RunSummary:
    """Start the synchronizers and learners, keep them alive, run the chaos schedule, end the run."""
    ctx = RunContext.open(cfg, run_id)
    syncs: list[Handle] = [launcher.start_synchronizer("sync-a")]
    _wait(lambda: _versions_ready(ctx), 300, "the synchronizer to publish version 0")
    labels = iter(f"sync-{c}" for c in "bcdefghijklmnopqrstuvwxyz")
    syncs.append(launcher.start_synchronizer(next(labels)))
    learners: dict[str, Handle] = {}
    regions = {lid: region for lid, region, _ in cfg.learners.learner_ids()}
    for lid, region in regions.items():
        learners[lid] = launcher.start_learner(lid, region)
    schedule = seeded_schedule(cfg, seconds or 0.0)
    held: dict[str, float] = {}  # learners a chaos kill keeps down until this elapsed time
    t0: float | None = None  # time counts from the first trained token, not from process start-up
    lcfg = cfg.learners
    while True:
        elapsed = 0.0 if t0 is None else time.monotonic() - t0
        while t0 is not None and schedule and schedule[0].at_s <= elapsed:
            event = schedule[0]
            result = apply_event(ctx, event)
            if result.retry:
                break  # its target is still starting: try again on the next pass
            schedule.pop(0)
            if result.applied and event.action == "kill_learner" and event.target and event.duration_s > 0:
                held[event.target] = elapsed + event.duration_s
        now = time.time()
        with ctx.transaction() as s:
            rows = {r.id: r for r in q.learners(s, run_id)}
            acct = q.token_accounting(s, run_id)
        if t0 is None and acct.trained > 0:
            t0 = time.monotonic()
        views = []
        for lid, h in learners.items():
            row = rows.get(lid)
            hb = to_timestamp(row.last_heartbeat_at) if row and row.last_heartbeat_at else None
            if hb is not None and row.started_at and to_timestamp(row.started_at) < h.started_at - 1.0:
                hb = None  # that heartbeat belongs to the incarnation before the relaunch
            views.append(LearnerView(lid, launcher.is_running(h), h.started_at, hb))
        decisions = relaunch_decisions(now, views, dead_after_s=lcfg.dead_after_s, startup_grace_s=lcfg.startup_grace_s)
        for lid, reason in decisions.items():
            if held.get(lid, 0.0) > elapsed:
                continue
            launcher.stop(learners[lid], kill=True)
            learners[lid] = launcher.start_learner(lid, regions[lid])
            with ctx.transaction() as s:
                q.record_event(s, run_id, "learner_relaunched", "supervisor", f"{lid}: {reason}", ctx.now_dt())
            log.info("relaunched learner %s: %s", lid, reason)
        live_syncs = [h for h in syncs if launcher.is_running(h)]
        while len(live_syncs) < 1 + STANDBYS:
            h = launcher.start_synchronizer(next(labels))
            syncs.append(h)
            live_syncs.append(h)
            with ctx.transaction() as s:
                q.record_event(s, run_id, "synchronizer_launched", "supervisor", h.name, ctx.now_dt())
        if progress:
            progress(elapsed, {"tokens": acct.trained})
        if budget_reached(acct.trained, cfg.token_budget) or (seconds is not None and t0 is not None and elapsed >= seconds):
            break
        time.sleep(SUPERVISE_EVERY_S)
    with ctx.transaction() as s:
        q.set_run_status(s, run_id, "finished", ctx.now_dt())
    launcher.close(STOP_TIMEOUT_S)
    return finish_run(ctx)


def finish_run(ctx: RunContext) -> RunSummary:
    """Merge what is still pending, evaluate the final global model, and summarise."""
    final = Synchronizer(ctx, holder=holder_name("final"))
    _wait(lambda: final.poll_once(drain=True).role == "active", ctx.cfg.synchronizer.lease_ttl_s * 4 + 10, "the lease for the final merge")
    evaluate_and_record(ctx, ctx.now(), cache=final.state)
    with ctx.transaction() as s:
        q.release_lease(s, ctx.run_id, final.holder, final.token, ctx.now_dt())
        return run_summary(s, ctx.run_id, ctx.now_dt())


def _loss_plot_markdown(ctx: RunContext) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with ctx.transaction() as s:
        evals = q.evaluations(s, ctx.run_id)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e.tokens for e in evals], [e.val_loss for e in evals], marker="o")
    ax.set_xlabel("tokens merged")
    ax.set_ylabel("validation loss")
    ax.set_title(f"run {ctx.run_id}")
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return f"![validation loss](data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()})"


def publish_artifacts(ctx: RunContext, summary: RunSummary) -> None:
    rows = [{"figure": k, "value": json.dumps(v) if isinstance(v, (dict, list)) else v} for k, v in json.loads(summary.to_json()).items()]
    create_table_artifact(key=f"summary-{ctx.run_id}".lower(), table=rows, description=f"ddiloco run {ctx.run_id}")
    create_markdown_artifact(key=f"loss-{ctx.run_id}".lower(), markdown=_loss_plot_markdown(ctx), description="validation loss vs tokens")


@flow(name="ddiloco-training-run", log_prints=True)
def training_run(
    config: RunConfig,
    run_id: str | None = None,
    launcher: Literal["local", "work-pools"] = "local",
    seconds: float | None = None,
    workdir: str = "ddiloco-runs",
) -> dict:
    """Register the run, launch synchronizer + standby + learners, supervise until the budget or time is up."""
    run_id = run_id or config.name
    register_run_task(config, run_id, _flow_run_url())
    if launcher == "local":
        rundir = Path(workdir).resolve() / run_id
        rundir.mkdir(parents=True, exist_ok=True)
        config_path = rundir / "config.yaml"
        config_path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        chosen: Launcher = SubprocessLauncher(config_path, run_id, rundir / "logs")
    else:
        chosen = DeploymentLauncher(config, run_id)
    summary = supervise(config, run_id, chosen, seconds=seconds)
    publish_artifacts(RunContext.open(config, run_id), summary)
    get_run_logger().info("run %s finished: val loss %s, goodput %.1f%%", run_id, summary.val_loss_end, 100 * summary.goodput)
    return json.loads(summary.to_json())


@flow(name="ddiloco-learner")
def learner_flow(config: RunConfig, learner_id: str, run_id: str | None = None) -> int:
    """One learner until the run ends; returns the inner steps it ran."""
    from ddiloco.learner_worker.launch import run_learner

    summary = run_learner(
        config, run_id or config.name, learner_id, flow_run_url=_flow_run_url(), nproc_per_node=config.learners.nproc_per_node
    )
    # None when stopped by a signal before rank 0 could report.
    return summary.step_count if summary is not None else 0


@flow(name="ddiloco-synchronizer")
def synchronizer_flow(config: RunConfig, run_id: str | None = None, label: str = "sync") -> None:
    """A synchronizer (active or standby) until the run ends."""
    from ddiloco.synchronizer.process import run_synchronizer

    run_synchronizer(config, run_id or config.name, label)


@flow(name="ddiloco-chaos")
def chaos_flow(config: RunConfig, run_id: str | None = None, seconds: float = 60.0) -> list[str]:
    """Rehearse failures on a running run: the config's chaos events, or a seeded random schedule."""
    ctx = RunContext.open(config, run_id or config.name)
    done = []
    t0 = time.monotonic()
    for event in seeded_schedule(config, seconds):
        time.sleep(max(0.0, event.at_s - (time.monotonic() - t0)))
        result = apply_event(ctx, event)
        done.append(result.detail)
    return done


@flow(name="ddiloco-evaluate")
def evaluate_flow(config: RunConfig, run_id: str | None = None) -> dict:
    """Evaluate the newest global model on the fixed validation set and record it in the ledger."""
    ctx = RunContext.open(config, run_id or config.name)
    loss, acc = evaluate_and_record(ctx, ctx.now())
    return {"val_loss": loss, "val_accuracy": acc}
