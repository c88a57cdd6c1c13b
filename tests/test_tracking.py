"""Experiment trackers: which backends the environment picks, Prometheus series turned into scalars, TensorBoard
event files written to a folder and to s3:// (moto) and read back with TensorBoard's own reader, a W&B offline run,
and the learner's count of non-finite losses and the synchronizer's version gauges in-process."""

from __future__ import annotations

import logging
import math
import re
import sys
import uuid
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from support import sim_run

from ddiloco.inprocess import sim_learner, sim_step
from ddiloco.learner_worker.launch import learner_figures
from ddiloco.platform.config import ConfigError
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.metrics import LearnerCollector, LearnerFigures
from ddiloco.platform.runtime import to_timestamp
from ddiloco.platform.tracking import (
    EVERY_ENV,
    TENSORBOARD_ENV,
    FanOut,
    Reporter,
    TensorBoardTracker,
    open_tracker,
    run_scalars,
    same_filesystem,
    select_backends,
    tracking_every_s,
    with_interval_means,
)
from ddiloco.testing.net import poll_until


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """The TensorBoard scalars under ``logdir`` as TensorBoard reads them: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# --- choosing backends -------------------------------------------------------------------------------------


def test_backends_follow_their_own_variables_and_a_missing_optional_package_is_skipped_with_its_reason():
    everything = lambda name: True  # noqa: E731
    nothing_optional = lambda name: name == "tensorboard"  # noqa: E731
    assert select_backends({}, everything) == ([], [])
    assert select_backends({TENSORBOARD_ENV: "s3://b/tb"}, everything) == (["tensorboard"], [])
    assert select_backends({"WANDB_PROJECT": "p", "MLFLOW_TRACKING_URI": "http://m"}, everything) == (["wandb", "mlflow"], [])
    assert select_backends({"WANDB_MODE": "offline"}, everything) == (["wandb"], [])
    # An API key alone, or W&B switched off its own ways, logs nothing there.
    assert select_backends({"WANDB_API_KEY": "k"}, everything) == ([], [])
    assert select_backends({"WANDB_PROJECT": "p", "WANDB_MODE": "disabled"}, everything) == ([], [])
    assert select_backends({"WANDB_PROJECT": "p", "WANDB_DISABLED": "true"}, everything) == ([], [])
    chosen, skipped = select_backends({"WANDB_PROJECT": "p", "MLFLOW_TRACKING_URI": "http://m"}, nothing_optional)
    assert chosen == [] and skipped == [
        "WANDB_PROJECT is set but wandb is not installed (pip install 'ddiloco[wandb]'): no W&B series",
        "MLFLOW_TRACKING_URI is set but mlflow is not installed (pip install 'ddiloco[mlflow]'): no MLflow series",
    ]
    with pytest.raises(ConfigError, match=r"DDILOCO_TENSORBOARD_DIR is set .* pip install 'ddiloco\[tensorboard\]'"):
        select_backends({TENSORBOARD_ENV: "/tmp/x"}, lambda name: False)


def test_a_tracker_needs_a_safe_run_id_and_a_sane_cadence(monkeypatch, tmp_path: Path):
    assert open_tracker("r", "evaluator", environ={}) is None
    with pytest.raises(ValueError, match="run id '../r' is not a valid id"):
        open_tracker("../r", "evaluator", environ={TENSORBOARD_ENV: str(tmp_path)})
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ConfigError, match="DDILOCO_TENSORBOARD_DIR is set"):
        open_tracker("r", "evaluator", environ={TENSORBOARD_ENV: str(tmp_path / "none")})
    assert not (tmp_path / "none").exists()
    assert tracking_every_s({}) == 30.0 and tracking_every_s({EVERY_ENV: "0.5"}) == 0.5
    for bad in ("0", "-1", "soon", "nan", "1e9"):
        with pytest.raises(ConfigError, match=f"{EVERY_ENV}=.*expected seconds between 0.1 and 86400"):
            tracking_every_s({EVERY_ENV: bad})


def test_the_run_store_options_reach_only_a_url_on_the_same_filesystem():
    assert same_filesystem("s3://logs/tb", "s3://store/root")
    assert not same_filesystem("gs://logs/tb", "s3://store/root")
    assert not same_filesystem("/var/tb", "file:///var/store") and not same_filesystem("s3://logs/tb", "")


# --- Prometheus series as scalars --------------------------------------------------------------------------


def test_a_run_s_series_become_scalars_and_histograms_their_interval_means():
    registry = CollectorRegistry()
    rejections = Counter("ddiloco_sync_rejections", "r", ["run", "reason"], registry=registry)
    staleness = Histogram("ddiloco_sync_staleness_versions", "s", ["run"], buckets=(0, 1, 2, 4), registry=registry)
    figures = LearnerFigures(step=7, tokens=900, tokens_per_s=128.0, loss=2.5, upload_queue=1, sent_bytes=4096,
                             received_bytes=2048, last_version=3, nonfinite_losses=2, incarnation=1)
    registry.register(LearnerCollector("r", "us-0", lambda: figures))
    rejections.labels("r", "staleness").inc(2)
    rejections.labels("other-run", "staleness").inc()
    staleness.labels("r").observe(1), staleness.labels("r").observe(3)
    first = run_scalars(registry.collect(), "r")
    assert first["sync/rejections_total/staleness"] == 2 and first["sync/staleness_versions_count"] == 2
    assert first["sync/staleness_versions_sum"] == 4
    assert {k: first[k] for k in first if k.startswith("learner/")} == {
        "learner/step": 7, "learner/tokens_total": 900, "learner/tokens_per_second": 128.0, "learner/loss": 2.5,
        "learner/nonfinite_losses_total": 2, "learner/incarnation": 1, "learner/upload_queue_depth": 1,
        "learner/sent_bytes_total": 4096, "learner/received_bytes_total": 2048, "learner/last_version_received": 3,
    }
    assert not any("bucket" in k or "created" in k for k in first)
    staleness.labels("r").observe(6)
    second = run_scalars(registry.collect(), "r")
    means = with_interval_means(first, second)
    assert means["sync/staleness_versions_mean"] == 6.0  # only what was observed since the first sample
    assert "sync/staleness_versions_sum" not in means
    assert "sync/staleness_versions_mean" not in with_interval_means(second, second)  # nothing observed: no mean


def test_a_learner_before_its_first_step_reports_no_loss_at_all():
    figures = LearnerFigures(step=0, tokens=0, tokens_per_s=0.0, loss=None, upload_queue=0, sent_bytes=0, received_bytes=0,
                             last_version=-1)
    names = {s.name for m in LearnerCollector("r", "us-0", lambda: figures).collect() for s in m.samples}
    assert "ddiloco_learner_loss" not in names and "ddiloco_learner_nonfinite_losses_total" in names


# --- TensorBoard, for real -----------------------------------------------------------------------------------


def _reporter(tracker, clock: list[float]) -> tuple[Reporter, Counter]:
    registry = CollectorRegistry()
    merges = Counter("ddiloco_sync_merges", "m", ["run"], registry=registry)
    return Reporter(tracker, "r", lambda s: int(s["sync/merges_total"]), registry=registry, clock=lambda: clock[0]), merges


def test_a_reporter_writes_tensorboard_event_files_into_a_folder(tmp_path: Path):
    clock = [1.7e9]
    tracker = open_tracker("r", "synchronizer-sync", environ={TENSORBOARD_ENV: str(tmp_path / "tb")})
    reporter, merges = _reporter(tracker, clock)
    merges.labels("r").inc(3)
    assert reporter.report()["sync/merges_total"] == 3
    merges.labels("r").inc(2)
    clock[0] += 30
    reporter.close()  # the final report
    assert scalars(tmp_path / "tb" / "r" / "synchronizer-sync") == {"sync/merges_total": [(3, 3.0), (5, 5.0)]}


def test_tensorboard_on_s3_with_the_run_store_options_is_read_back_by_tensorboard(s3_endpoint, tmp_path: Path):
    import s3fs

    from ddiloco.testing.s3 import TEST_CREDENTIALS

    bucket = f"tb-{uuid.uuid4().hex[:10]}"
    # The store's options carry the endpoint and the keys: TensorBoard's own s3:// support would not see them.
    options = {"key": TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"], "secret": TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
               "skip_instance_cache": True, "client_kwargs": {"endpoint_url": s3_endpoint}}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(bucket)
    clock = [1.7e9]
    tracker = open_tracker("r", "learner-us-0", storage_url=f"s3://{bucket}/store", storage_options=options,
                           environ={TENSORBOARD_ENV: f"s3://{bucket}/tb"})
    reporter, merges = _reporter(tracker, clock)
    merges.labels("r").inc()
    reporter.report()
    # Each write is on S3 at once (a run followed live), not only when the tracker closes.
    fs.invalidate_cache()
    assert len(fs.ls(f"{bucket}/tb/r/learner-us-0")) == 1
    merges.labels("r").inc()
    reporter.close()
    fs.get(f"{bucket}/tb/r/learner-us-0/", str(tmp_path / "down") + "/", recursive=True)
    assert scalars(tmp_path / "down") == {"sync/merges_total": [(1, 1.0), (2, 2.0)]}


def test_a_failing_tracker_is_a_warning_and_the_others_still_get_the_scalars(tmp_path: Path, caplog):
    class Broken:
        def log(self, scalars, step, at):
            raise OSError("s3://key:SECRETVALUE@bucket unreachable")

        def close(self):
            raise OSError("gone")

    good = TensorBoardTracker(str(tmp_path / "tb"))
    both = FanOut([Broken(), good])
    with caplog.at_level(logging.WARNING, logger="ddiloco.tracking"):
        both.log({"learner/loss": 2.0}, 1, 1.7e9)
        both.close()
    assert scalars(tmp_path / "tb") == {"learner/loss": [(1, 2.0)]}
    assert "Broken log failed" in caplog.text and "Broken close failed" in caplog.text and "SECRETVALUE" not in caplog.text


# --- W&B and MLflow, when installed ------------------------------------------------------------------------------


def test_wandb_offline_run_holds_the_logged_scalars(monkeypatch, tmp_path: Path):
    pytest.importorskip("wandb", reason="wandb is not installed (the wandb extra)")
    monkeypatch.setenv("WANDB_MODE", "offline"), monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = open_tracker("r", "learner-us-0", config={"outer": {"lr": 0.7}}, environ={"WANDB_MODE": "offline"})
    tracker.log({"learner/loss": 2.5, "learner/tokens_total": 640.0}, 3, 1.7e9)
    tracker.log({"learner/loss": 2.25}, 5, 1.7e9 + 30)
    tracker.close()
    # wandb ships no reader of its run files: the records are protobuf, so each key and its JSON value appear as written.
    # Its service process writes the file: on a loaded machine the records land a moment after finish() returns.
    records = (("learner/loss", "2.5"), ("learner/tokens_total", "640"), ("learner/loss", "2.25"))

    def missing() -> list[tuple[str, str]]:
        files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(files) <= 1, files
        data = files[0].read_bytes() if files else b""
        return [(k, v) for k, v in records if not re.search(re.escape(k.encode()) + rb".{1,6}" + re.escape(v.encode()), data)]

    poll_until(lambda: not missing(), 30)
    assert not missing(), missing()


def test_mlflow_run_holds_the_logged_scalars(monkeypatch, tmp_path: Path):
    pytest.importorskip("mlflow", reason="mlflow is not installed (the mlflow extra); its selection is tested above")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the file store is in maintenance mode: MLflow refuses it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker = open_tracker("r", "learner-us-0", environ={"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "t"})
    tracker.log({"learner/loss": 2.5}, 3, 1.7e9)
    tracker.close()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "learner/loss")] == [(3, 2.5)]


# --- the series' sources, in-process ------------------------------------------------------------------------------


def test_a_non_finite_loss_is_counted_logged_and_kept_out_of_the_loss_average(caplog):
    _cfg, clock, ctx, _sync = sim_run(name="trk-nan", learners={"regions": [{"name": "us", "learners": 1}]})
    learner = sim_learner(ctx, "us-0")
    learner.start(clock.t)
    clock.t += 1
    sim_step(learner, clock.t)
    finite = learner.last_loss
    assert finite is not None and math.isfinite(finite) and learner.nonfinite_losses == 0
    with caplog.at_level(logging.ERROR, logger="ddiloco.learner"):
        for p in learner.model.parameters():
            p.data.fill_(float("nan"))
        for _ in range(3):
            clock.t += 1
            sim_step(learner, clock.t)
    assert learner.nonfinite_losses == 3 and learner.last_loss == finite
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "loss is nan (1 non-finite step loss so far" in errors[0]  # the 1st and the 2nd, not the 3rd
    f = learner_figures(learner)
    assert f.nonfinite_losses == 3 and f.incarnation == 0 and f.loss == finite


def test_the_synchronizer_gauges_say_how_many_versions_the_run_has_and_when_the_newest_came():
    _cfg, clock, ctx, sync = sim_run(name="trk-sync", learners={"regions": [{"name": "us", "learners": 1}]},
                                     quorum={"min_count": 1}, grace={"enabled": False})
    learner = sim_learner(ctx, "us-0")
    learner.start(clock.t)
    for _ in range(12):
        clock.t += 1
        sim_step(learner, clock.t)
        sync.poll_once(clock.t)
    sync.poll_once(clock.t + 1)  # the gauges are read from the ledger at a pass's start
    with ctx.reading() as s:
        heads = runs_q.latest_versions(s, ctx.run_id)
    assert sum(h.version for h in heads.values()) >= 2
    assert REGISTRY.get_sample_value("ddiloco_sync_versions", {"run": "trk-sync"}) == sum(h.version for h in heads.values())
    assert REGISTRY.get_sample_value("ddiloco_sync_newest_version_timestamp_seconds", {"run": "trk-sync"}) == max(
        to_timestamp(h.created_at) for h in heads.values())
