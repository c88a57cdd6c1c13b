"""``ddiloco chaos-suite``: the fault matrix, on the real multi-region configuration.

PostgreSQL ledger (a scratch database on a throwaway server of the suite's own, unless ``--postgres-url`` names
one), an S3 store (moto's S3 server on loopback, through s3fs),
learners and synchronizers as OS processes started the way the flows start them, every fault point
of their kind armed by file. The suite is scaffolding itself (it lives in :mod:`ddiloco.testing`, which the
runtime never imports: only the CLI's ``chaos-suite`` command reaches it). Each fault is injected into one
live run, the run must recover, and after every fault the ledger invariants
(:mod:`ddiloco.platform.invariants`) must hold; throughout, new versions must keep appearing while at
least K learners are alive."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from ddiloco.entry import ProcessSpec
from ddiloco.platform.compression import encode_delta
from ddiloco.platform.config import RunConfig, build_config, environment, secret_env, tokens_per_step
from ddiloco.platform.fragments import shard_fragments
from ddiloco.platform.ids import submission_key
from ddiloco.platform.invariants import check_run
from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import Base, FragmentSpec, FragmentVersion, Learner, Submission
from ddiloco.platform.redact import redact_url
from ddiloco.platform.runtime import to_datetime
from ddiloco.platform.store import FragmentStore
from ddiloco.testing.net import poll_until
from ddiloco.testing.postgres import ThrowawayCluster, scratch_database, server_url
from ddiloco.testing.processes import ProcessCluster, watcher_context, write_config
from ddiloco.testing.progress import ProgressMonitor
from ddiloco.testing.s3 import S3Server

log = logging.getLogger("ddiloco.chaos_suite")

LEARNER_POINTS = ("learner.mid_step", "learner.after_blob", "learner.after_download")
SYNC_POINTS = ("sync.mid_merge", "sync.before_commit", "sync.renew_lease")
# The longest stretch without a new global version the suite accepts while at least K learners are
# up and the backends are up: a standby takes over within one lease TTL plus a poll, and a learner
# sends every few steps; the rest is slack for a loaded 2-core machine.
MAX_VERSION_GAP_S = 12.0
BACKLOG_SLACK = 8
"""Pending submissions above twice the steady backlog that still count as drained (a pass's worth at 4 learners)."""
BACKLOG_DRAIN_S = 15.0
"""A new holder must bring a shard's backlog back to its steady level within this long of its first publish."""
# After a backend comes back, clients retry with exponential backoff: gaps this close to an outage
# are the outage's, not the run's.
BACKEND_RECOVERY_S = 20.0


@dataclass
class FaultResult:
    fault: str
    injected: int = 0
    survived: int = 0
    lost: int = 0
    recover_s: float | None = None
    detail: str = ""


@dataclass
class Injection:
    """What one fault's injector saw: how many it injected, how many the run survived, and how long
    the run took from the injection to recovery."""

    survived: int
    injected: int
    detail: str
    recover_s: float | None = None


@dataclass
class SuiteReport:
    faults: list[FaultResult] = field(default_factory=list)
    invariants_ok: bool = True
    problems: list[str] = field(default_factory=list)
    max_version_gap_s: float | None = None
    seconds: float | None = None

    def to_dict(self) -> dict:
        return {
            "faults": [asdict(f) for f in self.faults],
            "invariants_ok": self.invariants_ok,
            "problems": self.problems,
            "max_version_gap_s": self.max_version_gap_s,
            "seconds": self.seconds,
        }

    @property
    def passed(self) -> bool:
        return self.invariants_ok and all(f.lost == 0 and f.survived == f.injected for f in self.faults)


def _wait(predicate: Callable[[], object], timeout_s: float) -> object:
    """``predicate``'s first truthy value, or None after ``timeout_s``; a backend restarting while we look is "not yet"."""
    return poll_until(predicate, timeout_s, interval_s=0.2, transient=(Exception,))


def suite_config(run_id: str, ledger_url: str, bucket: str, shards: int = 1) -> RunConfig:
    return build_config(
        {
            "name": run_id,
            "token_budget": 10**12,
            "model": {"kind": "gpt", "n_layer": 1, "d_model": 64, "n_head": 4, "seq_len": 64},
            "data": {"max_bytes": 1_000_000, "val_batches": 2},
            "learners": {
                "batch_size": 8, "heartbeat_s": 0.5, "poll_s": 0.3, "dead_after_s": 4.0,
                # Paced to a tenth, as the soak paces its learners: steps of a realistic length relative to an S3
                # round trip here, and a suite that spends its CPU on the faults rather than on training flat out.
                "regions": [{"name": "us", "learners": 2, "speeds": [0.1, 0.1]}, {"name": "eu", "learners": 1, "speeds": [0.1]}],
            },
            "fragments": {"count": 4},
            "quorum": {"min_count": 1},
            "grace": {"max_s": 1.0},
            "compression": {"codec": "int8"},
            "synchronizer": {"poll_s": 0.2, "lease_ttl_s": 2.0, "eval_every_s": 1000.0, "shards": shards,
                             "retention": {"keep_last": 1_000_000, "keep_submission_blobs": True}},
            "ledger": {"url": ledger_url, "idle_in_transaction_timeout_s": 2.0},
            "storage": {"url": f"s3://{bucket}/runs"},
        }
    )


class Suite:
    def __init__(self, quick: bool, postgres_server_url: str | None, workdir: Path, shards: int = 1) -> None:
        self.quick = quick
        self.shards = shards
        self.kills = 0
        """Synchronizer kills so far: each kills the holder of the next shard in turn."""
        self.server_url = postgres_server_url
        """None: a throwaway server of the suite's own (see :meth:`_open`)."""
        self.pg: ThrowawayCluster | None = None
        self.workdir = workdir
        self.report = SuiteReport()
        self.run_id = f"chaos-{uuid.uuid4().hex[:6]}"
        self.outages: list[tuple[float, float]] = []
        self.spare_synchronizers = 0
        self.stores: dict[str | None, FragmentStore] = {}
        self._stack = ExitStack()

    # --- set-up ----------------------------------------------------------------------------------

    def __enter__(self) -> Suite:
        try:
            self._open()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _open(self) -> None:
        # Undone in reverse order on exit: processes first, whatever else fails, so a suite that
        # dies never leaves a run behind; the scratch database last.
        if self.server_url is None:
            # A server of its own, as the soak has: the restart fault then disturbs no one else's sessions (a test suite's
            # other PostgreSQL tests, a developer's databases). Without initdb: the machine's server, restarted whole.
            try:
                self.pg = ThrowawayCluster.start()
                self._stack.callback(self.pg.stop)
                self.server_url = self.pg.url
            except RuntimeError as err:
                log.warning("no PostgreSQL server of the suite's own (%s): the ledger goes on %s", err, redact_url(server_url()))
                self.server_url = server_url()
        url = make_url(self._stack.enter_context(scratch_database(self.server_url, "ddiloco_chaos", durable=True)))
        # Planted credentials: the security check greps the ledger and every log for them. The
        # S3 server takes any key; a server with password authentication keeps its real password.
        self.secrets = [f"s3-secret-{uuid.uuid4().hex}"]
        if url.password is None:
            url = url.set(password=f"pg-secret-{uuid.uuid4().hex}")
        self.secrets.append(str(url.password))
        self.s3 = self._stack.enter_context(S3Server())
        self._stack.enter_context(environment(self.s3.env(secret=self.secrets[0])))
        self.cfg = suite_config(self.run_id, url.render_as_string(hide_password=False), self.s3.bucket("chaos"), self.shards)
        self.ctx = watcher_context(self.cfg, self.run_id)
        self._stack.callback(self.ctx.engine.dispose)
        self.monitor = ProgressMonitor(self.versions_total, every_s=0.25)
        self._stack.callback(self.monitor.stop)
        self.config_path = write_config(self.cfg, self.workdir / "config.yaml")
        # Warm, as the flows' launcher starts them: a restarted learner or a spare synchronizer costs a fork, not
        # seconds of imports (the bad-input launches stay cold: they must fail before torch is imported).
        self.cluster = ProcessCluster(self.config_path, self.run_id, self.workdir, warm=True, secrets=secret_env(self.cfg))
        self._stack.callback(self.cluster.stop_all)

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def learner(self, lid: str) -> None:
        self.cluster.learner(lid, faults=LEARNER_POINTS)

    def synchronizer(self, label: str) -> None:
        self.cluster.synchronizer(label, faults=SYNC_POINTS)

    # --- observations ------------------------------------------------------------------------------

    def versions_total(self) -> int:
        with self.ctx.reading() as s:
            return sum(runs_q.latest_version_numbers(s, self.run_id).values())

    def learner_row(self, lid: str) -> Learner | None:
        with self.ctx.reading() as s:
            return s.get(Learner, (self.run_id, lid))

    def progressed_since(self, versions_before: int, by: int = 2) -> bool:
        return self.versions_total() >= versions_before + by

    def holder(self, shard: int = 0) -> str | None:
        with self.ctx.reading() as s:
            lease = sync_q.current_lease(s, self.run_id, shard)
        return lease.holder if lease else None

    def shard_fragments(self, shard: int) -> tuple[int, ...]:
        with self.ctx.reading() as s:
            sizes = list(s.scalars(select(FragmentSpec.nbytes).where(FragmentSpec.run_id == self.run_id).order_by(FragmentSpec.fragment)))
        return shard_fragments(sizes, self.shards)[shard]

    def published_by_other_since(self, holder: str, since: float, fragments: tuple[int, ...] | None = None) -> bool:
        """A synchronizer other than ``holder`` published a version (of one of ``fragments``) at or after ``since`` (epoch s)."""
        mine = () if fragments is None else (FragmentVersion.fragment.in_(fragments),)
        with self.ctx.reading() as s:
            newest = s.scalar(select(func.max(FragmentVersion.created_at)).where(
                FragmentVersion.run_id == self.run_id, FragmentVersion.synchronizer != holder, *mine))
        return newest is not None and newest.timestamp() >= since

    def store_for(self, region: str | None) -> FragmentStore:
        """The invariant checks' store client for ``region``, kept from check to check (a new one costs the driver a
        botocore session: about half a CPU-second); the store outage drops them, as their pooled connections die."""
        store = self.stores.get(region)
        if store is None:
            store = self.stores[region] = FragmentStore(self.cfg.storage_url_for(region), {"skip_instance_cache": True})
        return store

    def crashed(self) -> list[str]:
        """Processes that exited by themselves (the suite only ever SIGKILLs)."""
        return [n for n, p in self.cluster.procs.items() if p.poll() not in (None, -signal.SIGKILL)]

    def check_invariants(self, when: str) -> int:
        """Record every broken invariant; returns the number of rows (or tokens) whose data is lost."""
        problems = check_run(self.ctx, self.store_for)
        self.report.problems.extend(f"{when}: {p}" for p in problems)
        if problems:
            self.report.invariants_ok = False
        return sum(p.lost for p in problems)

    # --- the faults --------------------------------------------------------------------------------

    def fault(self, name: str, inject: Callable[[], Injection]) -> None:
        log.info("fault %s", name)
        t0 = time.monotonic()
        try:
            got = inject()
        except Exception as err:  # noqa: BLE001 - a fault that breaks the suite is a failed fault
            log.exception("fault %s", name)
            got = Injection(0, 1, f"suite error: {err!r}")
        recover = got.recover_s if got.recover_s is not None else time.monotonic() - t0
        t1 = time.monotonic()
        lost = self.check_invariants(name)
        log.info("fault %s: injected and recovered in %.1fs, invariants checked in %.1fs", name, t1 - t0, time.monotonic() - t1)
        self.report.faults.append(FaultResult(name, got.injected, got.survived, lost, round(recover, 2), got.detail))

    def kill_learner(self, lid: str, point: str | None) -> Injection:
        """SIGKILL a learner (stopped at ``point`` if given), restart it: it must rejoin as a new
        incarnation from the newest global state while the others keep the run going."""
        before = self.learner_row(lid).incarnation
        where = "at a random moment"
        if point:
            self.cluster.arm(lid, point)
            if not _wait(lambda: self.cluster.fault_reached(lid, point), 60):
                self.cluster.disarm(lid, point)
                return Injection(0, 1, f"{lid} never reached {point}")
            where = f"stopped at {point}"
        versions = self.versions_total()
        killed = time.monotonic()
        self.cluster.signal(lid, signal.SIGKILL)
        progressed = _wait(lambda: self.progressed_since(versions), 60)  # without it, on the others alone
        self.learner(lid)
        rejoined = _wait(lambda: self.learner_row(lid).incarnation > before and self.learner_row(lid).step > 0, 120)
        recover = time.monotonic() - killed
        ok = bool(rejoined and progressed)
        return Injection(int(ok), 1, f"{lid} killed {where}; " + (f"rejoined as incarnation {before + 1}" if rejoined else "did not rejoin")
                         + ("" if progressed else "; the run stalled without it"), recover)

    def pause_learner(self, lid: str) -> Injection:
        """SIGSTOP past the heartbeat timeout, SIGCONT: the learner is declared dead, the run goes
        on, and on waking it carries on; its late submissions meet the staleness rule."""
        self.cluster.signal(lid, signal.SIGSTOP)
        stopped = time.monotonic()
        versions = self.versions_total()
        dead = _wait(lambda: self.learner_row(lid).status == "dead", 30)
        progressed = _wait(lambda: self.progressed_since(versions), 30)
        woke = time.time()
        self.cluster.signal(lid, signal.SIGCONT)
        step = self.learner_row(lid).step
        back = _wait(lambda: self.learner_row(lid).step > step and self.learner_row(lid).status != "dead", 60)
        recover = time.monotonic() - stopped
        window = (to_datetime(woke), to_datetime(time.time()))

        def late_fates() -> Counter[tuple[str, str]]:
            with self.ctx.reading() as s:
                rows = s.execute(
                    select(Submission.status, Submission.reject_reason).where(
                        Submission.run_id == self.run_id, Submission.learner_id == lid, Submission.created_at.between(*window))
                ).all()
            return Counter((status, (why or "").split(":", 1)[0]) for status, why in rows)

        # What it sent between waking and resuming was trained against versions it had not yet
        # replaced: the staleness rule decides those. Wait for their fates.
        _wait(lambda: all(status != "pending" for status, _ in late_fates()), 30)
        fates = ", ".join(f"{n} {status}" + (f" ({why})" if why else "") for (status, why), n in late_fates().items()) or "none"
        ok = bool(dead and progressed and back)
        return Injection(int(ok), 1, f"declared dead while stopped: {bool(dead)}; run went on: {bool(progressed)}; "
                         f"resumed after SIGCONT: {bool(back)}; its submissions since: {fates}", recover)

    def kill_active_synchronizer(self, point: str) -> Injection:
        """Stop the lease holder at ``point``, SIGKILL it: a standby must take over and publish, and
        nothing the dead one half-wrote may show. With shards, each kill takes the next shard's holder."""
        shard = self.kills % self.shards
        self.kills += 1
        holder = self.holder(shard)
        if holder is None:
            return Injection(0, 1, f"no synchronizer held the lease of shard {shard}")
        fragments = self.shard_fragments(shard)
        steady = self.backlog(fragments)
        name = holder.split("@", 1)[0]
        self.cluster.arm(name, point)
        if not _wait(lambda: self.cluster.fault_reached(name, point), 60):
            self.cluster.disarm(name, point)
            return Injection(0, 1, f"{name} never reached {point}")
        killed_at, killed = time.time(), time.monotonic()
        self.cluster.signal(name, signal.SIGKILL)
        ok = _wait(lambda: self.published_by_other_since(holder, killed_at, fragments), 60)
        recover = time.monotonic() - killed
        new_holder = self.holder(shard) or "nobody"
        # What piled up while the shard had no holder must drain to the steady level within seconds.
        published, peak = time.monotonic(), self.backlog(fragments)
        bound = max(2 * steady, steady + BACKLOG_SLACK)
        drained = bool(ok) and _wait(lambda: self.backlog(fragments) <= bound, BACKLOG_DRAIN_S)
        drain_s = time.monotonic() - published
        # Keep a standby in reserve for the next fault.
        self.spare_synchronizers += 1
        self.synchronizer(f"sync-spare{self.spare_synchronizers}")
        where = f" (shard {shard})" if self.shards > 1 else ""
        if not ok:
            return Injection(0, 1, f"no standby published within 60s of killing {name}", recover)
        backlog = (f"backlog {steady} before, {peak} at takeover, <= {bound} {drain_s:.1f}s later" if drained
                   else f"backlog {steady} before, {peak} at takeover, still above {bound} after {BACKLOG_DRAIN_S:.0f}s")
        return Injection(int(drained), 1, f"{name}{where} killed at {point}; {new_holder.split('@')[0]} published "
                         f"{recover:.1f}s after the kill; {backlog}", recover)

    def backlog(self, fragments: tuple[int, ...]) -> int:
        """Pending submissions of ``fragments``."""
        with self.ctx.reading() as s:
            return sum(n for f, n in sync_q.pending_counts(s, self.run_id).items() if f in fragments)

    def store_outage(self, seconds: float) -> Injection:
        versions = self.versions_total()
        down = time.monotonic()
        self.s3.stop()
        time.sleep(seconds)  # the outage itself: the store is down this long
        self.s3.start()
        self.stores.clear()
        up = time.monotonic()
        ok = _wait(lambda: self.progressed_since(versions, by=4), 120)
        self.outages.append((down, time.monotonic() + BACKEND_RECOVERY_S))
        crashed = self.crashed()
        return Injection(int(bool(ok) and not crashed), 1, f"S3 down {seconds:.0f}s; "
                         + (f"crashed: {crashed}" if crashed else "no process crashed"), time.monotonic() - up)

    def postgres_restart(self) -> Injection:
        clusters = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
        local = make_url(self.server_url).host in ("127.0.0.1", "localhost") and shutil.which("pg_ctlcluster")
        if self.pg is None and not (clusters and local):
            return Injection(0, 0, "skipped: no local PostgreSQL cluster to restart")
        versions = self.versions_total()
        started_before = self.postmaster_started()
        down = time.monotonic()
        if self.pg is not None:
            self.pg.halt()
            self.pg.resume()
        else:
            subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", clusters[-1], "main", "restart"], check=True, timeout=120,
                           capture_output=True)
        up = time.monotonic()
        ok = _wait(lambda: self.progressed_since(versions, by=4), 120)
        self.outages.append((down, time.monotonic() + BACKEND_RECOVERY_S))
        # The restart must have hit the server this run's ledger is on, or it proves nothing.
        restarted = self.postmaster_started() != started_before
        crashed = self.crashed()
        detail = f"PostgreSQL restart took {up - down:.1f}s; " + (f"crashed: {crashed}" if crashed else "no process crashed")
        if not restarted:
            detail += "; but the ledger's server was not the one restarted"
        return Injection(int(bool(ok) and restarted and not crashed), 1, detail, time.monotonic() - up)

    def postmaster_started(self) -> object:
        with self.ctx.reading() as s:
            return s.scalar(text("SELECT pg_postmaster_start_time()"))

    def secrets_check(self) -> Injection:
        """The planted credentials appear nowhere: not in any ledger row, not in any process log."""
        places = []
        with self.ctx.reading() as s:
            for table in Base.metadata.sorted_tables:
                for row in s.execute(select(table)):
                    if any(secret in str(v) for v in row for secret in self.secrets):
                        places.append(f"ledger table {table.name}")
                        break
        for path in sorted(self.workdir.glob("*.log")):
            text_ = path.read_text(errors="replace")
            if any(secret in text_ for secret in self.secrets):
                places.append(f"log {path.name}")
        return Injection(int(not places), 1, "found in: " + ", ".join(places) if places
                         else f"{len(self.secrets)} planted secrets in no ledger row and no log", 0.0)

    def bad_submissions(self) -> Injection:
        """Inject every kind of bad submission into the live run; each must be rejected with a reason."""
        store = FragmentStore(self.cfg.storage.url)
        now = to_datetime(time.time())
        with self.ctx.reading() as s:
            specs = runs_q.fragment_specs(s, self.run_id)
            learner = s.get(Learner, (self.run_id, "us-0"))
        shapes = {n: tuple(shape) for n, shape in specs[0]}
        good = {n: torch.full(sh, 1e-4) for n, sh in shapes.items()}

        def put(tensors: dict, uid: str, fragment: int = 0, lid: str = "us-0"):
            enc, meta = encode_delta(tensors, "none")
            return store.put(submission_key(self.run_id, fragment, lid, uid), enc, meta)

        # Blobs first, rows after, in one short transaction: store I/O inside it would hold us-0's row
        # lock, and stall that learner's own exchanges, for as long as the store takes.
        planned: list[tuple[str, str, object, dict, str]] = []  # (case, uid, blob, register kwargs, reason needle)
        b = put(good, "bad-corrupt")
        store.fs.pipe_file(store.path(b.key), b"\x00" * 64)
        # Read no further than the registered size: a blob of another size is refused before its checksum.
        planned.append(("corrupt blob", "bad-corrupt", b, {}, "registered"))
        b = put(good, "bad-truncated")
        data = store.get_bytes(b.key)
        store.fs.pipe_file(store.path(b.key), data[: len(data) // 2])
        planned.append(("truncated blob", "bad-truncated", b, {}, "registered"))
        planned.append(("sha256 mismatch", "bad-sha", put(good, "bad-sha"), {"sha": "0" * 64}, "sha256"))
        planned.append(("wrong shapes", "bad-shape", put({n: torch.zeros(3) for n in shapes}, "bad-shape"), {}, "bad update"))
        planned.append(("wrong dtype", "bad-dtype", put({n: t.to(torch.float64) for n, t in good.items()}, "bad-dtype"), {}, ""))
        planned.append(("NaN values", "bad-nan", put({n: torch.full(sh, float("nan")) for n, sh in shapes.items()}, "bad-nan"), {},
                        "non-finite"))
        planned.append(("Inf values", "bad-inf", put({n: torch.full(sh, float("inf")) for n, sh in shapes.items()}, "bad-inf"), {},
                        "non-finite"))
        planned.append(("huge norm", "bad-huge", put({n: torch.full(sh, 1e6) for n, sh in shapes.items()}, "bad-huge"), {},
                        "norm outlier"))
        planned.append(("unknown fragment", "bad-frag", put(good, "bad-frag", fragment=999), {"fragment": 999}, "does not exist"))
        planned.append(("unknown learner", "bad-ghost", put(good, "bad-ghost", lid="ghost"), {"lid": "ghost"}, "unknown learner"))
        cases: dict[str, tuple[str, str]] = {}
        with self.ctx.transaction() as s:
            base = runs_q.latest_version_numbers(s, self.run_id)[0]

            def register(uid: str, blob, *, fragment: int = 0, lid: str = "us-0", sha: str | None = None, steps: int = 4):
                sub = learner_q.SubmissionIn(uid, fragment, base, steps, 512, 0, learner.inc_tokens_trained, blob.key,
                                     sha or blob.sha256, blob.nbytes, "none")
                return learner_q.register_submission(s, self.run_id, lid, learner.incarnation, sub, now)[0]

            for case, uid, blob, kwargs, needle in planned:
                cases[case] = (register(uid, blob, **kwargs), needle)
        # The same id again with other content: refused, never a silent no-op (its own transaction).
        try:
            with self.ctx.transaction() as s:
                learner_q.register_submission(s, self.run_id, "us-0", learner.incarnation, learner_q.SubmissionIn(
                    "bad-corrupt", 0, base, 4, 512, 0, 0, "x", "0" * 64, 1, "none"), now)
            duplicate_ok = False
        except errors_q.SubmissionConflictError:
            duplicate_ok = True

        def decided() -> bool:
            with self.ctx.reading() as s:
                return all(s.get(Submission, sid).status != "pending" for sid, _ in cases.values())

        _wait(decided, 60)
        survived, details = int(duplicate_ok), []
        with self.ctx.reading() as s:
            for name, (sid, needle) in cases.items():
                row = s.get(Submission, sid)
                ok = row.status == "rejected" and needle in (row.reject_reason or "")
                # float64 where float32 is expected is decoded and converted: accepted, not lost.
                if name == "wrong dtype":
                    ok = row.status in ("rejected", "merged")
                survived += int(ok)
                details.append(f"{name}: {row.status} ({(row.reject_reason or '')[:60]})")
        return Injection(survived, len(cases) + 1, "; ".join(details))

    def hostile_learner(self) -> Injection:
        """A live learner's identity sends lies about its counts and outsized updates (well-formed blobs):
        each refused at registration or rejected with a reason, while the run keeps publishing."""
        store = FragmentStore(self.cfg.storage.url)
        now = to_datetime(time.time())
        with self.ctx.reading() as s:
            specs = runs_q.fragment_specs(s, self.run_id)
            learner = s.get(Learner, (self.run_id, "us-0"))
        fragment = self.cfg.fragments.count - 1
        shapes = {n: tuple(shape) for n, shape in specs[fragment]}
        tps = tokens_per_step(self.cfg.model, self.cfg.learners.batch_size)
        H = self.cfg.fragments.period
        before = self.versions_total()
        # Blobs first, rows after, in one short transaction (as in bad_submissions).
        planned: list[tuple[str, list[tuple[str, object]], int, int, int | None]] = []  # (case, [(uid, blob)], steps, tokens, base)

        def lie(name: str, value: float, c_steps: int, c_tokens: int, *, copies: int = 1, base_version: int | None = None) -> None:
            enc, meta = encode_delta({n: torch.full(sh, value) for n, sh in shapes.items()}, "none")
            blobs = []
            for i in range(copies):
                uid = f"hostile-{len(planned)}-{i}"
                blobs.append((uid, store.put(submission_key(self.run_id, fragment, "us-0", uid), enc, meta)))
            planned.append((name, blobs, c_steps, c_tokens, base_version))

        lie("weight 2^62", 1e-4, 3, 2**62)
        lie("the step turned around (2^40 tokens in 1 step)", -1e-4, 1, 2**40)
        lie("a huge update claiming 10^9 steps", 30.0, 10**9, 10**9 * tps)
        lie("a huge update with plausible counts", 1e3, H, H * tps)
        lie("20 updates of plausible counts, outsized together", 0.5, H, H * tps, copies=20)
        lie("base version -1", 1e-4, H, H * tps, base_version=-1)
        cases: dict[str, tuple[list[int], str]] = {}
        refused = 0
        with self.ctx.transaction() as s:
            base = runs_q.latest_version_numbers(s, self.run_id)[fragment]
            for name, blobs, c_steps, c_tokens, base_version in planned:
                ids = []
                for uid, blob in blobs:
                    try:
                        sub = learner_q.SubmissionIn(uid, fragment, base if base_version is None else base_version, c_steps, c_tokens, 0,
                                                     learner.inc_tokens_trained, blob.key, blob.sha256, blob.nbytes, "none")
                    except ValueError:
                        refused += 1  # refused before it reaches the ledger
                        break
                    ids.append(learner_q.register_submission(s, self.run_id, "us-0", learner.incarnation, sub, now)[0])
                else:
                    cases[name] = (ids, "")

        def decided() -> bool:
            with self.ctx.reading() as s:
                return all(s.get(Submission, sid).status != "pending" for ids, _ in cases.values() for sid in ids)

        _wait(decided, 60)
        survived, details = refused, [f"{refused} refused at registration"]
        with self.ctx.reading() as s:
            for name, (ids, _) in cases.items():
                rows = [s.get(Submission, sid) for sid in ids]
                ok = all(r.status == "rejected" and ("implausible" in (r.reject_reason or "") or "outlier" in (r.reject_reason or ""))
                         for r in rows)
                survived += int(ok)
                details.append(f"{name}: {rows[0].status} ({(rows[0].reject_reason or '')[:50]})")
        publishing = bool(_wait(lambda: self.progressed_since(before, by=self.cfg.fragments.count), 60))
        details.append(f"versions went on: {publishing}")
        return Injection(survived + int(publishing), len(cases) + refused + 1, "; ".join(details))

    def bad_configs(self) -> Injection:
        """Bad configs and CLI input: a clear error naming the field, exit code 2, nothing written."""
        with self.ctx.reading() as s:
            before = s.scalar(select(func.count()).select_from(Learner).where(Learner.run_id == self.run_id))
        cases = {
            "compression.codec": {"compression": {"codec": "zip"}},
            "quorum.min_count": {"quorum": {"min_count": -1}},
            "fragments.count": {"fragments": {"count": 0}},
            "learners.regions.0.speeds": {"learners": {"regions": [{"name": "us", "learners": 1, "speeds": [3.0]}]}},
            "unknown_key": {"unknown_key": 1},
        }
        bad = self.workdir / "bad-input"
        bad.mkdir(exist_ok=True)
        launched: dict[str, tuple[ProcessCluster, subprocess.Popen]] = {}
        for field_name, data in cases.items():
            base = self.cfg.model_dump(mode="json")
            for k, v in data.items():
                base[k] = {**base[k], **v} if isinstance(base.get(k), dict) and isinstance(v, dict) else v
            path = bad / f"{field_name}.yaml"
            path.write_text(yaml.safe_dump(base))
            cluster = ProcessCluster(path, self.run_id, bad, secrets=secret_env(self.cfg))
            launched[field_name] = cluster, cluster.start(field_name, ProcessSpec.learner("us-0"))
        cluster = ProcessCluster(self.config_path, self.run_id, bad, secrets=secret_env(self.cfg))
        launched["../x"] = cluster, cluster.start("bad-id", ProcessSpec.learner("../x"))
        survived = 0
        details = []
        for name, (cluster, proc) in launched.items():
            proc.wait(timeout=120)
            output = cluster.log("bad-id" if name == "../x" else name)
            # The error names the field (or the bad id) and the command exits 2.
            needle = name if name == "../x" else name.split(".")[0]
            ok = proc.returncode == 2 and needle in output
            survived += int(ok)
            details.append(f"{name}: exit {proc.returncode}")
        # Other learners keep submitting meanwhile; what matters is that the bad invocations wrote nothing.
        with self.ctx.reading() as s:
            rogue = s.scalar(select(func.count()).select_from(Learner).where(Learner.run_id == self.run_id, Learner.id == "../x"))
            after = s.scalar(select(func.count()).select_from(Learner).where(Learner.run_id == self.run_id))
        if rogue or after != before:
            details.append(f"learner rows {before} -> {after}")
        return Injection(survived - int(bool(rogue or after != before)), len(cases) + 1, "; ".join(details), 0.0)

    # --- the run -------------------------------------------------------------------------------------

    def run(self) -> SuiteReport:
        started = time.monotonic()
        self.synchronizer("sync-a")
        for k in range(1, self.shards):  # one holder per shard; each takes whichever shard is free
            self.synchronizer(f"sync-a{k}")
        # Learners start at once (they wait for version 0 themselves), so process start-ups overlap.
        for lid, _, _ in self.cfg.learners.learner_ids():
            self.learner(lid)

        def v0() -> bool:
            with self.ctx.reading() as s:
                return len(runs_q.latest_version_numbers(s, self.run_id)) == self.cfg.fragments.count

        if not _wait(v0, 180):
            raise RuntimeError("the synchronizer did not publish version 0")
        # Standbys start only now, so sync-a is the first holder; the learner faults come first,
        # which leaves them the time to start.
        self.synchronizer("sync-b")
        self.synchronizer("sync-c")
        if not _wait(lambda: self.versions_total() >= 8, 240):
            raise RuntimeError("the run did not start merging")
        self.monitor.start()
        self.fault("learner SIGKILL mid-step", lambda: self.kill_learner("us-0", "learner.mid_step"))
        self.fault("learner SIGKILL mid-upload", lambda: self.kill_learner("us-1", "learner.after_blob"))
        self.fault("learner SIGKILL mid-download", lambda: self.kill_learner("eu-0", "learner.after_download"))
        self.fault("learner SIGSTOP past heartbeat timeout, then SIGCONT", lambda: self.pause_learner("us-0"))
        self.fault("synchronizer SIGKILL mid-merge", lambda: self.kill_active_synchronizer("sync.mid_merge"))
        self.fault("synchronizer SIGKILL between blob write and commit", lambda: self.kill_active_synchronizer("sync.before_commit"))
        self.fault("synchronizer SIGKILL during lease renewal", lambda: self.kill_active_synchronizer("sync.renew_lease"))
        self.fault("PostgreSQL restarted mid-run", self.postgres_restart)
        self.fault("object store down", lambda: self.store_outage(8.0 if self.quick else 30.0))
        if not self.quick:
            self.fault("learner SIGKILL at a random moment", lambda: self.kill_learner("us-1", None))
        self.fault("bad submissions", self.bad_submissions)
        self.fault("hostile learner (lying counts, outsized updates)", self.hostile_learner)
        self.fault("bad configs and CLI input", self.bad_configs)
        self.monitor.stop()
        gap, at = self.monitor.longest_gap(self.outages)
        self.report.max_version_gap_s = round(gap, 2)
        if gap > MAX_VERSION_GAP_S:
            self.report.invariants_ok = False
            self.report.problems.append(
                f"no new global version for {gap:.1f}s (from {at - started:.0f}s into the suite) while learners were up"
                f" and the backends were up; at most {MAX_VERSION_GAP_S:.0f}s is allowed")
        self.fault("planted credentials in the ledger or logs", self.secrets_check)
        self.report.seconds = round(time.monotonic() - started, 1)
        return self.report


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run_suite(*, quick: bool, postgres_url: str | None = None, workdir: Path | None = None, shards: int = 1) -> SuiteReport:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="ddiloco-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C, so the run's processes and scratch database are cleaned up.
        signal.signal(signal.SIGTERM, _interrupt)
    with Suite(quick, postgres_url, workdir, shards) as suite:
        return suite.run()


def report_json(report: SuiteReport) -> str:
    return json.dumps(report.to_dict(), indent=2)
