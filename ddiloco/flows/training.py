"""Prefect flows: training-run (provision, supervise, finish), learner, synchronizer, chaos, evaluate.

Flows sequence calls into the packages; they hold no training state. Everything that matters
is in the ledger and the store, so a flow run can crash and a new one picks up the run."""

from __future__ import annotations

import base64
import io
import json
import time
from typing import Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run as current_flow_run

from ddiloco.entry import checked_id, evaluator_main, learner_main, setup_logging, synchronizer_main
from ddiloco.flows.chaos import apply_event, seeded_schedule
from ddiloco.flows.launchers import DeploymentLauncher, Launcher
from ddiloco.flows.runner import local_launcher, register, supervise
from ddiloco.platform.config import RunConfig
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.summary import RunSummary
from ddiloco.synchronizer.evaluation import evaluate_and_record


def _flow_run_url() -> str | None:
    try:
        url = current_flow_run.ui_url
    except Exception:  # noqa: BLE001 - outside a flow run there is no URL
        return None
    return url or None


@task(retries=3, retry_delay_seconds=[2, 5, 15])
def register_run_task(cfg: RunConfig, run_id: str, flow_run_url: str | None) -> bool:
    return register(cfg, run_id, flow_run_url)


def _loss_plot_markdown(ctx: RunContext) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with ctx.transaction() as s:
        evals = runs_q.evaluations(s, ctx.run_id)
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
    setup_logging()
    run_id = checked_id(run_id or config.name, "run")
    register_run_task(config, run_id, _flow_run_url())
    chosen: Launcher = local_launcher(config, run_id, workdir) if launcher == "local" else DeploymentLauncher(config, run_id)
    summary = supervise(config, run_id, chosen, seconds=seconds)
    publish_artifacts(RunContext.open(config, run_id), summary)
    get_run_logger().info("run %s finished: val loss %s, goodput %.1f%%", run_id, summary.val_loss_end, 100 * summary.goodput)
    return json.loads(summary.to_json())


@flow(name="ddiloco-learner")
def learner_flow(config: RunConfig, learner_id: str, run_id: str | None = None) -> int:
    """One learner until the run ends (the process main ``ddiloco learner`` runs); returns the inner steps it ran."""
    summary = learner_main(config, learner_id, run_id, flow_run_url=_flow_run_url())
    # None when stopped by a signal before rank 0 could report.
    return summary.step_count if summary is not None else 0


@flow(name="ddiloco-synchronizer")
def synchronizer_flow(config: RunConfig, run_id: str | None = None, label: str = "sync", shard: int | None = None) -> None:
    """A synchronizer (active for a shard, or standby) until the run ends; ``shard`` pins it to one shard."""
    synchronizer_main(config, run_id, label, shard=shard)


@flow(name="ddiloco-chaos")
def chaos_flow(config: RunConfig, run_id: str | None = None, seconds: float = 60.0) -> list[str]:
    """Rehearse failures on a running run: the config's chaos events, or a seeded random schedule."""
    setup_logging()
    ctx = RunContext.open(config, checked_id(run_id or config.name, "run"))
    done = []
    t0 = time.monotonic()
    for event in seeded_schedule(config, seconds):
        time.sleep(max(0.0, event.at_s - (time.monotonic() - t0)))
        result = apply_event(ctx, event)
        done.append(result.detail)
    return done


@flow(name="ddiloco-evaluate")
def evaluate_flow(config: RunConfig, run_id: str | None = None, follow: bool = False) -> dict:
    """Evaluate the newest global model on the fixed validation set and record it in the ledger;
    ``follow``: be the run's evaluator (evaluate new versions on its cadence until the run ends)."""
    if follow:
        return {"evaluations": evaluator_main(config, run_id)}
    setup_logging()
    ctx = RunContext.open(config, checked_id(run_id or config.name, "run"))
    loss, acc = evaluate_and_record(ctx, ctx.now())
    return {"val_loss": loss, "val_accuracy": acc}
