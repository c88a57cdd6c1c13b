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
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import yaml
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from ddiloco.platform.compression import encode_delta
from ddiloco.platform.config import RunConfig, build_config
from ddiloco.platform.ids import submission_key
from ddiloco.platform.ledger import make_engine
from ddiloco.platform.ledger import queries as q
from ddiloco.platform.ledger.models import FragmentVersion, Learner, Submission
from ddiloco.platform.runtime import RunContext, to_datetime
from ddiloco.platform.store import FragmentStore

log = logging.getLogger("ddiloco.chaos_suite")

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@dataclass
class FaultResult:
    fault: str
    injected: int = 0
    survived: int = 0
    lost: int = 0
    recover_s: float | None = None
    detail: str = ""


@dataclass
class SuiteReport:
    faults: list[FaultResult] = field(default_factory=list)
    invariants_ok: bool = True
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"faults": [asdict(f) for f in self.faults], "invariants_ok": self.invariants_ok, "problems": self.problems}


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
    """The run's processes, each with its own environment (for fault points)."""

    def __init__(self, config_path: Path, run_id: str, logdir: Path) -> None:
        self.config_path, self.run_id, self.logdir = config_path, run_id, logdir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], faults: str | None = None) -> None:
        env = dict(os.environ)
        env.pop("DDILOCO_FAULTS", None)
        if faults:
            env["DDILOCO_FAULTS"] = faults
            env["DDILOCO_FAULT_DIR"] = str(self.logdir / "faults" / name)
        log_file = open(self.logdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "ddiloco", *args, "--config", str(self.config_path), "--run", self.run_id],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def learner(self, lid: str, faults: str | None = None) -> None:
        self.start(lid, ["learner", "--learner", lid], faults)

    def synchronizer(self, label: str, faults: str | None = None) -> None:
        self.start(label, ["synchronizer", "--label", label], faults)

    def fault_reached(self, name: str, point: str) -> bool:
        return (self.logdir / "faults" / name / point).exists()

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
            "ledger": {"url": ledger_url},
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

    # --- set-up ----------------------------------------------------------------------------------

    def __enter__(self) -> "Suite":
        admin = make_engine(self.admin_url).execution_options(isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{self.db_name}"'))
        admin.dispose()
        self.ledger_url = make_url(self.admin_url).set(database=self.db_name).render_as_string(hide_password=False)
        self.s3 = S3Server()
        self.s3.start()
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=self.s3.url)
        import s3fs

        bucket = f"chaos-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        self.cfg = suite_config(self.run_id, self.ledger_url, bucket)
        self.config_path = self.workdir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json")))
        self.cluster = Cluster(self.config_path, self.run_id, self.workdir)
        self.ctx = RunContext.open(self.cfg, self.run_id)
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.stop_all()
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

    def check_invariants(self, when: str) -> int:
        """Record every broken invariant; returns the number of rows whose data is lost."""
        problems = []
        lost = 0
        store = FragmentStore(self.cfg.storage.url)
        with self.ctx.reading() as s:
            versions = s.execute(
                select(FragmentVersion.fragment, FragmentVersion.version, FragmentVersion.lease_token, FragmentVersion.blob_key,
                       FragmentVersion.sha256).where(FragmentVersion.run_id == self.run_id).order_by(FragmentVersion.created_at)
            ).all()
            subs = s.execute(
                select(Submission.id, Submission.status, Submission.blob_key, Submission.sha256, Submission.reject_reason)
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
        for sid, status, key, sha, reason in subs:
            if status not in ("pending", "merged", "rejected"):
                problems.append(f"{when}: submission {sid} has no fate ({status})")
            if status == "rejected" and not reason:
                problems.append(f"{when}: submission {sid} rejected without a reason")
            if status == "pending" and not store.verify(key, sha):
                problems.append(f"{when}: pending submission {sid} points to a missing or bad blob")
                lost += 1
        if not acct.balanced:
            problems.append(f"{when}: token accounting does not balance: {acct}")
            lost += abs(acct.trained - (acct.merged + acct.rejected + acct.pending + acct.lost + acct.in_flight))
        self.report.problems.extend(problems)
        if problems:
            self.report.invariants_ok = False
        return lost

    # --- the faults --------------------------------------------------------------------------------

    def fault(self, name: str, inject: Callable[[], tuple[int, int, str]]) -> None:
        t0 = time.monotonic()
        log.info("fault %s", name)
        try:
            survived, injected, detail = inject()
        except Exception as err:  # noqa: BLE001 - a fault that breaks the suite is a failed fault
            survived, injected, detail = 0, 1, f"suite error: {err!r}"
        recover = time.monotonic() - t0
        lost = self.check_invariants(name)
        self.report.faults.append(FaultResult(name, injected, survived, lost, round(recover, 2), detail))

    def kill_restart_learner(self, lid: str, faults: str | None = None, point: str | None = None) -> tuple[int, int, str]:
        if faults:
            self.cluster.signal(lid, signal.SIGTERM)
            self.cluster.procs[lid].wait(timeout=60)
            self.cluster.learner(lid, faults=faults)
            if not _wait(lambda: self.cluster.fault_reached(lid, point), 120):
                return 0, 1, f"{lid} never reached {point}"
        before = self.learner_row(lid).incarnation
        self.cluster.signal(lid, signal.SIGKILL)
        versions = self.versions_total()
        self.cluster.learner(lid)
        rejoined = _wait(lambda: self.learner_row(lid).incarnation > before and self.learner_row(lid).step > 0, 120)
        progressed = _wait(lambda: self.progressed_since(versions), 60)
        return int(bool(rejoined and progressed)), 1, "rejoined from the newest global state" if rejoined else "did not rejoin"

    def pause_learner(self, lid: str) -> tuple[int, int, str]:
        self.cluster.signal(lid, signal.SIGSTOP)
        versions = self.versions_total()
        dead = _wait(lambda: self.learner_row(lid).status == "dead", 30)
        progressed = _wait(lambda: self.progressed_since(versions), 30)  # the others keep the run going
        self.cluster.signal(lid, signal.SIGCONT)
        step = self.learner_row(lid).step
        back = _wait(lambda: self.learner_row(lid).step > step and self.learner_row(lid).status != "dead", 60)
        return int(bool(dead and progressed and back)), 1, "declared dead while stopped, resumed after SIGCONT"

    def holder(self) -> str | None:
        with self.ctx.reading() as s:
            lease = q.current_lease(s, self.run_id)
        return lease.holder if lease else None

    def kill_active_synchronizer(self, point: str) -> tuple[int, int, str]:
        """Hand the lease to a standby armed with a fault point, let it stop there, SIGKILL it: a
        second standby must take over and publish."""
        old = self.holder()
        armed = f"sync-{uuid.uuid4().hex[:4]}"
        self.cluster.synchronizer(armed, faults=f"{point}:2")
        self.cluster.signal(old.split("@", 1)[0], signal.SIGTERM)  # a clean hand-over: it releases the lease
        if not _wait(lambda: (self.holder() or "").startswith(f"{armed}@"), 120):
            return 0, 1, f"{armed} did not take the lease"
        standby = f"sync-{uuid.uuid4().hex[:4]}"
        self.cluster.synchronizer(standby)
        if not _wait(lambda: self.cluster.fault_reached(armed, point), 120):
            return 0, 1, f"{armed} never reached {point}"
        killed_at = time.time()
        self.cluster.signal(armed, signal.SIGKILL)

        def standby_published() -> bool:
            with self.ctx.reading() as s:
                newest = s.scalar(select(func.max(FragmentVersion.created_at)).where(
                    FragmentVersion.run_id == self.run_id, FragmentVersion.synchronizer.like(f"{standby}@%")))
            return newest is not None and newest.timestamp() >= killed_at

        ok = _wait(standby_published, 60)
        return int(bool(ok)), 1, f"killed at {point}; the standby published {time.time() - killed_at:.1f}s after the kill"

    def store_outage(self, seconds: float) -> tuple[int, int, str]:
        versions = self.versions_total()
        self.s3.stop()
        time.sleep(seconds)  # the outage itself: the store is down this long
        self.s3.start()
        ok = _wait(lambda: self.progressed_since(versions, by=4), 120)
        return int(bool(ok)), 1, f"S3 down {seconds:.0f}s"

    def postgres_restart(self) -> tuple[int, int, str]:
        clusters = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
        if not clusters or make_url(self.admin_url).host not in ("127.0.0.1", "localhost"):
            return 0, 0, "skipped: no local PostgreSQL cluster to restart"
        versions = self.versions_total()
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", clusters[-1], "main", "restart"], check=True, timeout=120)
        ok = _wait(lambda: self.progressed_since(versions, by=4), 120)
        return int(bool(ok)), 1, "pg_ctlcluster restart mid-run"

    def bad_submissions(self) -> tuple[int, int, str]:
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
        return survived, len(cases) + 1, "; ".join(details)

    def bad_configs(self) -> tuple[int, int, str]:
        """Bad configs and CLI input: a clear error naming the field, exit code 2, nothing written."""
        with self.ctx.reading() as s:
            before = s.scalar(select(func.count()).select_from(Submission))
        cases = {
            "compression.codec": {"compression": {"codec": "zip"}},
            "quorum.min_count": {"quorum": {"min_count": -1}},
            "fragments.count": {"fragments": {"count": 0}},
            "learners.regions.0.speeds": {"learners": {"regions": [{"name": "us", "learners": 1, "speeds": [3.0]}]}},
            "unknown_key": {"unknown_key": 1},
        }
        survived = 0
        details = []
        for field_name, data in cases.items():
            path = self.workdir / f"bad-{field_name}.yaml"
            base = self.cfg.model_dump(mode="json")
            for k, v in data.items():
                base[k] = {**base[k], **v} if isinstance(base.get(k), dict) and isinstance(v, dict) else v
            path.write_text(yaml.safe_dump(base))
            out = subprocess.run([sys.executable, "-m", "ddiloco", "learner", "--config", str(path), "--learner", "us-0"],
                                 capture_output=True, text=True, timeout=120)
            ok = out.returncode == 2 and field_name.split(".")[0] in out.stderr + out.stdout
            survived += int(ok)
            details.append(f"{field_name}: exit {out.returncode}")
        out = subprocess.run([sys.executable, "-m", "ddiloco", "learner", "--config", str(self.config_path), "--learner", "../x"],
                             capture_output=True, text=True, timeout=120)
        ok = out.returncode == 2 and "../x" in out.stderr + out.stdout
        survived += int(ok)
        details.append(f"learner id '../x': exit {out.returncode}")
        with self.ctx.reading() as s:
            after = s.scalar(select(func.count()).select_from(Submission))
        # Other learners keep submitting meanwhile; what matters is no row from the bad invocations.
        with self.ctx.reading() as s:
            rogue = s.scalar(select(func.count()).select_from(Learner).where(Learner.run_id == self.run_id, Learner.id == "../x"))
        del before, after
        return survived - int(bool(rogue)), len(cases) + 1, "; ".join(details)

    # --- the run -------------------------------------------------------------------------------------

    def run(self) -> SuiteReport:
        c = self.cluster
        c.synchronizer("sync-a")

        def v0() -> bool:
            with self.ctx.reading() as s:
                return len(q.latest_version_numbers(s, self.run_id)) == self.cfg.fragments.count

        if not _wait(v0, 180):
            raise RuntimeError("the synchronizer did not publish version 0")
        for lid, _, _ in self.cfg.learners.learner_ids():
            c.learner(lid)
        if not _wait(lambda: self.versions_total() >= 8, 240):
            raise RuntimeError("the run did not start merging")
        self.fault("learner SIGKILL mid-step", lambda: self.kill_restart_learner("us-0"))
        self.fault("learner SIGKILL mid-upload", lambda: self.kill_restart_learner("us-1", "learner.after_blob:3", "learner.after_blob"))
        self.fault("learner SIGSTOP past heartbeat timeout, then SIGCONT", lambda: self.pause_learner("eu-0"))
        self.fault("synchronizer SIGKILL mid-merge", lambda: self.kill_active_synchronizer("sync.mid_merge"))
        self.fault("synchronizer SIGKILL between blob write and commit", lambda: self.kill_active_synchronizer("sync.before_commit"))
        self.fault("object store down", lambda: self.store_outage(8.0 if self.quick else 30.0))
        if not self.quick:
            self.fault("learner SIGKILL mid-download", lambda: self.kill_restart_learner("eu-0"))
            self.fault("PostgreSQL restarted mid-run", self.postgres_restart)
        self.fault("bad submissions", self.bad_submissions)
        self.fault("bad configs and CLI input", self.bad_configs)
        return self.report


def run_suite(*, quick: bool, postgres_url: str | None = None, workdir: Path | None = None) -> SuiteReport:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="ddiloco-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with Suite(quick, postgres_url or os.environ.get("DDILOCO_TEST_POSTGRES_URL") or DEFAULT_POSTGRES, workdir) as suite:
        return suite.run()


def report_json(report: SuiteReport) -> str:
    return json.dumps(report.to_dict(), indent=2)
