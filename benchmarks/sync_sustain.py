"""Sustained synchronizer load: how many learners one synchronizer shard keeps up with, and two shards.

Issue #15. Simulated learners (no training) submit int8 fragments at the paper's cadence — one
fragment per learner per step, a step every second, fragment p sent every P steps — for a
100M-parameter Llama-style model (Hugging Face Llama: d 768, 12 layers, GQA 12/4 heads, SwiGLU 2048,
vocabulary 32,000, tied embeddings; 100.09 M parameters in P = 24 fragments). Everything else is real:

  * the synchronizer(s): ``python -m ddiloco synchronizer --shard k`` processes (one per shard), the
    shipped code, wrapped only to count where their time goes (named spans plus timers around store,
    ledger, decode and merge calls; nothing patched changes behaviour);
  * the ledger: a scratch database on the local PostgreSQL server (or $DDILOCO_TEST_POSTGRES_URL's; without
    either, a throwaway cluster when initdb is installed), durable commits;
  * the blobs: a ``file://`` store in a temp dir (``--store s3``: moto's S3 server in its own process,
    through s3fs, which is itself slow — its figures measure moto as much as the synchronizer).

Each simulated learner, every second: writes its fragment's int8 blob (encoded once per fragment,
written anew under the key its ids give) through ``FragmentStore.put_bytes``, then registers it in
the learner's one ledger transaction per step, ``ledger.learner.learner_exchange`` (registration + heartbeat
+ reading every fragment head), with honest counts (c_steps = H, c_tokens = H steps of tokens, one
step of new tokens) and the base version it read in its previous exchange. Learners are threads of
``--drivers`` driver processes; the driver's own lag (submissions started behind schedule) is
measured so that a slow driver is not mistaken for a slow synchronizer. By default the learners'
phases are spread (learner i sends fragment (i·P/L + k) mod P at second k + i/L, as learners that
joined at different times do); ``--phases aligned`` has them all send the same fragment each second.

Per (shards, learners) point, over a window of ``--minutes`` after a warm-up:
  * backlog: pending submissions sampled every second; no upward trend when the median of the last
    minute (a third of the window when shorter) is <= 2x that of the first (floored at 1);
  * median staleness of the submissions merged in the window (their ``staleness`` column);
  * served: share of the window's submissions merged by its end (those of its last 5 s left out);
    merges/s, submissions per merge, merge time (``merges.merge_s``), submission-to-merge latency;
  * the synchronizers' CPU (1.0 = one core) and where their pass time went.
A point keeps up, by the issue's criteria, when the backlog shows no upward trend and the median
staleness is <= 2 (and >= 95 % was served, <= 1 % rejected). Stricter, ``keeps_up_within_bound``
also wants the backlog under a fixed bound of 5 s of submissions (5 x learners): on average no
submission waits longer than the longest grace window the synchronizer ever waits on purpose
(``grace.max_s``). A point is conclusive only when the driver kept its schedule (p99 lag <= 0.5 s).

The baseline is the same run's one-shard figure: goal one shard >= 16 learners, two shards >= 1.7x
one. This machine has 2 cores shared with other work: synchronizers, drivers and PostgreSQL share
them, so two shards can only beat one where one shard leaves CPU idle.

    python benchmarks/sync_sustain.py --learners 4,8,16,24,32 --shards 1,2 [--minutes 5] [--store s3] [--merge]

``--merge`` adds the points to the published file (a point with the same store, phases, shards and
learners is replaced), so the search can be run a few points at a time; every point keeps its own
date, commit and load. ``--quick`` (2 learners, a tiny model, seconds) never writes the published file.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

NAME = "sync_sustain"
STEP_S = 1.0
"""The paper's step time: each learner submits one fragment per step."""
FRAGMENTS = 24
LLAMA_100M = {
    "kind": "hf", "vocab_size": 32_000, "seq_len": 1024,
    "hf_config": {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 1024,
                  "tie_word_embeddings": True},
}
QUICK_MODEL = {"kind": "gpt", "n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32}
BATCH = 8
"""Sequences per learner step: with seq_len 1024, 8,192 tokens a step."""
DELTA_STD = 2e-3
"""Per-coordinate size of the simulated outer gradient: well under what an inner step may move (the outlier check)."""
GOAL_ONE_SHARD = 16
GOAL_SCALING = 1.7
STALENESS_MAX = 2.0
BACKLOG_TREND_MAX = 2.0
BACKLOG_BOUND_S = 5.0
"""The fixed backlog bound, in seconds of submissions (x learners): grace.max_s, the longest a merge waits on purpose."""
SERVED_MIN = 0.95
REJECTED_MAX = 0.01
DRIVER_LAG_P99_MAX_S = 0.5
TAIL_S = 5.0
"""Submissions of the window's last seconds are left out of the served share (their merge is still due)."""
CTX = mp.get_context("spawn")


# --- the synchronizer, wrapped to count where its time goes ---------------------------------------------------------


def synchronizer_child(profile: str, command: list[str]) -> int:
    """Run ``ddiloco <command>`` in this process, adding timers around the calls a pass spends its time in;
    a snapshot of the totals (and this process's CPU seconds) is written to ``profile`` every half second."""
    from ddiloco.platform import spans
    from ddiloco.platform import store as store_mod
    from ddiloco.platform.runtime import RunContext
    from ddiloco.synchronizer import fetch, service

    def timed_fn(fn, name: str):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans.add(name, time.perf_counter() - t0)
        return wrapper

    def timed_cm(cm, name: str):
        @contextmanager
        def wrapper(self):
            t0 = time.perf_counter()
            try:
                with cm(self) as s:
                    yield s
            finally:
                spans.add(name, time.perf_counter() - t0)
        return wrapper

    # Where each is looked up at call time: the fetcher's and service's own imports, the store module's globals, the classes.
    fetch.decode_delta_into = timed_fn(fetch.decode_delta_into, "t.decode")
    service.merge_fragment = timed_fn(service.merge_fragment, "t.merge_fragment")
    store_mod.decode_tensors = timed_fn(store_mod.decode_tensors, "t.blob_parse")
    store_mod.encode_tensors = timed_fn(store_mod.encode_tensors, "t.blob_encode")
    store_mod.FragmentStore.get_bytes = timed_fn(store_mod.FragmentStore.get_bytes, "t.store_get")
    store_mod.FragmentStore.put_bytes = timed_fn(store_mod.FragmentStore.put_bytes, "t.store_put")
    store_mod.FragmentStore.delete = timed_fn(store_mod.FragmentStore.delete, "t.store_delete")
    RunContext.transaction = timed_cm(RunContext.transaction, "t.ledger_write")
    RunContext.reading = timed_cm(RunContext.reading, "t.ledger_read")

    from common import process_cpu_s

    done = threading.Event()
    with spans.collecting() as totals:

        def snapshot() -> None:
            data = {"t": time.time(), "cpu_s": process_cpu_s(os.getpid()), "runqueue_s": runqueue_wait_s(),
                    "totals": dict(totals)}
            tmp = f"{profile}.tmp"
            Path(tmp).write_text(json.dumps(data))
            os.replace(tmp, profile)

        def writer() -> None:
            while not done.wait(0.5):
                snapshot()

        threading.Thread(target=writer, name="profile-writer", daemon=True).start()
        from ddiloco.cli import app

        try:
            app(args=command, prog_name="ddiloco")
        except SystemExit as err:
            return int(err.code or 0)
        finally:
            done.set()
            snapshot()
    return 0


def runqueue_wait_s() -> float | None:
    """Seconds this process's threads, together, have waited for a CPU while runnable (schedstat): CPU starvation."""
    total = 0.0
    try:
        for task in Path("/proc/self/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[1]) / 1e9
            except (OSError, ValueError, IndexError):
                continue  # a thread that just ended
    except OSError:
        return None
    return total


def read_profile(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- simulated learners ---------------------------------------------------------------------------------------------


def schedule(index: int, learners: int, fragments: int, phases: str) -> tuple[float, int]:
    """(offset within the second, first fragment) of learner ``index``: spread over the second and, unless aligned, over the fragments."""
    return index / learners, (0 if phases == "aligned" else (index * fragments) // learners)


def learner_loop(ctx, lid: str, region: str, offset: float, first: int, blobs: list[bytes], heads: dict[int, int],
                 t_start: float, stop, counts: tuple[int, int, int], records: list) -> None:
    """One simulated learner: every STEP_S, write the next fragment's blob and register it in the step's one exchange."""
    from ddiloco.platform.ids import submission_key
    from ddiloco.platform.ledger import learner as learner_q
    from ddiloco.platform.runtime import to_datetime

    H, tokens_step, P = counts
    store = ctx.store(region)
    k = 0
    while True:
        due = t_start + offset + k * STEP_S
        wait = due - time.time()
        if wait > 0 and stop.wait(wait):
            return
        if stop.is_set():
            return
        started = time.time()
        frag, step = (first + k) % P, k + 1
        uid = f"i0-s{step}-f{frag}"
        ok = True
        t_put = t_ex = math.nan
        try:
            t0 = time.perf_counter()
            blob = store.put_bytes(submission_key(ctx.run_id, frag, lid, uid), blobs[frag])
            t1 = time.perf_counter()
            sub = learner_q.SubmissionIn(uid, frag, heads.get(frag, 0), H, H * tokens_step, tokens_step, step * tokens_step, blob.key,
                                 blob.sha256, blob.nbytes, "int8", data_batches=step)
            beat = learner_q.Beat(step, step * tokens_step, 3.0, tokens_step / STEP_S, STEP_S, STEP_S, history=k % 2 == 0,
                          queue_depth=0, oldest_unsent_s=0.0)
            with ctx.transaction() as s:
                ex = learner_q.learner_exchange(s, ctx.run_id, lid, 0, [sub], beat, to_datetime(time.time()))
            t_put, t_ex = t1 - t0, time.perf_counter() - t1
            heads = {f: h.version for f, h in ex.heads.items()}
        except Exception as err:  # noqa: BLE001 - counted and reported; the learner goes on with its next step
            ok = False
            print(f"{lid} step {step}: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr, flush=True)
        records.append((due, started, time.time(), t_put, t_ex, ok))
        k += 1


def driver_main(config_path: str, members: list[tuple[str, str, float, int]], blob_dir: str, heads: dict[int, int],
                ready, go, start_at, stop, out_path: str) -> None:
    """A driver process: its learners as threads, from the go signal until stop; their records to ``out_path``."""
    import torch
    from common import process_cpu_s

    from ddiloco.platform.config import load_config, tokens_per_step
    from ddiloco.platform.runtime import RunContext

    torch.set_num_threads(1)
    cfg = load_config(config_path)
    ctx = RunContext.open(cfg, cfg.name)
    P = cfg.fragments.count
    blobs = [Path(blob_dir, f"f{p}.bin").read_bytes() for p in range(P)]
    counts = (cfg.fragments.period, tokens_per_step(cfg.model, cfg.learners.batch_size), P)
    with ctx.reading() as s:  # connect before the start line
        s.connection()
    ready.put(os.getpid())
    go.wait()
    t_start = start_at.value
    cpu0 = process_cpu_s(os.getpid())
    records: dict[str, list] = {lid: [] for lid, *_ in members}
    threads = [
        threading.Thread(target=learner_loop, name=lid, daemon=True,
                         args=(ctx, lid, region, offset, first, blobs, dict(heads), t_start, stop, counts, records[lid]))
        for lid, region, offset, first in members
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = (process_cpu_s(os.getpid()) or 0.0) - (cpu0 or 0.0)
    Path(out_path).write_text(json.dumps({"records": records, "cpu_s": cpu, "wall_s": time.time() - t_start}))
    ctx.engine.dispose()


class InProcess:
    """The part of a multiprocessing context the drivers use, as threads of this process (--drivers 0, --quick)."""

    Queue = staticmethod(lambda: __import__("queue").Queue())
    Event = threading.Event

    class Value:
        def __init__(self, _typecode: str, value: float) -> None:
            self.value = value

    class Process(threading.Thread):
        exitcode = None

        def terminate(self) -> None:  # a thread cannot be killed: its learners stop at the stop event
            pass


def make_blobs(ctx, cfg, out: Path) -> dict[str, Any]:
    """Each fragment's int8 outer gradient, encoded once (random, seeded by fragment), as blob bytes in ``out``."""
    import torch

    from ddiloco.platform.compression import encode_delta
    from ddiloco.platform.ledger import runs as runs_q
    from ddiloco.platform.store import encode_tensors

    with ctx.reading() as s:
        specs = runs_q.fragment_specs(s, ctx.run_id)
    out.mkdir(parents=True, exist_ok=True)
    sizes, params = [], 0
    for p, tensors in sorted(specs.items()):
        g = torch.Generator().manual_seed(1000 + p)
        delta = {key: torch.randn(tuple(shape), generator=g) * DELTA_STD for key, shape in tensors}
        params += sum(t.numel() for t in delta.values())
        data = encode_tensors(*encode_delta(delta, "int8", cfg.compression.block_size))
        Path(out, f"f{p}.bin").write_bytes(data)
        sizes.append(len(data))
    return {"params": params, "fragments": len(sizes), "blob_bytes_mean": round(statistics.mean(sizes)),
            "blob_bytes_total": sum(sizes)}


# --- one point ------------------------------------------------------------------------------------------------------


def bench_config(name: str, learners: int, shards: int, ledger_url: str, store_url: str, storage_options: dict, quick: bool):
    from ddiloco.platform.config import build_config

    P = 4 if quick else FRAGMENTS
    return build_config({
        "name": name,
        "token_budget": 1 << 62,  # the run never ends by itself
        "model": QUICK_MODEL if quick else LLAMA_100M,
        "learners": {"regions": [{"name": "sim", "learners": learners}], "batch_size": BATCH},
        "fragments": {"count": P, "every": P},
        "compression": {"codec": "int8"},
        "synchronizer": {"shards": shards},
        "ledger": {"url": ledger_url},
        "storage": {"url": store_url, "storage_options": storage_options},
    })


def _pct(xs: list[float], p: float) -> float | None:
    xs = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))]


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def backlog_verdict(samples: list[tuple[float, int]], t0: float, t1: float, learners: int) -> dict[str, Any]:
    """Is the pending backlog bounded over [t0, t1]? (first vs last minute, or thirds of a shorter window; a fixed bound)."""
    inside = [(t, n) for t, n in samples if t0 <= t <= t1]
    span = min(60.0, (t1 - t0) / 3)
    first = [n for t, n in inside if t < t0 + span]
    last = [n for t, n in inside if t > t1 - span]
    f, la = (statistics.median(first) if first else math.nan), (statistics.median(last) if last else math.nan)
    bound = BACKLOG_BOUND_S * learners
    seconds = la / learners if learners else math.nan
    trend_ok = la <= BACKLOG_TREND_MAX * max(f, 1.0)
    slope = None
    if len(inside) >= 3:
        ts = [t - t0 for t, _ in inside]
        ns = [n for _, n in inside]
        mt, mn = statistics.mean(ts), statistics.mean(ns)
        var = sum((t - mt) ** 2 for t in ts)
        slope = sum((t - mt) * (n - mn) for t, n in zip(ts, ns)) / var * 60 if var > 0 else 0.0
    return {
        "first_median": f, "last_median": la, "span_s": round(span, 1), "max": max((n for _, n in inside), default=None),
        "bound": bound, "slope_per_min": _r(slope, 2), "trend_ok": bool(trend_ok), "under_bound": bool(la <= bound),
        "bounded": bool(trend_ok and la <= bound), "samples": len(inside), "last_in_s_of_submissions": _r(seconds, 2),
    }


def ledger_figures(ctx, assignment: list[tuple[int, ...]], t0: float, t1: float) -> dict[str, Any]:
    """What the ledger says about the window: submissions' fates, staleness and latency, merges."""
    from sqlalchemy import select

    from ddiloco.platform.ledger.models import Merge, Submission

    shard_of = {f: k for k, frags in enumerate(assignment) for f in frags}
    d0, d1 = datetime.fromtimestamp(t0, tz=timezone.utc), datetime.fromtimestamp(t1, tz=timezone.utc)
    with ctx.reading() as s:
        subs = s.execute(
            select(Submission.status, Submission.staleness, Submission.created_at, Submission.decided_at, Submission.reject_reason)
            .where(Submission.run_id == ctx.run_id, Submission.created_at >= d0, Submission.created_at < d1)
        ).all()
        merges = s.execute(
            select(Merge.fragment, Merge.included, Merge.rejected, Merge.merge_s, Merge.grace_waited_s)
            .where(Merge.run_id == ctx.run_id, Merge.at >= d0, Merge.at < d1)
        ).all()
    window = t1 - t0
    cut = d1.timestamp() - min(TAIL_S, window / 4)
    counted = [r for r in subs if r.created_at.timestamp() < cut]
    merged = [r for r in counted if r.status == "merged" and r.decided_at is not None and r.decided_at <= d1]
    rejected = [r for r in counted if r.status == "rejected"]
    staleness = [r.staleness for r in subs if r.status == "merged" and r.staleness is not None and r.decided_at <= d1]
    latency = [(r.decided_at - r.created_at).total_seconds() for r in merged]
    reasons: dict[str, int] = {}
    for r in rejected:
        key = (r.reject_reason or "")[:80]
        reasons[key] = reasons.get(key, 0) + 1
    per_shard = {k: sum(1 for m in merges if shard_of.get(m.fragment) == k) / window for k in range(len(assignment))}
    return {
        "submissions": len(subs),
        "submissions_per_s": _r(len(subs) / window, 2),
        "served_share": _r(len(merged) / len(counted), 4) if counted else None,
        "rejected_share": _r(len(rejected) / len(counted), 4) if counted else None,
        "rejected_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:5]),
        "staleness_median": statistics.median(staleness) if staleness else None,
        "staleness_p90": _pct(staleness, 0.9),
        "staleness_max": max(staleness, default=None),
        "latency_s_median": _r(_pct(latency, 0.5)),
        "latency_s_p90": _r(_pct(latency, 0.9)),
        "merges": len(merges),
        "merges_per_s": _r(len(merges) / window, 2),
        "merges_per_s_by_shard": {str(k): _r(v, 2) for k, v in per_shard.items()},
        "submissions_per_merge": _r(statistics.mean([m.included for m in merges]), 2) if merges else None,
        "merge_s_median": _r(_pct([m.merge_s for m in merges], 0.5), 4),
        "merge_s_p90": _r(_pct([m.merge_s for m in merges], 0.9), 4),
        "grace_waited_s_median": _r(_pct([m.grace_waited_s for m in merges], 0.5)),
    }


def driver_figures(outputs: list[dict], t0: float, t1: float) -> dict[str, Any]:
    recs = [r for out in outputs for rows in out["records"].values() for r in rows if t0 <= r[0] < t1]
    lag = [r[1] - r[0] for r in recs]
    return {
        "submissions": len(recs),
        "failed": sum(1 for r in recs if not r[5]),
        "lag_s_median": _r(_pct(lag, 0.5)),
        "lag_s_p99": _r(_pct(lag, 0.99)),
        "lag_s_max": _r(max(lag, default=None)),
        "late_share_over_0_5s": _r(sum(1 for x in lag if x > 0.5) / len(lag), 4) if lag else None,
        "put_s_median": _r(_pct([r[3] for r in recs], 0.5), 4),
        "put_s_p99": _r(_pct([r[3] for r in recs], 0.99), 4),
        "exchange_s_median": _r(_pct([r[4] for r in recs], 0.5), 4),
        "exchange_s_p99": _r(_pct([r[4] for r in recs], 0.99), 4),
        "cpu_share": _r(sum(out["cpu_s"] for out in outputs) / max(1e-9, max(out["wall_s"] for out in outputs)), 3),
        "processes": len(outputs),
    }


PROFILE_KEYS = {
    "pass": "sync.poll_once", "fetch": "sync.fetch", "merge": "sync.merge", "publish": "sync.publish", "gc": "sync.gc",
    "store_get": "t.store_get", "blob_parse": "t.blob_parse", "decode": "t.decode", "merge_fragment": "t.merge_fragment",
    "blob_encode": "t.blob_encode", "store_put": "t.store_put", "store_delete": "t.store_delete",
    "ledger_read": "t.ledger_read", "ledger_write": "t.ledger_write",
}


def profile_figures(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """Seconds per second of window each part of a synchronizer took (thread-seconds: fetches run 8 at a time)."""
    if not before or not after or after["t"] <= before["t"]:
        return None
    wall = after["t"] - before["t"]
    a, b = after["totals"], before["totals"]
    out: dict[str, Any] = {k: _r((a.get(v, 0.0) - b.get(v, 0.0)) / wall) for k, v in PROFILE_KEYS.items()}
    out["passes_per_s"] = _r((a.get("sync.poll_once.calls", 0) - b.get("sync.poll_once.calls", 0)) / wall, 2)
    if after.get("cpu_s") is not None and before.get("cpu_s") is not None:
        out["cpu_share"] = _r((after["cpu_s"] - before["cpu_s"]) / wall)
    if after.get("runqueue_s") is not None and before.get("runqueue_s") is not None:
        # Thread-seconds per second spent runnable but waiting for a CPU (another process had it).
        out["runqueue_wait_share"] = _r((after["runqueue_s"] - before["runqueue_s"]) / wall)
    return out


def machine_share(before, after) -> float | None:
    if not before or not after or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 3)


def run_point(args, learners: int, shards: int, stack_env: dict[str, str]) -> dict[str, Any]:
    """One (shards, learners) point on a fresh ledger and store; its figures."""
    from common import machine_busy

    from ddiloco.bench.provenance import git_state, load_average
    from ddiloco.platform.config import environment
    from ddiloco.platform.ledger import learner as learner_q
    from ddiloco.platform.ledger import synchronizer as sync_q
    from ddiloco.platform.runtime import RunContext
    from ddiloco.testing.postgres import scratch_database, server_url
    from ddiloco.testing.processes import ProcessCluster, write_config

    run_id = "sustain"
    window_s = args.minutes * 60
    warmup_s = args.warmup_s
    point: dict[str, Any] = {"store": args.store, "phases": args.phases, "shards": shards, "learners": learners,
                             "minutes": args.minutes, "warmup_s": warmup_s,
                             "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **git_state(),
                             "dirty_runtime_files": _dirty_runtime_files(),
                             "load_avg_1m_start": load_average(), "uptime_start": _uptime()}
    print(f"\n== {shards} shard(s), {learners} learners, {args.store} store, {args.phases} phases: "
          f"{args.minutes:g} min window after {warmup_s:g} s warm-up; {point['uptime_start']}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="sync-sustain-"))
    setup: dict[str, float] = {}
    mark = [time.perf_counter()]

    def phase(name: str) -> None:
        setup[name] = round(time.perf_counter() - mark[0], 2)
        mark[0] = time.perf_counter()

    with ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, True)
        ledger_url = stack.enter_context(scratch_database(server_url(), "ddiloco_sustain", durable=True))
        storage_options: dict[str, Any] = {}
        env = {"DDILOCO_LEDGER__URL": ledger_url, **stack_env}
        if args.store == "s3":
            from ddiloco.testing.s3 import TEST_CREDENTIALS, S3Server

            s3 = stack.enter_context(S3Server(own_process=True, log=workdir / "moto.log"))
            bucket = s3.bucket("sustain", s3.storage_options())
            store_url = f"s3://{bucket}/store"
            storage_options = {"client_kwargs": {"endpoint_url": s3.url}}
            env.update(TEST_CREDENTIALS)
        else:
            store_url = f"file://{workdir / 'store'}"
        stack.enter_context(environment(env))  # this process and the drivers it spawns
        cfg = bench_config(run_id, learners, shards, ledger_url, store_url, storage_options, args.quick)
        config_path = write_config(cfg, workdir / "config.yaml")
        phase("ledger_and_store")
        cluster = ProcessCluster(config_path, run_id, workdir / "logs", env=dict(os.environ))
        stack.callback(cluster.stop_all, 30.0)
        profiles = [workdir / f"profile-{k}.json" for k in range(shards)]
        t_launch = time.time()
        from ddiloco.entry import ProcessSpec

        for k in range(shards):
            cluster.start(f"sync-{k}", ProcessSpec.synchronizer(f"sync-{k}", shard=k),
                          wrap=[sys.executable, str(HERE), "--synchronizer-child", str(profiles[k])])
        ctx = RunContext.open(cfg, run_id)
        stack.callback(ctx.engine.dispose)
        P = cfg.fragments.count

        def check_alive() -> None:
            for name, proc in cluster.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}):\n{cluster.log(name)[-3000:]}")

        heads: dict[int, int] = {}
        while len(heads) < P:  # every shard has published version 0 of its fragments
            check_alive()
            if time.time() - t_launch > 900:
                raise RuntimeError("the synchronizers did not publish version 0 of every fragment in 15 minutes")
            time.sleep(0.2)
            try:
                with ctx.reading() as s:
                    heads = {f: h.version for f, h in learner_q.read_heads(s, run_id).items()}
            except Exception:  # noqa: BLE001 - the run row may not exist yet
                heads = {}
        phase("synchronizers_ready")
        point["model"] = make_blobs(ctx, cfg, workdir / "blobs")
        phase("blobs")
        now = ctx.now_dt()
        ids = cfg.learners.learner_ids()
        with ctx.transaction() as s:
            for lid, region, _speed in ids:
                learner_q.register_learner(s, run_id, lid, region, now, host="sync-sustain", pid=os.getpid())
        from ddiloco.platform.fragments import shard_fragments

        with ctx.reading() as s:
            nbytes = [n for _, n in sorted(_fragment_nbytes(s, run_id).items())]
        assignment = shard_fragments(nbytes, shards)  # the synchronizers' own split

        # Drivers: learners dealt round-robin to the processes (--drivers 0: one thread of this process).
        in_process = args.drivers == 0
        n_drivers = 1 if in_process else min(args.drivers, learners)
        kind = InProcess if in_process else CTX
        ready, go, stop, start_at = kind.Queue(), kind.Event(), kind.Event(), kind.Value("d", 0.0)
        members: list[list[tuple[str, str, float, int]]] = [[] for _ in range(n_drivers)]
        for i, (lid, region, _speed) in enumerate(ids):
            offset, first = schedule(i, learners, P, args.phases)
            members[i % n_drivers].append((lid, region, offset, first))
        outs = [workdir / f"driver-{d}.json" for d in range(n_drivers)]
        drivers = [kind.Process(target=driver_main, name=f"driver-{d}", daemon=True,
                               args=(str(config_path), members[d], str(workdir / "blobs"), heads, ready, go, start_at, stop,
                                     str(outs[d])))
                   for d in range(n_drivers)]
        for p in drivers:
            p.start()

        def stop_drivers() -> None:
            stop.set()
            go.set()
            for p in drivers:
                p.join(timeout=60)
                if p.is_alive():
                    p.terminate()
                    p.join(10)

        stack.callback(stop_drivers)
        for _ in drivers:
            ready.get(timeout=300)
        phase("drivers_ready")
        t_start = time.time() + 1.0
        start_at.value = t_start
        go.set()
        t0, t1 = t_start + warmup_s, t_start + warmup_s + window_s
        samples: list[tuple[float, int, dict[int, int]]] = []
        snap0 = snap1 = None
        next_sample = t_start
        while True:
            now = time.time()
            if now >= t1:
                break
            check_alive()
            if snap0 is None and now >= t0:
                snap0 = {"profiles": [read_profile(p) for p in profiles], "busy": machine_busy(), "load": load_average(),
                         "uptime": _uptime()}
            with ctx.reading() as s:
                counts = sync_q.pending_counts(s, run_id)
            by_shard = {k: sum(counts.get(f, 0) for f in frags) for k, frags in enumerate(assignment)}
            samples.append((now, sum(counts.values()), by_shard))
            if not args.quiet and len(samples) % 15 == 0:
                print(f"  t={now - t_start:6.1f}s pending {sum(counts.values()):4d} by shard {by_shard}", flush=True)
            next_sample += 1.0
            time.sleep(max(0.0, min(next_sample, t1) - time.time()))
        snap1 = {"profiles": [read_profile(p) for p in profiles], "busy": machine_busy(), "load": load_average(), "uptime": _uptime()}
        stop_drivers()
        phase("load")
        outputs = [json.loads(p.read_text()) for p in outs if p.exists()]
        if len(outputs) != len(drivers):
            raise RuntimeError(f"{len(drivers) - len(outputs)} driver process(es) left no records (exit codes "
                               f"{[p.exitcode for p in drivers]})")
        point.update(ledger_figures(ctx, assignment, t0, t1))
        point["driver"] = driver_figures(outputs, t0, t1)
        point["backlog"] = backlog_verdict([(t, n) for t, n, _ in samples], t0, t1, learners)
        point["backlog_by_shard"] = {
            str(k): backlog_verdict([(t, by[k]) for t, _, by in samples], t0, t1, max(1, learners // shards))
            for k in range(shards)}
        point["backlog_series"] = [[round(t - t0, 1), n] for t, n, _ in samples if t0 <= t <= t1]
        point["synchronizers"] = [profile_figures(a, b) for a, b in zip(snap0["profiles"], snap1["profiles"], strict=True)]
        point["machine_busy_share"] = machine_share(snap0["busy"], snap1["busy"])
        point["load_avg_1m_window_start"], point["load_avg_1m_window_end"] = snap0["load"], snap1["load"]
        point["uptime_window_start"], point["uptime_window_end"] = snap0["uptime"], snap1["uptime"]
        phase("figures")
    phase("teardown")
    point["setup_s"] = setup
    point["offered_per_s"] = learners / STEP_S
    judge(point)
    point["load_avg_1m_end"], point["uptime_end"] = load_average(), _uptime()
    print_point(point)
    return point


def _fragment_nbytes(session, run_id: str) -> dict[int, int]:
    from sqlalchemy import select

    from ddiloco.platform.ledger.models import FragmentSpec

    return {r.fragment: r.nbytes for r in session.execute(
        select(FragmentSpec.fragment, FragmentSpec.nbytes).where(FragmentSpec.run_id == run_id))}


def judge(point: dict[str, Any]) -> None:
    """Keeps up? By the issue's criteria: no upward trend of the backlog, median staleness <= 2, and the basics
    (>= 95 % served, <= 1 % rejected); ``keeps_up_within_bound`` also wants the backlog under the fixed bound.
    Conclusive? Only when the driver kept its schedule."""
    why = []
    b = point["backlog"]
    b.setdefault("last_in_s_of_submissions", _r(b["last_median"] / point["learners"], 2))  # points of earlier versions
    if not b["trend_ok"]:
        why.append(f"backlog grew ({b['first_median']} -> {b['last_median']})")
    st = point["staleness_median"]
    if st is None or st > STALENESS_MAX:
        why.append(f"median staleness {st}")
    if point["served_share"] is None or point["served_share"] < SERVED_MIN:
        why.append(f"served {point['served_share']}")
    if point["rejected_share"] is not None and point["rejected_share"] > REJECTED_MAX:
        why.append(f"rejected {point['rejected_share']}")
    point["keeps_up"] = not why
    point["why_not"] = "; ".join(why)
    b["bounded"] = bool(b["trend_ok"] and b["under_bound"])
    point["keeps_up_within_bound"] = point["keeps_up"] and b["under_bound"]
    point.pop("keeps_up_trend_and_staleness", None)  # an earlier name of the rule
    for k, sync in enumerate(point["synchronizers"]):
        rate = point["merges_per_s_by_shard"].get(str(k))
        if sync and rate:
            sync["ms_per_merge"] = {part: _r(sync[part] / rate * 1000, 1) for part in
                                    ("pass", "fetch", "merge", "publish", "gc", "store_get", "decode", "merge_fragment",
                                     "blob_encode", "store_put", "ledger_write")}
    lag = point["driver"]["lag_s_p99"]
    point["driver_on_schedule"] = lag is not None and lag <= DRIVER_LAG_P99_MAX_S and point["driver"]["failed"] == 0
    point["conclusive"] = point["driver_on_schedule"]


def print_point(p: dict[str, Any]) -> None:
    b, d = p["backlog"], p["driver"]
    print(f"  backlog first {b['first_median']} -> last {b['last_median']} (max {b['max']}, bound {b['bound']:g}, "
          f"slope {b['slope_per_min']}/min; {b['last_in_s_of_submissions']} s of submissions): "
          f"{'no upward trend' if b['trend_ok'] else 'GROWING'}, {'within' if b['under_bound'] else 'OVER'} the bound")
    print(f"  {p['submissions_per_s']} submissions/s (offered {p['offered_per_s']:g}); served {p['served_share']}, "
          f"rejected {p['rejected_share']} {p['rejected_reasons'] or ''}")
    print(f"  staleness median {p['staleness_median']} (p90 {p['staleness_p90']}, max {p['staleness_max']}); "
          f"latency median {p['latency_s_median']} s (p90 {p['latency_s_p90']}); {p['merges_per_s']} merges/s "
          f"{p['merges_per_s_by_shard']}, {p['submissions_per_merge']} submissions/merge, merge_s median {p['merge_s_median']}")
    print(f"  driver: lag median {d['lag_s_median']} s, p99 {d['lag_s_p99']} s, max {d['lag_s_max']} s, failed {d['failed']}; "
          f"put median {d['put_s_median']} s, exchange median {d['exchange_s_median']} s (p99 {d['exchange_s_p99']}); "
          f"CPU {d['cpu_share']} cores in {d['processes']} process(es)")
    for k, s in enumerate(p["synchronizers"]):
        if s:
            print(f"  sync-{k}: CPU {s.get('cpu_share')} cores, waited for a CPU {s.get('runqueue_wait_share')} thread-s/s; "
                  f"per second of window: pass {s['pass']} s "
                  f"({s['passes_per_s']} passes/s) = fetch {s['fetch']} + merge {s['merge']} + publish {s['publish']} + gc {s['gc']}; "
                  f"inside (thread-s/s): store get {s['store_get']}, parse {s['blob_parse']}, decode {s['decode']}, "
                  f"merge_fragment {s['merge_fragment']}, encode {s['blob_encode']}, store put {s['store_put']}, "
                  f"delete {s['store_delete']}, ledger read {s['ledger_read']} / write {s['ledger_write']}")
            if s.get("ms_per_merge"):
                print(f"         ms per merge: {s['ms_per_merge']}")
    print(f"  machine busy {p['machine_busy_share']} of 2 cores' time; load {p['load_avg_1m_window_start']} -> "
          f"{p['load_avg_1m_window_end']} over the window")
    verdict = "KEEPS UP" if p["keeps_up"] else f"FALLS BEHIND ({p['why_not']})"
    verdict += "" if p["backlog"]["under_bound"] else f"; backlog over the {BACKLOG_BOUND_S:g} s bound"
    print(f"  => {verdict}{'' if p['conclusive'] else ' [INCONCLUSIVE: the driver fell behind its schedule]'}", flush=True)


# --- the search and the summary -------------------------------------------------------------------------------------


def point_key(p: dict[str, Any]) -> tuple:
    return (p["store"], p["phases"], p["shards"], p["learners"])


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per store, phases and shard count: the largest learner count that kept up (with every smaller one run
    keeping up too), the smallest that did not; the 2-shard / 1-shard ratio; the goals."""
    out: dict[str, Any] = {}
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault((p["store"], p["phases"], p["shards"]), []).append(p)
    for (store, phases, shards), ps in sorted(groups.items()):
        ps = sorted(ps, key=lambda p: p["learners"])
        largest = first_fail = strict = None
        for p in ps:
            if p["keeps_up"] and p["conclusive"]:
                if first_fail is None:
                    largest = p
            elif first_fail is None:
                first_fail = p
        for p in ps:
            if not (p["keeps_up_within_bound"] and p["conclusive"]):
                break
            strict = p
        out.setdefault(f"{store}/{phases}", {})[str(shards)] = {
            "largest_keeping_up": largest["learners"] if largest else 0,
            "its_window_min": largest["minutes"] if largest else None,
            "smallest_falling_behind": first_fail["learners"] if first_fail else None,
            "its_reason": (first_fail["why_not"] or "driver off schedule") if first_fail else None,
            "largest_within_bound": strict["learners"] if strict else 0,
            "points": [[p["learners"], p["minutes"], p["keeps_up"], p["conclusive"]] for p in ps],
        }
    main = out.get("file/spread", {})
    one = main.get("1", {}).get("largest_keeping_up")
    two = main.get("2", {}).get("largest_keeping_up")
    ratio = two / one if one and two is not None else None
    goal = {"one_shard_min": GOAL_ONE_SHARD, "scaling_min": GOAL_SCALING, "one_shard": one, "two_shards": two,
            "ratio_two_vs_one": _r(ratio, 3),
            "one_shard_pass": bool(one is not None and one >= GOAL_ONE_SHARD),
            "scaling_pass": bool(ratio is not None and ratio >= GOAL_SCALING)}
    goal["pass"] = goal["one_shard_pass"] and goal["scaling_pass"]
    return {"by_setting": out, "goal": goal}


def main(argv: list[str] | None = None) -> int:
    from common import base_parser, exit_on_sigterm, header, verdict, write_results

    from ddiloco.bench.provenance import load_average

    ap = base_parser(__doc__)
    ap.add_argument("--learners", default="4,8,12,16,24,32", help="learner counts to run, ascending (comma separated)")
    ap.add_argument("--shards", default="1,2", help="shard counts to run (comma separated)")
    ap.add_argument("--minutes", type=float, default=5.0, help="measured window per point (the published run: 5)")
    ap.add_argument("--warmup-s", type=float, default=20.0, help="seconds of load before the window opens")
    ap.add_argument("--store", choices=("file", "s3"), default="file")
    ap.add_argument("--phases", choices=("spread", "aligned"), default="spread")
    ap.add_argument("--drivers", type=int, default=2, help="driver processes the learners are dealt to (0: threads of this process)")
    ap.add_argument("--all", action="store_true", help="run every learner count, not stopping at a shard count's first failure")
    ap.add_argument("--merge", action="store_true", help="add the points to the results file instead of replacing it")
    ap.add_argument("--quiet", action="store_true", help="no backlog line every 15 s")
    args = ap.parse_args(argv)
    if args.quick:
        args.learners, args.shards, args.minutes, args.warmup_s, args.drivers = "2", "1", 4 / 60, 2.0, 0
        if args.json is None:
            args.json = str(Path(tempfile.gettempdir()) / f"ddiloco-{NAME}.quick.json")  # never the published figures
    exit_on_sigterm()
    learner_counts = sorted({int(x) for x in args.learners.split(",") if x})
    shard_counts = [int(x) for x in args.shards.split(",") if x]
    results: dict[str, Any] = header(NAME, args)
    results["load_avg_1m_start"], results["uptime_start"] = load_average(), _uptime()
    results["dirty_runtime_files"] = _dirty_runtime_files()
    results["criteria"] = {
        "step_s": STEP_S, "backlog_trend_max": BACKLOG_TREND_MAX, "backlog_bound_s_of_submissions": BACKLOG_BOUND_S,
        "staleness_median_max": STALENESS_MAX, "served_min": SERVED_MIN, "rejected_max": REJECTED_MAX,
        "driver_lag_p99_max_s": DRIVER_LAG_P99_MAX_S, "tail_s": TAIL_S,
    }
    results["model_config"] = QUICK_MODEL if args.quick else LLAMA_100M
    print(f"sync_sustain: learners {learner_counts}, shards {shard_counts}, {args.minutes:g} min windows, "
          f"{args.store} store, {args.phases} phases; {results['uptime_start']}", flush=True)
    path = Path(args.json) if args.json else None
    old_points: list[dict[str, Any]] = []
    if args.merge:
        from common import results_path

        existing = results_path(NAME, args.json, quick=args.quick)
        if existing.exists():
            old = json.loads(existing.read_text())
            old_points = old.get("points", [])
            results["runs"] = old.get("runs", []) + [results["date"]]
    new: list[dict[str, Any]] = []

    def save() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Write what has been measured so far (after every point: a later failure loses nothing)."""
        keys = {point_key(p) for p in new}
        points = sorted([p for p in old_points if point_key(p) not in keys] + new,
                        key=lambda p: (p["store"], p["phases"], p["shards"], p["learners"]))
        for p in points:  # one rule for every point, including those of earlier invocations
            judge(p)
        summary = summarize(points)
        results.update(points=points, summary=summary["by_setting"], goal=summary["goal"])
        results["load_avg_1m_end"], results["uptime_end"] = load_average(), _uptime()
        write_results(NAME, results, str(path) if path else None)
        return points, summary

    with ExitStack() as stack:
        why = postgres_server(stack)
        if why:
            print(f"sync_sustain: no PostgreSQL server to put the ledger on: {why}", flush=True)
            return 2
        for shards in shard_counts:
            for n in learner_counts:
                p = run_point(args, n, shards, {})
                new.append(p)
                points, summary = save()
                if not args.all and not args.quick and not (p["keeps_up"] and p["conclusive"]):
                    break
    print("\nlearners x shards -> backlog first->last, median staleness, merges/s, served, keeps up?")
    for p in points:
        b = p["backlog"]
        print(f"  {p['store']:4} {p['phases']:7} {p['shards']} shard(s) {p['learners']:3} learners ({p['minutes']:g} min): "
              f"backlog {b['first_median']} -> {b['last_median']}, staleness {p['staleness_median']}, "
              f"{p['merges_per_s']} merges/s, served {p['served_share']}, sync CPU "
              f"{[s.get('cpu_share') if s else None for s in p['synchronizers']]}, "
              f"{'keeps up' if p['keeps_up'] else 'falls behind'}{'' if p['conclusive'] else ' (driver off schedule)'}"
              f" (backlog {b['last_in_s_of_submissions']} s of submissions: "
              f"{'within' if b['under_bound'] else 'over'} the {BACKLOG_BOUND_S:g} s bound; latency median {p['latency_s_median']} s)")
    for setting, by in summary["by_setting"].items():
        for shards, s in by.items():
            print(f"  {setting}, {shards} shard(s): largest keeping up {s['largest_keeping_up']} learners; "
                  f"first falling behind {s['smallest_falling_behind']} ({s['its_reason']}); with the backlog also "
                  f"within {BACKLOG_BOUND_S:g} s of submissions: {s['largest_within_bound']}")
    g = results["goal"]
    print(f"goal: one shard >= {GOAL_ONE_SHARD} learners: {verdict(g['one_shard_pass'])} ({g['one_shard']}); "
          f"two shards >= {GOAL_SCALING}x one: {verdict(g['scaling_pass'])} (ratio {g['ratio_two_vs_one']})")
    print(f"load: {results['uptime_start']} at start; {results['uptime_end']} at end")
    return 0


def postgres_server(stack: ExitStack) -> str | None:
    """None when the ledger's server is usable: $DDILOCO_TEST_POSTGRES_URL, the local one, or else (no URL set) a
    throwaway cluster started here and stopped with ``stack`` (a GPU machine has no server); else why not."""
    from ddiloco.platform.config import environment
    from ddiloco.testing import postgres

    url = postgres.server_url()
    reason = postgres.unreachable(url)
    if reason is None:
        return None
    if os.environ.get(postgres.SERVER_URL_ENV):
        return f"{url}: {reason}"
    try:
        cluster = postgres.ThrowawayCluster.start()
    except RuntimeError as err:
        return f"{url}: {reason}; {err}"
    stack.callback(cluster.stop)
    stack.enter_context(environment({postgres.SERVER_URL_ENV: cluster.url}))
    print(f"sync_sustain: the ledger's server is a throwaway cluster ({url}: {reason})", flush=True)
    return None


def _dirty_runtime_files() -> list[str]:
    """Uncommitted changes under ddiloco/ when the run started (the tree is shared): what the figures ran with beyond the commit."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "ddiloco"], cwd=HERE.parent.parent, capture_output=True,
                             text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in out.splitlines() if line.strip()]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--synchronizer-child"]:
        # argv: --synchronizer-child PROFILE <python> -m ddiloco <command...> (ProcessCluster's command after the wrap)
        rest = sys.argv[3:]
        sys.exit(synchronizer_child(sys.argv[2], rest[rest.index("ddiloco") + 1:]))
    sys.exit(main())
