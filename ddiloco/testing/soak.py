"""``ddiloco chaos-suite --soak DURATION --rate FAULTS_PER_HOUR --seed S``: many faults at once, for long.

A seeded Poisson stream of faults drawn from the matrix (learner SIGKILL / SIGSTOP, synchronizer shard SIGKILL,
evaluator SIGKILL, PostgreSQL restart, store outage, region partition), overlapping when the draw says so, applied to
one live run on PostgreSQL (a private throwaway server, so restarting it disturbs nobody), S3 (moto) and real
processes. The invariants are checked every ``check_every_s`` and at the end; every long-lived process is sampled
from /proc (RSS, open files, threads) and PostgreSQL's ``pg_stat_activity`` (its connections, by the
``application_name`` each process is started with).

The decisions are pure (:func:`draw_schedule`, :func:`availability_bound`, :func:`resource_growth`,
:func:`longest_gaps`); :class:`Soak` is the shell that applies a schedule to a live cluster and watches it."""

from __future__ import annotations

import heapq
import json
import logging
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from ddiloco.entry import ProcessSpec
from ddiloco.platform.config import LearnersConfig, RunConfig, build_config, environment, secret_env
from ddiloco.platform.fragments import shard_fragments
from ddiloco.platform.invariants import check_run
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import FragmentSpec, FragmentVersion, Learner
from ddiloco.platform.runtime import to_datetime
from ddiloco.platform.store import FragmentStore
from ddiloco.platform.summary import RunSummary, run_summary
from ddiloco.testing.net import free_port, poll_until, port_open
from ddiloco.testing.postgres import ThrowawayCluster, scratch_database, server_url
from ddiloco.testing.processes import ProcessCluster, watcher_context, write_config
from ddiloco.testing.progress import longest_gap
from ddiloco.testing.relay import Relay
from ddiloco.testing.s3 import S3Server

log = logging.getLogger("ddiloco.soak")

# --- the matrix --------------------------------------------------------------------------------------

LEARNER_KILL = "learner SIGKILL"
LEARNER_STOP = "learner SIGSTOP"
SYNC_KILL = "synchronizer shard SIGKILL"
EVAL_KILL = "evaluator SIGKILL"
PG_RESTART = "PostgreSQL restart"
STORE_OUTAGE = "store outage"
PARTITION = "region partition"


@dataclass(frozen=True)
class FaultKind:
    """One row of the matrix: what it hits (a learner, a shard, a region, the evaluator, the ledger, the store) and how
    long it lasts, drawn uniformly from [min_s, max_s]."""

    name: str
    hits: str
    min_s: float
    max_s: float


MATRIX: tuple[FaultKind, ...] = (
    # Down until the supervisor relaunches it.
    FaultKind(LEARNER_KILL, "learner", 3.0, 15.0),
    # Past the heartbeat timeout (4 s) at times, below it at others.
    FaultKind(LEARNER_STOP, "learner", 2.0, 10.0),
    # The holder dies at once; the duration only spaces two kills of one shard, so a standby has taken it over.
    FaultKind(SYNC_KILL, "shard", 6.0, 6.0),
    FaultKind(EVAL_KILL, "evaluator", 3.0, 15.0),
    FaultKind(PG_RESTART, "ledger", 1.0, 5.0),
    FaultKind(STORE_OUTAGE, "store", 3.0, 15.0),
    FaultKind(PARTITION, "region", 3.0, 15.0),
)
DOWN_KINDS = frozenset({LEARNER_KILL, LEARNER_STOP})
"""Faults that take a learner's process away: what the availability bound subtracts."""
UNREACHABLE_KINDS = frozenset({PG_RESTART, STORE_OUTAGE, PARTITION})
"""Faults that leave a learner running but cut from the ledger or the store: it trains on and sends later."""


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    target: str
    duration_s: float

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s


def draw_schedule(seed: int, duration_s: float, rate_per_hour: float, targets: Mapping[str, Sequence[str]],
                  matrix: Sequence[FaultKind] = MATRIX) -> list[Fault]:
    """A Poisson stream of faults over [0, duration_s), ``rate_per_hour`` on average, each a kind of ``matrix`` whose
    ``hits`` has ``targets``, on a target no other fault holds at that moment (faults of other targets overlap freely).

    The same arguments always give the same schedule."""
    rng = random.Random(seed)
    kinds = [k for k in matrix if targets.get(k.hits)]
    out: list[Fault] = []
    if rate_per_hour <= 0 or not kinds:
        return out
    hits_of = {k.name: k.hits for k in matrix}
    holding: list[Fault] = []  # the faults still in effect at t
    t = rng.expovariate(rate_per_hour / 3600.0)
    while t < duration_s:
        holding = [f for f in holding if f.end_s > t]
        held = {(hits_of[f.kind], f.target) for f in holding}
        free = {k.name: [x for x in targets[k.hits] if (k.hits, x) not in held] for k in kinds}
        choices = [k for k in kinds if free[k.name]]
        if choices:
            kind = rng.choice(choices)
            fault = Fault(round(t, 3), kind.name, rng.choice(free[kind.name]), round(rng.uniform(kind.min_s, kind.max_s), 3))
            out.append(fault)
            holding.append(fault)
        t += rng.expovariate(rate_per_hour / 3600.0)
    return out


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def unavailable(schedule: Iterable[Fault], learners: Mapping[str, str], span_s: float,
                kinds: frozenset[str] = DOWN_KINDS) -> dict[str, list[tuple[float, float]]]:
    """Each learner's (of ``learners``: id -> region) stretches of [0, span_s] that faults of ``kinds`` take from it."""
    per: dict[str, list[tuple[float, float]]] = {lid: [] for lid in learners}
    for f in schedule:
        if f.kind not in kinds:
            continue
        if f.kind in (LEARNER_KILL, LEARNER_STOP):
            hit = [f.target] if f.target in per else []
        elif f.kind == PARTITION:
            hit = [lid for lid, region in learners.items() if region == f.target]
        else:  # the ledger or the store: every learner
            hit = list(per)
        a, b = max(0.0, f.at_s), min(span_s, f.end_s)
        if b > a:
            for lid in hit:
                per[lid].append((a, b))
    return {lid: merge_intervals(iv) for lid, iv in per.items()}


def availability_bound(schedule: Iterable[Fault], learners: Mapping[str, str], span_s: float,
                       kinds: frozenset[str] = DOWN_KINDS) -> float:
    """The share of the learners' seconds over [0, span_s] that faults of ``kinds`` leave them: the most goodput the
    schedule allows."""
    if span_s <= 0 or not learners:
        return 1.0
    lost = sum(b - a for iv in unavailable(schedule, learners, span_s, kinds).values() for a, b in iv)
    return 1.0 - lost / (span_s * len(learners))


UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str) -> float:
    """``90``, ``90s``, ``30m`` or ``1h`` in seconds; ValueError naming the value otherwise."""
    v = value.strip().lower()
    number, unit = (v[:-1], v[-1]) if v[-1:] in UNITS else (v, "s")
    try:
        seconds = float(number) * UNITS[unit]
    except ValueError:
        raise ValueError(f"--soak: {value!r} is not a duration (e.g. 150s, 30m, 1h)") from None
    if not 0 < seconds <= 24 * 3600:
        raise ValueError(f"--soak: {value!r} is not between 1 s and 24 h")
    return seconds


# --- resources -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One look at one process: seconds into the soak, RSS (bytes), open files, threads, ledger connections (None: unknown)."""

    at_s: float
    rss: int
    fds: int
    threads: int
    connections: int | None = None
    role: str | None = None
    """A synchronizer's: "active" (it held a shard's lease) or "standby"; None for other processes, or unknown."""
    anon: int = 0
    """The anonymous part of RSS (bytes): heap, tensors, stacks. The rest is file-backed: the pages of code and
    libraries the process has touched so far, which a new code path adds to and no leak does."""
    peak: int = 0
    """The most RSS the process has held so far (VmHWM, bytes): what a leak raises, and a heap trim does not lower."""


class ProcStat(NamedTuple):
    rss: int
    fds: int
    threads: int
    anon: int
    peak: int = 0


def read_proc(pid: int) -> ProcStat | None:
    """RSS, its anonymous part and its peak so far (bytes), open file descriptors and threads of ``pid`` from /proc
    (Linux), or None once it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        return None

    def kib(name: str) -> int:
        return int(fields.get(name, "0 kB").split()[0]) * 1024

    return ProcStat(kib("VmRSS"), fds, int(fields.get("Threads", "0")), kib("RssAnon"), kib("VmHWM"))


@dataclass(frozen=True)
class Growth:
    process: str
    pid: int
    start: Sample
    end: Sample
    lived_s: float
    whole_soak: bool = True
    """Whether it lived through the whole soak; otherwise an incarnation that lived long enough after its own warm-up."""
    trace: tuple[tuple[float, int, int], ...] = ()
    """(seconds into the soak, RSS MiB, anonymous MiB) from ``start`` to ``end``, at most ``TRACE_POINTS`` of them:
    the shape tells a leak (a steady climb) from a warm-up (a climb that levels off)."""
    peak_from: int = 0
    peak_to: int = 0
    """The process's peak RSS (VmHWM) at the first and the last sample of the judged stretch."""

    @property
    def rss_ratio(self) -> float:
        return self.end.rss / self.start.rss if self.start.rss else 1.0

    @property
    def anon_ratio(self) -> float:
        return self.end.anon / self.start.anon if self.start.anon else 1.0

    @property
    def peak_ratio(self) -> float:
        """How much higher the process's peak RSS went after warm-up. RSS itself swings with the heap trimmer (a learner
        sampled after a trim and before its next step reads ~10% low, and a 2x-slowed learner steps a few times a
        minute); its peak does not, and a leak raises it: RSS at the end is at most this over the peak at warm-up."""
        return self.peak_to / self.peak_from if self.peak_from else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"process": self.process, "pid": self.pid, "lived_s": round(self.lived_s, 1), "rss_ratio": round(self.rss_ratio, 4),
                "anon_ratio": round(self.anon_ratio, 4), "peak_ratio": round(self.peak_ratio, 4), "whole_soak": self.whole_soak,
                "start": asdict(self.start),
                "end": asdict(self.end), "trace": [list(p) for p in self.trace]}


TRACE_POINTS = 40


def trace(samples: Sequence[Sample], points: int = TRACE_POINTS) -> tuple[tuple[float, int, int], ...]:
    """Evenly spaced samples (the first and last always among them) as (seconds, RSS MiB, anonymous MiB)."""
    if not samples:
        return ()
    n = min(points, len(samples))
    picks = sorted({round(i * (len(samples) - 1) / max(1, n - 1)) for i in range(n)})
    return tuple((samples[i].at_s, samples[i].rss >> 20, samples[i].anon >> 20) for i in picks)


END_WINDOW_S = 15.0
"""Growth is judged between the median samples (by RSS) within this long of each end of the judged stretch. A
learner's RSS swings by about 10% for a sample or two, up and down (every 30 s the heap trimmer hands free pages back,
:mod:`ddiloco.platform.memory`, and RSS stays low until the learner's next step touches them again); one sample caught
in a swing at either end made a 75 s soak's learners read as +10.9%, +11.7% or -11.8%. A slow learner can stay low for
a whole window: :attr:`Growth.peak_ratio` is what a trim does not move."""


def _middle(samples: Sequence[Sample]) -> Sample:
    return sorted(samples, key=lambda s: s.rss)[(len(samples) - 1) // 2]


def resource_growth(series: Mapping[tuple[str, int], Sequence[Sample]], warmup_s: float, end_s: float,
                    slack_s: float, min_life_s: float | None = None) -> list[Growth]:
    """For every process (name, pid) that lived through the soak (sampled within ``slack_s`` of its start and of
    ``end_s``), and with ``min_life_s`` every other that was sampled over at least that long after its own warm-up
    (a learner relaunched mid-soak is as long-lived as one never killed): from its first sample ``warmup_s`` or more
    after its own first and ``warmup_s`` or more after its last change of role, to its last: the median sample of the
    first ``END_WINDOW_S`` against that of the last (the last sample alone where the stretch is too short for two
    windows). A standby that takes a shard over starts holding its state and merging then: its warm-up begins again,
    as long as a fresh process's (one that took over less than ``warmup_s`` before its last sample is judged from that
    sample: not yet warm). Each also carries its peak RSS at the first and the last sample of that stretch
    (:attr:`Growth.peak_ratio`), which no trim lowers."""
    out = []
    for (name, pid), samples in sorted(series.items()):
        after = [s for s in samples if s.at_s >= samples[0].at_s + warmup_s]
        if not after:
            continue
        whole = samples[0].at_s <= slack_s and after[-1].at_s >= end_s - slack_s
        if not whole and (min_life_s is None or after[-1].at_s - after[0].at_s < min_life_s):
            continue
        role = next((s.role for s in reversed(samples) if s.role is not None), None)
        changed = [i for i, s in enumerate(samples) if s.role is not None and s.role != role]
        since = samples[changed[-1] + 1].at_s + warmup_s if changed else 0.0
        base = next((s for s in after if s.at_s >= since), after[-1])
        judged = [s for s in after if s.at_s >= base.at_s]
        head = [s for s in judged if s.at_s <= judged[0].at_s + END_WINDOW_S]
        tail = [s for s in judged[len(head):] if s.at_s >= judged[-1].at_s - END_WINDOW_S] or [judged[-1]]
        out.append(Growth(name, pid, _middle(head), _middle(tail), after[-1].at_s - samples[0].at_s, whole, trace(judged),
                          judged[0].peak, judged[-1].peak))
    return out


def longest_gaps(version_times: Mapping[int, Sequence[float]], shards: Sequence[Sequence[int]]) -> list[tuple[float, float]]:
    """Per shard: (the longest stretch without a new version of any of its fragments, when it began), from the
    versions' times (seconds, by fragment)."""
    out = []
    for fragments in shards:
        times = sorted(t for f in fragments for t in version_times.get(f, ()))
        out.append(longest_gap(times))
    return out


# --- the report ----------------------------------------------------------------------------------------------


@dataclass
class Applied:
    """One fault of the schedule as the soak applied it (times in seconds since the soak began)."""

    fault: Fault
    applied: bool = False
    started_s: float | None = None
    ended_s: float | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.fault), "applied": self.applied, "started_s": _r(self.started_s), "ended_s": _r(self.ended_s),
                "detail": self.detail}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


@dataclass
class SoakReport:
    seed: int
    rate_per_hour: float
    duration_s: float
    learner_speed: float = 1.0
    """The pace the learners were slowed to (1.0: the demo's learners at full speed)."""
    span_s: float = 0.0
    """From the soak's start to the end of its last fault plus the settle time: the window every figure covers."""
    timeline: list[Applied] = field(default_factory=list)
    skipped_kinds: dict[str, str] = field(default_factory=dict)
    invariant_checks: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    availability_bound: float = 1.0
    reachability_bound: float = 1.0
    goodput: float = 0.0
    goodput_of_bound: float = 0.0
    tokens: dict[str, int] = field(default_factory=dict)
    longest_gap_s: list[dict[str, Any]] = field(default_factory=list)
    processes: list[dict[str, Any]] = field(default_factory=list)
    growth: list[dict[str, Any]] = field(default_factory=list)
    connections: dict[str, dict[str, int]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    warm_up_s: float = 0.0
    """From the first process started to every learner stepping and the shards merging, when the faults begin."""
    seconds: float = 0.0

    @property
    def invariants_ok(self) -> bool:
        return not self.problems and bool(self.invariant_checks) and self.invariant_checks[-1].get("final", False)

    @property
    def lost(self) -> int:
        """Rows or tokens whose data vanished, as the invariant checks count them (the worst check)."""
        return max((int(c.get("lost", 0)) for c in self.invariant_checks), default=0)

    @property
    def all_applied(self) -> bool:
        return all(a.applied for a in self.timeline)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "timeline"}
        out["timeline"] = [a.to_dict() for a in self.timeline]
        out["invariants_ok"] = self.invariants_ok
        out["all_applied"] = self.all_applied
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def run_growth(report: SoakReport) -> list[dict[str, Any]]:
    """The growth of the run's own processes (learners, synchronizers, evaluator, relays), not this driver's: it hosts
    moto's S3 server, which keeps every blob of the store in its memory."""
    return [g for g in report.growth if g["process"] != DRIVER]


def soak_passed(report: SoakReport) -> bool:
    """Every fault of the schedule applied, the invariants held at every check and at the end, no token lost."""
    return report.invariants_ok and report.lost == 0 and report.all_applied


# --- the run under test ------------------------------------------------------------------------------------


def soak_config(run_id: str, ledger_url: str, bucket: str, shards: int = 2, speed: float = 1.0) -> RunConfig:
    """The demo's model and learners (4 in 2 regions, one 2x slower) with the chaos suite's short timeouts; ``speed`` < 1
    paces every learner that much slower still (``learners.regions[].speeds``: each step then waits)."""
    demo = LearnersConfig()
    regions = [{"name": r.name, "learners": r.learners, "speeds": [speed * s for _, region, s in demo.learner_ids() if region == r.name]}
               for r in demo.regions]
    return build_config({
        "name": run_id,
        "token_budget": 10**12,
        "data": {"max_bytes": 2_000_000},
        "learners": {"heartbeat_s": 0.5, "poll_s": 0.3, "dead_after_s": 4.0, "regions": regions},
        "quorum": {"min_count": 1},
        "grace": {"max_s": 1.0},
        "synchronizer": {"poll_s": 0.2, "lease_ttl_s": 2.0, "shards": shards},
        "ledger": {"url": ledger_url, "idle_in_transaction_timeout_s": 2.0},
        "storage": {"url": f"s3://{bucket}/runs"},
    })


DRIVER = "soak-driver"
"""This process (it also hosts moto's S3 server), by the name it is sampled and connects to PostgreSQL under."""
START_WAIT_S = 120.0
"""How long a process the soak starts waits for its ledger and store: nine processes starting at once on 2 loaded cores
took over 30 s (the default) to get their first answer from the store, and a relaunch may land in a backend fault."""
LONG_LIVED_S = 600.0
"""A process relaunched mid-soak is judged for growth too when it was sampled this long after its own warm-up: at
125 faults/hour every learner and synchronizer is killed at least once in 30 minutes."""
SETTLE_S = 15.0
"""After the last fault ends, the run goes on this long before the final figures: what the last fault held up drains."""
BACKEND_QUIET_S = 10.0
"""A periodic invariant check waits this long after a backend fault ends (clients back off and retry)."""
HOLDER_WAIT_S = 20.0
"""A shard SIGKILL looks for the shard's holder this long (the ledger may be restarting, or a takeover under way)."""
RETRY_S = 0.2


class Soak:
    """One soak: a run on its own PostgreSQL server, S3 (moto) and OS processes, a schedule applied to it."""

    def __init__(self, *, duration_s: float, rate_per_hour: float, seed: int, workdir: Path, postgres_url: str | None = None,
                 check_every_s: float = 60.0, sample_every_s: float = 5.0, warmup_s: float = 30.0, shards: int = 2,
                 speed: float = 1.0) -> None:
        self.duration_s, self.rate, self.seed, self.speed = duration_s, rate_per_hour, seed, speed
        self.workdir, self.postgres_url = workdir, postgres_url
        self.check_every_s, self.sample_every_s, self.warmup_s, self.shards = check_every_s, sample_every_s, warmup_s, shards
        self.report = SoakReport(seed, rate_per_hour, duration_s, speed)
        self.run_id = f"soak-{uuid.uuid4().hex[:6]}"
        self.series: dict[tuple[str, int], list[Sample]] = {}
        self.active: dict[str, int] = {}
        """Backend faults in effect (kind -> how many), and when the last one ended: the periodic check waits."""
        self.backend_quiet_at = 0.0
        self.spares = 0
        self.first_connections: dict[str, int] | None = None
        self.last_connections: dict[str, int] | None = None
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._stack = ExitStack()

    # --- set-up ------------------------------------------------------------------------------------------------

    def __enter__(self) -> Soak:
        try:
            self._open()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._stack.close()

    def _open(self) -> None:
        self.pg: ThrowawayCluster | None = None
        if self.postgres_url is None:
            try:
                self.pg = ThrowawayCluster.start()
                self._stack.callback(self.pg.stop)
            except RuntimeError as err:
                self.report.skipped_kinds[PG_RESTART] = f"no PostgreSQL server of its own to restart ({err}); on {server_url()}"
        else:
            self.report.skipped_kinds[PG_RESTART] = "a server named by --postgres-url is not the soak's to restart"
        server = self.pg.url if self.pg else (self.postgres_url or server_url())
        self.db_url = make_url(self._stack.enter_context(scratch_database(server, "ddiloco_soak", durable=True)))
        self.s3 = self._stack.enter_context(S3Server())
        # moto's server answers a GET that races a DELETE of the same key (GC) with a 500 and logs moto's own
        # traceback; the client retries and gets its 404. Its errors are not the run's.
        logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
        self._stack.enter_context(environment({**self.s3.env(), "PGAPPNAME": DRIVER}))
        self.cfg = soak_config(self.run_id, self.db_url.render_as_string(hide_password=False), self.s3.bucket("soak"), self.shards,
                               self.speed)
        # Its invariant checks hold a read transaction open while they verify blobs from the S3 server in this same
        # interpreter: under the run's 2 s limit, 2 of 28 checks were once skipped on a loaded machine.
        self.ctx = watcher_context(self.cfg, self.run_id)
        self._stack.callback(self.ctx.engine.dispose)
        self.admin = create_engine(self.db_url, poolclass=NullPool, connect_args={"connect_timeout": 3})
        self._stack.callback(self.admin.dispose)
        self.learners = {lid: region for lid, region, _ in self.cfg.learners.learner_ids()}
        # Each region reaches the ledger and the store through its own relay: a partition stops it.
        self.relays: dict[str, Relay] = {}
        self.region_env: dict[str, dict[str, str]] = {}
        for region in dict.fromkeys(self.learners.values()):
            s3_port, pg_port = free_port(), free_port()
            relay = Relay([f"127.0.0.1:{s3_port}=127.0.0.1:{self.s3.port}@0",
                           f"127.0.0.1:{pg_port}={self.db_url.host}:{self.db_url.port or 5432}@0"])
            self._stack.callback(relay.stop)
            self.relays[region] = relay
            ledger = self.db_url.set(host="127.0.0.1", port=pg_port).render_as_string(hide_password=False)
            self.region_env[region] = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}", "DDILOCO_LEDGER__URL": ledger}
        self.config_path = write_config(self.cfg, self.workdir / "config.yaml")
        self.cluster = ProcessCluster(self.config_path, self.run_id, self.workdir, warm=True, secrets=secret_env(self.cfg))
        self._stack.callback(self.cluster.stop_all)
        self._stack.callback(self._halt.set)  # the watcher stops before the processes

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- processes ---------------------------------------------------------------------------------------------

    def start_learner(self, lid: str) -> None:
        self.cluster.start(lid, ProcessSpec.learner(lid, wait_s=START_WAIT_S), env={**self.region_env[self.learners[lid]],
                                                                                     "PGAPPNAME": lid}, warm=True)

    def start_synchronizer(self, label: str) -> None:
        self.cluster.start(label, ProcessSpec.synchronizer(label, wait_s=START_WAIT_S), env={"PGAPPNAME": label}, warm=True)

    def start_evaluator(self) -> None:
        self.cluster.start("evaluator", ProcessSpec.evaluator(wait_s=START_WAIT_S), env={"PGAPPNAME": "evaluator"}, warm=True)

    def running(self, name: str) -> bool:
        proc = self.cluster.procs.get(name)
        return proc is not None and proc.poll() is None

    def pids(self) -> dict[str, int]:
        """Every process of the soak alive now, by name: the run's, the relays, this driver."""
        out = {name: p.pid for name, p in self.cluster.procs.items() if p.poll() is None}
        out.update({f"relay-{region}": r.pid for region, r in self.relays.items()})
        out[DRIVER] = os.getpid()
        return out

    # --- observations ------------------------------------------------------------------------------------------

    def every_shard_merged(self) -> bool:
        """Each shard's holder has published a merged version (beyond version 0) of one of its fragments."""
        with self.ctx.reading() as s:
            latest = runs_q.latest_version_numbers(s, self.run_id)
            sizes = list(s.scalars(select(FragmentSpec.nbytes).where(FragmentSpec.run_id == self.run_id).order_by(FragmentSpec.fragment)))
        return bool(sizes) and all(any(latest.get(f, 0) > 0 for f in frags) for frags in shard_fragments(sizes, self.shards))

    def learner_row(self, lid: str) -> Learner | None:
        with self.ctx.reading() as s:
            return s.get(Learner, (self.run_id, lid))

    def holder(self, shard: int) -> str | None:
        with self.ctx.reading() as s:
            lease = sync_q.current_lease(s, self.run_id, shard)
        return lease.holder.split("@", 1)[0] if lease else None

    def connections(self) -> dict[str, int] | None:
        """Ledger connections by application name (each process is started with its name), or None while the server is down."""
        try:
            with self.admin.connect() as conn:
                rows = conn.execute(text("SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = :db "
                                         "GROUP BY application_name"), {"db": self.db_url.database}).all()
        except Exception:  # noqa: BLE001 - the server may be restarting: this sample has no connection counts
            return None
        return {str(name): int(n) for name, n in rows}

    def holders(self) -> set[str] | None:
        """The synchronizers holding a shard's lease now, or None while the ledger cannot say."""
        try:
            return {h for shard in range(self.shards) if (h := self.holder(shard)) is not None}
        except Exception:  # noqa: BLE001 - the server may be restarting: this sample has no roles
            return None

    def sample(self) -> None:
        at = self.now()
        conns = self.connections()
        if conns is not None:
            self.last_connections = conns
            self.first_connections = self.first_connections or conns
        holders = self.holders()
        for name, pid in self.pids().items():
            got = read_proc(pid)
            if got is None:
                continue
            n = None if conns is None else conns.get(name, 0)
            role = None if holders is None or not name.startswith("sync") else "active" if name in holders else "standby"
            with self._lock:
                self.series.setdefault((name, pid), []).append(Sample(round(at, 2), got.rss, got.fds, got.threads, n, role, got.anon,
                                                                               peak=got.peak))

    def check(self, final: bool = False) -> None:
        at = self.now()
        try:
            problems = check_run(self.ctx, lambda region: FragmentStore(self.cfg.storage_url_for(region), {"skip_instance_cache": True}))
        except Exception as err:  # noqa: BLE001 - a backend came back a moment ago: the next check sees it
            self.report.invariant_checks.append({"at_s": round(at, 1), "ok": None, "final": final,
                                                 "skipped": " ".join(str(err).split())[:160]})
            return
        self.report.invariant_checks.append({"at_s": round(at, 1), "ok": not problems, "final": final,
                                             "lost": sum(p.lost for p in problems), "seconds": round(self.now() - at, 2)})
        self.report.problems.extend(f"{at:.0f}s: {p}" for p in problems)

    def backends_quiet(self) -> bool:
        with self._lock:
            return not self.active and self.now() >= self.backend_quiet_at + BACKEND_QUIET_S

    def watch(self) -> None:
        """Sample every process every ``sample_every_s``; check the invariants every ``check_every_s`` the backends are up."""
        next_check = self.check_every_s
        while not self._halt.wait(self.sample_every_s):
            self.sample()
            if self.now() >= next_check and self.backends_quiet():
                self.check()
                next_check = self.now() + self.check_every_s

    # --- the faults --------------------------------------------------------------------------------------------

    def begin(self, a: Applied) -> float | None:
        """Apply the fault's start; for a shard SIGKILL whose holder is not known yet, when to look again (the schedule
        goes on meanwhile: waiting here held a PostgreSQL restart's end back 19 s, and the kill then found no holder)."""
        f = a.fault
        a.started_s = self.now()
        if f.kind == LEARNER_KILL:
            proc = self.cluster.procs[f.target]
            if proc.poll() is not None:
                a.detail = f"{f.target} was not running"
                return
            self.cluster.signal(f.target, signal.SIGKILL)
            a.applied = proc.poll() == -signal.SIGKILL
            a.detail = f"{f.target} (pid {proc.pid}) SIGKILLed"
        elif f.kind == LEARNER_STOP:
            proc = self.cluster.procs[f.target]
            if proc.poll() is not None:
                a.detail = f"{f.target} was not running"
                return
            proc.send_signal(signal.SIGSTOP)
            a.applied = bool(poll_until(lambda: _state(proc.pid) == "T", 5, interval_s=0.02))
            a.detail = f"{f.target} (pid {proc.pid}) stopped"
        elif f.kind == SYNC_KILL:
            shard = int(f.target)
            try:
                holder = self.holder(shard)
            except Exception:  # noqa: BLE001 - the ledger may be restarting: look again
                holder = None
            if holder is None or not self.running(holder):
                if a.started_s < f.at_s + HOLDER_WAIT_S:
                    return a.started_s + RETRY_S
                a.detail = f"shard {shard} had no live holder within {HOLDER_WAIT_S:.0f} s"
                return None
            proc = self.cluster.procs[holder]
            self.cluster.signal(holder, signal.SIGKILL)
            a.applied = proc.poll() == -signal.SIGKILL
            self.spares += 1
            self.start_synchronizer(f"sync-s{self.spares}")  # the standby pool stays as large
            a.detail = f"shard {shard}'s holder {holder} SIGKILLed; sync-s{self.spares} started as a standby"
        elif f.kind == EVAL_KILL:
            proc = self.cluster.procs["evaluator"]
            if proc.poll() is not None:
                a.detail = "the evaluator was not running"
                return
            self.cluster.signal("evaluator", signal.SIGKILL)
            a.applied = proc.poll() == -signal.SIGKILL
            a.detail = f"evaluator (pid {proc.pid}) SIGKILLed"
        elif f.kind == PG_RESTART:
            assert self.pg is not None
            self._backend(f.kind, +1)
            self.pg.halt()
            a.applied = not port_open("127.0.0.1", make_url(self.pg.url).port or 5432)
            a.detail = "PostgreSQL stopped (fast shutdown: every session ended)"
        elif f.kind == STORE_OUTAGE:
            self._backend(f.kind, +1)
            self.s3.stop()
            a.applied = not port_open("127.0.0.1", self.s3.port)
            a.detail = "S3 stopped"
        elif f.kind == PARTITION:
            relay = self.relays[f.target]
            relay.partition()
            a.applied = bool(poll_until(lambda: _state(relay.pid) == "T", 5, interval_s=0.02))
            a.detail = f"region {f.target} cut from the ledger and the store"

    def end(self, a: Applied) -> None:
        f = a.fault
        a.ended_s = self.now()
        if f.kind == LEARNER_KILL:
            if not self.running(f.target):
                self.start_learner(f.target)
                a.detail += "; relaunched"
        elif f.kind == LEARNER_STOP:
            proc = self.cluster.procs[f.target]
            proc.send_signal(signal.SIGCONT) if proc.poll() is None else None
        elif f.kind == EVAL_KILL:
            if not self.running("evaluator"):
                self.start_evaluator()
                a.detail += "; relaunched"
        elif f.kind == PG_RESTART:
            assert self.pg is not None
            self.pg.resume()
            self._backend(f.kind, -1)
            a.detail += f"; started again after {a.ended_s - (a.started_s or 0):.1f}s"
        elif f.kind == STORE_OUTAGE:
            self.s3.start()
            self._backend(f.kind, -1)
        elif f.kind == PARTITION:
            self.relays[f.target].heal()

    def _backend(self, kind: str, delta: int) -> None:
        with self._lock:
            self.active[kind] = self.active.get(kind, 0) + delta
            if self.active[kind] <= 0:
                del self.active[kind]
                self.backend_quiet_at = self.now()

    def apply(self, schedule: Sequence[Fault]) -> None:
        """Begin every fault at its time and end it its duration after it began, in one thread: overlapping faults
        interleave as the schedule says, and one begun late on a loaded machine still lasts as long as drawn."""
        events: list[tuple[float, int, int, Applied]] = []  # (when, 0 = end first at a tie, order, fault)
        for i, f in enumerate(schedule):
            a = Applied(f)
            self.report.timeline.append(a)
            events.append((f.at_s, 1, i, a))
        heapq.heapify(events)
        while events:
            when, is_begin, i, a = heapq.heappop(events)
            self._halt.wait(max(0.0, when - self.now()))  # the schedule's own clock: wait for the fault's time
            if self._halt.is_set():
                return
            log.info("%s %s %s", "begin" if is_begin else "end", a.fault.kind, a.fault.target)
            again = None
            try:
                again = self.begin(a) if is_begin else self.end(a)
            except Exception as err:  # noqa: BLE001 - a fault that breaks the soak is a fault not applied
                log.exception("fault %s", a.fault)
                a.applied = False if is_begin else a.applied
                a.detail += f"; soak error: {' '.join(str(err).split())[:160]}"
            if again is not None:
                heapq.heappush(events, (again, 1, i, a))
            elif is_begin:
                began = a.started_s if a.started_s is not None else self.now()
                heapq.heappush(events, (max(a.fault.end_s, began + a.fault.duration_s), 0, i, a))

    # --- the soak -----------------------------------------------------------------------------------------------

    def targets(self) -> dict[str, list[str]]:
        out = {"learner": list(self.learners), "shard": [str(k) for k in range(self.shards)], "evaluator": ["evaluator"],
               "store": ["s3"], "region": sorted(set(self.learners.values()))}
        if PG_RESTART not in self.report.skipped_kinds:
            out["ledger"] = ["postgresql"]
        return out

    def warm_up(self) -> None:
        for k in range(self.shards + 2):  # a holder per shard and two standbys
            self.start_synchronizer(f"sync-{k}")
        for lid in self.learners:
            self.start_learner(lid)
        self.start_evaluator()

        # Every learner stepping and every shard merging is a run in progress. Waiting for merged versions as many as
        # the fragments as well took 118 s of a suite run (its paced learners on loaded cores had stepped 6-14 times;
        # the rule before it, twice as many, longer still), with nothing more to judge.
        def all_stepping() -> bool:
            rows = [self.learner_row(lid) for lid in self.learners]
            return all(r is not None and r.step > 0 for r in rows) and self.every_shard_merged()

        if not poll_until(all_stepping, 300, interval_s=0.5, transient=(Exception,)):
            raise RuntimeError("the run did not start: not every learner stepped and merged within 300 s")

    def summary(self) -> RunSummary:
        return poll_until(lambda: self._summary(), 60, interval_s=1.0, transient=(Exception,))

    def _summary(self) -> RunSummary:
        with self.ctx.reading() as s:
            return run_summary(s, self.run_id, to_datetime(time.time()))

    def run(self) -> SoakReport:
        began = time.monotonic()
        self.warm_up()
        self.report.warm_up_s = round(time.monotonic() - began, 1)
        schedule = draw_schedule(self.seed, self.duration_s, self.rate, self.targets())
        before = self.summary()
        self.t0 = time.monotonic()
        wall0 = time.time()
        self.sample()
        watcher = threading.Thread(target=self.watch, name="soak-watch", daemon=True)
        watcher.start()
        self.apply(schedule)
        settle_until = max(self.duration_s, max((f.end_s for f in schedule), default=0.0)) + SETTLE_S
        self._halt.wait(max(0.0, settle_until - self.now()))  # the run goes on alone until the window closes
        self.report.span_s = round(self.now(), 2)
        self.sample()
        after = self.summary()
        self._halt.set()
        watcher.join(timeout=60)
        self._final_check()
        self._figures(schedule, before, after, wall0)
        self.report.seconds = round(time.monotonic() - began, 1)
        return self.report

    def _final_check(self) -> None:
        def checked() -> bool:
            self.check(final=True)
            return self.report.invariant_checks[-1]["ok"] is not None

        poll_until(checked, 60, interval_s=5.0)  # a backend still recovering: bounded retries

    def _figures(self, schedule: Sequence[Fault], before: RunSummary, after: RunSummary, wall0: float) -> None:
        r, span = self.report, self.report.span_s
        r.availability_bound = round(availability_bound(schedule, self.learners, span), 4)
        r.reachability_bound = round(availability_bound(schedule, self.learners, span, DOWN_KINDS | UNREACHABLE_KINDS), 4)
        merged = after.time_breakdown["merged"] - before.time_breakdown["merged"]
        allocated = after.learner_s - before.learner_s
        r.goodput = round(merged / allocated, 4) if allocated > 0 else 0.0
        r.goodput_of_bound = round(r.goodput / r.availability_bound, 4) if r.availability_bound > 0 else 0.0
        # Trained = merged + rejected + pending + in flight + unsent at a kill (work a SIGKILLed learner had not sent yet,
        # which no system keeps); the invariants check that the sum balances: a token missing from it is lost data.
        r.tokens = {"trained": after.tokens, "merged": after.tokens_merged, "rejected": after.tokens_rejected,
                    "pending": after.tokens_pending, "in_flight": after.tokens_in_flight, "unsent_at_kill": after.tokens_lost,
                    "lost": r.lost}
        r.summary = {"goodput_whole_run": round(after.goodput, 4), "availability_bound_observed": round(after.availability_bound, 4),
                     "rejected_by_reason": after.rejected_by_reason, "versions": sum(after.versions.values()),
                     "val_loss_start": after.val_loss_start, "val_loss_end": after.val_loss_end}
        with self.ctx.reading() as s:
            sizes = list(s.scalars(select(FragmentSpec.nbytes).where(FragmentSpec.run_id == self.run_id).order_by(FragmentSpec.fragment)))
            rows = s.execute(select(FragmentVersion.fragment, FragmentVersion.created_at).where(
                FragmentVersion.run_id == self.run_id, FragmentVersion.created_at >= to_datetime(wall0))).all()
        times: dict[int, list[float]] = {}
        for frag, at in rows:
            times.setdefault(frag, []).append(at.timestamp() - wall0)
        shards = shard_fragments(sizes, self.shards)
        gaps = longest_gaps(times, shards)
        r.longest_gap_s = [{"shard": k, "gap_s": round(g, 2), "from_s": round(at, 1)} for k, (g, at) in enumerate(gaps)]
        with self._lock:
            series = {k: list(v) for k, v in self.series.items()}
        r.processes = [{"process": name, "pid": pid, "start": asdict(v[0]), "end": asdict(v[-1])}
                       for (name, pid), v in sorted(series.items())]
        warmup = min(self.warmup_s, span / 2)
        r.growth = [g.to_dict() for g in resource_growth(series, warmup, span, slack_s=2 * self.sample_every_s,
                                                            min_life_s=LONG_LIVED_S)]
        r.connections = {"start": self.first_connections or {}, "end": self.last_connections or {}}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return ""


def run_soak(*, duration_s: float, rate_per_hour: float, seed: int, workdir: Path, postgres_url: str | None = None,
             check_every_s: float = 60.0, sample_every_s: float = 5.0, warmup_s: float = 30.0, speed: float = 1.0) -> SoakReport:
    """Run one soak (see the module's docstring) and return its report."""
    workdir.mkdir(parents=True, exist_ok=True)
    with Soak(duration_s=duration_s, rate_per_hour=rate_per_hour, seed=seed, workdir=workdir, postgres_url=postgres_url,
              check_every_s=check_every_s, sample_every_s=sample_every_s, warmup_s=warmup_s, speed=speed) as soak:
        return soak.run()
