"""Starting a learner: as one process, as one rank of a torchrun job, or as a whole job of ranks.

``run_learner`` is the entry point of ``ddiloco learner`` and of the Prefect learner flow:
- inside a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK set) this process is one rank of a
  data-parallel learner;
- with ``nproc_per_node > 1`` it launches that job here through torchrun's elastic agent and waits;
- otherwise it is a learner of one rank, on the GPU when ``learners.device`` resolves to one.

Failure: collectives have a timeout (``DDILOCO_DIST_TIMEOUT_S``, default 60 s); a rank that dies
makes its peers' next collective fail, the ranks exit, torchrun (``max_restarts=0``) stops the job,
and the supervisor relaunches it: the new job registers a new incarnation and rejoins from the
newest global state like any learner. Rank 0 flushes the uploads it has queued before it exits."""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from ddiloco.learner_worker.device import resolve_device
from ddiloco.learner_worker.dist import Dist, collective_timeout_s, init_dist, rank_env, set_parent_death_signal, shutdown_dist
from ddiloco.learner_worker.flops import model_cost
from ddiloco.learner_worker.learner import Learner, StepReport
from ddiloco.learner_worker.link import LearnerLink
from ddiloco.platform.config import ConfigError, RunConfig, environment, secret_env, world_size_problem
from ddiloco.platform.metrics import LearnerFigures, serve_learner
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.tracking import Reporter, open_run_tracker, tracking_every_s
from ddiloco.platform.units import format_flops

log = logging.getLogger("ddiloco.learner")

SHUTDOWN_TIMEOUT_S = 30
"""How long torchrun lets the remaining ranks finish (flush uploads) after SIGTERM before SIGKILL."""


class LearnerJobFailed(RuntimeError):
    """A rank of a multi-rank learner job failed and torchrun stopped the others."""


@dataclass
class JobSummary:
    """What rank 0 reports when a learner ends."""

    learner_id: str
    incarnation: int
    world_size: int
    device: str
    step_count: int
    tokens_total: int
    wall_s: float
    figures: dict[str, float]


def paced(speed: float, stop: threading.Event):  # noqa: ANN201 - a step callback
    """Emulated slower hardware (``learners.regions[].speeds``): each step takes 1/speed as long."""
    if speed >= 1.0:
        return None

    def pace(report: StepReport) -> None:
        stop.wait(report.compute_s * (1.0 / speed - 1.0))

    return pace


def step_callback(cfg: RunConfig, learner: Learner, speed: float, stop: threading.Event) -> Callable[[StepReport], None]:
    """After each step: a progress line every ``learners.log_every`` steps (rank 0), then the emulated pace."""
    pace = paced(speed, stop)
    every = cfg.learners.log_every if learner.link is not None else 0

    def after_step(report: StepReport) -> None:
        if every and report.tokens and learner.step_count % every == 0:
            f = learner_figures(learner)
            log.info("learner %s step %s: %s tokens, loss %.4f, %.0f tokens/s%s, %s uploads queued, newest version v%s",
                     learner.id, f.step, f.tokens, f.loss if f.loss is not None else float("nan"), f.tokens_per_s,
                     flops_clause(f), f.upload_queue, f.last_version)
        if pace is not None:
            pace(report)

    return after_step


def flops_clause(f: LearnerFigures) -> str:
    """The progress line's model FLOP/s per device and MFU, where known."""
    if f.model_flops_per_s is None:
        return ""
    mfu = f" (MFU {f.mfu:.1%})" if f.mfu is not None else ""
    return f", {format_flops(f.model_flops_per_s)}/s per device{mfu}"


def learner_figures(learner: Learner) -> LearnerFigures:
    """A rank-0 learner's figures for its progress line and /metrics."""
    link = learner.link
    queued, newest = link.io_figures() if link is not None else (0, -1)
    tokens_per_s, flops, mfu = learner.throughput()
    return LearnerFigures(
        step=learner.step_count, tokens=learner.tokens_total, tokens_per_s=tokens_per_s,
        loss=learner.last_loss, upload_queue=queued, sent_bytes=link.uploader.bytes_sent if link else 0,
        received_bytes=link.downloader.bytes_received if link else 0, last_version=newest,
        nonfinite_losses=learner.nonfinite_losses, incarnation=max(0, learner.incarnation),
        model_flops_per_s=flops, mfu=mfu,
    )


def run_learner(
    cfg: RunConfig,
    run_id: str,
    learner_id: str,
    *,
    max_steps: int | None = None,
    ready_timeout_s: float = 300.0,
    flow_run_url: str | None = None,
    nproc_per_node: int = 1,
    summary_path: str | os.PathLike[str] | None = None,
) -> JobSummary | None:
    """Run one learner until the run ends; rank 0's summary (None on other ranks or when stopped by a signal)."""
    index, region, speed = cfg.learners.resolve(learner_id)
    info = rank_env()
    # Refused before any rank builds its model; registering would refuse it too (the ledger's backstop).
    why = world_size_problem(info.world if info else nproc_per_node, cfg.learners.max_world_size)
    if why:
        raise ConfigError(f"learner {learner_id!r}: {why}")
    if info is None and nproc_per_node > 1:
        return launch_learner_job(
            cfg, run_id, learner_id, nproc_per_node, max_steps=max_steps, flow_run_url=flow_run_url,
            verbose=logging.getLogger().isEnabledFor(logging.DEBUG),
        )
    if info is not None:
        set_parent_death_signal(signal.SIGTERM)
    torch.set_num_threads(cfg.learners.torch_threads)
    stop = threading.Event()

    def _on_signal(signum, _frame) -> None:  # noqa: ANN001
        log.info("learner %s got signal %s: finishing uploads and stopping", learner_id, signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
    device = resolve_device(cfg.learners.device, info.local_rank if info else 0)
    if info is not None and info.world > 1:
        d = init_dist(device, timeout_s=collective_timeout_s(), ready_timeout_s=ready_timeout_s)
    else:
        d = Dist.single(device)
    t0 = time.monotonic()
    clean = False
    tracker, reporter = None, None
    try:
        if d.rank == 0:
            tracking_every_s()  # a bad value is refused before the model is built
            tracker = open_run_tracker(cfg, run_id, f"learner-{learner_id}")
        ctx = RunContext.open(cfg, run_id) if d.rank == 0 else None
        link = LearnerLink(ctx, learner_id, region, flow_run_url=flow_run_url) if ctx is not None else None
        learner = Learner(cfg, learner_id, index=index, num_learners=cfg.learners.count, link=link, dist=d)
        learner.start(ready_timeout_s=ready_timeout_s)
        learner.start_background_io()
        if d.rank == 0:
            learner.cost = model_cost(cfg.model, device)
            serve_learner(run_id, learner_id, lambda: learner_figures(learner), register=tracker is not None)
            if tracker is not None:
                # Its step is the learner's inner step over all its incarnations, so a relaunch's series go on forward.
                reporter = Reporter(tracker, run_id, lambda _: learner.schedule_offset + learner.step_count,
                                    every_s=tracking_every_s()).start()
            log.info(
                "learner %s (incarnation %s) joined run %s in region %s: %s rank(s) on %s, %s%s; %s",
                learner_id, learner.incarnation, run_id, region, d.world, device, learner.layout.parallelism,
                f", {learner.checkpointed_blocks} blocks recomputing their activations" if learner.checkpointed_blocks else "",
                learner.cost.describe(),
            )
        try:
            learner.run(stop.is_set, max_steps=max_steps, after_step=step_callback(cfg, learner, speed, stop))
        except Exception:
            if d.world > 1:
                log.error(
                    "learner %s rank %s: stepping failed (a collective fails when a peer rank died or hung); "
                    "this rank exits and torchrun stops the job", learner_id, d.rank,
                )
            raise
        finally:
            learner.stop()
        clean = True
    finally:
        if reporter is not None:
            reporter.close()  # the final figures, then the tracker closes
        elif tracker is not None:
            tracker.close()
        shutdown_dist(d, together=clean)
    if d.rank != 0:
        return None
    log.info("learner %s stopped after %s steps, %s tokens over %s rank(s)", learner_id, learner.step_count, learner.tokens_total, d.world)
    summary = JobSummary(
        learner_id=learner_id, incarnation=learner.incarnation, world_size=d.world, device=str(device),
        step_count=learner.step_count, tokens_total=learner.tokens_total, wall_s=time.monotonic() - t0,
        figures={**learner.timings, "learner.upload": link.uploader.upload_s if link else 0.0},
    )
    if summary_path:
        Path(summary_path).write_text(json.dumps(asdict(summary)))
    return summary


def torchrun_command(
    nproc_per_node: int, config_path: str | os.PathLike[str], run_id: str, learner_id: str, *,
    max_steps: int | None = None, summary_path: str | os.PathLike[str] | None = None, flow_run_url: str | None = None,
    verbose: bool = False,
) -> list[str]:
    """The torchrun arguments ``ddiloco learner --nproc-per-node N`` runs (the same as typing ``torchrun …``)."""
    # --run-id, not --run: torchrun's argument parser would take --run for an abbreviation of its --run-path.
    args = [
        "--standalone", "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0", "--monitor-interval", "0.2",
        "-m", "ddiloco", "learner", "--config", str(config_path), "--run-id", run_id, "--learner", learner_id,
    ]
    if max_steps is not None:
        args += ["--max-steps", str(max_steps)]
    if summary_path is not None:
        args += ["--summary-json", str(summary_path)]
    if flow_run_url:
        args += ["--flow-run-url", flow_run_url]
    if verbose:
        args.append("--verbose")
    return args


def launch_learner_job(
    cfg: RunConfig,
    run_id: str,
    learner_id: str,
    nproc_per_node: int,
    *,
    max_steps: int | None = None,
    flow_run_url: str | None = None,
    verbose: bool = False,
) -> JobSummary | None:
    """Run a learner as ``nproc_per_node`` ranks on this machine through torchrun's elastic agent.

    ``max_restarts=0``: a rank that fails stops the whole job (the others get SIGTERM, then SIGKILL after
    ``SHUTDOWN_TIMEOUT_S``) and this raises :class:`LearnerJobFailed`; relaunching is the supervisor's
    job, and a relaunch rejoins from the newest global state. Returns rank 0's summary."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    with tempfile.TemporaryDirectory(prefix="ddiloco-learner-") as tmp, environment(secret_env(cfg)):
        # The effective config (file + env overrides) goes to every rank, whoever built it; the file holds its secrets
        # masked, and the ranks take them from the environment, which beats the file (else a rank's ledger and store
        # would be opened with the masks for passwords).
        config_path = Path(tmp) / "config.yaml"
        config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        summary_path = Path(tmp) / "summary.json"
        args = get_args_parser().parse_args(
            torchrun_command(
                nproc_per_node, config_path, run_id, learner_id, max_steps=max_steps, summary_path=summary_path,
                flow_run_url=flow_run_url, verbose=verbose,
            )
        )
        # What torchrun's run() does for --standalone: a private c10d rendezvous on a free port.
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        if args.master_port is None:
            args.master_port = 29500
        config, cmd, cmd_args = config_from_args(args)
        config.shutdown_timeout = SHUTDOWN_TIMEOUT_S
        log.info("learner %s: launching %s ranks (torchrun %s)", learner_id, nproc_per_node, " ".join(cmd_args))
        try:
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
        except ChildFailedError as err:
            failures = ", ".join(
                f"rank {rank} exit {f.exitcode}" + (f" ({f.signal_name()})" if f.exitcode < 0 else "")
                for rank, f in sorted(err.failures.items())
            )
            raise LearnerJobFailed(f"learner {learner_id} job failed: {failures}") from None
        except SignalException as sig:
            # SIGTERM/SIGINT to the launcher: torchrun passed it on, the ranks stopped together and flushed.
            log.info("learner %s job stopped by signal %s", learner_id, sig.sigval)
            return None
        if not summary_path.exists():
            return None
        return JobSummary(**json.loads(summary_path.read_text()))
