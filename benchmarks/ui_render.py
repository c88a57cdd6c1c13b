"""Dashboard render time: the run health page for a run with 100 learners and 10,000 heartbeats each.

Builds a synthetic ledger shaped like a long multi-region run (regions of learners, dead, straggling
and recovering ones, a synchronizer take-over, merges, rejections, events, evaluations; goal: the page
renders in < 2 s), then times:
  * each dashboard query on its own (``ddiloco.ui.queries``, cold: a fresh engine);
  * the whole page, server side, with ``streamlit.testing.v1.AppTest``: a cold render (Streamlit's
    caches cleared, so every query runs) and a warm one (an auto-refresh within the cache TTL).

The page's time in a browser adds the client's drawing of the same charts; the browser test
(tests/test_ui_browser.py) covers that the page shows up at all.

    python benchmarks/ui_render.py                        # 100 learners x 10,000 heartbeats on SQLite
    python benchmarks/ui_render.py --backends sqlite,postgres   # also on a fresh database of the local server
    python benchmarks/ui_render.py --quick                # 20 learners x 1,000 heartbeats: checks it works
"""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("STREAMLIT_BROWSER_GATHER_USAGE_STATS", "false")

from common import base_parser, header, verdict, write_results  # noqa: E402

from ddiloco.testing.postgres import scratch_database, server_url  # noqa: E402

GOAL_RENDER_S = 2.0
RUN = "bench"
REGIONS = ("us-east", "us-west", "eu", "asia")
FRAGMENTS = 24
HEARTBEAT_S = 2.0
STEPS_PER_HEARTBEAT = 4
TOKENS_PER_STEP = 16 * 128
CHUNK = 20_000


def _config_json(learners: int, dead_after_s: float) -> str:
    from ddiloco.platform.config import build_config

    per = [learners // len(REGIONS) + (1 if i < learners % len(REGIONS) else 0) for i in range(len(REGIONS))]
    cfg = build_config(
        {
            "name": RUN,
            "learners": {
                "regions": [{"name": r, "learners": n} for r, n in zip(REGIONS, per) if n],
                "heartbeat_s": HEARTBEAT_S,
                "dead_after_s": dead_after_s,
            },
            "fragments": {"count": FRAGMENTS},
        }
    )
    return cfg.to_json()


def build_synthetic_ledger(
    url: str,
    *,
    learners: int = 100,
    heartbeats: int = 10_000,
    submissions_per_learner: int = 400,
    now: datetime | None = None,
    seed: int = 0,
) -> dict[str, int]:
    """Fill an empty ledger at ``url`` with one long run; returns the row counts written."""
    from sqlalchemy import insert

    from ddiloco.platform.ledger import make_engine, upgrade
    from ddiloco.platform.ledger.models import (
        Evaluation,
        Event,
        FragmentSpec,
        FragmentVersion,
        Heartbeat,
        Learner,
        Merge,
        Run,
        Submission,
        SynchronizerLease,
    )

    rng = random.Random(seed)
    now = now or datetime.now(timezone.utc)
    duration = heartbeats * HEARTBEAT_S
    t0 = now - timedelta(seconds=duration + 30)
    dead_after_s = 30.0
    engine = make_engine(url)
    upgrade(engine)
    counts: dict[str, int] = {}

    def put(conn, model, rows: list[dict]) -> None:
        for i in range(0, len(rows), CHUNK):
            conn.execute(insert(model), rows[i : i + CHUNK])
        counts[model.__tablename__] = counts.get(model.__tablename__, 0) + len(rows)

    ids = []
    for i in range(learners):
        region = REGIONS[i % len(REGIONS)]
        ids.append((f"{region}-{i // len(REGIONS)}", region))
    dead = {ids[i][0] for i in range(5, learners, 37)}
    straggling = {ids[i][0] for i in range(11, learners, 29)} - dead
    recovering = {ids[i][0] for i in range(17, learners, 45)} - dead - straggling

    with engine.begin() as conn:
        put(
            conn,
            Run,
            [
                dict(
                    id=RUN,
                    created_at=t0,
                    status="running",
                    config_json=_config_json(learners, dead_after_s),
                    code_version="0.1.0",
                    git_commit=None,
                    num_fragments=FRAGMENTS,
                    token_budget=10**12,
                    flow_run_url="http://127.0.0.1:4200/runs/flow-run/00000000-0000-0000-0000-000000000000",
                    finished_at=None,
                )
            ],
        )
        put(
            conn,
            FragmentSpec,
            [dict(run_id=RUN, fragment=f, tensors_json="[]", numel=20_000, nbytes=80_000) for f in range(FRAGMENTS)],
        )
        learner_rows, hb_rows, events = [], [], []
        for lid, region in ids:
            step_s = 0.5 * (3.0 if lid in straggling else 1.0) * rng.uniform(0.9, 1.1)
            end = now - timedelta(seconds=600 if lid in dead else rng.uniform(0.0, HEARTBEAT_S))
            start = end - timedelta(seconds=duration)
            rows = []
            for k in range(heartbeats):
                step = int(k * HEARTBEAT_S / step_s)
                rows.append(
                    dict(
                        run_id=RUN,
                        learner_id=lid,
                        incarnation=0,
                        at=start + timedelta(seconds=k * HEARTBEAT_S),
                        step=step,
                        tokens=step * TOKENS_PER_STEP,
                        loss=1.6 + 3.9 * math.exp(-step / 6000) + rng.gauss(0, 0.05),
                        tokens_per_s=TOKENS_PER_STEP / step_s,
                        step_time_s=step_s,
                    )
                )
            last = rows[-1]
            inc = 0
            if lid in recovering:
                inc = 1
                restart = now - timedelta(seconds=5)
                rows.append(dict(last, incarnation=1, at=restart, step=0, tokens=0, loss=None, tokens_per_s=0.0, step_time_s=0.0))
                events.append(
                    dict(
                        run_id=RUN,
                        at=restart,
                        kind="learner_restarted",
                        actor=lid,
                        detail="incarnation 1; 2048 unsubmitted tokens lost",
                    )
                )
            hb_rows.extend(rows)
            events.append(dict(run_id=RUN, at=start, kind="learner_joined", actor=lid, detail=f"region {region}"))
            if lid in dead:
                events.append(
                    dict(
                        run_id=RUN,
                        at=end + timedelta(seconds=dead_after_s),
                        kind="learner_dead",
                        actor=lid,
                        detail=f"no heartbeat for {dead_after_s:.1f}s",
                    )
                )
            cur = rows[-1]
            learner_rows.append(
                dict(
                    run_id=RUN,
                    id=lid,
                    region=region,
                    status="dead"
                    if lid in dead
                    else "recovering"
                    if lid in recovering
                    else "straggling"
                    if lid in straggling
                    else "alive",
                    incarnation=inc,
                    started_at=cur["at"] if inc else start,
                    last_heartbeat_at=cur["at"],
                    step=cur["step"],
                    tokens_per_s=cur["tokens_per_s"],
                    step_time_s=cur["step_time_s"],
                    tokens_trained=last["tokens"] if inc else 0,
                    tokens_submitted=last["tokens"] if inc else 0,
                    tokens_lost=2048 if inc else 0,
                    inc_tokens_trained=0 if inc else last["tokens"],
                    inc_tokens_submitted=0 if inc else last["tokens"],
                    busy_s=duration * 0.95,
                    optimizer_state_key=None,
                    optimizer_state_sha256=None,
                    flow_run_url=None,
                )
            )
        put(conn, Learner, learner_rows)
        put(conn, Heartbeat, hb_rows)
        del hb_rows

        # Global versions: two synchronizers (a take-over at 60%), one 4-minute outage of merging.
        versions_per_fragment = max(2, learners * submissions_per_learner // (FRAGMENTS * 8))
        takeover = t0 + timedelta(seconds=0.6 * duration)
        gap_start, gap_end = t0 + timedelta(seconds=0.3 * duration), t0 + timedelta(seconds=0.3 * duration + 240)
        fv_rows, merge_rows = [], []
        for f in range(FRAGMENTS):
            for v in range(versions_per_fragment):
                at = t0 + timedelta(seconds=duration * v / versions_per_fragment + f * 0.01)
                if gap_start <= at < gap_end:
                    at = gap_end + timedelta(seconds=(at - gap_start).total_seconds() / 100)
                holder, token = ("sync-b", 2) if at >= takeover else ("sync-a", 1)
                fv_rows.append(
                    dict(
                        run_id=RUN,
                        fragment=f,
                        version=v,
                        created_at=at,
                        blob_key=f"{RUN}/global/f{f}/v{v}",
                        sha256="0" * 64,
                        nbytes=80_000,
                        state_key=f"{RUN}/outer/f{f}/v{v}",
                        state_sha256="0" * 64,
                        lease_token=token,
                        synchronizer=holder,
                        blob_deleted=v < versions_per_fragment - 3,
                    )
                )
                if v:
                    included = rng.randint(1, 12)
                    window = rng.uniform(0.2, 1.5)
                    merge_rows.append(
                        dict(
                            run_id=RUN,
                            fragment=f,
                            version=v,
                            at=at,
                            quorum=1,
                            live_learners=learners - len(dead),
                            included=included,
                            rejected=int(rng.random() < 0.05),
                            grace_window_s=window,
                            grace_waited_s=window * rng.random(),
                            merge_s=rng.uniform(0.005, 0.05),
                            reason=f"grace window of {window:.2f}s closed with {included}/{learners - len(dead)} learners",
                            detail_json="{}",
                        )
                    )
        put(conn, FragmentVersion, fv_rows)
        put(conn, Merge, merge_rows)
        events += [
            dict(run_id=RUN, at=t0, kind="run_created", actor=None, detail=f"{FRAGMENTS} fragments"),
            dict(run_id=RUN, at=t0, kind="lease_acquired", actor="sync-a", detail="token 1"),
            dict(
                run_id=RUN,
                at=takeover - timedelta(seconds=5),
                kind="chaos",
                actor="chaos-flow",
                detail="SIGKILL active synchronizer sync-a",
            ),
            dict(run_id=RUN, at=takeover, kind="lease_acquired", actor="sync-b", detail="token 2; took over from sync-a"),
        ]

        sub_rows = []
        trained = {r["id"]: r["tokens_trained"] + r["inc_tokens_trained"] for r in learner_rows}
        reasons = [
            "stale: based on v{b}, current v{c} (max staleness 4)",
            "norm outlier: 41.2 > 10x median 0.9",
            "blob: checksum mismatch",
        ]
        for lid, _region in ids:
            for j in range(submissions_per_learner):
                at = t0 + timedelta(seconds=duration * (j + rng.random()) / submissions_per_learner)
                f = j % FRAGMENTS
                roll = rng.random()
                status = "pending" if j >= submissions_per_learner - 2 else "rejected" if roll < 0.03 else "merged"
                base = max(0, int(versions_per_fragment * j / submissions_per_learner) - 1)
                stale = rng.choice((0, 0, 0, 0, 1, 1, 2, 3))
                reason = rng.choice(reasons).format(b=base, c=base + 5) if status == "rejected" else None
                sub_rows.append(
                    dict(
                        run_id=RUN,
                        learner_id=lid,
                        uid=f"{lid}-{j}",
                        fragment=f,
                        base_version=base,
                        c_steps=24,
                        c_tokens=24 * TOKENS_PER_STEP,
                        tokens_new=trained[lid] // submissions_per_learner,
                        blob_key=f"{RUN}/submissions/f{f}/{lid}/{j}",
                        sha256="0" * 64,
                        nbytes=20_000,
                        codec="int8",
                        created_at=at,
                        status=status,
                        merged_version=base + stale + 1 if status == "merged" else None,
                        merge_id=None,
                        reject_reason=reason,
                        decided_at=at + timedelta(seconds=1) if status != "pending" else None,
                        norm=1.0 if status == "merged" else None,
                        weight=1.0 if status == "merged" else None,
                        staleness=stale if status == "merged" else None,
                        blob_deleted=status != "pending",
                    )
                )
                if reason:
                    events.append(
                        dict(
                            run_id=RUN,
                            at=at + timedelta(seconds=1),
                            kind="submission_rejected",
                            actor="sync-a",
                            detail=f"submission {lid}-{j}: {reason}",
                        )
                    )
        put(conn, Submission, sub_rows)
        put(conn, Event, sorted(events, key=lambda e: e["at"]))
        put(
            conn,
            Evaluation,
            [
                dict(
                    run_id=RUN,
                    at=t0 + timedelta(seconds=60 * i),
                    tokens=int(i * 60 * learners * TOKENS_PER_STEP / 0.5 * 0.9),
                    versions_total=int(i * 60 / duration * versions_per_fragment * FRAGMENTS),
                    val_loss=1.7 + 3.8 * math.exp(-i * 60 / duration * 5),
                    val_accuracy=None,
                )
                for i in range(int(duration // 60) + 1)
            ],
        )
        put(
            conn,
            SynchronizerLease,
            [dict(run_id=RUN, holder="sync-b", token=2, acquired_at=takeover, expires_at=now + timedelta(hours=1))],
        )
    if engine.dialect.name == "postgresql":
        # What autovacuum does soon after a bulk load in production: planner statistics.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()
    return counts


def time_queries(url: str) -> dict[str, float]:
    """Each dashboard query once, on a fresh read-only engine (cold database caches aside)."""
    from sqlalchemy.orm import Session

    from ddiloco.platform.ledger import reports as reports_q
    from ddiloco.platform.summary import run_summary
    from ddiloco.ui import queries as uq

    engine = uq.read_only_engine(url)
    now = datetime.now(timezone.utc)
    calls = {
        "runs_overview": lambda s: uq.runs_overview(s, now),
        "health_snapshot": lambda s: uq.health_snapshot(s, RUN, now),
        "run_aggregates": lambda s: reports_q.run_aggregates(s, RUN),
        "run_summary": lambda s: run_summary(s, RUN, now),
        "learners_frame": lambda s: uq.learners_frame(s, RUN, now),
        "synchronizer_holders": lambda s: uq.synchronizer_holders(s, RUN),
        "versions_frame": lambda s: uq.versions_frame(s, RUN),
        "merges_frame": lambda s: uq.merges_frame(s, RUN),
        "staleness_frame": lambda s: uq.staleness_frame(s, RUN),
        "evaluations_frame": lambda s: uq.evaluations_frame(s, RUN),
        "training_loss_frame": lambda s: uq.training_loss_frame(s, RUN),
        "events_frame": lambda s: uq.events_frame(s, RUN),
        "rejections_frame": lambda s: uq.rejections_frame(s, RUN),
    }
    calls["run_page (all of it)"] = lambda s: uq.run_page(s, RUN, now)
    out = {}
    for name, fn in calls.items():
        with Session(engine) as s:
            t = time.perf_counter()
            fn(s)
            out[name] = time.perf_counter() - t
    engine.dispose()
    return out


def time_page(url: str, repeats: int) -> dict[str, list[float]]:
    """Cold and warm server-side renders of the run health page, wall and CPU seconds.

    Cold: Streamlit's caches cleared, so every query runs, in a process that has rendered the page
    before (as a running server has: module imports are not counted). Warm: a rerun within the
    cache TTL (an auto-refresh that finds fresh cached data). CPU seconds are this process's (the
    script runs in a thread of it, SQLite in-process): on a shared, busy machine they show what the
    render costs when wall time mostly shows the wait for a core."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from ddiloco.ui import APP_PATH, LEDGER_URL_ENV

    os.environ[LEDGER_URL_ENV] = url

    def timed_run(at: AppTest) -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        at.run()
        if at.exception:
            raise RuntimeError(f"the page raised: {at.exception[0].value}")
        return time.perf_counter() - t, time.process_time() - c

    def cold_render() -> tuple[AppTest, float, float]:
        st.cache_data.clear()
        st.cache_resource.clear()
        at = AppTest.from_file(str(APP_PATH), default_timeout=120)
        at.query_params["run"] = RUN
        at.run()
        at.switch_page("views/run_health.py")
        return (at, *timed_run(at))

    cold_render()  # warm-up: imports and first-use costs of a fresh process
    out: dict[str, list[float]] = {"cold_s": [], "cold_cpu_s": [], "warm_s": [], "warm_cpu_s": []}
    for _ in range(repeats):
        at, wall, cpu = cold_render()
        out["cold_s"].append(wall)
        out["cold_cpu_s"].append(cpu)
        wall, cpu = timed_run(at)
        out["warm_s"].append(wall)
        out["warm_cpu_s"].append(cpu)
    return out


def measure(url: str, args, build: bool) -> dict:  # noqa: ANN001 - argparse namespace
    """Fill (unless already filled) and time one ledger; prints and returns its figures."""
    from ddiloco.platform.redact import redact_url as redact

    t = time.perf_counter()
    counts = {}
    if build:
        counts = build_synthetic_ledger(
            url, learners=args.learners, heartbeats=args.heartbeats, submissions_per_learner=args.submissions
        )
    build_s = time.perf_counter() - t
    print(f"{redact(url)}: built in {build_s:.1f}s: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()), flush=True)
    queries = time_queries(url)
    for name, secs in sorted(queries.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<24} {secs * 1000:8.1f} ms")
    pages = time_page(url, args.repeats)
    med = {k: statistics.median(v) for k, v in pages.items()}
    print(
        f"  run health page, {args.learners} learners x {args.heartbeats:,} heartbeats: "
        f"cold render {med['cold_s']:.2f}s wall / {med['cold_cpu_s']:.2f}s CPU "
        f"(wall runs {', '.join(f'{c:.2f}' for c in pages['cold_s'])}), "
        f"warm {med['warm_s']:.2f}s wall / {med['warm_cpu_s']:.2f}s CPU; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return {
        "ledger": redact(url),
        "rows": counts,
        "build_s": round(build_s, 2),
        "query_s": {k: round(v, 4) for k, v in queries.items()},
        **{f"page_{k}": [round(x, 3) for x in v] for k, v in pages.items()},
        **{f"page_{k}_median": round(v, 3) for k, v in med.items()},
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = base_parser(__doc__)
    ap.add_argument("--learners", type=int, default=100)
    ap.add_argument("--heartbeats", type=int, default=10_000, help="heartbeats per learner")
    ap.add_argument("--submissions", type=int, default=400, help="submissions per learner")
    ap.add_argument("--repeats", type=int, default=5, help="cold renders (the median is the figure)")
    ap.add_argument("--backends", default="sqlite", help="sqlite, postgres or both (comma-separated)")
    ap.add_argument(
        "--postgres-url",
        default=server_url(),
        help="a server where the benchmark may CREATE and DROP a database (default $DDILOCO_TEST_POSTGRES_URL or the local one)",
    )
    ap.add_argument("--ledger", default=None, help="time this SQLite/PostgreSQL ledger instead (see --filled)")
    ap.add_argument("--filled", action="store_true", help="--ledger already holds the synthetic run (from an earlier call)")
    args = ap.parse_args()
    if args.quick:
        args.learners, args.heartbeats, args.submissions, args.repeats = 20, 1_000, 100, 1
    if args.filled and not args.ledger:
        ap.error("--filled needs --ledger")

    results = {**header("ui_render", args), "backends": {}}
    tmp = tempfile.TemporaryDirectory(prefix="ddiloco-ui-bench-")
    try:
        if args.ledger:
            results["backends"]["given"] = measure(args.ledger, args, build=not args.filled)
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()] if not args.ledger else []:
            if backend == "sqlite":
                results["backends"]["sqlite"] = measure(f"sqlite:///{tmp.name}/ledger.db", args, build=True)
            elif backend == "postgres":
                with ExitStack() as stack:
                    try:
                        url = stack.enter_context(scratch_database(args.postgres_url, "ddiloco_uibench", durable=True))
                    except Exception as err:  # noqa: BLE001 - no server must not lose the SQLite figures
                        print(f"postgres: NOT RUN: {str(err).splitlines()[0]}")
                        results["backends"]["postgres"] = {"error": str(err)}
                        continue
                    results["backends"]["postgres"] = measure(url, args, build=True)
            else:
                ap.error(f"unknown backend {backend!r}")
    finally:
        tmp.cleanup()
    measured = {k: v for k, v in results["backends"].items() if "page_cold_s_median" in v}
    worst = max((v["page_cold_s_median"] for v in measured.values()), default=math.inf)
    worst_cpu = max((v["page_cold_cpu_s_median"] for v in measured.values()), default=math.inf)
    ok = worst < GOAL_RENDER_S
    results["goal"] = {"page_cold_s_median_max": GOAL_RENDER_S, "value": worst, "cpu_s": worst_cpu, "pass": ok}
    print(
        f"goal: run health page renders in < {GOAL_RENDER_S:.0f}s cold: median {worst:.2f}s wall "
        f"({worst_cpu:.2f}s CPU) on the slowest backend: {verdict(ok)}"
    )
    write_results("ui_render" + ("_quick" if args.quick else ""), results, args.json)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
