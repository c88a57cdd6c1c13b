"""A training run without Prefect: start the synchronizers and learners through a Launcher, keep
them alive, apply the chaos schedule, and end with a final merge and an evaluation.

The ``training-run`` flow calls these functions; ``ddiloco demo`` calls them directly when the
``flows`` extra (Prefect) is not installed."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from ddiloco.flows import alerts
from ddiloco.flows.chaos import apply_event, seeded_schedule
from ddiloco.flows.launchers import Handle, Launcher, SubprocessLauncher
from ddiloco.flows.supervise import LearnerView, relaunch_decisions
from ddiloco.platform.config import RunConfig, secret_env
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.liveness import LivenessPolicy
from ddiloco.platform.redact import redact_url
from ddiloco.platform.run_state import build_layout, register_run
from ddiloco.platform.runtime import RunContext, to_timestamp
from ddiloco.platform.summary import RunSummary, run_summary
from ddiloco.synchronizer.evaluation import evaluate_and_record
from ddiloco.synchronizer.lease import holder_name
from ddiloco.synchronizer.policy import budget_end
from ddiloco.synchronizer.service import Synchronizer

SUPERVISE_EVERY_S = 1.0
STARTUP_POLL_S = 0.1
"""How often the supervisor asks the ledger whether training has started, before it has."""
STOP_TIMEOUT_S = 60.0
"""How long processes get to finish their uploads when the run ends."""
STANDBYS = 1

log = logging.getLogger("ddiloco.flows")

Progress = Callable[[float, dict], None]


def register(cfg: RunConfig, run_id: str, flow_run_url: str | None = None) -> bool:
    """Record the run, its layout and its version 0 in the ledger (idempotent)."""
    ctx = RunContext.open(cfg, run_id)
    return register_run(ctx, build_layout(ctx), flow_run_url=flow_run_url)


def local_launcher(cfg: RunConfig, run_id: str, workdir: str | Path) -> SubprocessLauncher:
    """Processes on this machine; the config they read is saved under ``workdir/run_id`` (secrets
    masked: they reach the processes through their environment)."""
    rundir = Path(workdir).resolve() / run_id
    rundir.mkdir(parents=True, exist_ok=True)
    config_path = rundir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return SubprocessLauncher(config_path, run_id, rundir / "logs", secrets=secret_env(cfg))


def _versions_ready(ctx: RunContext) -> bool:
    with ctx.transaction() as s:
        return len(runs_q.latest_version_numbers(s, ctx.run_id)) == ctx.cfg.fragments.count


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def _until_training(ctx: RunContext, timeout_s: float) -> None:
    """Return once the run's first trained token is in the ledger, or after ``timeout_s``: the clock that chaos events
    and ``seconds`` count by starts then, and a whole supervision pass late would shift every one of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with ctx.transaction() as s:
            if reports_q.token_accounting(s, ctx.run_id).trained > 0:
                return
        time.sleep(STARTUP_POLL_S)


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
    run_resource = alerts.RUN_RESOURCE.format(run_id=run_id)
    alerts.emit("ddiloco.run.started", run_resource)
    try:
        _keep_alive(cfg, run_id, launcher, ctx, seconds, progress)
    except BaseException as err:
        launcher.close(0.0)  # an error or an interrupt (Ctrl-C, a test's timeout) leaves no process of the run behind
        if isinstance(err, Exception):
            _mark_failed(ctx, err)
        raise
    with ctx.transaction() as s:
        # The synchronizer may have finished it at its budget already, or an operator stopped it: that end stands.
        runs_q.set_run_status(s, run_id, runs_q.FINISHED, ctx.now_dt(), detail="the training flow's time or budget is up")
        status = runs_q.require_run(s, run_id).status
    alerts.emit("ddiloco.run.finished", run_resource)  # whatever its status: the event that closes the run's alerts
    launcher.close(STOP_TIMEOUT_S)
    return finish_run(ctx, merge=status == runs_q.FINISHED)


def _mark_failed(ctx: RunContext, err: Exception) -> None:
    """End the run as failed, the error in one line with its credentials masked: with its processes gone it would
    otherwise read as running for good. An operator's end stands (``set_run_status``); a ledger that is itself what
    failed gets a log line instead."""
    first_line = (str(err).splitlines() or [""])[0]
    detail = redact_url(f"the training flow failed: {type(err).__name__}: {first_line}")[:500]
    try:
        with ctx.transaction() as s:
            runs_q.set_run_status(s, ctx.run_id, runs_q.FAILED, ctx.now_dt(), detail=detail)
    except Exception:  # noqa: BLE001 - the error being raised is the one to see
        log.exception("could not mark run %s failed", ctx.run_id)


def _keep_alive(cfg: RunConfig, run_id: str, launcher: Launcher, ctx: RunContext, seconds: float | None, progress: Progress | None) -> None:
    """Start every process, relaunch what dies, apply the chaos schedule; return when the budget or the time is up, or
    the run has ended otherwise (``ddiloco run finish | stop``)."""
    run_resource = alerts.RUN_RESOURCE.format(run_id=run_id)
    syncs: list[Handle] = [launcher.start_synchronizer("sync-a")]
    # Learners start with the synchronizer, not after its version 0: their start-up overlaps its own, and
    # each joins as soon as version 0 is out.
    learners: dict[str, Handle] = {}
    regions = {lid: region for lid, region, _ in cfg.learners.learner_ids()}
    for lid, region in regions.items():
        learners[lid] = _launch_learner(ctx, launcher, lid, region, "launched")
    exited: set[str] = set()  # learners whose current process was seen to end (recorded once)
    _wait(lambda: _versions_ready(ctx), 300, "the synchronizer to publish version 0")
    labels = iter(f"sync-{c}" for c in "bcdefghijklmnopqrstuvwxyz")
    syncs.append(launcher.start_synchronizer(next(labels)))
    evaluator = launcher.start_evaluator()  # evaluation runs in its own process, never in a merge pass
    schedule = seeded_schedule(cfg, seconds or 0.0)
    published = 0  # global versions published, summed over fragments
    held: dict[str, float] = {}  # learners a chaos kill keeps down until this elapsed time
    t0: float | None = None  # time counts from the first trained token, not from process start-up
    lcfg = cfg.learners
    liveness = LivenessPolicy.from_learners_config(lcfg)
    while True:
        now = time.time()
        with ctx.transaction() as s:
            rows = {r.id: r for r in runs_q.learners(s, run_id)}
            acct = reports_q.token_accounting(s, run_id)
            versions = sum(runs_q.latest_version_numbers(s, run_id).values())
            status = runs_q.require_run(s, run_id).status
        if status != runs_q.RUNNING:
            break  # ended by its synchronizer at the budget, or by an operator: its processes are exiting, none is relaunched
        if versions > published:
            published = versions
            alerts.emit("ddiloco.version.published", run_resource, **{"ddiloco.versions": str(versions)})
        if t0 is None and acct.trained > 0:
            t0 = time.monotonic()
        elapsed = 0.0 if t0 is None else time.monotonic() - t0
        killed: set[str] = set()  # SIGKILLed in this pass: ended, though the kernel may not have reaped them yet
        while t0 is not None and schedule and schedule[0].at_s <= elapsed:
            event = schedule[0]
            result = apply_event(ctx, event)
            if result.retry:
                break  # its target is still starting: try again on the next pass
            schedule.pop(0)
            if not (result.applied and event.action == "kill_learner" and event.target):
                continue
            if event.target in learners:
                killed.add(event.target)
                if event.target not in exited:
                    # SIGKILL ends it now: its down time starts here, not when a later pass sees the process gone.
                    exited.add(event.target)
                    _record_exit(ctx, event.target, result.detail)
            if event.duration_s > 0:
                held[event.target] = elapsed + event.duration_s
        views = []
        for lid, h in learners.items():
            row = rows.get(lid)
            hb = to_timestamp(row.last_heartbeat_at) if row and row.last_heartbeat_at else None
            if hb is not None and row.started_at and to_timestamp(row.started_at) < h.started_at - 1.0:
                hb = None  # that heartbeat belongs to the incarnation before the relaunch
            running = lid not in killed and launcher.is_running(h)
            if not running and lid not in exited:
                exited.add(lid)
                _record_exit(ctx, lid, "its process or flow run ended")
            views.append(LearnerView(lid, running, h.started_at, hb))
        decisions = relaunch_decisions(now, views, liveness=liveness, startup_grace_s=lcfg.startup_grace_s)
        for lid, reason in decisions.items():
            if held.get(lid, 0.0) > elapsed:
                continue
            if lid not in exited:
                _record_exit(ctx, lid, f"stopped by the supervisor: {reason}")
            exited.discard(lid)
            launcher.stop(learners[lid], kill=True)
            learners[lid] = _launch_learner(ctx, launcher, lid, regions[lid], f"relaunched: {reason}")
            with ctx.transaction() as s:
                runs_q.record_event(s, run_id, "learner_relaunched", "supervisor", f"{lid}: {reason}", ctx.now_dt())
            log.info("relaunched learner %s: %s", lid, reason)
            learner_resource = alerts.LEARNER_RESOURCE.format(run_id=run_id, learner_id=lid)
            alerts.emit("ddiloco.learner.relaunched", learner_resource, **{"ddiloco.run": run_id})
        live_syncs = [h for h in syncs if launcher.is_running(h)]
        while len(live_syncs) < cfg.synchronizer.shards + STANDBYS:
            h = launcher.start_synchronizer(next(labels))
            syncs.append(h)
            live_syncs.append(h)
            with ctx.transaction() as s:
                runs_q.record_event(s, run_id, "synchronizer_launched", "supervisor", h.name, ctx.now_dt())
        if not launcher.is_running(evaluator):
            evaluator = launcher.start_evaluator()
        if progress:
            progress(elapsed, {"tokens": acct.trained})
        if budget_end(acct.merged, cfg.token_budget) or (seconds is not None and t0 is not None and elapsed >= seconds):
            break
        if t0 is None:
            _until_training(ctx, SUPERVISE_EVERY_S)
        else:
            time.sleep(SUPERVISE_EVERY_S)


def _launch_learner(ctx: RunContext, launcher: Launcher, lid: str, region: str, why: str) -> Handle:
    """Start a learner's process and record when (its timeline's launch: see ``summary.time_breakdown``)."""
    handle = launcher.start_learner(lid, region)
    with ctx.transaction() as s:
        runs_q.record_event(s, ctx.run_id, runs_q.LEARNER_LAUNCHED, lid, why, ctx.now_dt())
    return handle


def _record_exit(ctx: RunContext, lid: str, why: str) -> None:
    with ctx.transaction() as s:
        runs_q.record_event(s, ctx.run_id, runs_q.LEARNER_EXITED, lid, why, ctx.now_dt())


def finish_run(ctx: RunContext, *, merge: bool = True) -> RunSummary:
    """Merge what is still pending (unless ``merge`` is off: a stopped run merges nothing more), evaluate the final
    global model, and summarise."""
    cache = {}
    for shard in range(ctx.cfg.synchronizer.shards if merge else 0):
        final = Synchronizer(ctx, holder=holder_name("final"), shard=shard)
        _wait(lambda final=final: final.poll_once(drain=True).role == "active", ctx.cfg.synchronizer.lease_ttl_s * 4 + 10,
              f"the lease of shard {shard} for the final merge")
        cache.update(final.state)
        with ctx.transaction() as s:
            sync_q.release_lease(s, ctx.run_id, final.holder, final.token, ctx.now_dt(), shard=shard)
    evaluate_and_record(ctx, ctx.now(), cache=cache)
    with ctx.transaction() as s:
        return run_summary(s, ctx.run_id, ctx.now_dt())


def train_locally(config: RunConfig, run_id: str, launcher: str = "local", seconds: float | None = None,
                  workdir: str = "ddiloco-runs") -> dict:
    """The ``training-run`` flow's work with local processes, without Prefect (same arguments, same result)."""
    if launcher != "local":
        raise ValueError(f"launcher {launcher!r} needs Prefect (the 'flows' extra); without it only 'local' runs")
    register(config, run_id)
    return json.loads(supervise(config, run_id, local_launcher(config, run_id, workdir), seconds=seconds).to_json())
