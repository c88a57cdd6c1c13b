"""Synchronizer failover: SIGKILL the active synchronizer, time until the standby publishes a version.

Real OS processes, started as the flows start them (``python -m ddiloco learner|synchronizer`` forked from the warm
fork server, through ddiloco.testing's ProcessRun) on a SQLite ledger or a scratch database on the local PostgreSQL
server, and a file:// store in a temp dir: 2 learners, an active and a standby synchronizer, the config's default
lease_ttl_s (3.0 s) and poll_s (0.2 s). The standby learns of the holder's death from its presence lock (a
PostgreSQL advisory lock on the holder's own session; a file lock beside a SQLite ledger), not from the lease's
expiry. First a no-kill baseline (--baseline-s, learners' tokens/s with nothing killed). Then each round: wait for a
quiet window plus a seeded random delay (--seed; up to one lease renewal period, so the kills land at every phase of
the holder's renewals and merges), look the lease holder up in the ledger, SIGKILL that process by its PID, and
watch the ledger (every 50 ms) until a version published by another holder appears; then start a fresh standby (a
new --holder name) for the next round.

Per kill it reports
  * failover_s: kill -> first new version seen committed in the ledger (the goal's figure)
  * lease_left_s: how long the killed holder's lease still had to run at the kill (what the TTL path would wait)
  * takeover_s: kill -> the standby's lease acquisition (lease row acquired_at); takeover_by: presence (the event
    says "its session ended") or expiry
  * ledger_created_s: kill -> the new version's created_at (stamped with the start of the
    publishing poll, so it can read earlier than the commit)
  * learners' tokens/s in the window before vs after the kill, from their heartbeats, two ways:
    the tokens_per_s they report, and the tokens they added (max - min tokens over the window's beats); the
    window after a kill runs on past --window-s until every learner has beaten twice in it (a loaded machine)
Lease changes not caused by a kill are counted too (a holder whose renewals came too late).

Goal (issue #29): p99 of failover_s <= 1 s over the kills (p99 by nearest rank: with 20 kills, the largest), on each
ledger, and learners' tokens/s after the kills >= 0.9 x the no-kill baseline of the same run (mean over kills of the
tokens added per second in the window after each kill, from heartbeats).

With shards (``--shards N``, N > 1; ``synchronizer.shards: N``): N + 1 unpinned synchronizers (each
takes whichever shard's lease is free: N active, 1 standby). Kill i SIGKILLs the holder of shard
i mod N (the shards in turn), then a fresh standby is started as above. Per kill it reports
  * failover_s for the killed shard: kill -> first new version of one of that shard's fragments
    (``shard_fragments`` over the fragment_specs table's nbytes) seen committed by another holder;
    takeover_s, lease_left_s, ledger_created_s as above, for that shard's lease
  * for every other shard: whether its holder and token stayed the same from the kill to the end of
    the window after it (the lease rows are read every 0.2 s, and any lease_acquired event of that
    shard counts as a change), and its gaps. A shard's publish times are the distinct created_at of
    its fragments' versions (one poll's merges share one). Steady: the gaps between consecutive
    publishes within the window_s before the kill (the benchmark starts no process in it); median_gap
    and max_gap of those. Around the kill: the gaps from its last publish before the kill through every
    publish in the window_s after it, plus the open gap from its last publish to the window's end (so
    a shard that stopped shows as one long gap). ratio = the largest gap around the kill / the steady
    median gap. The shard is *uninterrupted* when its holder and token are unchanged and no gap around
    the kill is longer than max(2 x steady median gap, steady max gap) -- the steady max gap being its
    merge cadence with nothing killed (when merges wait for learners' sends and grace windows, gaps
    of that length are its ordinary rhythm, not an interruption). Too few steady publishes (< 3) to
    have a median: not judged, which counts as not uninterrupted. (This definition was fixed before
    the first full run. With the default config a shard publishes at nearly every synchronizer pass,
    poll_s 0.2 s, so its gaps are one pass, ~0.25 s, or two, ~0.5 s, and the threshold lands near a
    two-pass gap: one skipped pass anywhere in the window can read as an interruption;
    max_gap_starts_after_kill_s says where the largest gap was.)
  * learners' tokens/s before vs after, as above
Goal with shards: the killed shard's failover p99 <= 1 s, and every other shard uninterrupted at every kill (the
tokens/s ratio is reported with its 0.9 line, as above, but is not part of this goal).
Results go to benchmarks/results/failover_shards<N>.json (failover.json stays the one-shard figures).
Any --quick run writes under the system temp dir unless --json says where (never the published figures).
(Earlier versions also ran a "prewarmed" variant, torch._dynamo imported before the first merge; the shipped
synchronizer does that at start-up now.)

    python benchmarks/failover.py [--quick] [--kills 20] [--seed 0] [--window-s 6] [--baseline-s 30]
                                  [--ledgers sqlite,postgres] [--shards N]
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import func, select

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import base_parser, exit_on_sigterm, header, median, verdict, write_results

from ddiloco.platform.config import build_config
from ddiloco.platform.fragments import shard_fragments
from ddiloco.platform.ledger import open_ledger
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import Event, FragmentSpec, FragmentVersion, Heartbeat
from ddiloco.platform.runtime import RunContext
from ddiloco.testing.net import wait_for
from ddiloco.testing.postgres import scratch_database, server_url
from ddiloco.testing.processes import ProcessRun

NAME = "failover"
GOAL_FAILOVER_P99_S = 1.0
GOAL_TPS_RATIO = 0.9
LEARNERS = ("us-0", "us-1")
LEDGERS = ("sqlite", "postgres")


def bench_config(name: str, quick: bool, shards: int = 1):
    # The run is time-boxed by the benchmark: at the default budget its synchronizer would end it mid-measurement.
    data: dict = {"name": name, "token_budget": 10**12, "learners": {"regions": [{"name": "us", "learners": 2}]}}
    if shards > 1:
        data["synchronizer"] = {"shards": shards}
    if quick:
        # A small model so the processes start and step fast; more frequent heartbeats for a short window.
        data.update(
            model={"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32},
            data={"max_bytes": 400_000, "val_batches": 2},
            learners={"regions": [{"name": "us", "learners": 2}], "batch_size": 4, "heartbeat_s": 0.5},
            fragments={"count": 4},
        )
    return build_config(data)


class BenchRun(ProcessRun):
    """ProcessRun on the ledger given, with a read-only view of it for the benchmark's own polls."""

    def __init__(self, tmp_path: Path, cfg, ledger_url: str | None) -> None:
        super().__init__(tmp_path, cfg, warm=True, ledger_url=ledger_url)
        # The benchmark only reads the ledger: a read-only engine (plain BEGIN) so its frequent polls
        # never take SQLite's write lock away from the processes being measured.
        self.ro = RunContext.open(self.cfg, self.cfg.name, engine=open_ledger(self.cfg.ledger.url, migrate=False, read_only=True))


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in (0, 100]): a value of ``xs``, never an interpolation below the worst."""
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


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
        row = sync_q.current_lease(s, run.ctx.run_id)
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
        previous = detail.split("took over from ", 1)[1].split(" (", 1)[0]  # "X" or "X (its session ended)"
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


def after_window_end(run: ProcessRun, t_kill: float, window_s: float, timeout_s: float) -> float:
    """The end of the window after a kill: ``window_s`` after it, or later, once every learner has beaten twice in it
    (tokens added need two beats; a loaded machine can space them wider than the window), at most ``timeout_s``."""
    while True:
        end = max(time.time(), t_kill + window_s)
        beats = tokens_per_s(run, t_kill, end)["heartbeats"]
        if min(beats.values(), default=0) >= 2 or end >= t_kill + timeout_s:
            return end
        time.sleep(0.2)


def version_count(run: ProcessRun) -> int:
    with run.ro.transaction() as s:
        return s.scalar(select(func.count()).select_from(FragmentVersion).where(FragmentVersion.run_id == run.ro.run_id))


def newest_version(run: ProcessRun):
    with run.ro.transaction() as s:
        row = s.scalar(
            select(FragmentVersion).where(FragmentVersion.run_id == run.ro.run_id).order_by(FragmentVersion.created_at.desc()).limit(1)
        )
        return None if row is None else (row.fragment, row.version, row.created_at.timestamp(), row.synchronizer)


def kill_record(holder: str, active: str, t_kill: float, pid: int | None, token: int | None, new_lease, expires: float,
                takeover_seen: float | None, published_seen: float | None, first, events: list[tuple[float, str, str]],
                before: dict, after: dict) -> dict:
    """What one kill's record says, with or without shards: who was killed, who took over and when, the first
    version published after it (``first``: (created, fragment, version, holder) or None), tokens/s around it."""
    # A holder that "took over from" itself let its own lease lapse (renewals too late) and re-acquired it.
    self_takeovers = [e for e in events if e[2].endswith(f"took over from {e[1]}")]
    takeover = next((e for e in events if f"took over from {holder}" in e[2]), None)
    return {
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
        "takeover_by": None if takeover is None else "presence" if takeover[2].endswith("(its session ended)") else "expiry",
        "takeover_seen_s": round(takeover_seen - t_kill, 3) if takeover_seen else None,
        "failover_s": round(published_seen - t_kill, 3) if published_seen else None,
        "ledger_created_s": round(first[0] - t_kill, 3) if first else None,
        "first_version": {"fragment": first[1], "version": first[2]} if first else None,
        "lease_events_after_kill": [{"at_s": round(t - t_kill, 3), "holder": a, "detail": d} for t, a, d in events],
        "self_takeovers": len(self_takeovers),
        "tokens_per_s_before": before,
        "tokens_per_s_after": after,
        "ratio_reported": after["reported"] / before["reported"] if before["reported"] else None,
        "ratio_progress": (after["progress"] / before["progress"]) if before["progress"] and after["progress"] is not None else None,
    }


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
    after = tokens_per_s(run, t_kill, after_window_end(run, t_kill, window_s, timeout_s))
    events = lease_events(run, t_kill)
    # newest_version rows are (fragment, version, created, holder).
    created = (first[2], first[0], first[1], first[3]) if first else None
    return kill_record(holder, active, t_kill, pid, token, new_lease, expires, takeover_seen, published_seen, created, events,
                       before, after)


# --- with shards -------------------------------------------------------------------------------------


def shard_map(run: ProcessRun, shards: int) -> list[tuple[int, ...]]:
    """Each shard's fragments, as every synchronizer computes them (from the fragments' bytes)."""
    with run.ro.transaction() as s:
        nbytes = [n for _f, n in s.execute(select(FragmentSpec.fragment, FragmentSpec.nbytes)
                                           .where(FragmentSpec.run_id == run.ro.run_id).order_by(FragmentSpec.fragment))]
    return shard_fragments(nbytes, shards)


def shard_leases(run: ProcessRun) -> dict[int, tuple[str, int, float, float]]:
    """shard -> (holder, token, acquired_at, expires_at) of every shard's lease row."""
    with run.ro.transaction() as s:
        return {r.shard: (r.holder, r.token, r.acquired_at.timestamp(), r.expires_at.timestamp()) for r in sync_q.leases(s, run.ro.run_id)}


def shard_version_count(run: ProcessRun, frags: Sequence[int]) -> int:
    with run.ro.transaction() as s:
        return s.scalar(
            select(func.count()).select_from(FragmentVersion)
            .where(FragmentVersion.run_id == run.ro.run_id, FragmentVersion.fragment.in_(frags))
        )


def shard_versions(run: ProcessRun, frags: Sequence[int], since: float) -> list[tuple[float, int, int, str]]:
    """(created_at, fragment, version, synchronizer) of the shard's versions created at or after ``since``, oldest first."""
    with run.ro.transaction() as s:
        rows = s.execute(
            select(FragmentVersion.created_at, FragmentVersion.fragment, FragmentVersion.version, FragmentVersion.synchronizer)
            .where(FragmentVersion.run_id == run.ro.run_id, FragmentVersion.fragment.in_(frags),
                   FragmentVersion.created_at >= datetime.fromtimestamp(since, tz=timezone.utc))
            .order_by(FragmentVersion.created_at)
        ).all()
    return [(r.created_at.timestamp(), r.fragment, r.version, r.synchronizer) for r in rows]


def event_shard(detail: str) -> int:
    """The shard of a lease_acquired event (its detail starts ``shard K; `` except for shard 0)."""
    m = re.match(r"shard (\d+); ", detail)
    return int(m.group(1)) if m else 0


def gap_profile(times: Sequence[float], t_kill: float, window_s: float) -> dict:
    """A shard's publish rhythm before and around a kill (see the module docstring: *uninterrupted*).

    ``times``: created_at of its versions; one poll's versions share one, so distinct times are publishes."""
    pub = sorted(set(times))
    end = t_kill + window_s
    steady = [t for t in pub if t_kill - window_s <= t < t_kill]
    steady_gaps = [b - a for a, b in zip(steady, steady[1:])]
    before = [t for t in pub if t < t_kill]
    after = [t for t in pub if t_kill <= t < end]
    points = before[-1:] + after
    around = [b - a for a, b in zip(points, points[1:])] + ([end - points[-1]] if points else [])
    starts = points  # around[i] starts at points[i] (the last one: the open gap to the window's end)
    med = median(steady_gaps) if len(steady_gaps) >= 2 else None
    steady_max = max(steady_gaps) if steady_gaps else None
    largest = max(around) if around else None
    threshold = max(2 * med, steady_max) if med is not None else None
    return {
        "steady_publishes": len(steady),
        "steady_median_gap_s": round(med, 3) if med is not None else None,
        "steady_max_gap_s": round(steady_max, 3) if steady_max is not None else None,
        "publishes_after": len(after),
        "gap_across_kill_s": round(after[0] - before[-1], 3) if after and before else None,
        "max_gap_around_s": round(largest, 3) if largest is not None else None,
        "max_gap_starts_after_kill_s": round(starts[around.index(largest)] - t_kill, 3) if largest is not None else None,
        "ratio_to_median": round(largest / med, 3) if med and largest is not None else None,
        "threshold_s": round(threshold, 3) if threshold is not None else None,
        "within_threshold": (largest <= threshold) if threshold is not None and largest is not None else None,
    }


def one_shard_failover(run: ProcessRun, live: list[str], shard: int, assignment: list[tuple[int, ...]], window_s: float,
                       timeout_s: float) -> dict:
    """SIGKILL the holder of ``shard``'s lease; wait for that shard's next version; watch the other shards' leases and versions."""
    leases = shard_leases(run)
    if shard not in leases:
        raise RuntimeError(f"shard {shard} has no lease row: {leases}")
    holder, token, _acquired, expires = leases[shard]
    active = label_of(holder)
    if active not in live:
        raise RuntimeError(f"shard {shard}'s lease holder {holder} is not one of the running synchronizers {live}")
    proc = run.procs[active]
    pid = pid_of(holder) or proc.pid
    if pid != proc.pid:
        raise RuntimeError(f"lease holder {holder} names pid {pid}, but {active} was started as pid {proc.pid}")
    others = {k: v for k, v in leases.items() if k != shard}
    frags = assignment[shard]
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)
    live.remove(active)
    # Every row of the shard counted now is the killed holder's or older (it is dead): the first one added is the failover's.
    baseline = shard_version_count(run, frags)
    takeover_seen = published_seen = None
    first = None
    other_changes: dict[int, list] = {k: [] for k in others}

    def watch_others(cur: dict) -> None:
        for k, (h, tok, _a, _e) in others.items():
            now_k = cur.get(k)
            if now_k is None or (now_k[0], now_k[1]) != (h, tok):
                seen = (now_k[0], now_k[1]) if now_k else None
                if not other_changes[k] or other_changes[k][-1][1] != seen:
                    other_changes[k].append((round(time.time() - t_kill, 3), seen))

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = time.time()
        cur = shard_leases(run)
        watch_others(cur)
        if takeover_seen is None and shard in cur and cur[shard][0] != holder:
            takeover_seen = now
        if shard_version_count(run, frags) > baseline:
            published_seen = now
            # Another holder's version is stamped with the start of a poll that found the killed lease expired: after the kill.
            new = [v for v in shard_versions(run, frags, t_kill - 1.0) if v[3] != holder]
            first = new[0] if new else None
            break
        time.sleep(0.05)
    new_lease = shard_leases(run).get(shard)
    # The rest of the window: keep watching the other shards' leases.
    while time.time() < t_kill + window_s:
        watch_others(shard_leases(run))
        time.sleep(0.2)
    at_end = shard_leases(run)
    watch_others(at_end)
    # A publish whose poll started before the window's end may commit a moment later.
    time.sleep(2.0)
    before = tokens_per_s(run, t_kill - window_s, t_kill)
    after = tokens_per_s(run, t_kill, after_window_end(run, t_kill, window_s, timeout_s))
    events = lease_events(run, t_kill)
    other_shards = {}
    for k, (h, tok, _a, _e) in others.items():
        times = [v[0] for v in shard_versions(run, assignment[k], t_kill - 2 * window_s)]
        prof = gap_profile(times, t_kill, window_s)
        k_events = [e for e in events if event_shard(e[2]) == k and e[0] <= t_kill + window_s]
        kept = not other_changes[k] and not k_events and (at_end.get(k) or ("", 0))[:2] == (h, tok)
        other_shards[str(k)] = {
            "holder": h,
            "token": tok,
            "holder_and_token_kept": kept,
            "lease_changes": [{"at_s": at, "holder_token": seen} for at, seen in other_changes[k]]
            + [{"at_s": round(t - t_kill, 3), "event": d, "holder": a} for t, a, d in k_events],
            **prof,
            "uninterrupted": kept and prof["within_threshold"] is True,
        }
    return {"shard": shard, "shard_fragments": list(frags), "other_shards": other_shards,
            **kill_record(holder, active, t_kill, pid, token, new_lease, expires, takeover_seen, published_seen, first, events,
                          before, after)}


def run_ledger(args, ledger: str) -> dict:
    """One run on ``ledger`` (sqlite or postgres): a scratch ledger, then :func:`run_kills` on it."""
    if ledger == "sqlite":
        return run_kills(args, ledger, None)
    with scratch_database(server_url(), prefix="ddiloco_failover") as url:
        return run_kills(args, ledger, url)


def run_kills(args, ledger: str, ledger_url: str | None) -> dict:
    """One run: start everything, measure the no-kill baseline, kill the active synchronizer ``args.kills`` times (with
    shards: each shard's holder in turn); the kills and a summary."""
    shards = args.shards
    cfg = bench_config("failover", args.quick, shards)
    tmp = Path(tempfile.mkdtemp(prefix="failover-bench-"))
    run = BenchRun(tmp, cfg, ledger_url)
    cfg = run.cfg
    rng = random.Random(args.seed)
    jitter_s = cfg.synchronizer.lease_ttl_s / 3  # one renewal period of the holder
    out: dict = {"ledger": ledger, "kills": []}
    t_start = time.monotonic()
    n_sync = 0

    def new_sync() -> str:
        nonlocal n_sync
        n_sync += 1
        name = f"sync-{n_sync}"
        run.synchronizer(name)
        return name

    try:
        # Both synchronizers at once (whichever gets the lease is active; with shards, N + 1 of them: the
        # one left without a free shard is the standby); the learners only once version 0 is complete: a
        # learner that starts while version 0 is only partly published never becomes ready (Learner.start
        # counts only the fragments fetched by its current attempt).
        live = [new_sync() for _ in range(shards + 1)]

        def v0() -> bool:
            with run.ro.transaction() as s:
                return len(runs_q.latest_version_numbers(s, run.ctx.run_id)) == cfg.fragments.count

        wait_for(v0, 120, "version 0")
        for lid in LEARNERS:
            run.learner(lid)
        if shards == 1:
            wait_for(lambda: any(role_seen(run, x, "standby") for x in live), 120, "a standby synchronizer")
        else:
            assignment = shard_map(run, shards)
            out["shard_fragments"] = [list(f) for f in assignment]

            def every_shard_held_and_a_standby() -> bool:
                now = time.time()
                held = {label_of(h) for h, _tok, _a, exp in shard_leases(run).values() if exp > now}
                return (len(held) == shards and held <= set(live)
                        and any(role_seen(run, x, "standby") for x in live if x not in held))

            wait_for(every_shard_held_and_a_standby, 120, f"{shards} shards held and a standby synchronizer")

        def learners_stepping() -> bool:
            with run.ro.transaction() as s:
                rows = runs_q.learners(s, run.ctx.run_id)
                return len(rows) == len(LEARNERS) and all(r.step > 0 for r in rows)

        wait_for(learners_stepping, 180, "both learners to step")
        out["startup_s"] = round(time.monotonic() - t_start, 1)
        # The no-kill baseline: everything running (the standby too), nothing killed or started.
        t_base = time.time()
        time.sleep(args.baseline_s + 0.5)  # the window's last heartbeats commit
        out["baseline"] = tokens_per_s(run, t_base, t_base + args.baseline_s)
        ready_at = time.time()
        print(
            f"[{ledger}] startup {out['startup_s']:.1f}s; lease ttl {cfg.synchronizer.lease_ttl_s}s; baseline "
            f"{out['baseline']['progress'] or 0:.0f} tokens/s over {args.baseline_s:.0f}s; {args.kills} kill(s), "
            f"{args.window_s:.0f}s windows, seed {args.seed}",
            flush=True,
        )
        for i in range(args.kills):
            # A clean "before" window (nothing started within it), then a seeded delay within one renewal period.
            wait_s = ready_at + args.window_s + rng.uniform(0, jitter_s) - time.time()
            if wait_s > 0:
                time.sleep(wait_s)
            if shards == 1:
                k = one_failover(run, live, args.window_s, args.timeout_s)
            else:
                k = one_shard_failover(run, live, i % shards, assignment, args.window_s, args.timeout_s)
            out["kills"].append(k)
            fs = f"{k['failover_s']:.2f}s" if k["failover_s"] is not None else "none"
            rp = f"{k['ratio_progress']:.3f}" if k["ratio_progress"] else "n/a"
            print(
                f"  kill {i + 1}/{args.kills}: SIGKILL {'shard ' + str(k['shard']) + ' holder ' if 'shard' in k else ''}"
                f"{k['killed']} (lease left {k['lease_left_s']:.2f}s"
                f"{', self-takeovers after: ' + str(k['self_takeovers']) if k['self_takeovers'] else ''}) -> "
                f"{k['new_holder']} took the lease at +{k['takeover_s']}s by {k['takeover_by']}, first version seen at +{fs} "
                f"(its created_at +{k['ledger_created_s']}s); learners tok/s after/before: {rp}",
                flush=True,
            )
            for sk, o in k.get("other_shards", {}).items():
                print(
                    f"      shard {sk} ({o['holder']}, token {o['token']}): holder and token "
                    f"{'kept' if o['holder_and_token_kept'] else 'CHANGED ' + str(o['lease_changes'])}; largest gap around the kill "
                    f"{o['max_gap_around_s']}s (from +{o['max_gap_starts_after_kill_s']}s; across the kill {o['gap_across_kill_s']}s) "
                    f"vs steady median {o['steady_median_gap_s']}s "
                    f"(ratio {o['ratio_to_median']}), steady max {o['steady_max_gap_s']}s -> "
                    f"{'uninterrupted' if o['uninterrupted'] else 'INTERRUPTED'} (threshold {o['threshold_s']}s)",
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
        run.ro.engine.dispose()
        run.ctx.engine.dispose()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    out["summary"], out["goal"] = summarize(out, args)
    return out


def summarize(out: dict, args) -> tuple[dict, dict]:
    """A run's summary figures and its goal verdicts."""
    kills = out["kills"]
    times = [k["failover_s"] for k in kills if k["failover_s"] is not None]
    prog = [k["ratio_progress"] for k in kills if k["ratio_progress"]]
    after = [k["tokens_per_s_after"]["progress"] for k in kills if k["tokens_per_s_after"]["progress"] is not None]
    base = out["baseline"]["progress"]
    vs_baseline = (sum(after) / len(after)) / base if after and base else None
    p99 = percentile(times, 99) if times else None
    ok_time = bool(times) and len(times) == len(kills) == args.kills and p99 <= GOAL_FAILOVER_P99_S
    ok_tps = vs_baseline is not None and vs_baseline >= GOAL_TPS_RATIO
    summary = {
        "kills": len(kills),
        "failover_s": times,
        "failover_p50_s": round(percentile(times, 50), 3) if times else None,
        "failover_p99_s": round(p99, 3) if p99 is not None else None,
        "failover_mean_s": round(sum(times) / len(times), 3) if times else None,
        "failover_max_s": round(max(times), 3) if times else None,
        "takeover_p50_s": round(percentile([k["takeover_s"] for k in kills if k["takeover_s"] is not None], 50), 3)
        if any(k["takeover_s"] is not None for k in kills) else None,
        "takeovers_by_presence": sum(k["takeover_by"] == "presence" for k in kills),
        "publish_after_takeover_mean_s": round(
            sum(k["failover_s"] - k["takeover_s"] for k in kills if k["failover_s"] and k["takeover_s"]) / len(times), 3)
        if times else None,
        "lease_left_mean_s": round(sum(k["lease_left_s"] for k in kills) / len(kills), 3) if kills else None,
        "self_takeovers": out.get("lease_takeovers", {}).get("self"),
        "spontaneous_takeovers": out.get("lease_takeovers", {}).get("spontaneous"),
        "tokens_per_s_baseline": round(base, 1) if base else None,
        "tokens_per_s_after_kills_mean": round(sum(after) / len(after), 1) if after else None,
        "tokens_per_s_after_vs_baseline": round(vs_baseline, 4) if vs_baseline is not None else None,
        "tokens_per_s_ratio_progress_mean": round(sum(prog) / len(prog), 4) if prog else None,
    }
    goal = {"failover_pass": ok_time, "tokens_per_s_pass": ok_tps, "pass": ok_time and ok_tps}
    if args.shards > 1:
        others = [o for k in kills for o in k["other_shards"].values()]
        ratios = [o["ratio_to_median"] for o in others if o["ratio_to_median"] is not None]
        ok_others = bool(others) and len(kills) == args.kills and all(o["uninterrupted"] for o in others)
        summary.update(
            shards=args.shards,
            killed_shards=[k["shard"] for k in kills],
            other_shards_judged=len(others),
            other_shards_uninterrupted=sum(bool(o["uninterrupted"]) for o in others),
            other_shards_holder_and_token_kept=sum(bool(o["holder_and_token_kept"]) for o in others),
            other_shards_max_gap_ratio=max(ratios) if ratios else None,
            other_shards_max_gap_around_s=max((o["max_gap_around_s"] for o in others if o["max_gap_around_s"] is not None), default=None),
        )
        # The goal with shards: the killed shard's next version within the p99 goal, the others uninterrupted.
        goal = {"failover_pass": ok_time, "other_shards_pass": ok_others, "tokens_per_s_pass": ok_tps, "pass": ok_time and ok_others}
    return summary, goal


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="seeds the random delay before each kill")
    ap.add_argument("--window-s", type=float, default=6.0, help="tokens/s window before and after each kill")
    ap.add_argument("--baseline-s", type=float, default=30.0, help="the no-kill baseline's length")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="give up on a failover after this long")
    ap.add_argument("--ledgers", default=None, help="comma list of: sqlite, postgres (default both; --quick: sqlite)")
    ap.add_argument("--shards", type=int, default=1,
                    help="synchronizer.shards: N + 1 synchronizers, each kill takes the next shard's holder (default 1)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs (ledger, store, process logs)")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    if args.shards < 1:
        ap.error("--shards must be >= 1")
    ledgers = (args.ledgers or ("sqlite" if args.quick else ",".join(LEDGERS))).split(",")
    if unknown := [x for x in ledgers if x not in LEDGERS]:
        ap.error(f"--ledgers: {', '.join(unknown)} is not one of {', '.join(LEDGERS)}")
    if args.quick:
        args.kills, args.window_s, args.baseline_s = (1, 2.0, 3.0) if args.shards == 1 else (args.shards, 4.0, 3.0)
        if not args.json:
            # never the published figures
            args.json = str(Path(tempfile.gettempdir()) / f"ddiloco-{NAME}{shards_suffix(args.shards)}.quick.json")

    cfg = bench_config("failover", args.quick, args.shards)
    results = header(NAME, args)
    results["config"] = {
        "shards": cfg.synchronizer.shards,
        "synchronizers": cfg.synchronizer.shards + 1,
        "lease_ttl_s": cfg.synchronizer.lease_ttl_s,
        "synchronizer_poll_s": cfg.synchronizer.poll_s,
        "learners": len(LEARNERS),
        "heartbeat_s": cfg.learners.heartbeat_s,
        "fragments": cfg.fragments.count,
        "codec": cfg.compression.codec,
        "model": {k: getattr(cfg.model, k) for k in ("n_layer", "d_model", "seq_len")},
        "batch_size": cfg.learners.batch_size,
    }
    results["ledgers"] = {}
    for ledger in ledgers:  # one after the other: never two runs on the machine at once
        results["ledgers"][ledger] = run_ledger(args, ledger)
    first = results["ledgers"][ledgers[0]]
    results["kills"] = first["kills"]
    results["summary"] = first["summary"]
    results["goal"] = {
        "failover_p99_max_s": GOAL_FAILOVER_P99_S,
        "failover_measure": "p99 (nearest rank) of SIGKILL -> the shard's next version seen committed in the ledger, per ledger",
        "tokens_per_s_ratio_min": GOAL_TPS_RATIO,
        "tokens_per_s_measure": "mean over kills of the tokens added per s in the window after the kill, / the no-kill baseline",
        **{f"{ledger}_{k}": v for ledger, r in results["ledgers"].items() for k, v in r["goal"].items()},
        "pass": all(r["goal"]["pass"] for r in results["ledgers"].values()),
    }
    print()
    for ledger, r in results["ledgers"].items():
        sm = r["summary"]
        if sm["failover_s"]:
            print(
                f"{ledger:9} failover over {len(sm['failover_s'])} kills: p50 {sm['failover_p50_s']:.2f} s, "
                f"p99 {sm['failover_p99_s']:.2f} s, "
                f"max {sm['failover_max_s']:.2f} s (takeover p50 {sm['takeover_p50_s']} s, {sm['takeovers_by_presence']} by presence; "
                f"lease left at kill {sm['lease_left_mean_s']:.2f} s on average; first publish {sm['publish_after_takeover_mean_s']:.2f} s "
                f"after takeover) -> {verdict(r['goal']['failover_pass'])} (goal p99 <= {GOAL_FAILOVER_P99_S:.1f} s)"
            )
        else:
            print(f"{ledger:9} failover: no version published by a standby: FAIL")
        print(
            f"{'':9} learners' tokens/s: baseline {sm['tokens_per_s_baseline']}, after kills {sm['tokens_per_s_after_kills_mean']} "
            f"= {sm['tokens_per_s_after_vs_baseline']} x -> {verdict(r['goal']['tokens_per_s_pass'])} (goal >= {GOAL_TPS_RATIO})"
        )
        if args.shards > 1:
            print(
                f"{'':9} other shards: {sm['other_shards_uninterrupted']}/{sm['other_shards_judged']} uninterrupted, holder and token "
                f"kept {sm['other_shards_holder_and_token_kept']}/{sm['other_shards_judged']}, largest gap around a kill "
                f"{sm['other_shards_max_gap_around_s']} s = {sm['other_shards_max_gap_ratio']} x its steady median -> "
                f"{verdict(r['goal']['other_shards_pass'])}"
            )
    print(f"goal: {verdict(results['goal']['pass'])}")
    write_results(NAME + shards_suffix(args.shards), results, args.json)
    return 0


def shards_suffix(shards: int) -> str:
    """The result file's name suffix: none for one shard (benchmarks/results/failover.json), else _shards<N>."""
    return "" if shards == 1 else f"_shards{shards}"


if __name__ == "__main__":
    sys.exit(main())
