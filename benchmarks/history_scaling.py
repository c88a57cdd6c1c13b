"""History scaling: does every per-step ledger call cost the same at 100 and at 100,000 versions per fragment?

Fills a ledger with a run of 8 learners x 24 fragments at each size (``ddiloco.testing.history``: bulk inserts at the
schema an existing run has before the heads, 0003: versions, merges, two merged submissions per merge, a few
rejected and pending, heartbeats every 2 s, evaluations every 10 s, GC caught up), upgrades it in
place to the current schema (the migration's time is reported), then times each call a step makes,
through the very functions the learner, synchronizer and dashboard call:

  learner.exchange     registration + heartbeat + poll, one transaction (``ledger.learner.learner_exchange``)
  sync.poll_read       learners, pending submissions, fragment heads (``synchronizer.snapshot.read_snapshot``'s reads)
  sync.decision        recent merged norms of a fragment (the outlier check's input)
  sync.publish         a merge of 2 submissions (``publish_version``; rolled back, the ledger stays as filled)
  sync.gc              GC's reads and its bulk mark (rolled back)
  eval.token_totals    token accounting and the version total recorded with each evaluation
  dashboard.run_page   the run health page (``ui.queries.run_page``)

Writes are rolled back so every repeat sees the same ledger. Median and p99 per call and size, on
SQLite and PostgreSQL; the baseline is the same call at 100 versions in the same run. Goals: p99 at
100,000 <= 1.5x p99 at 100 for every call; the health page < 0.5 s at 10,000 (#27).

With --old PATH (a checkout of the code before the heads, e.g. ``git worktree add PATH ec56b99``) the
same calls of that code are timed on the same filled ledger before the upgrade (sizes <= --old-max),
in a subprocess that imports it: before/after figures.

    python benchmarks/history_scaling.py [--quick] [--old /tmp/old] [--backends sqlite,postgres]

Published: benchmarks/results/history_scaling.json (SQLite) and history_scaling_postgres.json, the two
backends run side by side (``--backends sqlite`` and ``--backends postgres --json ...``) on this 2-core machine.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    from ddiloco.testing.history import CHECKPOINT_EVERY, FRAGMENTS, KEEP_LAST, RUN, T0, fill, migrate
except ImportError:  # --measure under --old's code, from before the fill moved to ddiloco.testing: only measure() runs
    RUN, FRAGMENTS, KEEP_LAST, CHECKPOINT_EVERY = "hist", 24, 3, 50
    T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

SIZES = (100, 1_000, 10_000, 100_000)
QUICK_SIZES = (100, 1_000)
GOAL_P99_RATIO = 1.5
ROUNDS = 5
GOAL_PAGE_S = 0.5
CALLS = ("learner.exchange", "sync.poll_read", "sync.decision", "sync.publish", "sync.gc", "eval.token_totals",
         "dashboard.run_page")
OLD_CALLS = ("learner.poll", "learner.register", "learner.heartbeat", "sync.poll_read", "sync.decision", "sync.publish",
             "sync.gc", "eval.token_totals", "dashboard.run_page")


# --- timing the calls ---------------------------------------------------------------------------------------


def _stats(samples: list[float]) -> dict[str, float]:
    xs = sorted(samples)
    p99 = xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]
    return {"median_ms": statistics.median(xs) * 1e3, "p99_ms": p99 * 1e3, "n": len(xs)}


def _time(fn: Callable[[int], Any], reps: int, offset: int) -> list[float]:
    fn(-1 - offset)  # warm: compiled statements, plans, caches
    samples = []
    for i in range(offset, offset + reps):
        t0 = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - t0)
    return samples


def measure(url: str, reps: int, page_reps: int, offset: int = 0) -> dict[str, list[float]]:
    """Seconds of each per-step call, ``reps`` times (the page ``page_reps``), with whatever ``ddiloco`` is
    importable (the current code, or --old's). ``offset`` keeps the ids of one round's writes unique."""
    from sqlalchemy.orm import Session

    from ddiloco.platform.ledger.engine import make_engine, reader_of, session_factory

    try:
        from ddiloco.platform.ledger import learner as learner_q
        from ddiloco.platform.ledger import reports as reports_q
        from ddiloco.platform.ledger import runs as runs_q
        from ddiloco.platform.ledger import synchronizer as sync_q
    except ImportError:  # --old's code, from before the ledger's queries were split by caller role (#27)
        from ddiloco.platform.ledger import queries as learner_q  # type: ignore[no-redef]
        reports_q = runs_q = sync_q = learner_q  # type: ignore[misc]
    from ddiloco.ui import queries as uq

    engine = make_engine(url)
    reader = reader_of(engine)
    W, R = session_factory(engine), session_factory(reader)
    page_engine = uq.read_only_engine(url)
    now = T0 + timedelta(days=400)
    new = hasattr(learner_q, "learner_exchange")
    blob = sync_q.BlobRef("b", "0" * 64, 1)

    def sub(tag: str, i: int, fragment: int = 0) -> Any:
        return learner_q.SubmissionIn(f"bench-{tag}-{i}", fragment, 0, 24, 512, 512, 10**12, f"k/{tag}/{i}", "c" * 64, 1000, "int8")

    @contextmanager
    def rolled_back(factory: Any) -> Iterator[Any]:
        with factory() as s:
            try:
                yield s
            finally:
                s.rollback()

    def exchange(i: int) -> None:
        with rolled_back(W) as s:
            beat = learner_q.Beat(1, 10**12, 1.0, 512.0, 1.0, 1.0, history=i % 2 == 0)
            learner_q.learner_exchange(s, RUN, "l0", 0, [sub("x", i)], beat, now)

    def poll(i: int) -> None:
        with R.begin() as s:
            runs_q.latest_versions(s, RUN)
            runs_q.get_run(s, RUN)

    def register(i: int) -> None:
        with rolled_back(W) as s:
            learner_q.register_submissions(s, RUN, "l0", 0, [sub("r", i)], now)

    def heartbeat(i: int) -> None:
        with rolled_back(W) as s:
            learner_q.record_heartbeat(s, RUN, "l0", 0, now=now, step=1, tokens=10**12, loss=1.0, tokens_per_s=1.0, step_time_s=1.0)

    def poll_read(i: int) -> None:
        with R.begin() as s:
            runs_q.learners(s, RUN)
            sync_q.pending_submissions(s, RUN)
            runs_q.latest_versions(s, RUN)

    def decision(i: int) -> None:
        with R.begin() as s:
            sync_q.recent_merged_norms(s, RUN, i % FRAGMENTS if i >= 0 else 0, limit=8, per_step=True)

    def publish(i: int) -> None:
        with rolled_back(W) as s:
            ids = [learner_q.register_submission(s, RUN, f"l{k}", 0, sub(f"p{k}", i, fragment=5), now)[0] for k in range(2)]
            top = runs_q.latest_version_numbers(s, RUN)[5]
            t0 = time.perf_counter()
            sync_q.publish_version(
                s, RUN, 5, top + 1, blob=blob, state=blob, holder="sync-3", token=3, now=now,
                merged=[sync_q.MergedIn(x, 1.0, 1.0, 0) for x in ids], record=sync_q.MergeRecord(1, 8, 0.0, 0.0, 0.0, "bench", {}),
            )
            publish_s.append(time.perf_counter() - t0)

    publish_s: list[float] = []

    def gc(i: int) -> None:
        with rolled_back(W) as s:
            versions = sync_q.versions_for_gc(s, RUN, KEEP_LAST, CHECKPOINT_EVERY)
            subs = sync_q.submissions_for_gc(s, RUN)
            runs_q.learners(s, RUN)
            if new:
                sync_q.mark_blobs_deleted(s, versions, subs)
            else:
                sync_q.mark_blobs_deleted(s, [s.merge(v) for v in versions], [s.merge(x) for x in subs])
                s.flush()

    def token_totals(i: int) -> None:
        with rolled_back(W) as s:
            reports_q.token_accounting(s, RUN)
            sum(runs_q.latest_version_numbers(s, RUN).values())

    def run_page(i: int) -> None:
        with Session(page_engine) as s:
            try:
                uq.run_page(s, RUN, now)
            finally:
                s.rollback()

    calls: dict[str, tuple[Callable[[int], Any], int]] = {
        "sync.poll_read": (poll_read, reps),
        "sync.decision": (decision, reps),
        "sync.publish": (publish, reps),
        "sync.gc": (gc, max(5, reps // 10)),
        "eval.token_totals": (token_totals, max(5, reps // 10)),
        "dashboard.run_page": (run_page, page_reps),
    }
    if new:
        calls = {"learner.exchange": (exchange, reps), **calls}
    else:
        calls = {"learner.poll": (poll, reps), "learner.register": (register, reps), "learner.heartbeat": (heartbeat, reps),
                 **calls}
    out = {}
    try:
        for name, (fn, n) in calls.items():
            publish_s.clear()
            out[name] = _time(fn, n, offset)
            if name == "sync.publish":  # the publish itself, without registering the two submissions it merges
                out[name] = publish_s[1:]
    finally:
        page_engine.dispose()
        engine.dispose()
        if reader is not engine:
            reader.dispose()
    return out


# --- driving ------------------------------------------------------------------------------------------------


@contextmanager
def database(backend: str) -> Iterator[str]:
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="hist-") as d:
            yield f"sqlite:///{d}/ledger.db"
    else:
        from ddiloco.testing.postgres import scratch_database, server_url

        with scratch_database(server_url(), prefix="ddiloco_hist") as url:
            yield url


def measure_old(old: str, url: str, reps: int, page_reps: int) -> dict[str, Any]:
    """:func:`measure` with the code at ``old`` (imported first in a subprocess)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([old, env_path] if (env_path := os.environ.get("PYTHONPATH")) else [old])}
    proc = subprocess.run(
        [sys.executable, __file__, "--measure", url, "--reps", str(reps), "--page-reps", str(page_reps)],
        env=env, capture_output=True, text=True, timeout=3600, cwd=old,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratios(by_size: dict[int, dict[str, Any]], base: int) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for size, calls in by_size.items():
        for name, st in calls.items():
            if name in by_size[base]:
                out.setdefault(name, {})[size] = st["p99_ms"] / max(1e-9, by_size[base][name]["p99_ms"])
    return out


def main(argv: list[str] | None = None) -> int:
    from common import base_parser, header, verdict, write_results

    from ddiloco.bench.provenance import load_average

    ap = base_parser(__doc__)
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--sizes", default=None, help="versions per fragment, comma separated")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--page-reps", type=int, default=10)
    ap.add_argument("--old", default=None, help="a checkout of the code before the heads, to time the same calls (before/after)")
    ap.add_argument("--old-max", type=int, default=10_000, help="largest size the old code is timed at")
    ap.add_argument("--measure", default=None, help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps({name: _stats(xs) for name, xs in measure(args.measure, args.reps, args.page_reps).items()}))
        return 0
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    reps, page_reps = (30, 5) if args.quick else (args.reps, args.page_reps)
    results: dict[str, Any] = {**header("history_scaling", args), "load_avg_1m_start": load_average(), "backends": {}}
    ok = True
    for backend in args.backends.split(","):
        by_size: dict[int, dict[str, Any]] = {}
        old: dict[int, dict[str, Any]] = {}
        setup: dict[int, dict[str, float]] = {}
        with ExitStack() as stack:
            urls = {}
            for n in sizes:
                urls[n] = url = stack.enter_context(database(backend))
                # SQLite keeps no statistics unless something runs ANALYZE, and nothing does on a real ledger.
                info = fill(url, n, analyze=backend != "sqlite")
                if args.old and n <= args.old_max:
                    old[n] = measure_old(args.old, url, reps, page_reps)
                info.update(migrate(url))
                setup[n] = info
                print(f"{backend} {n:>7} versions/fragment: filled {info['rows']:,} rows in {info['fill_s']:.1f} s, "
                      f"upgraded in {info['migrate_s']:.1f} s, GC settled the kept checkpoints in {info['gc_settle_passes']} "
                      f"passes ({info['gc_settle_s']:.1f} s)", flush=True)
            # Rounds over the sizes, so a burst of load on this shared machine hits every size alike.
            samples: dict[int, dict[str, list[float]]] = {n: {} for n in sizes}
            for r in range(ROUNDS):
                for n in sizes:
                    for name, xs in measure(urls[n], max(1, reps // ROUNDS), max(1, page_reps // ROUNDS), offset=r * reps).items():
                        samples[n].setdefault(name, []).extend(xs)
        for n in sizes:
            by_size[n] = {name: _stats(xs) for name, xs in samples[n].items()}
            print(f"{backend} {n:>7} versions/fragment:")
            for name, st in by_size[n].items():
                before = old.get(n, {}).get(name)
                was = f"   (before: median {before['median_ms']:8.2f}  p99 {before['p99_ms']:8.2f})" if before else ""
                print(f"    {name:20} median {st['median_ms']:8.2f} ms  p99 {st['p99_ms']:8.2f} ms{was}")
            for name, before in old.get(n, {}).items():
                if name not in by_size[n] and isinstance(before, dict):
                    print(f"    {name:20} (before only: median {before['median_ms']:8.2f}  p99 {before['p99_ms']:8.2f})")
        base = min(by_size)
        r = ratios(by_size, base)
        top = max(by_size)
        goals = {name: {"p99_ratio_at_largest": r[name][top], "ok": r[name][top] <= GOAL_P99_RATIO} for name in r}
        page_10k = by_size.get(10_000, {}).get("dashboard.run_page")
        if page_10k:
            page_s = page_10k["median_ms"] / 1e3
            goals["dashboard.run_page_at_10000_s"] = {"median_s": page_s, "ok": page_s < GOAL_PAGE_S}
        backend_ok = all(g["ok"] for g in goals.values())
        ok &= backend_ok
        print(f"{backend}: p99 at {top:,} / p99 at {base:,} per call (goal <= {GOAL_P99_RATIO}):")
        for name, g in goals.items():
            if "p99_ratio_at_largest" in g:
                print(f"    {name:20} {g['p99_ratio_at_largest']:6.2f}x  {verdict(g['ok'])}")
        if page_10k:
            print(f"    health page at 10,000: {page_10k['median_ms'] / 1e3:.3f} s (goal < {GOAL_PAGE_S} s)  "
                  f"{verdict(goals['dashboard.run_page_at_10000_s']['ok'])}")
        results["backends"][backend] = {"setup": setup, "calls": by_size, "p99_ratio_vs_smallest": r, "goals": goals,
                                        **({"old_code": old} if old else {})}
    results["goals_met"] = ok
    results["load_avg_1m_end"] = load_average()
    print(f"load average (1 min): {results['load_avg_1m_start']} at start, {results['load_avg_1m_end']} at end (uptime)")
    if args.quick and not args.json:
        print("--quick: results not written (the published figures stay)")
        return 0
    write_results("history_scaling", results, args.json)
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
