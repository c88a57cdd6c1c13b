"""``ddiloco chaos-suite``: a fault matrix on the real multi-region configuration.

PostgreSQL ledger, an S3 store (moto's S3 server on loopback, through s3fs), learners and
synchronizers as OS processes. Each fault is injected into one live run, the run must recover,
and the invariants are checked after every fault:

- every submission has one fate (merged into a version, rejected with a reason, or pending);
- fragment versions are dense; versions' fencing tokens never go backwards;
- every ledger row points to a blob that exists and verifies;
- tokens trained = merged + rejected + pending + lost + in flight;
- new versions kept appearing while at least K learners were alive.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import yaml
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from ddiloco.platform.compression import encode_delta
from ddiloco.platform.config import RunConfig, build_config
from ddiloco.platform.faults import ARMED_BY_FILE, arm_file
from ddiloco.platform.ids import submission_key
from ddiloco.platform.ledger import make_engine
from ddiloco.platform.ledger import queries as q
from ddiloco.platform.ledger.models import FragmentVersion, Learner, Submission
from ddiloco.platform.runtime import RunContext, to_datetime
from ddiloco.platform.store import FragmentStore

log = logging.getLogger("ddiloco.chaos_suite")

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


# The longest stretch without a new global version the suite accepts while at least K learners are
# up and the backends are up: a standby takes over within one lease TTL plus a poll, and a learner
# sends every few steps; the rest is slack for a loaded 2-core machine.
MAX_VERSION_GAP_S = 12.0
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


def _bare(path: str) -> str:
    """A store path without its protocol, as fsspec listings return it."""
    return path.split("://", 1)[-1].lstrip("/")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.2) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - a backend may be restarting while we look
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval_s)


class S3Server:
    """moto's S3 server on a loopback port, restartable on the same port (its state lives in this process)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = _free_port()
        self._cls = ThreadedMotoServer
        self.server = None

    def start(self) -> None:
        self.server = self._cls(ip_address="127.0.0.1", port=self.port)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Cluster:
    """The run's processes, each started with every fault point of its kind armed by file, so the
    suite chooses which process stops where, and when."""

    LEARNER_POINTS = ("learner.mid_step", "learner.after_blob", "learner.after_download")
    SYNC_POINTS = ("sync.mid_merge", "sync.before_commit", "sync.renew_lease")

    def __init__(self, config_path: Path, run_id: str, logdir: Path) -> None:
        self.config_path, self.run_id, self.logdir = config_path, run_id, logdir
        self.procs: dict[str, subprocess.Popen] = {}

    def fault_dir(self, name: str) -> Path:
        return self.logdir / "faults" / name

    def start(self, name: str, args: list[str], points: tuple[str, ...]) -> None:
        env = dict(os.environ)
        env["DDILOCO_FAULTS"] = ",".join(f"{p}:{ARMED_BY_FILE}" for p in points)
        env["DDILOCO_FAULT_DIR"] = str(self.fault_dir(name))
        log_file = open(self.logdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "ddiloco", *args, "--config", str(self.config_path), "--run", self.run_id],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def learner(self, lid: str) -> None:
        self.start(lid, ["learner", "--learner", lid], self.LEARNER_POINTS)

    def synchronizer(self, label: str) -> None:
        self.start(label, ["synchronizer", "--label", label], self.SYNC_POINTS)

    def arm(self, name: str, point: str) -> None:
        (self.fault_dir(name) / point).unlink(missing_ok=True)
        trigger = arm_file(self.fault_dir(name), point)
        trigger.parent.mkdir(parents=True, exist_ok=True)
        trigger.write_text("")

    def disarm(self, name: str, point: str) -> None:
        arm_file(self.fault_dir(name), point).unlink(missing_ok=True)

    def fault_reached(self, name: str, point: str) -> bool:
        return (self.fault_dir(name) / point).exists()

    def log_text(self, name: str) -> str:
        path = self.logdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


class VersionMonitor(threading.Thread):
    """Samples the number of published versions, to measure the longest stretch without one."""

    def __init__(self, count: Callable[[], int], every_s: float) -> None:
        super().__init__(name="version-monitor", daemon=True)
        self.count, self.every_s = count, every_s
        self.new_version_at: list[float] = []
        self._halt = threading.Event()

    def run(self) -> None:
        last = -1
        while not self._halt.wait(self.every_s):
            try:
                n = self.count()
            except Exception:  # noqa: BLE001 - the ledger may be restarting; the next sample sees it
                continue
            if n > last:
                self.new_version_at.append(time.monotonic())
                last = n

    def stop(self) -> None:
        self._halt.set()
        if self.ident is not None:
            self.join(timeout=10)

    def longest_gap(self, excused: list[tuple[float, float]]) -> tuple[float, float]:
        """(longest gap between new versions that overlaps no excused window, its start)."""
        worst, at = 0.0, 0.0
        for a, b in zip(self.new_version_at, self.new_version_at[1:]):
            if any(a < end and b > start for start, end in excused):
                continue
            if b - a > worst:
                worst, at = b - a, a
        return worst, at


def suite_config(run_id: str, ledger_url: str, bucket: str) -> RunConfig:
    return build_config(
        {
            "name": run_id,
            "token_budget": 10**12,
            "model": {"kind": "gpt", "n_layer": 1, "d_model": 64, "n_head": 4, "seq_len": 64},
            "data": {"max_bytes": 1_000_000, "val_batches": 2},
            "learners": {
                "batch_size": 8, "heartbeat_s": 0.5, "poll_s": 0.3, "dead_after_s": 4.0,
                # Slowed to steps of a realistic length relative to an S3 round trip here.
                "regions": [{"name": "us", "learners": 2, "speeds": [0.25, 0.25]}, {"name": "eu", "learners": 1, "speeds": [0.25]}],
            },
            "fragments": {"count": 4},
            "quorum": {"min_count": 1},
            "grace": {"max_s": 1.0},
            "compression": {"codec": "int8"},
            "synchronizer": {"poll_s": 0.2, "lease_ttl_s": 2.0, "eval_every_s": 1000.0,
                             "retention": {"keep_last": 1_000_000, "keep_submission_blobs": True}},
            "ledger": {"url": ledger_url, "idle_in_transaction_timeout_s": 2.0},
            "storage": {"url": f"s3://{bucket}/runs"},
        }
    )


class Suite:
    def __init__(self, quick: bool, postgres_admin_url: str, workdir: Path) -> None:
        self.quick = quick
        self.admin_url = postgres_admin_url
        self.workdir = workdir
        self.report = SuiteReport()
        self.run_id = f"chaos-{uuid.uuid4().hex[:6]}"
        self.db_name = f"ddiloco_chaos_{uuid.uuid4().hex[:8]}"
        self.outages: list[tuple[float, float]] = []
        self.spare_synchronizers = 0

    # --- set-up ----------------------------------------------------------------------------------

    def __enter__(self) -> "Suite":
        admin = make_engine(self.admin_url).execution_options(isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{self.db_name}"'))
        admin.dispose()
        url = make_url(self.admin_url).set(database=self.db_name)
        # Planted credentials: the security check greps the ledger and every log for them. The
        # S3 server takes any key; a server with password authentication keeps its real password.
        self.secrets = [f"s3-secret-{uuid.uuid4().hex}"]
        if url.password is None:
            url = url.set(password=f"pg-secret-{uuid.uuid4().hex}")
        self.secrets.append(str(url.password))
        self.ledger_url = url.render_as_string(hide_password=False)
        self.s3 = S3Server()
        self.s3.start()
        os.environ.update(AWS_ACCESS_KEY_ID="chaos", AWS_SECRET_ACCESS_KEY=self.secrets[0], AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=self.s3.url)
        import s3fs

        bucket = f"chaos-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        self.cfg = suite_config(self.run_id, self.ledger_url, bucket)
        self.config_path = self.workdir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json")))
        self.cluster = Cluster(self.config_path, self.run_id, self.workdir)
        self.ctx = RunContext.open(self.cfg, self.run_id)
        self.monitor = VersionMonitor(self.versions_total, every_s=0.25)
        return self

    def __exit__(self, *exc: object) -> None:
        # Processes first, whatever else fails: a suite that dies must not leave a run behind.
        try:
            self.cluster.stop_all()
        finally:
            self.monitor.stop()
            self.ctx.engine.dispose()
            self.s3.stop()
            admin = make_engine(self.admin_url).execution_options(isolation_level="AUTOCOMMIT")
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
            admin.dispose()

    # --- observations ------------------------------------------------------------------------------

    def versions_total(self) -> int:
        with self.ctx.reading() as s:
            return sum(q.latest_version_numbers(s, self.run_id).values())

    def learner_row(self, lid: str) -> Learner | None:
        with self.ctx.reading() as s:
            return s.get(Learner, (self.run_id, lid))

    def progressed_since(self, versions_before: int, by: int = 2) -> bool:
        return self.versions_total() >= versions_before + by

    def holder(self) -> str | None:
        with self.ctx.reading() as s:
            lease = q.current_lease(s, self.run_id)
        return lease.holder if lease else None

    def published_by_other_since(self, holder: str, since: float) -> bool:
        """A synchronizer other than ``holder`` published a version at or after ``since`` (epoch s)."""
        with self.ctx.reading() as s:
            newest = s.scalar(select(func.max(FragmentVersion.created_at)).where(
                FragmentVersion.run_id == self.run_id, FragmentVersion.synchronizer != holder))
        return newest is not None and newest.timestamp() >= since

    @staticmethod
    def listed_sizes(store: FragmentStore, prefix: str) -> dict[str, int]:
        try:
            found = store.fs.find(store.path(prefix), detail=True)
        except FileNotFoundError:
            return {}
        return {_bare(path): int(info["size"]) for path, info in found.items()}

    def check_invariants(self, when: str) -> int:
        """Record every broken invariant; returns the number of rows whose data is lost."""
        problems = []
        lost = 0
        # A client of its own for each check: after a store outage, pooled connections are dead.
        store = FragmentStore(self.cfg.storage.url, {"skip_instance_cache": True})
        t0 = time.monotonic()
        with self.ctx.reading() as s:
            versions = s.execute(
                select(FragmentVersion.fragment, FragmentVersion.version, FragmentVersion.lease_token, FragmentVersion.blob_key,
                       FragmentVersion.sha256).where(FragmentVersion.run_id == self.run_id).order_by(FragmentVersion.created_at)
            ).all()
            subs = s.execute(
                select(Submission.id, Submission.status, Submission.blob_key, Submission.sha256, Submission.reject_reason,
                       Submission.nbytes)
                .where(Submission.run_id == self.run_id)
            ).all()
            acct = q.token_accounting(s, self.run_id)
        by_frag: dict[int, list] = {}
        for f, v, token, key, sha in versions:
            by_frag.setdefault(f, []).append((v, token, key, sha))
        for f, rows in by_frag.items():
            vs = sorted(v for v, _, _, _ in rows)
            if vs != list(range(len(vs))):
                problems.append(f"{when}: fragment {f} versions not dense: {vs[:10]}…")
            tokens = [t for _, t, _, _ in sorted(rows, key=lambda r: r[0])]
            if tokens != sorted(tokens):
                problems.append(f"{when}: fragment {f} has a version from a synchronizer that had lost its lease")
            newest = max(rows, key=lambda r: r[0])
            if not store.verify(newest[2], newest[3]):
                problems.append(f"{when}: fragment {f} v{newest[0]} blob missing or corrupt")
                lost += 1
        for sid, status, key, sha, reason, _ in subs:
            if status not in ("pending", "merged", "rejected"):
                problems.append(f"{when}: submission {sid} has no fate ({status})")
            if status == "rejected" and not reason:
                problems.append(f"{when}: submission {sid} rejected without a reason")
        # A pending blob is checked to exist with the size its row records: the
        # synchronizer hashes every blob it merges and rejects a mismatch with a reason, and a full
        # read of hundreds of blobs here would slow the S3 server the run depends on.
        pending = [(sid, key, nbytes) for sid, status, key, _, _, nbytes in subs if status == "pending"]
        t1 = time.monotonic()
        # One listing (after the rows were read: a blob is written before its row) instead of a
        # request per blob.
        sizes = self.listed_sizes(store, f"{self.run_id}/submissions") if pending else {}
        fine = [sizes.get(_bare(store.path(key))) == nbytes for _, key, nbytes in pending]
        log.info("%s: ledger read in %.1fs (%d submissions), %d pending blobs checked in %.1fs", when, t1 - t0, len(subs),
                 len(pending), time.monotonic() - t1)
        for (sid, _, _), ok in zip(pending, fine):
            if not ok:
                problems.append(f"{when}: pending submission {sid} points to a missing blob or one of the wrong size")
                lost += 1
        if not acct.balanced:
            problems.append(f"{when}: token accounting does not balance: {acct}")
            lost += abs(acct.trained - (acct.merged + acct.rejected + acct.pending + acct.lost + acct.in_flight))
        self.report.problems.extend(problems)
        if problems:
            self.report.invariants_ok = False
        return lost

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
        self.cluster.learner(lid)
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
        nothing the dead one half-wrote may show."""
        holder = self.holder()
        if holder is None:
            return Injection(0, 1, "no synchronizer held the lease")
        name = holder.split("@", 1)[0]
        self.cluster.arm(name, point)
        if not _wait(lambda: self.cluster.fault_reached(name, point), 60):
            self.cluster.disarm(name, point)
            return Injection(0, 1, f"{name} never reached {point}")
        killed_at, killed = time.time(), time.monotonic()
        self.cluster.signal(name, signal.SIGKILL)
        ok = _wait(lambda: self.published_by_other_since(holder, killed_at), 60)
        recover = time.monotonic() - killed
        new_holder = self.holder() or "nobody"
        # Keep a standby in reserve for the next fault.
        self.spare_synchronizers += 1
        self.cluster.synchronizer(f"sync-spare{self.spare_synchronizers}")
        return Injection(int(bool(ok)), 1, f"{name} killed at {point}; {new_holder.split('@')[0]} published "
                         f"{recover:.1f}s after the kill" if ok else f"no standby published within 60s of killing {name}", recover)

    def store_outage(self, seconds: float) -> Injection:
        versions = self.versions_total()
        down = time.monotonic()
        self.s3.stop()
        time.sleep(seconds)  # the outage itself: the store is down this long
        self.s3.start()
        up = time.monotonic()
        ok = _wait(lambda: self.progressed_since(versions, by=4), 120)
        self.outages.append((down, time.monotonic() + BACKEND_RECOVERY_S))
        crashed = [n for n, p in self.cluster.procs.items() if p.poll() not in (None, -signal.SIGKILL)]
        return Injection(int(bool(ok) and not crashed), 1, f"S3 down {seconds:.0f}s; "
                         + (f"crashed: {crashed}" if crashed else "no process crashed"), time.monotonic() - up)

    def postgres_restart(self) -> Injection:
        clusters = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
        if not clusters or make_url(self.admin_url).host not in ("127.0.0.1", "localhost") or not shutil.which("pg_ctlcluster"):
            return Injection(0, 0, "skipped: no local PostgreSQL cluster to restart")
        versions = self.versions_total()
        started_before = self.postmaster_started()
        down = time.monotonic()
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", clusters[-1], "main", "restart"], check=True, timeout=120,
                       capture_output=True)
        up = time.monotonic()
        ok = _wait(lambda: self.progressed_since(versions, by=4), 120)
        self.outages.append((down, time.monotonic() + BACKEND_RECOVERY_S))
        # The restart must have hit the server this run's ledger is on, or it proves nothing.
        restarted = self.postmaster_started() != started_before
        crashed = [n for n, p in self.cluster.procs.items() if p.poll() not in (None, -signal.SIGKILL)]
        detail = f"pg_ctlcluster restart took {up - down:.1f}s; " + (f"crashed: {crashed}" if crashed else "no process crashed")
        if not restarted:
            detail += "; but the ledger's server was not the one restarted"
        return Injection(int(bool(ok) and restarted and not crashed), 1, detail, time.monotonic() - up)

    def postmaster_started(self) -> object:
        with self.ctx.reading() as s:
            return s.scalar(text("SELECT pg_postmaster_start_time()"))

    def secrets_check(self) -> Injection:
        """The planted credentials appear nowhere: not in any ledger row, not in any process log."""
        from ddiloco.platform.ledger.models import Base

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
            specs = q.fragment_specs(s, self.run_id)
            learner = s.get(Learner, (self.run_id, "us-0"))
        shapes = {n: tuple(shape) for n, shape in specs[0]}
        good = {n: torch.full(sh, 1e-4) for n, sh in shapes.items()}

        def put(tensors: dict, uid: str, fragment: int = 0, lid: str = "us-0"):
            enc, meta = encode_delta(tensors, "none")
            return store.put(submission_key(self.run_id, fragment, lid, uid), enc, meta)

        cases: dict[str, tuple[str, str]] = {}
        with self.ctx.transaction() as s:
            base = q.latest_version_numbers(s, self.run_id)[0]

            def register(uid: str, blob, *, fragment: int = 0, lid: str = "us-0", sha: str | None = None, steps: int = 4):
                sub = q.SubmissionIn(uid, fragment, base, steps, 512, 0, learner.inc_tokens_trained, blob.key,
                                     sha or blob.sha256, blob.nbytes, "none")
                return q.register_submission(s, self.run_id, lid, learner.incarnation, sub, now)[0]

            b = put(good, "bad-corrupt")
            store.fs.pipe_file(store.path(b.key), b"\x00" * 64)
            cases["corrupt blob"] = (register("bad-corrupt", b), "sha256")
            b = put(good, "bad-truncated")
            data = store.get_bytes(b.key)
            store.fs.pipe_file(store.path(b.key), data[: len(data) // 2])
            cases["truncated blob"] = (register("bad-truncated", b), "sha256")
            b = put(good, "bad-sha")
            cases["sha256 mismatch"] = (register("bad-sha", b, sha="0" * 64), "sha256")
            b = put({n: torch.zeros(3) for n in shapes}, "bad-shape")
            cases["wrong shapes"] = (register("bad-shape", b), "bad update")
            b = put({n: t.to(torch.float64) for n, t in good.items()}, "bad-dtype")
            cases["wrong dtype"] = (register("bad-dtype", b), "")
            b = put({n: torch.full(sh, float("nan")) for n, sh in shapes.items()}, "bad-nan")
            cases["NaN values"] = (register("bad-nan", b), "non-finite")
            b = put({n: torch.full(sh, float("inf")) for n, sh in shapes.items()}, "bad-inf")
            cases["Inf values"] = (register("bad-inf", b), "non-finite")
            b = put({n: torch.full(sh, 1e6) for n, sh in shapes.items()}, "bad-huge")
            cases["huge norm"] = (register("bad-huge", b), "norm outlier")
            b = put(good, "bad-frag", fragment=999)
            cases["unknown fragment"] = (register("bad-frag", b, fragment=999), "does not exist")
            b = put(good, "bad-ghost", lid="ghost")
            cases["unknown learner"] = (register("bad-ghost", b, lid="ghost"), "unknown learner")
            first, _ = q.register_submission(s, self.run_id, "us-0", learner.incarnation, q.SubmissionIn(
                "bad-corrupt", 0, base, 4, 512, 0, 0, "x", "0" * 64, 1, "none"), now)
            duplicate_ok = first == cases["corrupt blob"][0]

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
        invocations: dict[str, list[str]] = {}
        for field_name, data in cases.items():
            path = self.workdir / f"bad-{field_name}.yaml"
            base = self.cfg.model_dump(mode="json")
            for k, v in data.items():
                base[k] = {**base[k], **v} if isinstance(base.get(k), dict) and isinstance(v, dict) else v
            path.write_text(yaml.safe_dump(base))
            invocations[field_name] = ["--config", str(path), "--learner", "us-0"]
        invocations["../x"] = ["--config", str(self.config_path), "--learner", "../x"]
        procs = {
            name: subprocess.Popen([sys.executable, "-m", "ddiloco", "learner", *args], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
            for name, args in invocations.items()
        }
        survived = 0
        details = []
        for name, proc in procs.items():
            output, _ = proc.communicate(timeout=120)
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
        c = self.cluster
        c.synchronizer("sync-a")
        # Learners start at once (they wait for version 0 themselves), so process start-ups overlap.
        for lid, _, _ in self.cfg.learners.learner_ids():
            c.learner(lid)

        def v0() -> bool:
            with self.ctx.reading() as s:
                return len(q.latest_version_numbers(s, self.run_id)) == self.cfg.fragments.count

        if not _wait(v0, 180):
            raise RuntimeError("the synchronizer did not publish version 0")
        # Standbys start only now, so sync-a is the first holder; the learner faults come first,
        # which leaves them the time to start.
        c.synchronizer("sync-b")
        c.synchronizer("sync-c")
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


def run_suite(*, quick: bool, postgres_url: str | None = None, workdir: Path | None = None) -> SuiteReport:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="ddiloco-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C, so the run's processes and scratch database are cleaned up.
        signal.signal(signal.SIGTERM, _interrupt)
    with Suite(quick, postgres_url or os.environ.get("DDILOCO_TEST_POSTGRES_URL") or DEFAULT_POSTGRES, workdir) as suite:
        return suite.run()


def report_json(report: SuiteReport) -> str:
    return json.dumps(report.to_dict(), indent=2)
