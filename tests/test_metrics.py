"""Prometheus /metrics of a real learner process and a real synchronizer process, scraped over HTTP, and the same
series in TensorBoard (``DDILOCO_TENSORBOARD_DIR``); the learner's progress lines; rejection reasons as a label of few
values."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from support import tiny_config, wait_for
from test_tracking import scalars

from ddiloco.platform.ledger import make_engine
from ddiloco.platform.ledger.models import Heartbeat, Learner
from ddiloco.platform.metrics import metrics_address, reason_label
from ddiloco.platform.models.cost import count_flops_per_token
from ddiloco.platform.tracking import EVERY_ENV, TENSORBOARD_ENV
from ddiloco.platform.units import format_flops
from ddiloco.testing.net import free_port
from ddiloco.testing.processes import ProcessCluster, stop_processes, write_config

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[str, float]:
    """``{name{labels}: value}`` of every sample at ``/metrics``, or {} while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_learner_and_synchronizer_serve_the_series_the_dashboards_need(tmp_path):
    cfg = tiny_config(
        name="metrics",
        token_budget=10**9,
        learners={"regions": [{"name": "us", "learners": 1}], "heartbeat_s": 0.5, "poll_s": 0.2, "log_every": 5},
        synchronizer={"poll_s": 0.1, "lease_ttl_s": 1.5},
        ledger={"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
        storage={"url": f"file://{tmp_path / 'store'}"},
    )
    cluster = ProcessCluster(write_config(cfg, tmp_path / "config.yaml"), "metrics", tmp_path / "logs")
    sync_port, learner_port = free_port(), free_port()
    tb = {TENSORBOARD_ENV: str(tmp_path / "tb"), EVERY_ENV: "0.5"}
    try:
        cluster.synchronizer("sync-a", env={"DDILOCO_METRICS_PORT": f"127.0.0.1:{sync_port}", **tb})
        cluster.learner("us-0", env={"DDILOCO_METRICS_PORT": f"127.0.0.1:{learner_port}", **tb})

        def merged_and_received():
            s, ln = scrape(sync_port), scrape(learner_port)
            merges = s.get("ddiloco_sync_merges_total{run=metrics}", 0)
            received = ln.get("ddiloco_learner_last_version_received{learner=us-0,run=metrics}", -1)
            return (s, ln) if merges >= 2 and received >= 1 else None

        sync, learner = wait_for(merged_and_received, 120, "merges published and received through /metrics")
    finally:
        stop_processes(cluster.procs.values())
    label = "{learner=us-0,run=metrics}"
    assert learner[f"ddiloco_learner_step{label}"] >= 1
    assert learner[f"ddiloco_learner_tokens_total{label}"] >= 4 * 32
    assert learner[f"ddiloco_learner_tokens_per_second{label}"] > 0
    # One device's model FLOP/s is the tokens/s of the same scrape times the model's FLOPs per token; a CPU has no MFU.
    per_token = count_flops_per_token(cfg.model)
    assert learner[f"ddiloco_learner_model_flops_per_second{label}"] == pytest.approx(
        learner[f"ddiloco_learner_tokens_per_second{label}"] * per_token)
    assert f"ddiloco_learner_mfu{label}" not in learner
    assert 0 < learner[f"ddiloco_learner_loss{label}"] < 10
    assert learner[f"ddiloco_learner_sent_bytes_total{label}"] > 0
    assert learner[f"ddiloco_learner_received_bytes_total{label}"] > 0
    assert learner[f"ddiloco_learner_upload_queue_depth{label}"] >= 0
    assert learner[f"ddiloco_learner_nonfinite_losses_total{label}"] == 0
    assert learner[f"ddiloco_learner_incarnation{label}"] == 0
    holder = next(k for k in sync if k.startswith("ddiloco_sync_lease_held{"))
    assert sync[holder] == 1 and "sync-a@" in holder
    assert sync["ddiloco_sync_merge_seconds_count{run=metrics}"] == sync["ddiloco_sync_merges_total{run=metrics}"]
    assert sync["ddiloco_sync_staleness_versions_count{run=metrics}"] >= 1
    assert "ddiloco_sync_pending_submissions{run=metrics}" in sync
    assert sync["ddiloco_sync_versions{run=metrics}"] >= 1
    assert 0 < time.time() - sync["ddiloco_sync_newest_version_timestamp_seconds{run=metrics}"] < 120
    # The same series in TensorBoard, each process under its own name; stopped by SIGTERM, each wrote its final report.
    learner_tb = scalars(tmp_path / "tb" / "metrics" / "learner-us-0")
    sync_tb = scalars(tmp_path / "tb" / "metrics" / "synchronizer-sync-a")
    assert {"learner/loss", "learner/tokens_per_second", "learner/sent_bytes_total", "learner/nonfinite_losses_total"} <= set(learner_tb)
    assert all(0 < v < 10 for _, v in learner_tb["learner/loss"])
    steps = [step for step, _ in learner_tb["learner/tokens_total"]]
    assert steps == sorted(steps) and steps[-1] >= learner[f"ddiloco_learner_step{label}"]
    assert sync_tb["sync/merges_total"][-1][1] >= 2 and "sync/staleness_versions_count" in sync_tb
    versions = [int(v) for _, v in sync_tb["sync/versions"]]  # the step of a synchronizer's report: the run's versions
    assert [step for step, _ in sync_tb["sync/versions"]] == versions == sorted(versions) and versions[-1] >= 1
    log = (tmp_path / "logs" / "us-0.log").read_text()
    assert "metrics at http://127.0.0.1:" in log
    progress = [line for line in log.splitlines() if "learner us-0 step " in line]
    assert f"{format_flops(per_token)} per token, no MFU (no peak is published for a cpu device)" in log
    assert progress and "tokens/s, " in progress[0] and "FLOP/s per device, " in progress[0]
    assert all(int(p.split(" step ")[1].split(":")[0]) % 5 == 0 for p in progress)
    # The ledger has them too, for the dashboard: each beat's FLOP/s is its own tokens/s times the FLOPs per token.
    engine = make_engine(cfg.ledger.url, read_only=True)
    try:
        with engine.connect() as conn:
            beats = conn.execute(select(Heartbeat.tokens_per_s, Heartbeat.model_flops_per_s, Heartbeat.mfu)).all()
            row = conn.execute(select(Learner.tokens_per_s, Learner.model_flops_per_s, Learner.mfu)).one()
    finally:
        engine.dispose()
    counted = [b for b in beats if b.model_flops_per_s is not None]
    assert counted and all(b.model_flops_per_s == pytest.approx(b.tokens_per_s * per_token) for b in counted)
    assert row.model_flops_per_s > 0 and row.model_flops_per_s == pytest.approx(row.tokens_per_s * per_token)
    assert row.mfu is None and all(b.mfu is None for b in beats)


def test_rejection_reasons_lose_their_figures_and_bad_ports_are_refused():
    assert reason_label("staleness 7 > 4") == "staleness"
    assert reason_label("unknown learner 'x-9'") == "unknown_learner"
    assert reason_label("blob: 512 bytes registered, more than the 64 any encoding takes") == "blob"
    assert metrics_address("9100") == ("0.0.0.0", 9100) and metrics_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert metrics_address("") is None
    for bad in ("http", "127.0.0.1:99999", "9100x"):
        with pytest.raises(ValueError, match="DDILOCO_METRICS_PORT"):
            metrics_address(bad)


HELD_ONLY = ("ddiloco_region_learners", "ddiloco_region_cut_off", "ddiloco_sync_pending_submissions", "ddiloco_sync_versions",
             "ddiloco_sync_newest_version_timestamp_seconds")


def held_only_series(run_id: str) -> dict[str, float]:
    """This process's samples of the series only a lease holder knows, for ``run_id``."""
    from prometheus_client import REGISTRY

    return {f"{s.name}{sorted(s.labels.items())}": s.value for family in REGISTRY.collect() for s in family.samples
            if s.name in HELD_ONLY and s.labels.get("run") == run_id}


def test_a_holder_that_loses_its_lease_stops_serving_what_only_a_holder_knows():
    """Shard 0's holder serves the regions' series, the pending submissions and the versions. Once another holder has
    its lease it serves none of them: the max or the sum over synchronizers (the alerts, the dashboard) would read its
    last values as current, a region cut off for ever or its learners counted twice. Its lease gauge says 0."""
    from prometheus_client import REGISTRY
    from support import sim_run

    from ddiloco.inprocess import sim_learner, sim_step
    from ddiloco.synchronizer.lease import ShardLease
    from ddiloco.synchronizer.service import STATUS_EVERY_S

    cfg, clock, ctx, sync = sim_run(name="lease-lost-series", learners={"regions": [{"name": "us", "learners": 1}]})
    learner = sim_learner(ctx, "us-0")
    learner.start(clock.t)
    clock.t += STATUS_EVERY_S
    sim_step(learner, clock.t)
    assert sync.poll_once(clock.t).role == "active"
    served = held_only_series(ctx.run_id)
    assert {name.partition("[")[0] for name in served} == set(HELD_ONLY), served
    assert any("'us'" in name for name in served if name.startswith("ddiloco_region_learners")), served

    clock.t += cfg.synchronizer.lease_ttl_s + 1.0  # the holder stalled past its lease; another takes it
    assert ShardLease(ctx, "sync-b", 0).acquire(clock.t) is not None
    assert sync.poll_once(clock.t).role == "standby"
    assert held_only_series(ctx.run_id) == {}
    assert REGISTRY.get_sample_value("ddiloco_sync_lease_held", {"run": ctx.run_id, "holder": sync.holder}) == 0
