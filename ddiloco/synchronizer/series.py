"""The evaluations' series as TensorBoard scalars, when ``DDILOCO_TENSORBOARD_DIR`` is set.

The evaluator writes each evaluation it records (validation loss, accuracy, global versions) against
the tokens merged, under ``DIR/<run>``, so ``tensorboard --logdir DIR`` shows every run beside the
others. The ledger stays the record (the dashboard and the run summary read it); this is a copy for
people who follow runs in TensorBoard. Needs the ``tensorboard`` package (the ``tensorboard`` extra)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ddiloco.platform.ids import validate_id

TENSORBOARD_ENV = "DDILOCO_TENSORBOARD_DIR"


class TensorBoardSeries:
    """Scalars ``eval/val_loss``, ``eval/val_accuracy`` and ``eval/versions_total`` at step = tokens merged."""

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = logdir
        self.writer = SummaryWriter(log_dir=str(logdir))

    def add(self, *, tokens: int, versions_total: int, val_loss: float, val_accuracy: float | None, at: float) -> None:
        """One evaluation, as recorded in the ledger (``at``: its time, seconds since the epoch)."""
        self.writer.add_scalar("eval/val_loss", val_loss, global_step=tokens, walltime=at)
        if val_accuracy is not None:
            self.writer.add_scalar("eval/val_accuracy", val_accuracy, global_step=tokens, walltime=at)
        self.writer.add_scalar("eval/versions_total", versions_total, global_step=tokens, walltime=at)
        self.writer.flush()  # evaluations are minutes apart: each shows in TensorBoard as soon as it is made

    def close(self) -> None:
        self.writer.close()


def series_from_env(run_id: str, environ: Mapping[str, str] | None = None) -> TensorBoardSeries | None:
    """The run's series under ``$DDILOCO_TENSORBOARD_DIR/<run>``; None when the variable is unset or empty."""
    value = (os.environ if environ is None else environ).get(TENSORBOARD_ENV)
    if not value:
        return None
    try:
        import tensorboard  # noqa: F401 - torch's SummaryWriter needs it
    except ModuleNotFoundError:
        raise ValueError(f"{TENSORBOARD_ENV} is set but the tensorboard package is missing: pip install 'ddiloco[tensorboard]'") from None
    return TensorBoardSeries(Path(value) / validate_id(run_id, "run id"))
