"""Ledger throughput: many learners registering submissions while a synchronizer polls and claims them.

Simulates --learners learners x --fragments fragments. --workers OS processes register submissions for
disjoint sets of learners, in two modes:
  * one_per_tx: one submission per transaction — the honest unit (a learner registers each fragment
    as soon as its blob is uploaded);
  * batch: --fragments submissions per transaction (one learner sending every fragment at once).
Meanwhile one synchronizer process loops: poll (ledger.synchronizer.pending_counts, the synchronizer's poll, timed
through its read-write engine and through a read-only engine), then claim every pending submission of
the readiest fragment with publish_version (one transaction per merge). A separate poller process
runs the same poll every --poll-interval s, so the poll's p50/p99 have enough samples even when a
merge takes seconds.

Reports submissions/s registered, claims/s (submissions marked merged) and publishes/s, and p50/p99
poll latency, on SQLite and PostgreSQL (a fresh database on the local server, dropped afterwards).

    python benchmarks/ledger_throughput.py --learners 1000 --fragments 24 --backends sqlite,postgres \\
        --json benchmarks/results/ledger.json
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, header, verdict, write_results  # noqa: E402

from ddiloco.testing.postgres import scratch_database, server_url  # noqa: E402

GOAL_SUBMISSIONS_PER_S = 2000
GOAL_P99_POLL_MS = 50.0
RUN = "bench"
HOLDER = "bench-sync"
CTX = mp.get_context("spawn")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _blob(key: str):
    from ddiloco.platform.ledger import synchronizer as sync_q

    return sync_q.BlobRef(key, "0" * 64, 1)


# --- processes -----------------------------------------------------------------------------------------
#
# The processes are spawned once (a spawn costs seconds of imports on a small machine) and run every
# phase in turn: for each phase they meet at the barrier, run for `seconds`, report, and go on.


def learner_worker(phases: list[tuple[str, bool]], learners: list[str], fragments: int, seconds: float, barrier, out) -> None:
    try:
        from ddiloco.platform.ledger import learner as learner_q
        from ddiloco.platform.ledger import open_ledger, session_factory
        from ddiloco.platform.ledger import runs as runs_q

        for phase, (url, batch) in enumerate(phases):
            engine = open_ledger(url, migrate=False)
            S = session_factory(engine)
            with S() as s:
                runs_q.get_run(s, RUN)  # connect before the start line
            state = {lid: [0, 0] for lid in learners}  # learner -> [sequence number, tokens so far]
            per_tx = fragments if batch else 1
            barrier.wait(timeout=300)
            t0 = time.perf_counter()
            deadline = t0 + seconds
            subs = txs = 0
            i = 0
            while time.perf_counter() < deadline:
                lid = learners[i % len(learners)]
                i += 1
                st = state[lid]
                with S.begin() as s:
                    now = _now()
                    batch_subs = []
                    for _ in range(per_tx):
                        seq = st[0]
                        st[0] += 1
                        st[1] += 512
                        frag = seq % fragments
                        uid = f"p{phase}s{seq}"
                        key = f"{RUN}/submissions/f{frag}/{lid}/{uid}.safetensors"
                        batch_subs.append(learner_q.SubmissionIn(uid, frag, 0, 1, 512, 512, st[1], key, "0" * 64, 1024, "int4"))
                    # What a learner's upload thread does with whatever it has queued: one statement.
                    learner_q.register_submissions(s, RUN, lid, 0, batch_subs, now)
                subs += per_tx
                txs += 1
            elapsed = time.perf_counter() - t0
            engine.dispose()
            out.put(("learners", phase, {"submissions": subs, "transactions": txs, "elapsed_s": elapsed}))
    except BaseException:  # noqa: BLE001
        out.put(("error", -1, traceback.format_exc()))


def synchronizer_worker(phases: list[tuple[str, bool]], token: int, fragments: int, seconds: float, barrier, out) -> None:
    try:
        from ddiloco.platform.ledger import make_engine, open_ledger, session_factory
        from ddiloco.platform.ledger import runs as runs_q
        from ddiloco.platform.ledger import synchronizer as sync_q

        versions_by_url: dict[str, dict[int, int]] = {}
        for phase, (url, _batch) in enumerate(phases):
            versions = versions_by_url.setdefault(url, {f: 0 for f in range(fragments)})
            engine = open_ledger(url, migrate=False)
            S = session_factory(engine)
            # The same poll through a read-only engine (SQLite: a deferred BEGIN that does not queue
            # behind writers for the write lock); on PostgreSQL the two are the same.
            ro_engine = make_engine(url, read_only=True)
            R = session_factory(ro_engine)
            for factory in (S, R):
                with factory() as s:
                    runs_q.get_run(s, RUN)
            barrier.wait(timeout=300)
            t0 = time.perf_counter()
            deadline = t0 + seconds
            polls: list[float] = []
            polls_ro: list[float] = []
            claims = publishes = 0
            while time.perf_counter() < deadline:
                p0 = time.perf_counter()
                with R() as s:
                    sync_q.pending_counts(s, RUN)
                polls_ro.append((time.perf_counter() - p0) * 1000)
                p0 = time.perf_counter()
                with S() as s:
                    counts = sync_q.pending_counts(s, RUN)
                polls.append((time.perf_counter() - p0) * 1000)
                # Claim the readiest fragment (quorum K = 1), then poll again.
                ready = [(n, f) for f, n in counts.items() if n >= 1]
                if ready and time.perf_counter() < deadline:
                    fragment = max(ready)[1]
                    m0 = time.perf_counter()
                    with S.begin() as s:
                        pending = sync_q.pending_submissions(s, RUN, fragment)
                        version = versions[fragment] + 1
                        sync_q.publish_version(
                            s, RUN, fragment, version,
                            blob=_blob(f"{RUN}/global/f{fragment}/v{version}.safetensors"),
                            state=_blob(f"{RUN}/outer/f{fragment}/v{version}.safetensors"),
                            holder=HOLDER, token=token, now=_now(),
                            merged=[sync_q.MergedIn(p.id, float(p.c_tokens), 1.0, 0) for p in pending],
                            record=sync_q.MergeRecord(1, 0, 0.0, 0.0, time.perf_counter() - m0, "bench", {}),
                        )
                    versions[fragment] = version
                    claims += len(pending)
                    publishes += 1
            elapsed = time.perf_counter() - t0
            engine.dispose()
            ro_engine.dispose()
            figures = {"claims": claims, "publishes": publishes, "polls_ms": polls, "polls_ro_ms": polls_ro, "elapsed_s": elapsed}
            out.put(("sync", phase, figures))
    except BaseException:  # noqa: BLE001
        out.put(("error", -1, traceback.format_exc()))


def poller_worker(phases: list[tuple[str, bool]], seconds: float, interval: float, barrier, out) -> None:
    """The poll on its own, every `interval` s (as a synchronizer between merges, or a standby):
    enough samples for a p99 however long the merges take."""
    try:
        from ddiloco.platform.ledger import open_ledger, session_factory
        from ddiloco.platform.ledger import runs as runs_q
        from ddiloco.platform.ledger import synchronizer as sync_q

        for phase, (url, _batch) in enumerate(phases):
            engine = open_ledger(url, migrate=False)
            S = session_factory(engine)
            with S() as s:
                runs_q.get_run(s, RUN)
            barrier.wait(timeout=300)
            t0 = time.perf_counter()
            polls: list[float] = []
            next_poll = t0
            while time.perf_counter() < t0 + seconds:
                p0 = time.perf_counter()
                with S() as s:
                    sync_q.pending_counts(s, RUN)
                polls.append((time.perf_counter() - p0) * 1000)
                next_poll += interval
                time.sleep(max(0.0, next_poll - time.perf_counter()))  # the poll interval, not synchronisation
            engine.dispose()
            out.put(("poller", phase, {"polls_ms": polls}))
    except BaseException:  # noqa: BLE001
        out.put(("error", -1, traceback.format_exc()))


# --- set-up and the run ------------------------------------------------------------------------------------


def setup_ledger(url: str, learners: int, fragments: int) -> tuple[list[str], int]:
    """A run, its learners (bulk-inserted: set-up is not what is measured), the lease and v0 of every fragment."""
    from sqlalchemy import insert

    from ddiloco.platform.ledger import open_ledger, session_factory
    from ddiloco.platform.ledger import runs as runs_q
    from ddiloco.platform.ledger import synchronizer as sync_q
    from ddiloco.platform.ledger.models import Learner

    engine = open_ledger(url)
    S = session_factory(engine)
    now = _now()
    ids = [f"l{i:05d}" for i in range(learners)]
    zero = dict(
        status="alive",
        incarnation=0,
        started_at=now,
        last_heartbeat_at=now,
        step=0,
        tokens_per_s=0.0,
        step_time_s=0.0,
        tokens_trained=0,
        tokens_submitted=0,
        tokens_lost=0,
        inc_tokens_trained=0,
        inc_tokens_submitted=0,
        busy_s=0.0,
    )
    with S.begin() as s:
        runs_q.create_run(
            s, RUN, config_json="{}", code_version="bench", git_commit=None, num_fragments=fragments, token_budget=10**12, now=now
        )
        s.execute(insert(Learner), [dict(run_id=RUN, id=lid, region="bench", **zero) for lid in ids])
        token = sync_q.acquire_lease(s, RUN, HOLDER, 24 * 3600, now)
    with S.begin() as s:
        for f in range(fragments):
            sync_q.publish_version(s, RUN, f, 0, blob=_blob(f"g{f}"), state=_blob(f"o{f}"), holder=HOLDER, token=token, now=now)
    engine.dispose()
    return ids, token


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(p * len(v)))], 2)


def phase_summary(learner_results: list[dict], sync: dict, poller: dict, per_tx: int, workers: int) -> dict:
    window = max(r["elapsed_s"] for r in learner_results)
    subs = sum(r["submissions"] for r in learner_results)
    txs = sum(r["transactions"] for r in learner_results)
    return {
        "submissions_per_tx": per_tx,
        "workers": workers,
        "seconds": round(window, 2),
        "submissions": subs,
        "transactions": txs,
        "submissions_per_s": round(subs / window, 1),
        "transactions_per_s": round(txs / window, 1),
        "claims": sync["claims"],
        "claims_per_s": round(sync["claims"] / sync["elapsed_s"], 1),
        "publishes_per_s": round(sync["publishes"] / sync["elapsed_s"], 1),
        # The goal's figure: the dedicated poller, sampling every --poll-interval s.
        "polls": len(poller["polls_ms"]),
        "poll_p50_ms": _pct(poller["polls_ms"], 0.5),
        "poll_p99_ms": _pct(poller["polls_ms"], 0.99),
        "poll_max_ms": _pct(poller["polls_ms"], 1.0),
        # The synchronizer's own polls between merges (few when merges are long).
        "sync_loop_polls": len(sync["polls_ms"]),
        "sync_loop_poll_p50_ms": _pct(sync["polls_ms"], 0.5),
        "sync_loop_poll_p99_ms": _pct(sync["polls_ms"], 0.99),
        "sync_loop_poll_readonly_engine_p50_ms": _pct(sync["polls_ro_ms"], 0.5),
        "sync_loop_poll_readonly_engine_p99_ms": _pct(sync["polls_ro_ms"], 0.99),
    }


def baseline(url: str, seconds: float) -> dict:
    """In-run yardsticks, one process, no contention: raw single-row INSERT commits (driver SQL, no ORM)
    and register_submission one per transaction. Their ratio is the ledger code's own overhead."""
    from sqlalchemy import insert, select

    from ddiloco.platform.ledger import learner as learner_q
    from ddiloco.platform.ledger import open_ledger, session_factory
    from ddiloco.platform.ledger import synchronizer as sync_q
    from ddiloco.platform.ledger.models import Event, Learner

    engine = open_ledger(url, migrate=False)
    S = session_factory(engine)
    try:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            with engine.begin() as conn:
                conn.execute(insert(Event), {"run_id": RUN, "at": _now(), "kind": "bench", "actor": None, "detail": ""})
            n += 1
        raw = n / (time.perf_counter() - t0)
        with S() as s:
            lid = s.scalar(select(Learner.id).where(Learner.run_id == RUN).order_by(Learner.id).limit(1))
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            with S.begin() as s:
                uid = f"base{n}"
                sub = learner_q.SubmissionIn(uid, n % 2, 0, 1, 1, 1, n + 1, "k", "0" * 64, 1, "int4")
                learner_q.register_submission(s, RUN, lid, 0, sub, _now())
            n += 1
        reg = n / (time.perf_counter() - t0)
        with S.begin() as s:  # leave no pending baseline rows for the measured phases
            ids = [sub.id for sub in sync_q.pending_submissions(s, RUN)]
            sync_q.reject_submissions(s, RUN, [(i, "baseline") for i in ids], holder=HOLDER, token=1, now=_now())
    finally:
        engine.dispose()
    return {
        "raw_insert_commits_per_s": round(raw, 1),
        "register_submission_tx_per_s": round(reg, 1),
        "register_vs_raw_insert": round(reg / raw, 3),
    }


def run_all(phases: list[tuple[str, str, str, bool]], args, ids: list[str], tokens: dict[str, int]) -> dict:
    """Run every (backend, mode, url, batch) phase with one set of processes; returns backend -> mode -> figures."""
    token_set = set(tokens.values())
    assert len(token_set) == 1, "every fresh ledger gives the first lease token 1"
    token = token_set.pop()
    plan = [(url, batch) for _, _, url, batch in phases]
    workers = args.workers
    barrier = CTX.Barrier(workers + 2)
    out = CTX.Queue()
    procs = [
        CTX.Process(target=learner_worker, args=(plan, ids[w::workers], args.fragments, args.seconds, barrier, out), daemon=True)
        for w in range(workers)
    ]
    procs.append(CTX.Process(target=synchronizer_worker, args=(plan, token, args.fragments, args.seconds, barrier, out), daemon=True))
    procs.append(CTX.Process(target=poller_worker, args=(plan, args.seconds, args.poll_interval, barrier, out), daemon=True))
    for p in procs:
        p.start()
    got: dict[int, dict] = {i: {"learners": [], "sync": None, "poller": None} for i in range(len(phases))}
    results: dict[str, dict] = {}
    deadline = time.monotonic() + len(phases) * (args.seconds + 120) + 120
    try:
        for i, (backend, mode, _url, batch) in enumerate(phases):
            while len(got[i]["learners"]) < workers or got[i]["sync"] is None or got[i]["poller"] is None:
                try:
                    kind, phase, value = out.get(timeout=max(1.0, deadline - time.monotonic()))
                except queue_mod.Empty:
                    raise RuntimeError("benchmark processes timed out") from None
                if kind == "error":
                    raise RuntimeError(f"a benchmark process failed:\n{value}")
                if kind in ("sync", "poller"):
                    got[phase][kind] = value
                else:
                    got[phase]["learners"].append(value)
            r = phase_summary(got[i]["learners"], got[i]["sync"], got[i]["poller"], args.fragments if batch else 1, workers)
            results.setdefault(backend, {})[mode] = r
            print(
                f"  {backend:8} {mode:10} {r['submissions_per_s']:>8.1f} subs/s ({r['transactions_per_s']:.1f} tx/s)"
                f"  claims {r['claims_per_s']:>7.1f}/s ({r['publishes_per_s']:.1f} publishes/s)"
                f"  poll p50 {r['poll_p50_ms']} / p99 {r['poll_p99_ms']} ms ({r['polls']} polls;"
                f" in the merge loop p99 {r['sync_loop_poll_p99_ms']} ms,"
                f" read-only engine {r['sync_loop_poll_readonly_engine_p99_ms']} ms)",
                flush=True,
            )
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(5)
    return results


def backend_url(backend: str, postgres_server: str, workdir: Path, cleanups: ExitStack) -> str:
    """A fresh, empty ledger (a PostgreSQL one is dropped when ``cleanups`` closes)."""
    if backend == "sqlite":
        return f"sqlite:///{workdir}/ledger.db"
    # Durable commits: commit throughput is what this benchmark measures.
    return cleanups.enter_context(scratch_database(postgres_server, "ddiloco_bench", durable=True))


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--learners", type=int, default=1000)
    ap.add_argument("--fragments", type=int, default=24)
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--workers", type=int, default=4, help="learner processes registering submissions")
    ap.add_argument("--seconds", type=float, default=12.0, help="length of each measured phase")
    ap.add_argument("--poll-interval", type=float, default=0.05, help="seconds between the dedicated poller's polls")
    ap.add_argument(
        "--postgres-url",
        default=server_url(),
        help="a server where the benchmark may CREATE and DROP a database (default $DDILOCO_TEST_POSTGRES_URL or the local one)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.learners, args.seconds = min(args.learners, 100), 2.0

    results: dict = {**header("ledger", args), "backends": {}}
    print(
        f"{args.learners} learners x {args.fragments} fragments, {args.workers} learner processes + 1 synchronizer + 1 poller, "
        f"{args.seconds:g} s a phase"
    )
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("sqlite", "postgres"):
            ap.error(f"unknown backend {b!r}")
    workdir = Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    cleanups = ExitStack()
    try:
        phases, tokens, ids = [], {}, []
        for backend in backends:
            try:
                url = backend_url(backend, args.postgres_url, workdir, cleanups)
            except Exception as err:  # noqa: BLE001 - one backend missing must not lose the other's figures
                print(f"  {backend}: NOT RUN: {str(err).splitlines()[0]}", flush=True)
                results["backends"][backend] = {"error": str(err)}
                continue
            t0 = time.perf_counter()
            ids, tokens[backend] = setup_ledger(url, args.learners, args.fragments)
            results["backends"][backend] = {"setup_s": round(time.perf_counter() - t0, 2)}
            results["backends"][backend]["baseline_one_process"] = b = baseline(url, 0.5 if args.quick else 2.0)
            print(
                f"  {backend:8} baseline, one process: raw INSERT {b['raw_insert_commits_per_s']:.0f} commits/s,"
                f" register_submission {b['register_submission_tx_per_s']:.0f} tx/s (ratio {b['register_vs_raw_insert']:.2f})",
                flush=True,
            )
            phases += [(backend, "one_per_tx", url, False), (backend, "batch", url, True)]
        if phases:
            for backend, modes in run_all(phases, args, ids, tokens).items():
                results["backends"][backend].update(modes)
    finally:
        cleanups.close()
        shutil.rmtree(workdir, ignore_errors=True)

    pg = results["backends"].get("postgres")
    goals = {}
    if pg and "error" not in pg:
        one, batch = pg["one_per_tx"], pg["batch"]
        worst_p99 = max(one["poll_p99_ms"], batch["poll_p99_ms"])
        goals = {
            "submissions_per_s_one_per_tx": {
                "value": one["submissions_per_s"],
                "goal": GOAL_SUBMISSIONS_PER_S,
                "pass": one["submissions_per_s"] >= GOAL_SUBMISSIONS_PER_S,
            },
            "submissions_per_s_batch": {
                "value": batch["submissions_per_s"],
                "goal": GOAL_SUBMISSIONS_PER_S,
                "pass": batch["submissions_per_s"] >= GOAL_SUBMISSIONS_PER_S,
            },
            "poll_p99_ms": {"value": worst_p99, "goal": GOAL_P99_POLL_MS, "pass": worst_p99 < GOAL_P99_POLL_MS},
        }
        g = goals
        print(
            f"goal >= {GOAL_SUBMISSIONS_PER_S} submissions/s on PostgreSQL, one per transaction: "
            f"{verdict(g['submissions_per_s_one_per_tx']['pass'])} ({one['submissions_per_s']:.0f}/s)"
        )
        print(
            f"goal >= {GOAL_SUBMISSIONS_PER_S} submissions/s on PostgreSQL, {args.fragments} per transaction: "
            f"{verdict(g['submissions_per_s_batch']['pass'])} ({batch['submissions_per_s']:.0f}/s)"
        )
        print(f"goal p99 poll < {GOAL_P99_POLL_MS:g} ms on PostgreSQL: {verdict(g['poll_p99_ms']['pass'])} ({worst_p99:.1f} ms)")
    else:
        print("goals on PostgreSQL: NOT MEASURED (no PostgreSQL run)")
    results["goals_postgres"] = goals

    write_results("ledger", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
