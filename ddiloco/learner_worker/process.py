"""The learner as an OS process: signals, logging, and the loop until the run ends."""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch

from ddiloco.learner_worker.worker import Learner
from ddiloco.platform.config import RunConfig
from ddiloco.platform.runtime import RunContext

log = logging.getLogger("ddiloco.learner")


class LearnerJobFailed(RuntimeError):
    """A rank of a multi-rank learner job failed and torchrun stopped the others (see distributed.py)."""


def resolve_learner(cfg: RunConfig, learner_id: str) -> tuple[int, str, float]:
    """(index, region, speed) of a learner named in the config, or a ConfigError listing the known ids."""
    return cfg.learners.resolve(learner_id)


def run_learner(
    cfg: RunConfig,
    run_id: str,
    learner_id: str,
    *,
    max_steps: int | None = None,
    ready_timeout_s: float = 300.0,
    flow_run_url: str | None = None,
    nproc_per_node: int = 1,
    summary_path: str | None = None,
):  # -> Learner | DistributedLearner | JobSummary (see below)
    """Run one learner until the run ends.

    - inside a torchrun job (RANK/WORLD_SIZE/LOCAL_RANK set): this process is one rank of a
      data-parallel learner (``distributed.run_learner_rank``; returns its DistributedLearner);
    - ``nproc_per_node > 1``: launch that job here through torchrun's agent and wait for it
      (returns rank 0's JobSummary, which has ``step_count`` like a Learner);
    - one process whose device resolves to CUDA: a lone DistributedLearner on the GPU;
    - otherwise the single-process CPU Learner below, unchanged."""
    index, region, speed = resolve_learner(cfg, learner_id)
    # --- data-parallel learner jobs (learner_worker/distributed.py) -------------------------------
    from ddiloco.learner_worker.device import resolve_device

    in_rank = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))  # set by torchrun
    if in_rank or resolve_device(cfg.learners.device).type == "cuda":
        from ddiloco.learner_worker.distributed import run_learner_rank

        return run_learner_rank(
            cfg, run_id, learner_id, max_steps=max_steps, ready_timeout_s=ready_timeout_s,
            flow_run_url=flow_run_url, summary_path=summary_path,
        )
    if nproc_per_node > 1:
        from ddiloco.learner_worker.distributed import launch_learner_job

        return launch_learner_job(
            cfg, run_id, learner_id, nproc_per_node, max_steps=max_steps, flow_run_url=flow_run_url,
            verbose=logging.getLogger().isEnabledFor(logging.DEBUG),
        )
    # --- end of data-parallel dispatch ----------------------------------------------------------
    torch.set_num_threads(cfg.learners.torch_threads)
    stop = threading.Event()

    def _on_signal(signum, _frame) -> None:  # noqa: ANN001
        log.info("learner %s got signal %s: finishing uploads and stopping", learner_id, signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
    ctx = RunContext.open(cfg, run_id)
    learner = Learner(
        ctx, learner_id, region, index=index, num_learners=cfg.learners.count, speed=speed, flow_run_url=flow_run_url
    )
    learner.wait_until_ready(ready_timeout_s)
    log.info("learner %s (incarnation %s) joined run %s in region %s", learner_id, learner.incarnation, run_id, region)
    try:
        learner.run(stop, max_steps=max_steps)
    finally:
        learner.stop(flush=True)
    log.info("learner %s stopped after %s steps, %s tokens", learner_id, learner.step_count, learner.tokens_total)
    return learner
