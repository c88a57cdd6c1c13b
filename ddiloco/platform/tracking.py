"""A run's series in the experiment trackers teams already use: TensorBoard, Weights & Biases, MLflow.

One small interface, :class:`Tracker` (scalars at a step), with a backend per tracker, chosen from the
environment by :func:`select_backends`:

- TensorBoard when ``DDILOCO_TENSORBOARD_DIR`` is set, to a folder or any fsspec URL (``s3://…``, ``gs://…``);
  each process writes under ``DIR/<run>/<process>`` (``learner-us-0``, ``synchronizer-sync``, ``evaluator``), so
  ``tensorboard --logdir DIR`` shows every run and process side by side. A remote URL is written locally by
  torch's ``SummaryWriter`` and each event file copied to the URL after every write, with the run's storage
  options when the URL is on the run store's filesystem: TensorBoard's own ``s3://`` support is boto3 with an
  ``S3_ENDPOINT`` variable of its own, and its fsspec fallback takes no storage options, so neither reaches a store
  that needs an endpoint or credentials from the config.
- W&B when ``wandb`` is importable and ``WANDB_PROJECT`` or ``WANDB_MODE`` (``online``/``offline``) is set;
  everything else (API key, entity, ``WANDB_DIR``) is W&B's own configuration. One W&B run per process, grouped by
  the ddiloco run.
- MLflow when ``mlflow`` is importable and ``MLFLOW_TRACKING_URI`` is set (``MLFLOW_EXPERIMENT_NAME`` /
  ``MLFLOW_EXPERIMENT_ID`` pick the experiment, default ``ddiloco``). One MLflow run per process.

W&B and MLflow are optional extras (``ddiloco[wandb]``, ``ddiloco[mlflow]``), never dependencies: configured but
not installed, they are skipped with a warning. A tracker that fails to write is logged and skipped; it never
stops a learner, a synchronizer or an evaluator.

Learners and synchronizers report what their Prometheus series say (``metrics``): a :class:`Reporter` thread
samples the process's registry every ``DDILOCO_TRACKING_EVERY_S`` (30 s) and logs the run's samples, so the
training thread does no tracking work and Prometheus and the trackers show one set of figures."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import REGISTRY
from prometheus_client.registry import CollectorRegistry

from ddiloco.platform import stall
from ddiloco.platform.config import ConfigError, RunConfig
from ddiloco.platform.ids import validate_id
from ddiloco.platform.redact import redact_url

TENSORBOARD_ENV = "DDILOCO_TENSORBOARD_DIR"
EVERY_ENV = "DDILOCO_TRACKING_EVERY_S"
DEFAULT_EVERY_S = 30.0
WANDB_MODES = ("online", "offline")
"""``WANDB_MODE`` values that turn W&B on by themselves (``disabled`` turns it off whatever else is set)."""

log = logging.getLogger("ddiloco.tracking")


class Tracker(Protocol):
    """Where a process's scalars go."""

    def log(self, scalars: Mapping[str, float], step: int, at: float) -> None:
        """Scalars by tag (``learner/loss``) at ``step``; ``at`` is their time (seconds since the epoch)."""

    def close(self) -> None:
        """Write what is buffered and let go of the tracker."""


# --- choosing backends ----------------------------------------------------------------------------------------


def select_backends(environ: Mapping[str, str], importable: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """The backends the environment configures and that can run (``tensorboard``, ``wandb``, ``mlflow``), and one
    line for each configured one that cannot (its package is missing). A ``DDILOCO_TENSORBOARD_DIR`` without
    tensorboard is a :class:`ConfigError`: that variable is ours and asks for nothing else."""
    chosen: list[str] = []
    skipped: list[str] = []
    if environ.get(TENSORBOARD_ENV):
        if not importable("tensorboard"):
            raise ConfigError(f"{TENSORBOARD_ENV} is set but the tensorboard package is missing: pip install 'ddiloco[tensorboard]'")
        chosen.append("tensorboard")
    mode = environ.get("WANDB_MODE", "").strip().lower()
    disabled = mode == "disabled" or environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes")
    wandb_asked = [v for v in ("WANDB_PROJECT",) if environ.get(v)] + (["WANDB_MODE"] if mode in WANDB_MODES else [])
    if wandb_asked and not disabled:
        if importable("wandb"):
            chosen.append("wandb")
        else:
            skipped.append(f"{wandb_asked[0]} is set but wandb is not installed (pip install 'ddiloco[wandb]'): no W&B series")
    if environ.get("MLFLOW_TRACKING_URI"):
        if importable("mlflow"):
            chosen.append("mlflow")
        else:
            skipped.append("MLFLOW_TRACKING_URI is set but mlflow is not installed (pip install 'ddiloco[mlflow]'): no MLflow series")
    return chosen, skipped


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules (tests) or a broken install
        return False


def tracking_every_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between two reports of a learner or synchronizer (``DDILOCO_TRACKING_EVERY_S``, default 30)."""
    value = (os.environ if environ is None else environ).get(EVERY_ENV, "")
    if not value:
        return DEFAULT_EVERY_S
    try:
        every = float(value)
    except ValueError:
        every = -1.0
    if not 0.1 <= every <= 86_400:
        raise ConfigError(f"{EVERY_ENV}={value[:40]!r}: expected seconds between 0.1 and 86400")
    return every


def open_tracker(
    run_id: str,
    process: str,
    *,
    storage_url: str = "",
    storage_options: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Tracker | None:
    """The trackers the environment configures for ``process`` (``learner-us-0``, ``synchronizer-sync``,
    ``evaluator``) of ``run_id``, as one that never raises; None when none is. ``storage_*``: the run's store, whose options a
    TensorBoard URL on the same filesystem is opened with; ``config``: the effective config (masked), which W&B
    records with its run."""
    environ = os.environ if environ is None else environ
    validate_id(run_id, "run id"), validate_id(process, "process name")
    chosen, skipped = select_backends(environ, _importable)
    for line in skipped:
        log.warning("%s", line)
    trackers: list[Tracker] = []
    for name in chosen:
        try:
            if name == "tensorboard":
                url = environ[TENSORBOARD_ENV]
                options = storage_options if same_filesystem(url, storage_url) else None
                trackers.append(TensorBoardTracker(join_url(url, run_id, process), options))
            elif name == "wandb":
                trackers.append(WandbTracker(run_id, process, config))
            else:
                trackers.append(MlflowTracker(run_id, process, environ))
        except Exception as err:  # noqa: BLE001 - a tracker that cannot start must not stop the process
            log.warning("%s: could not start (%s): no %s series from %s", name, redact_url(str(err))[:300], name, process)
    return FanOut(trackers) if trackers else None  # FanOut guards every write, even of a single tracker


def open_run_tracker(cfg: RunConfig, run_id: str, process: str, environ: Mapping[str, str] | None = None) -> Tracker | None:
    """:func:`open_tracker` for a process of a run of ``cfg``: its store's options, its config (masked) for W&B."""
    return open_tracker(run_id, process, storage_url=cfg.storage.url, storage_options=cfg.storage.fsspec_options(),
                        config=json.loads(cfg.to_json()), environ=environ)


def join_url(base: str, *parts: str) -> str:
    """``base`` (a folder or an fsspec URL) with ``parts`` appended, keeping its ``scheme://``."""
    return "/".join([base.rstrip("/"), *parts])


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def is_local(url: str) -> bool:
    """Whether ``url`` is a folder of this machine (a path or ``file://``)."""
    return _protocol(url) in ("file", "local")


def same_filesystem(url: str, storage_url: str) -> bool:
    """Whether ``url`` lies on the run store's kind of filesystem (so the store's options apply to it)."""
    return bool(storage_url) and not is_local(url) and _protocol(url) == _protocol(storage_url)


# --- backends -------------------------------------------------------------------------------------------------


class TensorBoardTracker:
    """Scalars as TensorBoard event files under ``url``: written there (a folder), or locally and copied there after
    every write (any other fsspec URL; the event file only grows, so each copy replaces the last)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.url = url
        self._fs = None
        self._staging: Path | None = None
        if is_local(url):
            logdir = Path(url.removeprefix("file://").removeprefix("local://"))
        else:
            import fsspec

            self._fs, self._root = fsspec.core.url_to_fs(url, **stall.store_options(url, storage_options))
            self._staging = Path(tempfile.mkdtemp(prefix="ddiloco-tb-"))
            logdir = self._staging
        self._copied: dict[str, int] = {}
        self.writer = SummaryWriter(log_dir=str(logdir))

    def log(self, scalars: Mapping[str, float], step: int, at: float) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=at)
        self.writer.flush()  # writes come seconds apart at the least: each is visible at once
        self._copy()

    def _copy(self) -> None:
        """Copy the event files that grew since the last copy to the URL."""
        if self._fs is None or self._staging is None:
            return
        for path in sorted(self._staging.iterdir()):
            size = path.stat().st_size
            if self._copied.get(path.name) != size:
                self._fs.put_file(str(path), f"{self._root.rstrip('/')}/{path.name}")
                self._copied[path.name] = size

    def close(self) -> None:
        self.writer.close()
        try:
            self._copy()
        finally:
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)


class WandbTracker:
    """One W&B run per process (``<run>/<process>``, grouped by the ddiloco run), configured by W&B's own
    environment (``WANDB_PROJECT``, default ``ddiloco``; ``WANDB_MODE``, ``WANDB_ENTITY``, ``WANDB_DIR``, …)."""

    def __init__(self, run_id: str, process: str, config: Mapping[str, Any] | None = None) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "ddiloco", group=run_id, name=f"{run_id}/{process}",
            job_type=process.split("-", 1)[0], config=dict(config or {}), reinit="create_new",
        )

    def log(self, scalars: Mapping[str, float], step: int, at: float) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """One MLflow run per process in ``MLFLOW_EXPERIMENT_ID`` / ``MLFLOW_EXPERIMENT_NAME`` (default ``ddiloco``), tagged
    with the ddiloco run and process; written through ``MlflowClient`` (no global active run, so several
    trackers may live in one process)."""

    def __init__(self, run_id: str, process: str, environ: Mapping[str, str]) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient()  # MLFLOW_TRACKING_URI
        experiment = environ.get("MLFLOW_EXPERIMENT_ID")
        if not experiment:
            name = environ.get("MLFLOW_EXPERIMENT_NAME") or "ddiloco"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=f"{run_id}/{process}",
                                             tags={"ddiloco.run": run_id, "ddiloco.process": process}).info.run_id

    def log(self, scalars: Mapping[str, float], step: int, at: float) -> None:
        from mlflow.entities import Metric

        ms = int(at * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, float(v), ms, step) for tag, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class FanOut:
    """Several trackers as one: each write goes to all; one that fails is logged and the others still get it."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, scalars: Mapping[str, float], step: int, at: float) -> None:
        for t in self.trackers:
            _guarded(t, "log", lambda t=t: t.log(scalars, step, at))

    def close(self) -> None:
        for t in self.trackers:
            _guarded(t, "close", t.close)


def _guarded(tracker: object, what: str, call: Callable[[], None]) -> bool:
    """Run a tracker's call; a failure is a warning, never the caller's problem. Whether it succeeded."""
    try:
        call()
        return True
    except Exception as err:  # noqa: BLE001 - trackers are a copy of the record, not the record
        log.warning("%s %s failed: %s", type(tracker).__name__, what, redact_url(str(err))[:300])
        return False


# --- from Prometheus series to scalars ------------------------------------------------------------------------

DROPPED_LABELS = frozenset({"run", "learner", "holder"})
"""Labels that name the process a tracker already belongs to; other labels' values (``reason``) extend the tag."""


def run_scalars(families: Iterable[Any], run_id: str) -> dict[str, float]:
    """The ``ddiloco_*`` samples of ``run_id`` as scalars: ``ddiloco_learner_loss`` -> ``learner/loss``,
    ``ddiloco_sync_rejections_total{reason="staleness"}`` -> ``sync/rejections_total/staleness``; histogram
    buckets and ``_created`` samples are left out."""
    out: dict[str, float] = {}
    for family in families:
        if not family.name.startswith("ddiloco_"):
            continue
        for s in family.samples:
            if s.labels.get("run") != run_id or s.name.endswith(("_bucket", "_created")):
                continue
            tag = s.name.removeprefix("ddiloco_").replace("_", "/", 1)
            extra = [v for k, v in sorted(s.labels.items()) if k not in DROPPED_LABELS]
            out["/".join([tag, *extra])] = float(s.value)
    return out


def with_interval_means(previous: Mapping[str, float], current: Mapping[str, float]) -> dict[str, float]:
    """``current`` with each histogram's ``_sum`` replaced by ``_mean`` over the interval since ``previous``
    (the mean staleness or merge time of the last interval; none when nothing was observed in it)."""
    out = {k: v for k, v in current.items() if not k.endswith("_sum")}
    for key, total in current.items():
        if not key.endswith("_sum"):
            continue
        base = key.removesuffix("_sum")
        count = current.get(base + "_count", 0.0) - previous.get(base + "_count", 0.0)
        if count > 0:
            out[base + "_mean"] = (total - previous.get(key, 0.0)) / count
    return out


class Reporter:
    """Logs a process's Prometheus series of one run to a tracker every ``every_s``, from its own thread (a slow
    remote write never holds up training, uploads or merges). ``step`` makes the step of a report from its scalars."""

    def __init__(
        self,
        tracker: Tracker,
        run_id: str,
        step: Callable[[Mapping[str, float]], int],
        *,
        every_s: float = DEFAULT_EVERY_S,
        registry: CollectorRegistry = REGISTRY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tracker = tracker
        self.run_id = run_id
        self.step = step
        self.every_s = every_s
        self.registry = registry
        self.clock = clock
        self._previous: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def report(self) -> dict[str, float]:
        """Sample the series now and log them; the scalars logged ({} when the run has none yet)."""
        current = run_scalars(self.registry.collect(), self.run_id)
        scalars = with_interval_means(self._previous, current)
        self._previous = current
        if scalars:
            self.tracker.log(scalars, int(self.step(scalars)), self.clock())
        return scalars

    def start(self) -> Reporter:
        self._thread = threading.Thread(target=self._loop, name="tracking", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            _guarded(self.tracker, "report", self.report)

    def close(self) -> None:
        """Stop the thread, log a last report (the final figures) and close the tracker."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        _guarded(self.tracker, "report", self.report)
        _guarded(self.tracker, "close", self.tracker.close)
