"""The ledger's rules under real concurrency: several OS processes (spawned) hit one ledger at once.

Workers are module-level functions so the "spawn" context can import them; they report back
through a Queue. Processes start together on a Barrier; nothing waits on sleeps.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import random
import time
import traceback
from datetime import datetime, timezone

import pytest
from sqlalchemy import select

from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import MERGED, Event, FragmentVersion, Merge, Run, Submission

pytestmark = pytest.mark.slow

CTX = mp.get_context("spawn")
RUN = "race"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
BLOB = sync_q.BlobRef("race/global/f0/v.safetensors", "a" * 64, 1)
JOIN_TIMEOUT = 60


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _sub(uid: str, fragment: int = 0, tokens_total: int = 10) -> learner_q.SubmissionIn:
    return learner_q.SubmissionIn(uid, fragment, 0, 1, 10, 10, tokens_total, f"k/{uid}", "c" * 64, 1, "int8")


def _setup(url: str, *, learners: int = 1, lease_holder: str | None = None, lease_ttl: float = 3600) -> int | None:
    engine = open_ledger(url)
    try:
        with session_factory(engine).begin() as s:
            runs_q.create_run(s, RUN, config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=1, now=T0)
            for i in range(learners):
                learner_q.register_learner(s, RUN, f"l{i}", "us", T0)
            if lease_holder:
                return sync_q.acquire_lease(s, RUN, lease_holder, lease_ttl, _now())
    finally:
        engine.dispose()
    return None


class WorkerPool:
    """Long-lived spawned processes, reused by every test here (a spawn costs ~2 s of imports).

    Each task names a worker function of this module; the workers given a task are released
    together by a Barrier and report through a Queue."""

    SIZE = 4

    def __init__(self) -> None:
        self.barriers = {n: CTX.Barrier(n) for n in (3, 4)}
        self.results = CTX.Queue()
        self.inboxes = [CTX.Queue() for _ in range(self.SIZE)]
        self.procs = [
            CTX.Process(target=_pool_worker, args=(i, self.inboxes[i], self.results, self.barriers), daemon=True)
            for i in range(self.SIZE)
        ]
        for p in self.procs:
            p.start()

    def run(self, target, args_per_worker: list[tuple], timeout: float = JOIN_TIMEOUT) -> list:
        n = len(args_per_worker)
        assert n in self.barriers
        for i, args in enumerate(args_per_worker):
            self.inboxes[i].put((target.__name__, n, args))
        out: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(out) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"workers timed out; results from {sorted(out)}")
            try:
                idx, ok, value = self.results.get(timeout=remaining)
            except queue_mod.Empty:
                continue
            if not ok:
                raise AssertionError(f"worker {idx} failed:\n{value}")
            out[idx] = value
        return [out[i] for i in range(n)]

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(5)


_LINE = None
"""The pool's barrier of the task under way, in a worker process."""


def _pool_worker(idx, inbox, results, barriers) -> None:
    while True:
        task = inbox.get()
        if task is None:
            return
        name, parties, args = task
        try:
            engine = open_ledger(args[0], migrate=False)
            try:
                S = session_factory(engine)
                with S() as s:  # connect before the start line, so the race is on the queries
                    s.execute(select(Run.id)).all()
                barriers[parties].wait(timeout=JOIN_TIMEOUT)
                globals()["_LINE"] = barriers[parties]  # a task may line the processes up again (see _publish_race)
                value = globals()[name](S, idx, *args[1:])
            finally:
                engine.dispose()
            results.put((idx, True, value))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((idx, False, traceback.format_exc()))


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool()
    try:
        yield p
    finally:
        p.close()


# --- (a) the same submissions registered by 4 processes ------------------------------------------------


LEARNERS = 8


def _register_same(S, idx: int, n: int) -> int:
    """Register submissions 0..n-1 (submission i belongs to learner l{i % LEARNERS}), one per transaction."""
    created = 0
    order = list(range(n))
    random.Random(idx).shuffle(order)  # different orders make the collisions land everywhere
    for i in order:
        learner, nth = f"l{i % LEARNERS}", i // LEARNERS
        with S.begin() as s:
            _, was_created = learner_q.register_submission(
                s, RUN, learner, 0, _sub(f"u{i:04d}", fragment=i % 3, tokens_total=10 * (nth + 1)), _now()
            )
            created += was_created
    return created


def test_concurrent_registration_of_same_uids(pool, ledger_url):
    _setup(ledger_url, learners=LEARNERS)
    created = pool.run(_register_same, [(ledger_url, 200)] * 4)
    assert sum(created) == 200  # every uid was "created" by exactly one process
    engine = open_ledger(ledger_url, migrate=False)
    try:
        with session_factory(engine)() as s:
            uids = s.scalars(select(Submission.uid)).all()
            assert len(uids) == 200 and len(set(uids)) == 200
            assert sum(sync_q.pending_counts(s, RUN).values()) == 200
            acct = reports_q.token_accounting(s, RUN)
            assert acct.pending == 2000 and acct.balanced  # tokens counted once per uid
    finally:
        engine.dispose()


# --- (b) 4 processes publish the next version of one fragment ----------------------------------------


def _publish_race(S, idx: int, token: int, wins_wanted: int) -> dict:
    from sqlalchemy.exc import IntegrityError, OperationalError

    wins, conflicts = [], 0
    while len(wins) < wins_wanted:
        with S() as s:  # read, then publish in another transaction: as a synchronizer that merged meanwhile
            latest = runs_q.latest_version_numbers(s, RUN).get(0, -1)
        if not wins and not conflicts:
            # The first attempt of every process publishes the same version: a collision however the OS schedules
            # them (a quiet machine once ran all four one after another, and nothing collided).
            _LINE.wait(timeout=JOIN_TIMEOUT)
        try:
            with S.begin() as s:
                sync_q.publish_version(s, RUN, 0, latest + 1, blob=BLOB, state=BLOB, holder="sync", token=token, now=_now())
            wins.append(latest + 1)
        except (errors_q.VersionConflictError, IntegrityError, OperationalError):
            conflicts += 1
    return {"wins": wins, "conflicts": conflicts}


def test_concurrent_publish_is_dense(pool, ledger_url):
    token = _setup(ledger_url, lease_holder="sync")
    results = pool.run(_publish_race, [(ledger_url, token, 50)] * 4)
    wins = sorted(v for r in results for v in r["wins"])
    assert wins == list(range(200))  # no version claimed by two processes
    assert sum(r["conflicts"] for r in results) > 0  # the processes did collide
    engine = open_ledger(ledger_url, migrate=False)
    try:
        with session_factory(engine)() as s:
            versions = s.scalars(select(FragmentVersion.version).where(FragmentVersion.fragment == 0)).all()
        assert sorted(versions) == list(range(200))
    finally:
        engine.dispose()


# --- (c) 4 processes merge overlapping sets of the same pending submissions -------------------------------


def _merge_race(S, idx: int, token: int, ids: list[int]) -> dict:
    """Merge `ids` in small batches, in this process's order. No look before the leap: a batch is
    tried as it is, and only a refusal (AlreadyDecidedError) makes the process re-read what is pending."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    rng = random.Random(idx)
    merged: list[int] = []
    refused = 0
    remaining = list(ids)
    while remaining:
        batch = remaining[: rng.randint(1, 4)]
        with S() as s:
            latest = runs_q.latest_version_numbers(s, RUN).get(0, -1)
        try:
            with S.begin() as s:
                sync_q.publish_version(
                    s, RUN, 0, latest + 1, blob=BLOB, state=BLOB, holder="sync", token=token, now=_now(),
                    merged=[sync_q.MergedIn(i, 1.0, 1.0, 0) for i in batch],
                    record=sync_q.MergeRecord(1, 4, 0.0, 0.0, 0.0, f"worker {idx}", {}),
                )
            merged.extend(batch)
            remaining = remaining[len(batch):]
        except errors_q.AlreadyDecidedError:
            refused += 1  # rolled back as a whole: nothing of this batch was merged
            with S() as s:
                pending = {x.id for x in sync_q.pending_submissions(s, RUN, 0)}
            remaining = [i for i in remaining if i in pending]
        except (errors_q.VersionConflictError, IntegrityError, OperationalError):
            pass  # someone published first: re-read the latest version and try again
    return {"merged": merged, "refused": refused}


def test_concurrent_merges_merge_each_submission_once(pool, ledger_url):
    token = _setup(ledger_url, lease_holder="sync")
    engine = open_ledger(ledger_url, migrate=False)
    S = session_factory(engine)
    try:
        with S.begin() as s:
            sync_q.publish_version(s, RUN, 0, 0, blob=BLOB, state=BLOB, holder="sync", token=token, now=_now())
            ids = [learner_q.register_submission(s, RUN, "l0", 0, _sub(f"s{i}"), T0)[0] for i in range(120)]
        orders = [ids[k * 30:] + ids[: k * 30] for k in range(4)]  # same ids, overlapping windows
        results = pool.run(_merge_race, [(ledger_url, token, order) for order in orders])
        claimed = [i for r in results for i in r["merged"]]
        assert sorted(claimed) == sorted(ids)  # every submission claimed by exactly one process
        # Each process walks all 120 ids until refused, so unless one process merged everything
        # alone, some merge of an already-merged submission was attempted — and refused.
        assert sum(r["refused"] for r in results) >= 1
        with S() as s:
            rows = s.scalars(select(Submission)).all()
            assert all(r.status == MERGED and r.merged_version is not None for r in rows)
            merges = s.scalars(select(Merge)).all()
            per_version = {}
            for r in rows:
                per_version[r.merged_version] = per_version.get(r.merged_version, 0) + 1
            assert {m.version: m.included for m in merges} == per_version
            assert sorted(runs_q.latest_version_numbers(s, RUN).values()) == [len(merges)]
    finally:
        engine.dispose()


# --- (d) 3 processes contend for a short lease -------------------------------------------------------


TTL = 0.15
MIN_TOKENS = 4


def _lease_contend(S, idx: int, duration: float, seed: int) -> dict:
    from sqlalchemy.exc import IntegrityError, OperationalError

    rng = random.Random(seed * 10 + idx)
    holder = f"sync-{idx}"
    held: dict[int, list[float]] = {}  # token -> [first acquired, last believed expiry] (epoch seconds)
    publishes: list[tuple[int, int, float]] = []
    fenced = 0
    stale_published = 0
    start = time.time()
    newest = 0  # newest token this process has seen
    # ~`duration` seconds; on a loaded machine go on (up to 3x) until a few takeovers have happened.
    while (t := time.time()) < start + duration or (newest < MIN_TOKENS and t < start + 3 * duration):
        now = _now()
        with S.begin() as s:
            token = sync_q.acquire_lease(s, RUN, holder, TTL, now)
        if token is None:
            with S() as s:
                lease = sync_q.current_lease(s, RUN)
                newest = max(newest, lease.token if lease else 0)
            time.sleep(0.01)  # standby poll interval
            continue
        newest = max(newest, token)
        span = held.setdefault(token, [now.timestamp(), 0.0])
        span[1] = max(span[1], now.timestamp() + TTL)
        # Do some "work": publish the next version under the fencing token.
        try:
            with S.begin() as s:
                latest = runs_q.latest_version_numbers(s, RUN).get(0, -1)
                pub_now = _now()
                sync_q.publish_version(s, RUN, 0, latest + 1, blob=BLOB, state=BLOB, holder=holder, token=token, now=pub_now)
            publishes.append((token, latest + 1, pub_now.timestamp()))
        except errors_q.LeaseLostError:
            fenced += 1
        except (errors_q.VersionConflictError, IntegrityError, OperationalError):
            pass
        if rng.random() < 0.3:
            # Stall past the TTL without renewing, then wake up and try to publish with the old token.
            # (A paused process — GC pause, lost network — simulated by sleeping; not used to synchronise.)
            stall_until = span[1] + TTL * rng.uniform(0.2, 1.0)
            while time.time() < stall_until:
                time.sleep(0.005)
            try:
                with S.begin() as s:
                    latest = runs_q.latest_version_numbers(s, RUN).get(0, -1)
                    sync_q.publish_version(s, RUN, 0, latest + 1, blob=BLOB, state=BLOB, holder=holder, token=token, now=_now())
                stale_published += 1
            except errors_q.LeaseLostError:
                fenced += 1
    return {"holder": holder, "held": held, "publishes": publishes, "fenced": fenced, "stale_published": stale_published}


def test_lease_contention_single_holder_and_fencing(pool, ledger_url):
    _setup(ledger_url)
    results = pool.run(_lease_contend, [(ledger_url, 2.0, 1)] * 3)

    # Tokens a process believed it held: each token believed by exactly one process.
    owner: dict[int, str] = {}
    spans: dict[int, list[float]] = {}
    for r in results:
        for token, span in r["held"].items():
            assert token not in owner, f"token {token} believed held by {owner[token]} and {r['holder']}"
            owner[token] = r["holder"]
            spans[token] = span
    tokens = sorted(owner)
    assert len(tokens) >= MIN_TOKENS - 1, f"too little contention to test anything: tokens {tokens}"
    assert len({owner[t] for t in tokens}) >= 2

    # At every instant at most one holder: belief windows of successive tokens do not overlap.
    for a, b in zip(tokens, tokens[1:]):
        assert a < b
        assert spans[a][1] <= spans[b][0] + 1e-6, f"token {a} ({owner[a]}) until {spans[a][1]}, token {b} ({owner[b]}) from {spans[b][0]}"

    # Every stalled process that woke up after its lease expired was fenced off.
    assert all(r["stale_published"] == 0 for r in results)
    assert sum(r["fenced"] for r in results) >= 1

    engine = open_ledger(ledger_url, migrate=False)
    try:
        with session_factory(engine)() as s:
            acquired = s.scalars(select(Event).where(Event.kind == "lease_acquired").order_by(Event.id)).all()
            ledger_tokens = [int(e.detail.split(";")[0].split()[1]) for e in acquired]
            # The events table: tokens strictly increasing by one, each with the holder that believed it.
            assert ledger_tokens == list(range(1, len(ledger_tokens) + 1))
            assert {t: e.actor for t, e in zip(ledger_tokens, acquired)} == owner
            assert [e.at for e in acquired] == sorted(e.at for e in acquired)
            # Every published version came from the token's holder, within its lease window.
            versions = s.scalars(select(FragmentVersion).order_by(FragmentVersion.version)).all()
            assert [v.version for v in versions] == list(range(len(versions)))
            assert len(versions) == sum(len(r["publishes"]) for r in results) > 0
            for v in versions:
                assert owner[v.lease_token] == v.synchronizer
                start, end = spans[v.lease_token]
                assert start <= v.created_at.timestamp() < end
            assert [v.lease_token for v in versions] == sorted(v.lease_token for v in versions)
    finally:
        engine.dispose()
