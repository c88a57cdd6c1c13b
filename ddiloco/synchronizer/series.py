"""The evaluations' series in the run's experiment trackers (``platform.tracking``: TensorBoard when
``DDILOCO_TENSORBOARD_DIR`` is set, W&B or MLflow when configured).

The evaluator logs each evaluation it records (validation loss, accuracy, global versions) against the
tokens merged, as the ``evaluator`` process of the run (TensorBoard: ``DIR/<run>/evaluator``). The ledger stays
the record (the dashboard and the run summary read it); this is a copy for people who follow runs in a tracker."""

from __future__ import annotations

from collections.abc import Mapping

from ddiloco.platform.config import RunConfig
from ddiloco.platform.tracking import TENSORBOARD_ENV, Tracker, open_run_tracker

__all__ = ["TENSORBOARD_ENV", "EvalSeries", "series_for"]


class EvalSeries:
    """Scalars ``eval/val_loss``, ``eval/val_accuracy`` and ``eval/versions_total`` at step = tokens merged."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def add(self, *, tokens: int, versions_total: int, val_loss: float, val_accuracy: float | None, at: float) -> None:
        """One evaluation, as recorded in the ledger (``at``: its time, seconds since the epoch)."""
        scalars = {"eval/val_loss": val_loss, "eval/versions_total": float(versions_total)}
        if val_accuracy is not None:
            scalars["eval/val_accuracy"] = val_accuracy
        self.tracker.log(scalars, tokens, at)

    def close(self) -> None:
        self.tracker.close()


def series_for(cfg: RunConfig, run_id: str, environ: Mapping[str, str] | None = None) -> EvalSeries | None:
    """The evaluator's series of ``run_id`` in the trackers the environment configures; None when none is."""
    tracker = open_run_tracker(cfg, run_id, "evaluator", environ)
    return EvalSeries(tracker) if tracker is not None else None
