"""The synchronizer as an OS process: active while it holds the lease, standby otherwise."""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch

from ddiloco.platform import metrics
from ddiloco.platform.config import RunConfig
from ddiloco.platform.runtime import RunContext
from ddiloco.platform.tracking import Reporter, open_run_tracker, tracking_every_s
from ddiloco.synchronizer.lease import holder_name
from ddiloco.synchronizer.outer import outer_step
from ddiloco.synchronizer.service import Synchronizer

log = logging.getLogger("ddiloco.synchronizer")


def run_synchronizer(cfg: RunConfig, run_id: str, label: str = "sync", shard: int | None = None) -> Synchronizer:
    """Run until stopped; ``label`` names it in the lease (as ``label@host:pid``); ``shard`` pins it to one shard."""
    # Large merge buffers on transparent huge pages: fewer page faults on fresh allocations.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    torch.set_num_threads(1)
    # The first outer step builds a torch optimizer, which imports torch._dynamo (seconds on a busy
    # machine): pay it now, not in the first merge after a failover.
    outer_step({"w": torch.zeros(1)}, {"w": torch.zeros(1)}, None, lr=1.0, beta=0.9)
    stop = threading.Event()

    def _on_signal(signum, _frame) -> None:  # noqa: ANN001
        log.info("synchronizer got signal %s: stopping", signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
    every_s = tracking_every_s()
    tracker = open_run_tracker(cfg, run_id, f"synchronizer-{label}")
    sync = Synchronizer(RunContext.open(cfg, run_id), holder=holder_name(label), shard=shard)
    metrics.serve()  # /metrics when DDILOCO_METRICS_PORT is set
    # The step of a report is the run's merged versions (from the ledger): it only grows, across failovers too.
    reporter = Reporter(tracker, run_id, lambda s: int(s.get("sync/versions", 0)), every_s=every_s).start() if tracker else None
    log.info("synchronizer %s started for run %s", sync.holder, run_id)
    try:
        sync.run(stop)
    finally:
        if reporter is not None:
            reporter.close()
    return sync
