"""The evaluator: evaluation off the merge path, in its own process (``ddiloco evaluate --run R``).

It evaluates the newest published global model on the run's fixed validation set whenever versions
were published since its last evaluation, at most every ``synchronizer.eval_every_s``, and records
each result in the ledger as evaluations have always been recorded (the dashboard and the run
summary read them). The synchronizer never evaluates: at real model sizes an evaluation takes
minutes, which inside a merge pass would stall merges and trip the synchronizer's watchdog.

Several evaluators on one run each record what they evaluate; one per run is the intended setup.
Each evaluation also goes to the experiment trackers the environment configures (``series``: TensorBoard with
``DDILOCO_TENSORBOARD_DIR``, W&B, MLflow)."""

from __future__ import annotations

import logging
import threading

import torch

from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.models import build_model
from ddiloco.platform.runtime import RunContext
from ddiloco.synchronizer.evaluation import evaluate_and_record
from ddiloco.synchronizer.series import EvalSeries, series_for

log = logging.getLogger("ddiloco.evaluator")


class Evaluator:
    """Evaluates newly published versions on its own cadence; holds no training state."""

    def __init__(
        self, ctx: RunContext, *, every_s: float | None = None, device: str = "cpu", series: EvalSeries | None = None
    ) -> None:
        self.ctx = ctx
        self.series = series
        """Where each evaluation also goes once recorded (experiment trackers), if anywhere."""
        self.every_s = ctx.cfg.synchronizer.eval_every_s if every_s is None else every_s
        if not self.every_s > 0:
            raise ValueError(f"the evaluator's cadence must be > 0 seconds, got {self.every_s}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            where = torch.device(device)
            if where.type not in ("cpu", "cuda"):
                raise RuntimeError(where.type)
        except RuntimeError:
            raise ValueError(f"evaluator device must be auto, cpu, cuda or cuda:N, got {device!r}") from None
        if where.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("evaluator device cuda: torch sees no CUDA device")
        self.model: torch.nn.Module = build_model(ctx.cfg.model, seed=ctx.cfg.seed).to(where)
        """Built once (on ``device``: auto is the GPU when torch sees one) and overwritten with each evaluated version."""
        self.evaluated: dict[int, int] | None = None
        """The version of every fragment at this evaluator's last evaluation."""
        self._told_partial = False

    def published(self) -> dict[int, int]:
        """The newest published version of every fragment."""
        with self.ctx.reading() as s:
            return runs_q.latest_version_numbers(s, self.ctx.run_id)

    def whole(self, versions: dict[int, int]) -> bool:
        """Whether every fragment of the run has a published version: with shards, each holder publishes version 0 of
        its own fragments, and a model assembled before all have is missing rows."""
        with self.ctx.reading() as s:
            run = runs_q.get_run(s, self.ctx.run_id)
        return run is not None and len(versions) >= run.num_fragments

    def evaluate_once(self, now: float | None = None) -> tuple[float, float | None] | None:
        """Evaluate and record the newest global model when versions were published since the last
        evaluation (or none was made yet); returns (loss, accuracy), or None when there was nothing new, or no whole
        model yet."""
        versions = self.published()
        if not versions or versions == self.evaluated:
            return None
        if not self.whole(versions):
            if not self._told_partial:
                log.info("waiting for version 0 of every fragment (%d published so far)", len(versions))
                self._told_partial = True
            return None
        result = evaluate_and_record(self.ctx, self.ctx.now() if now is None else now, model=self.model, series=self.series)
        self.evaluated = versions
        log.info("evaluated versions %s: val loss %.4f", sum(versions.values()), result[0])
        return result

    def run(self, stop: threading.Event | None = None) -> int:
        """Evaluate every ``every_s`` until stopped, or until the run has ended and a tick finds no new
        version (so the synchronizer's final drain is evaluated too); returns the evaluations made."""
        stop = stop or threading.Event()
        made, told = 0, False
        while not stop.is_set():
            try:
                with self.ctx.reading() as s:
                    run = runs_q.get_run(s, self.ctx.run_id)
            except Exception:  # noqa: BLE001 - the ledger may be restarting: asked again on the next tick
                log.exception("reading the run's status failed; retrying in %.0fs", self.every_s)
                stop.wait(self.every_s)
                continue
            ended = run is not None and run.status != "running"
            if run is None and not told:
                # Deployments start in any order: the synchronizer may not have registered the run yet.
                log.warning("run %r is not in the ledger (yet): waiting for its synchronizer to register it", self.ctx.run_id)
                told = True
            try:
                fresh = self.evaluate_once() is not None
                made += fresh
            except Exception:  # noqa: BLE001 - a failed evaluation (store or ledger away) is retried on the next tick
                log.exception("evaluation failed; retrying in %.0fs", self.every_s)
                fresh = True
            if ended and not fresh:
                break
            stop.wait(self.every_s)
        return made


def run_evaluator(ctx: RunContext, stop: threading.Event | None = None, device: str = "auto") -> int:
    """The evaluator process's body: one torch thread (it shares the machine with learners), SIGTERM stops it."""
    import signal

    torch.set_num_threads(1)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    series = series_for(ctx.cfg, ctx.run_id)
    log.info("evaluator started for run %s (every %.0fs%s)", ctx.run_id, ctx.cfg.synchronizer.eval_every_s,
             ", with experiment trackers" if series else "")
    try:
        return Evaluator(ctx, device=device, series=series).run(stop)
    finally:
        if series is not None:
            series.close()
