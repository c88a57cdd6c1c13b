"""A run's long history written straight into a ledger by bulk inserts (``COPY`` on PostgreSQL), at the schema a
run had before the fragment heads (0003), so that upgrading it in place derives what a real long run's ledger
holds: 8 learners x 24 fragments by default, each version merging two submissions, a few rejected and pending,
heartbeats every 2 s, evaluations every 10 s, the learners' launches and joins and an event per rejection,
GC caught up. ``benchmarks/history_scaling.py`` times the per-step
calls on it; ``tests/test_report_plans.py`` plans the report reads on it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

RUN = "hist"
LEARNERS = 8
FRAGMENTS = 24
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
KEEP_LAST, CHECKPOINT_EVERY = 3, 50
"""The retention GC had applied (newest kept, every this-many kept for good)."""


def _at(seconds: float, sqlite: bool) -> Any:
    t = T0 + timedelta(seconds=seconds)
    return t.strftime("%Y-%m-%d %H:%M:%S.%f") if sqlite else t


def _rows(n: int, sqlite: bool, fragments: int, learners: int) -> dict[str, tuple[list[str], Iterator[tuple]]]:
    """Every table's rows for a run with ``n`` versions per fragment (lazily, so 10 M rows never sit in memory)."""
    at = lambda s: _at(s, sqlite)  # noqa: E731
    false, true = (0, 1) if sqlite else (False, True)
    tokens_of = lambda v: 1 + v * 3 // n  # noqa: E731 - three synchronizer holders over the run

    def versions() -> Iterator[tuple]:
        for v in range(n):
            for f in range(fragments):
                deleted = v < n - KEEP_LAST and v % CHECKPOINT_EVERY != 0
                yield (RUN, f, v, at(v + f / fragments), f"{RUN}/global/f{f}/v{v}", "a" * 64, 1000, f"{RUN}/outer/f{f}/v{v}",
                       "b" * 64, tokens_of(v), f"sync-{tokens_of(v)}", true if deleted else false)

    def merges() -> Iterator[tuple]:
        mid = 0
        for v in range(1, n):
            for f in range(fragments):
                mid += 1
                yield (mid, RUN, f, v, at(v + f / fragments), 1, learners, 2, 0, 1.0, 0.1, 0.01, "quorum", "{}")

    def submissions() -> Iterator[tuple]:
        sid = mid = 0
        total = 2 * fragments * (n - 1)
        for v in range(1, n):
            for f in range(fragments):
                mid += 1
                for k in range(2):
                    sid += 1
                    learner = f"l{(2 * v + f + k) % learners}"
                    t = v + f / fragments - 0.5
                    if sid % 1000 == 0:  # a few rejected along the way
                        yield (sid, RUN, learner, f"u{sid}", f, v - 1, 24, 512, 512, f"s/{sid}", "c" * 64, 1000, "int8", at(t),
                               "rejected", None, None, "stale: based on an old version", at(t + 0.5), None, None, None, true)
                    else:
                        yield (sid, RUN, learner, f"u{sid}", f, v - 1, 24, 512, 512, f"s/{sid}", "c" * 64, 1000, "int8", at(t),
                               "merged", v, mid, None, at(t + 0.5), 1.0, 512.0, v % 3, true if sid < total - 200 else false)
        for k in range(16):  # the backlog a pass finds
            sid += 1
            yield (sid, RUN, f"l{k % learners}", f"u{sid}", k % fragments, n - 1, 24, 512, 512, f"s/{sid}", "c" * 64, 1000, "int8",
                   at(n - 0.2), "pending", None, None, None, None, None, None, None, false)

    def heartbeats() -> Iterator[tuple]:
        for s in range(0, n, 2):
            for i in range(learners):
                yield (RUN, f"l{i}", 0, at(s + i / learners), s, 512 * s, 5.0 / (1 + s / 1000), 512.0, 1.0)

    def evaluations() -> Iterator[tuple]:
        for s in range(0, n, 10):
            yield (RUN, at(s), 512 * s, s * fragments, 5.0 / (1 + s / 1000), None)

    def events() -> Iterator[tuple]:
        yield (RUN, at(-5), "run_created", None, f"{fragments} fragments")
        for i in range(learners):
            yield (RUN, at(-4), "learner_launched", f"l{i}", "start")
            yield (RUN, at(-3), "learner_joined", f"l{i}", "region us")
        for sid in range(1000, 2 * fragments * (n - 1) + 1, 1000):  # the rejected submissions above, by their ids
            v, f = divmod((sid - 1) // 2, fragments)
            yield (RUN, at(v + 1 + f / fragments), "submission_rejected", "sync-1", f"submission {sid}: stale")

    per_learner = 2 * fragments * (n - 1) * 512 // learners
    return {
        "runs": (["id", "created_at", "status", "config_json", "code_version", "num_fragments", "token_budget"],
                 iter([(RUN, at(-5), "running", json.dumps({"learners": {"dead_after_s": 10.0}}), "bench", fragments, 10**15)])),
        "learners": (["run_id", "id", "region", "status", "incarnation", "started_at", "last_heartbeat_at", "step", "tokens_per_s",
                      "step_time_s", "tokens_trained", "tokens_submitted", "tokens_lost", "inc_tokens_trained",
                      "inc_tokens_submitted", "busy_s"],
                     iter([(RUN, f"l{i}", ["us", "eu"][i % 2], "alive", 0, at(-5), at(n), n, 512.0, 1.0, 0, 0, 0,
                            per_learner + 4096, per_learner + 1024, float(n)) for i in range(learners)])),
        "synchronizer_leases": (["run_id", "holder", "token", "acquired_at", "expires_at"],
                                iter([(RUN, "sync-3", 3, at(n * 2 / 3), at(10**9))])),
        "fragment_versions": (["run_id", "fragment", "version", "created_at", "blob_key", "sha256", "nbytes", "state_key",
                               "state_sha256", "lease_token", "synchronizer", "blob_deleted"], versions()),
        "merges": (["id", "run_id", "fragment", "version", "at", "quorum", "live_learners", "included", "rejected",
                    "grace_window_s", "grace_waited_s", "merge_s", "reason", "detail_json"], merges()),
        "submissions": (["id", "run_id", "learner_id", "uid", "fragment", "base_version", "c_steps", "c_tokens", "tokens_new",
                         "blob_key", "sha256", "nbytes", "codec", "created_at", "status", "merged_version", "merge_id",
                         "reject_reason", "decided_at", "weight", "norm", "staleness", "blob_deleted"], submissions()),
        "heartbeats": (["run_id", "learner_id", "incarnation", "at", "step", "tokens", "loss", "tokens_per_s", "step_time_s"],
                       heartbeats()),
        "evaluations": (["run_id", "at", "tokens", "versions_total", "val_loss", "val_accuracy"], evaluations()),
        "events": (["run_id", "at", "kind", "actor", "detail"], events()),
    }


def _chunks(rows: Iterator[tuple], size: int) -> Iterator[list[tuple]]:
    chunk: list[tuple] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def fill(url: str, n: int, *, fragments: int = FRAGMENTS, learners: int = LEARNERS, analyze: bool = True) -> dict[str, float]:
    """A ledger at schema 0003 holding the run with ``n`` versions per fragment; returns seconds and rows.

    ``analyze``: leave table statistics behind (PostgreSQL's VACUUM ANALYZE, SQLite's ANALYZE), as a server's
    autovacuum would; without, SQLite's planner has none."""
    from ddiloco.platform.ledger.engine import make_engine, upgrade

    engine = make_engine(url)
    t0 = time.perf_counter()
    upgrade(engine, "0003")
    sqlite = engine.dialect.name == "sqlite"
    raw = engine.raw_connection()
    rows = 0
    try:
        cur = raw.cursor()
        if sqlite:
            cur.execute("PRAGMA synchronous=OFF")
            cur.execute("BEGIN")
        for table, (columns, data) in _rows(n, sqlite, fragments, learners).items():
            if sqlite:
                sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
                for chunk in _chunks(data, 50_000):
                    cur.executemany(sql, chunk)
                    rows += len(chunk)
            else:
                with cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
                    for row in data:
                        copy.write_row(row)
                        rows += 1
        if not sqlite:
            for table in ("merges", "submissions"):
                cur.execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))")
        raw.commit()
        if not sqlite:
            raw.driver_connection.autocommit = True
            raw.driver_connection.execute("VACUUM ANALYZE" if analyze else "VACUUM")
        else:
            if analyze:
                raw.cursor().execute("ANALYZE")
            # Fold the fill's write-ahead log into the database now, not during the first timed calls.
            raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        raw.close()
        engine.dispose()
    return {"fill_s": time.perf_counter() - t0, "rows": rows}


def migrate(url: str) -> dict[str, float]:
    """Upgrade the filled ledger in place (0003 -> head), then let GC settle what the upgrade left unsettled
    (the checkpoints it keeps for good) as a running synchronizer's first passes would: their seconds."""
    from sqlalchemy import func, select

    from ddiloco.platform.ledger import synchronizer as sync_q
    from ddiloco.platform.ledger.engine import make_engine, session_factory, upgrade
    from ddiloco.platform.ledger.models import GC_VERSIONS, FragmentVersion

    engine = make_engine(url)
    t0 = time.perf_counter()
    try:
        upgrade(engine)
        t1 = time.perf_counter()
        S = session_factory(engine)
        passes = 0
        while True:
            with S.begin() as s:
                before = s.scalar(select(func.count()).select_from(FragmentVersion).where(FragmentVersion.run_id == RUN, GC_VERSIONS))
                sync_q.versions_for_gc(s, RUN, KEEP_LAST, CHECKPOINT_EVERY)
                after = s.scalar(select(func.count()).select_from(FragmentVersion).where(FragmentVersion.run_id == RUN, GC_VERSIONS))
            passes += 1
            if after == before:
                break
        if engine.dialect.name == "sqlite":
            raw = engine.raw_connection()  # outside any transaction (the engine's BEGIN IMMEDIATE would block it)
            try:
                raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                raw.close()
    finally:
        engine.dispose()
    return {"migrate_s": t1 - t0, "gc_settle_s": time.perf_counter() - t1, "gc_settle_passes": passes}
