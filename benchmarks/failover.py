"""Synchronizer failover: SIGKILL the active synchronizer, time until the standby publishes a version.

Real OS processes, started as the flows start them (``python -m ddiloco learner|synchronizer``,
through ddiloco.testing's ProcessRun) on a SQLite ledger and a file:// store in a temp dir:
2 learners, an active and a standby synchronizer, lease_ttl_s from the config's default (3.0 s).
Each round: wait for a quiet window, look the lease holder up in the ledger, SIGKILL that process
by its PID, and watch the ledger (every 50 ms) until a version published by another holder
appears; then start a fresh standby (a new --holder name) for the next round.

Per kill it reports
  * failover_s: kill -> first new version seen committed in the ledger (the goal's figure)
  * lease_left_s: how long the killed holder's lease still had to run at the kill (the floor)
  * takeover_s: kill -> the standby's lease acquisition (lease row acquired_at)
  * ledger_created_s: kill -> the new version's created_at (stamped with the start of the
    publishing poll, so it can read earlier than the commit)
  * learners' tokens/s in the window before vs after the kill, from their heartbeats, two ways:
    the tokens_per_s they report, and the tokens they added (max - min tokens over the window's beats)

Two variants (full run: both; --quick: as_is only):
  * as_is: the synchronizer as shipped (``python -m ddiloco synchronizer``)
  * prewarmed: the same, but started with torch._dynamo already imported, which is what a fix
    would do: a synchronizer's first torch.optim.SGD (its first outer step) imports it, seconds of
    work that otherwise land between a standby taking the lease and its first publish.
Lease changes not caused by a kill are counted too (a holder whose renewals came too late).

Goal (judged on as_is): max failover_s < 5 s, and learners' tokens/s after / before >= 0.9
(mean over kills, tokens added per second from heartbeats).

    python benchmarks/failover.py [--quick] [--kills 3] [--window-s 10] [--variants as_is,prewarmed]
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import func, select

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import base_parser, exit_on_sigterm, header, verdict, write_results

from ddiloco.platform.config import build_config
from ddiloco.platform.ledger import open_ledger
from ddiloco.platform.ledger import queries as q
from ddiloco.platform.ledger.models import Event, FragmentVersion, Heartbeat
from ddiloco.platform.runtime import RunContext
from ddiloco.testing.net import wait_for
from ddiloco.testing.processes import ProcessRun

NAME = "failover"
GOAL_FAILOVER_S = 5.0
GOAL_TPS_RATIO = 0.9
LEARNERS = ("us-0", "us-1")


def bench_config(name: str, quick: bool):
    data: dict = {"name": name, "learners": {"regions": [{"name": "us", "learners": 2}]}}
    if quick:
        # A small model so the processes start and step fast; more frequent heartbeats for a short window.
        data.update(
            model={"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32},
            data={"max_bytes": 400_000, "val_batches": 2},
            learners={"regions": [{"name": "us", "learners": 2}], "batch_size": 4, "heartbeat_s": 0.5},
            fragments={"count": 4},
        )
    return build_config(data)


# Wraps the launcher's ``python -m ddiloco <args>``: inside, argv is [-c, python, -m, ddiloco, <args>...].
PREWARM = [sys.executable, "-c", "import sys, torch._dynamo; from ddiloco.cli import app; sys.argv = sys.argv[3:]; app()"]


class BenchRun(ProcessRun):
    """ProcessRun whose synchronizers can be started with torch._dynamo already imported.

    That is what a fix would do: a synchronizer's first ``torch.optim.SGD(...)`` (its first outer
    step) imports torch._dynamo, which takes seconds, and a standby's first merge is the one after a
    failover. ``prewarm`` measures the failover with that cost paid at start-up instead."""

    def __init__(self, tmp_path: Path, cfg, prewarm: bool) -> None:
        super().__init__(tmp_path, cfg)
        self.prewarm = prewarm
        # The benchmark only reads the ledger: a read-only engine (plain BEGIN) so its frequent polls
        # never take SQLite's write lock away from the processes being measured.
        self.ro = RunContext.open(self.cfg, self.cfg.name, engine=open_ledger(self.cfg.ledger.url, migrate=False, read_only=True))

    def synchronizer(self, label: str, **kw):  # noqa: ANN003 - ProcessRun.synchronizer's
        return super().synchronizer(label, wrap=PREWARM if self.prewarm else (), **kw)


def label_of(holder: str) -> str:
    """The --holder label of a lease holder name (``label@host:pid``, or just the label)."""
    return holder.rpartition("@")[0] or holder


def pid_of(holder: str) -> int | None:
    _label, at, where = holder.rpartition("@")
    pid = where.rpartition(":")[2]
    return int(pid) if at and pid.isdigit() else None


def role_seen(run: ProcessRun, label: str, role: str) -> bool:
    try:
        return re.search(rf"\b{re.escape(label)}(@\S+)? is {role}\b", run.log(label)) is not None
    except FileNotFoundError:
        return False


def lease(run: ProcessRun):
    with run.ro.transaction() as s:
        row = q.current_lease(s, run.ctx.run_id)
        return None if row is None else (row.holder, row.token, row.acquired_at.timestamp(), row.expires_at.timestamp())


def lease_events(run: ProcessRun, since: float) -> list[tuple[float, str, str]]:
    with run.ro.transaction() as s:
        rows = s.execute(
            select(Event.at, Event.actor, Event.detail)
            .where(
                Event.run_id == run.ro.run_id, Event.kind == "lease_acquired", Event.at >= datetime.fromtimestamp(since, tz=timezone.utc)
            )
            .order_by(Event.id)
        ).all()
    return [(r.at.timestamp(), r.actor, r.detail) for r in rows]


def classify_takeovers(events: list[tuple[float, str, str]], kills: list[dict]) -> dict:
    """Every lease change of the run: after one of our kills, from itself (its own lease lapsed), or
    spontaneous (a standby took a live holder's lease because its renewals came too late)."""
    out = {"after_kill": 0, "self": 0, "spontaneous": 0, "spontaneous_detail": []}
    for at, actor, detail in events:
        if "took over from " not in detail:
            continue
        previous = detail.split("took over from ", 1)[1]
        if previous == actor:
            out["self"] += 1
        elif any(k["killed"] == previous and at >= k["t_kill"] for k in kills):
            out["after_kill"] += 1
        else:
            out["spontaneous"] += 1
            out["spontaneous_detail"].append({"at": at, "holder": actor, "from": previous})
    return out


def tokens_per_s(run: ProcessRun, start: float, end: float) -> dict:
    """Learners' throughput in [start, end) from their heartbeats: reported tokens/s, and tokens added."""
    t0 = datetime.fromtimestamp(start, tz=timezone.utc)
    t1 = datetime.fromtimestamp(end, tz=timezone.utc)
    with run.ro.transaction() as s:
        rows = list(
            s.execute(
                select(Heartbeat.learner_id, Heartbeat.at, Heartbeat.tokens, Heartbeat.tokens_per_s)
                .where(Heartbeat.run_id == run.ctx.run_id, Heartbeat.at >= t0, Heartbeat.at < t1)
                .order_by(Heartbeat.at)
            )
        )
    reported, progress, beats = 0.0, 0.0, {}
    ok_progress = True
    for lid in LEARNERS:
        mine = [r for r in rows if r.learner_id == lid]
        beats[lid] = len(mine)
        if mine:
            reported += sum(r.tokens_per_s for r in mine) / len(mine)
        if len(mine) >= 2 and mine[-1].at > mine[0].at:
            progress += (mine[-1].tokens - mine[0].tokens) / (mine[-1].at - mine[0].at).total_seconds()
        else:
            ok_progress = False
    return {"reported": reported, "progress": progress if ok_progress else None, "heartbeats": beats}


def version_count(run: ProcessRun) -> int:
    with run.ro.transaction() as s:
        return s.scalar(select(func.count()).select_from(FragmentVersion).where(FragmentVersion.run_id == run.ro.run_id))


def newest_version(run: ProcessRun):
    with run.ro.transaction() as s:
        row = s.scalar(
            select(FragmentVersion).where(FragmentVersion.run_id == run.ro.run_id).order_by(FragmentVersion.created_at.desc()).limit(1)
        )
        return None if row is None else (row.fragment, row.version, row.created_at.timestamp(), row.synchronizer)


def one_failover(run: ProcessRun, live: list[str], window_s: float, timeout_s: float) -> dict:
    """SIGKILL whichever live synchronizer holds the lease; wait for the next version anyone publishes."""
    holder, token, _acquired, expires = lease(run)
    active = label_of(holder)
    if active not in live:
        raise RuntimeError(f"the lease holder {holder} is not one of the running synchronizers {live}")
    proc = run.procs[active]
    pid = pid_of(holder) or proc.pid  # the PID is in the holder name (label@host:pid)
    if pid != proc.pid:
        raise RuntimeError(f"lease holder {holder} names pid {pid}, but {active} was started as pid {proc.pid}")
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)
    live.remove(active)
    # Every row counted now is the killed holder's or older; the first one added after is the failover's.
    baseline = version_count(run)
    takeover_seen = published_seen = None
    first = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = time.time()
        if takeover_seen is None:
            cur = lease(run)
            if cur is not None and cur[0] != holder:
                takeover_seen = now
        if version_count(run) > baseline:
            published_seen = now
            first = newest_version(run)
            break
        time.sleep(0.05)
    new_lease = lease(run)
    rest = t_kill + window_s - time.time()
    if rest > 0:
        time.sleep(rest)
    time.sleep(0.5)  # let the window's last heartbeats commit
    before = tokens_per_s(run, t_kill - window_s, t_kill)
    after = tokens_per_s(run, t_kill, t_kill + window_s)
    events = lease_events(run, t_kill)
    # A holder that "took over from" itself let its own lease lapse (renewals too late) and re-acquired it.
    self_takeovers = [e for e in events if e[2].endswith(f"took over from {e[1]}")]
    out = {
        "killed": holder,
        "killed_label": active,
        "t_kill": t_kill,
        "published_by": first[3] if first else None,
        "killed_pid": pid,
        "killed_token": token,
        "new_holder": new_lease[0] if new_lease else None,
        "new_token": new_lease[1] if new_lease else None,
        "lease_left_s": round(expires - t_kill, 3),
        "takeover_s": round(new_lease[2] - t_kill, 3) if new_lease and new_lease[0] != holder else None,
        "takeover_seen_s": round(takeover_seen - t_kill, 3) if takeover_seen else None,
        "failover_s": round(published_seen - t_kill, 3) if published_seen else None,
        "ledger_created_s": round(first[2] - t_kill, 3) if first else None,
        "first_version": {"fragment": first[0], "version": first[1]} if first else None,
        "lease_events_after_kill": [{"at_s": round(t - t_kill, 3), "holder": a, "detail": d} for t, a, d in events],
        "self_takeovers": len(self_takeovers),
        "tokens_per_s_before": before,
        "tokens_per_s_after": after,
        "ratio_reported": after["reported"] / before["reported"] if before["reported"] else None,
        "ratio_progress": (after["progress"] / before["progress"]) if before["progress"] and after["progress"] is not None else None,
    }
    return out


def run_variant(args, prewarm: bool) -> dict:
    """One run: start everything, kill the active synchronizer ``args.kills`` times; the kills and a summary."""
    cfg = bench_config("failover", args.quick)
    tmp = Path(tempfile.mkdtemp(prefix="failover-bench-"))
    run = BenchRun(tmp, cfg, prewarm)
    cfg = run.cfg
    out: dict = {"prewarmed_dynamo": prewarm, "kills": []}
    t_start = time.monotonic()
    n_sync = 0

    def new_sync() -> str:
        nonlocal n_sync
        n_sync += 1
        name = f"sync-{n_sync}"
        run.synchronizer(name)
        return name

    try:
        # Both synchronizers at once (whichever gets the lease is active); the learners only once
        # version 0 is complete: a learner that starts while version 0 is only partly published never
        # becomes ready (Learner.start counts only the fragments fetched by its current attempt).
        live = [new_sync(), new_sync()]

        def v0() -> bool:
            with run.ro.transaction() as s:
                return len(q.latest_version_numbers(s, run.ctx.run_id)) == cfg.fragments.count

        wait_for(v0, 120, "version 0")
        for lid in LEARNERS:
            run.learner(lid)
        wait_for(lambda: any(role_seen(run, x, "standby") for x in live), 120, "a standby synchronizer")

        def learners_stepping() -> bool:
            with run.ro.transaction() as s:
                rows = q.learners(s, run.ctx.run_id)
                return len(rows) == len(LEARNERS) and all(r.step > 0 for r in rows)

        wait_for(learners_stepping, 180, "both learners to step")
        ready_at = time.time()
        out["startup_s"] = round(time.monotonic() - t_start, 1)
        print(
            f"[{'prewarmed' if prewarm else 'as is'}] startup {out['startup_s']:.1f}s; lease ttl {cfg.synchronizer.lease_ttl_s}s; "
            f"{args.kills} kill(s), {args.window_s:.0f}s windows",
            flush=True,
        )
        for i in range(args.kills):
            # A clean "before" window: nothing started within it.
            wait_s = ready_at + args.window_s - time.time()
            if wait_s > 0:
                time.sleep(wait_s)
            k = one_failover(run, live, args.window_s, args.timeout_s)
            out["kills"].append(k)
            fs = f"{k['failover_s']:.2f}s" if k["failover_s"] is not None else "none"
            rr = f"{k['ratio_reported']:.3f}" if k["ratio_reported"] else "n/a"
            rp = f"{k['ratio_progress']:.3f}" if k["ratio_progress"] else "n/a"
            print(
                f"  kill {i + 1}/{args.kills}: SIGKILL {k['killed']} (lease left {k['lease_left_s']:.2f}s"
                f"{', self-takeovers after: ' + str(k['self_takeovers']) if k['self_takeovers'] else ''}) -> "
                f"{k['new_holder']} took the lease at +{k['takeover_s']}s, first version seen at +{fs} "
                f"(its created_at +{k['ledger_created_s']}s); learners tok/s after/before: progress {rp}, reported {rr}",
                flush=True,
            )
            if k["failover_s"] is None or i == args.kills - 1:
                break
            standby = new_sync()
            live.append(standby)
            wait_for(lambda sb=standby: role_seen(run, sb, "standby"), 120, f"{standby} to be standby")
            ready_at = time.time()
        out["lease_takeovers"] = classify_takeovers(lease_events(run, 0.0), out["kills"])
    finally:
        run.stop_all()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    kills = out["kills"]
    times = [k["failover_s"] for k in kills if k["failover_s"] is not None]
    rep = [k["ratio_reported"] for k in kills if k["ratio_reported"]]
    prog = [k["ratio_progress"] for k in kills if k["ratio_progress"]]
    ok_time = bool(times) and len(times) == len(kills) and max(times) < GOAL_FAILOVER_S
    tps_ratio = sum(prog) / len(prog) if prog else (sum(rep) / len(rep) if rep else None)
    ok_tps = tps_ratio is not None and tps_ratio >= GOAL_TPS_RATIO
    out["summary"] = {
        "failover_s": times,
        "failover_mean_s": round(sum(times) / len(times), 3) if times else None,
        "failover_max_s": round(max(times), 3) if times else None,
        "publish_after_takeover_mean_s": round(
            sum(k["failover_s"] - k["takeover_s"] for k in kills if k["failover_s"] and k["takeover_s"]) / len(times), 3
        )
        if times
        else None,
        "lease_left_mean_s": round(sum(k["lease_left_s"] for k in kills) / len(kills), 3) if kills else None,
        "self_takeovers": out.get("lease_takeovers", {}).get("self"),
        "spontaneous_takeovers": out.get("lease_takeovers", {}).get("spontaneous"),
        "tokens_per_s_ratio_progress_mean": round(sum(prog) / len(prog), 4) if prog else None,
        "tokens_per_s_ratio_reported_mean": round(sum(rep) / len(rep), 4) if rep else None,
    }
    out["goal"] = {"failover_pass": ok_time, "tokens_per_s_pass": ok_tps, "pass": ok_time and ok_tps}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=10.0, help="tokens/s window before and after each kill")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="give up on a failover after this long")
    ap.add_argument(
        "--variants",
        default=None,
        help="comma list of: as_is (the synchronizer as shipped), prewarmed (torch._dynamo imported at "
        "start-up, what a fix would do); default both, --quick as_is",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs (ledger, store, process logs)")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    if args.quick:
        args.kills, args.window_s = 1, 2.0
    variants = (args.variants or ("as_is" if args.quick else "as_is,prewarmed")).split(",")

    cfg = bench_config("failover", args.quick)
    results = header(NAME, args)
    results["config"] = {
        "lease_ttl_s": cfg.synchronizer.lease_ttl_s,
        "synchronizer_poll_s": cfg.synchronizer.poll_s,
        "learners": len(LEARNERS),
        "heartbeat_s": cfg.learners.heartbeat_s,
        "fragments": cfg.fragments.count,
        "codec": cfg.compression.codec,
        "model": {k: getattr(cfg.model, k) for k in ("n_layer", "d_model", "seq_len")},
        "batch_size": cfg.learners.batch_size,
    }
    results["variants"] = {}
    for v in variants:
        results["variants"][v] = run_variant(args, prewarm=(v == "prewarmed"))
    # The goal is judged on the synchronizer as shipped (the first variant run).
    main_v = results["variants"][variants[0]]
    results["kills"] = main_v["kills"]
    results["summary"] = main_v["summary"]
    results["goal"] = {
        "variant": variants[0],
        "failover_max_s": GOAL_FAILOVER_S,
        "failover_pass": main_v["goal"]["failover_pass"],
        "tokens_per_s_ratio_min": GOAL_TPS_RATIO,
        "tokens_per_s_measure": "mean over kills of (tokens added per s after / before), from heartbeats",
        "tokens_per_s_pass": main_v["goal"]["tokens_per_s_pass"],
        "pass": main_v["goal"]["pass"],
    }
    print()
    for v, r in results["variants"].items():
        sm = r["summary"]
        if sm["failover_s"]:
            print(
                f"{v:10} failover: {', '.join(f'{t:.2f}' for t in sm['failover_s'])} s; mean {sm['failover_mean_s']:.2f} s, "
                f"max {sm['failover_max_s']:.2f} s (lease left at kill {sm['lease_left_mean_s']:.2f} s on average, "
                f"first publish {sm['publish_after_takeover_mean_s']:.2f} s after takeover) -> {verdict(r['goal']['failover_pass'])} "
                f"(goal < {GOAL_FAILOVER_S:.0f} s)"
            )
        else:
            print(f"{v:10} failover: no version published by a standby: FAIL")
        print(
            f"{'':10} learners' tokens/s after/before: progress {sm['tokens_per_s_ratio_progress_mean']}, reported "
            f"{sm['tokens_per_s_ratio_reported_mean']} -> {verdict(r['goal']['tokens_per_s_pass'])} (goal >= {GOAL_TPS_RATIO})"
        )
    print(f"goal ({variants[0]}): failover < {GOAL_FAILOVER_S:.0f} s and tokens/s kept: {verdict(results['goal']['pass'])}")
    write_results(NAME, results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
