"""Prometheus metrics of a learner or a synchronizer process, served at ``/metrics``.

A process serves them when ``DDILOCO_METRICS_PORT`` is set (``9100``, or ``HOST:PORT``; ``0`` picks a
free port, logged). Learner series are read from the learner when scraped (nothing in its step
loop); synchronizer series are counted where merges and rejections happen. Series (label ``run``,
plus ``learner`` / ``holder`` / ``reason``):

- learner: ``ddiloco_learner_step``, ``_tokens_total``, ``_tokens_per_second``, ``_model_flops_per_second`` and
  ``_mfu`` (of one device; absent where the model's FLOPs or the device's peak are unknown), ``_loss`` (absent before the
  first step, so a NaN is a NaN), ``_nonfinite_losses_total``, ``_incarnation`` (relaunches of the learner so far),
  ``_upload_queue_depth``, ``_sent_bytes_total``, ``_received_bytes_total``, ``_last_version_received``
- synchronizer: ``ddiloco_sync_merges_total`` (``rate()`` gives merges/s), ``_merge_seconds``,
  ``_pending_submissions``, ``_staleness_versions`` (its ``_count``: submissions merged), ``_rejections_total{reason}``,
  ``_lease_held{holder}``, ``_versions`` (versions published, all fragments), ``_newest_version_timestamp_seconds``
- regions (served by the synchronizer that writes the learners' statuses, shard 0's holder, at each status pass):
  ``ddiloco_region_learners{region,status}`` (its learners by liveness status), ``ddiloco_region_cut_off{region}``
  (1 while every learner of the region fell silent together: a partition, ``liveness.region_verdicts``)

A synchronizer that loses its lease stops serving the series only a holder knows (regions, pending, versions).

``infra/prometheus/alerts.yaml`` and ``infra/grafana/ddiloco.json`` are written over these names (``tests/test_alerts.py``
holds them to this module), and ``tracking`` copies the same series to TensorBoard, W&B or MLflow.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ddiloco.platform.ledger import rejections as rejections_q
from ddiloco.platform.liveness import CUT_OFF, Verdict

PORT_ENV = "DDILOCO_METRICS_PORT"

log = logging.getLogger("ddiloco.metrics")

MERGES = Counter("ddiloco_sync_merges", "Global versions published by merges.", ["run"])
MERGE_SECONDS = Histogram("ddiloco_sync_merge_seconds", "Time from fetching submissions to the version's commit.", ["run"],
                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
PENDING = Gauge("ddiloco_sync_pending_submissions", "Submissions waiting for a merge at the last pass.", ["run"])
STALENESS = Histogram("ddiloco_sync_staleness_versions", "Versions a merged submission's base was behind.", ["run"],
                      buckets=(0, 1, 2, 3, 4, 6, 8, 16))
REJECTIONS = Counter("ddiloco_sync_rejections", "Submissions rejected, by reason.", ["run", "reason"])
LEASE_HELD = Gauge("ddiloco_sync_lease_held", "1 while this synchronizer holds the run's lease (it is the active one).",
                   ["run", "holder"])
VERSIONS = Gauge("ddiloco_sync_versions", "Merged versions of the run: the sum of every fragment's newest version number "
                 "(from the ledger).", ["run"])
NEWEST_VERSION_AT = Gauge("ddiloco_sync_newest_version_timestamp_seconds",
                          "When the run's newest global version was published (Unix time, from the ledger).", ["run"])

REGION_LEARNERS = Gauge("ddiloco_region_learners", "A region's learners by liveness status, at the last status pass.",
                        ["run", "region", "status"])
REGION_CUT_OFF = Gauge("ddiloco_region_cut_off", "1 while every learner of the region fell silent together (a partition "
                       "or a region outage), at the last status pass.", ["run", "region"])


def reason_label(why: str) -> str:
    """A rejection reason as a label of few values: its class (``ledger.rejections.reason_class``) in snake case."""
    return rejections_q.reason_class(why).replace(" ", "_")[:40]


def observe_pass(run_id: str, holder: str, active: bool, pending: int | None = None,
                 versions: int | None = None, newest_at: float | None = None) -> None:
    """One synchronizer pass: whether it holds the lease and (active) how many submissions wait, how many versions
    the run has and when its newest was published, as the ledger says (so a restarted synchronizer knows too)."""
    LEASE_HELD.labels(run_id, holder).set(1 if active else 0)
    if pending is not None:
        PENDING.labels(run_id).set(pending)
    if versions is not None:
        VERSIONS.labels(run_id).set(versions)
    if newest_at is not None:
        NEWEST_VERSION_AT.labels(run_id).set(newest_at)


def observe_regions(run_id: str, counts: Mapping[str, Mapping[str, int]], verdicts: Mapping[str, Verdict]) -> None:
    """One status pass: each region's learners by status, and whether it is cut off (``liveness.region_verdicts``)."""
    for region, by_status in counts.items():
        for status, n in by_status.items():
            REGION_LEARNERS.labels(run_id, region, status).set(n)
    for region, v in verdicts.items():
        REGION_CUT_OFF.labels(run_id, region).set(1 if v.status == CUT_OFF else 0)


def forget_active(run_id: str) -> None:
    """Stop serving what only a lease holder knows: the regions' series, the pending submissions, the versions. A
    holder that lost its lease would otherwise serve its last values for good, and dashboards and alerts that take the
    max or the sum over synchronizers would read them as current (a region cut off for ever, its learners counted
    twice)."""
    for gauge in (REGION_LEARNERS, REGION_CUT_OFF, PENDING, VERSIONS, NEWEST_VERSION_AT):
        gauge.remove_by_labels({"run": run_id})


def observe_merge(run_id: str, merge_s: float, staleness: Iterable[int]) -> None:
    """A published merge: its time and the staleness of each merged submission. The run's version count and newest
    publish move with it, so they are current between the passes that read them from the ledger."""
    MERGES.labels(run_id).inc()
    VERSIONS.labels(run_id).inc()
    NEWEST_VERSION_AT.labels(run_id).set(time.time())
    MERGE_SECONDS.labels(run_id).observe(merge_s)
    for s in staleness:
        STALENESS.labels(run_id).observe(s)


def observe_rejections(run_id: str, rejected: Iterable[tuple[int, str]]) -> None:
    """Rejected submissions as (id, reason)."""
    for _, why in rejected:
        REJECTIONS.labels(run_id, reason_label(why)).inc()


@dataclass(frozen=True)
class LearnerFigures:
    """What a learner reports when scraped."""

    step: int
    tokens: int
    tokens_per_s: float
    loss: float | None
    upload_queue: int
    sent_bytes: int
    received_bytes: int
    last_version: int
    nonfinite_losses: int = 0
    incarnation: int = 0
    model_flops_per_s: float | None = None
    """Model FLOP/s of one device over the last step (None: the model's FLOPs could not be counted)."""
    mfu: float | None = None
    """That as a share of the device's dense bf16 peak (None: no peak known, as on a CPU)."""


class LearnerCollector(Collector):
    """Reads one learner's figures at scrape time, so its step loop does no metrics work."""

    def __init__(self, run_id: str, learner_id: str, figures: Callable[[], LearnerFigures]) -> None:
        self.labels = [run_id, learner_id]
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        f = self.figures()
        names = ["run", "learner"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"ddiloco_learner_{name}", doc, labels=names)
            g.add_metric(self.labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"ddiloco_learner_{name}", doc, labels=names)
            c.add_metric(self.labels, value)
            return c

        yield gauge("step", "Inner steps of this incarnation.", f.step)
        yield counter("tokens", "Tokens trained by this incarnation.", f.tokens)
        yield gauge("tokens_per_second", "Tokens per second of the last step.", f.tokens_per_s)
        if f.model_flops_per_s is not None:
            yield gauge("model_flops_per_second", "Model FLOP/s of one device over the last step (forward and backward).",
                        f.model_flops_per_s)
        if f.mfu is not None:
            yield gauge("mfu", "Model FLOPs utilisation of one device: its model FLOP/s over its dense bf16 peak.", f.mfu)
        if f.loss is not None:  # absent before the first step: a NaN here is a training problem, never a start
            yield gauge("loss", "Training loss (moving average of the finite step losses).", f.loss)
        yield counter("nonfinite_losses", "Steps whose loss was NaN or infinite.", f.nonfinite_losses)
        yield gauge("incarnation", "This learner's incarnation: how often it was relaunched so far.", f.incarnation)
        yield gauge("upload_queue_depth", "Outer gradients queued for upload.", f.upload_queue)
        yield counter("sent_bytes", "Bytes of outer gradients sent.", f.sent_bytes)
        yield counter("received_bytes", "Bytes of global fragments received.", f.received_bytes)
        yield gauge("last_version_received", "Newest global version received of any fragment (-1: none yet).", f.last_version)


def metrics_address(value: str | None = None) -> tuple[str, int] | None:
    """(host, port) from ``DDILOCO_METRICS_PORT`` (``PORT`` or ``HOST:PORT``), None when unset; a bad value is a one-line error."""
    value = os.environ.get(PORT_ENV) if value is None else value
    if not value:
        return None
    host, _, port = value.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{PORT_ENV}={value!r}: expected a port (9100) or HOST:PORT (127.0.0.1:9100)")
    return host or "0.0.0.0", int(port)


def serve(registry: CollectorRegistry = REGISTRY, address: tuple[str, int] | None = None) -> int | None:
    """Serve ``/metrics`` in a daemon thread at ``address`` (default: from the environment); the port, or None when off."""
    address = address or metrics_address()
    if address is None:
        return None
    server, _thread = start_http_server(address[1], addr=address[0], registry=registry)
    port = server.server_address[1]
    log.info("metrics at http://%s:%s/metrics", address[0], port)
    return port


def serve_learner(run_id: str, learner_id: str, figures: Callable[[], LearnerFigures], *, register: bool = False) -> int | None:
    """Register a learner's collector when ``/metrics`` is served (``DDILOCO_METRICS_PORT``) or ``register`` asks for it
    (a tracker reports it), and serve ``/metrics``; the port, or None when not served."""
    address = metrics_address()
    if address is not None or register:
        REGISTRY.register(LearnerCollector(run_id, learner_id, figures))
    return serve(REGISTRY, address) if address is not None else None
