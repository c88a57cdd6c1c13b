"""A learner as a data-parallel job: tokens/s of 2 gloo ranks vs 1 rank on this machine, and rank 0's fragment I/O.

Three learners of one run train side by side, each a real learner job against a real synchronizer
OS process (quorum 1, no grace window: every submission is merged at once, so rank 0 really
downloads, broadcasts and applies new global fragments every few steps):

  * ``classic`` (us-0): one rank in a plain process — what ``ddiloco learner`` runs with --nproc-per-node 1;
  * ``ddp1`` (us-1): one rank under torchrun — the same learner with the launcher around it;
  * ``ddp2`` (us-2): two gloo ranks under torchrun (``--nproc-per-node 2``), DDP, the same per-rank
    batch (weak scaling: the learner trains on twice the tokens per step).

Each rank runs one torch thread (learners.torch_threads = 1) on the default demo model (2 layers,
d_model 128, seq 128, batch 16 per rank, P = 24 fragments, one sent per step, int8 codec).

The machine is small and shared, and its load swings by 2x within minutes, so the jobs are not run
one after another: all three start and warm up together, then a gate file lets one job at a time
step, in windows of ``--window-s`` seconds, for ``--rounds`` rounds, each round in a different
order (all 6 permutations over 6 rounds) — load drift hits every variant alike. A gated job waits before its
next step (every rank polls the gate,
so a 2-rank job stops at a step boundary); its background threads go on polling the ledger, as a
learner's do. (Freezing jobs with SIGSTOP instead can stop one inside a SQLite write transaction and
lock the ledger for everyone.) The collective timeout is raised for the benchmark, since a gated
job's ranks may wait in a collective across windows.

Rank 0 logs, after every step, its token count and where its training thread's time went:
``train`` (forward, backward with DDP's gradient all-reduce, AdamW, the loss/token all-reduce),
``control`` (the per-step control all-reduce; it absorbs waiting for the slower rank), ``apply``
(broadcast + copy of received fragments) and ``send`` (staging the due fragment to host memory).
Fragment I/O on the training thread = apply + send. The outer-gradient arithmetic, compression and
upload run on rank 0's upload thread: reported as ``upload_thread`` (busy seconds per wall second,
off the step's critical path). Figures are pooled over each variant's windows (sum of tokens / sum
of seconds), with the per-round ratios' median alongside.

    python benchmarks/ddp_learner.py [--quick] [--rounds 6] [--window-s 10] [--warmup-steps 30]
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    base_parser,
    exit_on_sigterm,
    header,
    machine_busy,
    median,
    write_results,
)

NAME = "ddp_learner"
VARIANTS = {"classic": ("us-0", 1), "ddp1": ("us-1", 1), "ddp2": ("us-2", 2)}
TIMERS = ("train_s", "control_s", "apply_s", "send_s", "upload_s")


def bench_config(quick: bool):
    from ddiloco.platform.config import build_config

    learners = {
        "regions": [{"name": "us", "learners": 3}],
        "torch_threads": 1,
        "device": "cpu",
        "dead_after_s": 1e6,
        "startup_grace_s": 1e6,
        "heartbeat_s": 2.0,
    }
    data: dict = {
        "name": "ddpbench",
        "token_budget": 10**12,
        "learners": learners,
        "grace": {"enabled": False},
    }
    if quick:
        data.update(
            model={"n_layer": 1, "d_model": 64, "n_head": 2, "seq_len": 64},
            data={"max_bytes": 400_000, "val_batches": 2},
            learners={**learners, "batch_size": 8},
            fragments={"count": 4},
        )
    return build_config(data)


# --- the worker: one rank of a learner job, or the classic learner ------------------------------------------


def worker(args) -> None:  # noqa: ANN001
    import torch

    from ddiloco.learner_worker.device import resolve_device
    from ddiloco.learner_worker.dist import Dist, collective_timeout_s, init_dist, rank_env, shutdown_dist
    from ddiloco.learner_worker.learner import Learner
    from ddiloco.learner_worker.link import LearnerLink
    from ddiloco.platform.config import load_config
    from ddiloco.platform.runtime import RunContext

    cfg = load_config(args.config)
    index, region, _ = cfg.learners.resolve(args.learner)
    torch.set_num_threads(cfg.learners.torch_threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # The same Learner class in every variant: "classic" is one rank in a plain process, without torchrun.
    info = None if args.classic else rank_env()
    device = resolve_device(cfg.learners.device, info.local_rank if info else 0)
    d = init_dist(device, timeout_s=collective_timeout_s(), ready_timeout_s=300) if info and info.world > 1 else Dist.single(device)
    rank = d.rank
    link = LearnerLink(RunContext.open(cfg), args.learner, region) if rank == 0 else None
    learner = Learner(cfg, args.learner, index=index, num_learners=cfg.learners.count, link=link, dist=d)

    def figures() -> dict[str, float]:
        t = learner.timings
        return {
            "train_s": t.get("learner.train_step", 0.0),
            "control_s": t.get("learner.agree", 0.0),
            "apply_s": t.get("learner.apply", 0.0),
            "send_s": t.get("learner.send", 0.0),
            "upload_s": link.uploader.upload_s if link else 0.0,
        }

    progress = open(args.progress, "a", buffering=1) if rank == 0 else None  # noqa: SIM115 - one line a step
    step = learner.step
    gate = Path(args.gate)

    def logged_step(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        while not stop.is_set():
            try:
                if gate.read_text().strip() in ("*", args.variant):
                    break
            except OSError:
                pass
            time.sleep(0.02)
        report = step(*a, **kw)
        if progress is not None:
            f = figures()
            progress.write(
                json.dumps([time.monotonic(), learner.step_count, learner.tokens_total, *(f.get(k, 0.0) for k in TIMERS)]) + "\n"
            )
        return report

    learner.step = logged_step
    try:
        learner.start(ready_timeout_s=300)
        learner.start_background_io()
        learner.run(stop.is_set)
    finally:
        learner.stop()
        shutdown_dist(d)
        if progress is not None:
            progress.close()


# --- the driver ---------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _has_rank_env(pid: int) -> bool:
    try:
        return any(item.startswith(b"RANK=") for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return False


class Job:
    def __init__(self, variant: str, config: Path, tmp: Path, log) -> None:  # noqa: ANN001
        self.variant = variant
        self.learner, self.nproc = VARIANTS[variant]
        self.progress = tmp / f"{variant}.progress"
        common = [
            "--worker",
            "--config",
            str(config),
            "--learner",
            self.learner,
            "--progress",
            str(self.progress),
            "--gate",
            str(tmp / "gate"),
            "--variant",
            variant,
        ]
        script = str(Path(__file__).resolve())
        if variant == "classic":
            cmd = [sys.executable, script, *common, "--classic"]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(self.nproc),
                "--max-restarts",
                "0",
                script,
                *common,
            ]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(OMP_NUM_THREADS="1", DDILOCO_DIST_TIMEOUT_S="3600")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def ranks(self) -> list[int]:
        """The processes that train."""
        if self.variant == "classic":
            return [self.proc.pid]
        return [p for p in _children(self.proc.pid) if _has_rank_env(p)]

    def lines(self) -> list[list[float]]:
        try:
            return [json.loads(line) for line in self.progress.read_text().splitlines() if line.strip()]
        except OSError:
            return []


def set_gate(path: Path, value: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(value)
    tmp.replace(path)


def window(job: Job, gate: Path, seconds: float, settle_s: float) -> dict:
    set_gate(gate, job.variant)
    time.sleep(settle_s)  # the first step after the gate opens may have started before it
    t0 = time.monotonic()
    busy0 = machine_busy()
    time.sleep(seconds)
    t1 = time.monotonic()
    busy1 = machine_busy()
    set_gate(gate, "-")
    rows = [r for r in job.lines() if t0 <= r[0] <= t1]
    if len(rows) < 2:
        return {"steps": 0}
    a, b = rows[0], rows[-1]
    dt = b[0] - a[0]
    out = {
        "seconds": dt,
        "steps": int(b[1] - a[1]),
        "tokens": int(b[2] - a[2]),
        "spent": {k.removesuffix("_s"): b[3 + i] - a[3 + i] for i, k in enumerate(TIMERS)},
    }
    if busy0 and busy1 and busy1[1] > busy0[1]:
        out["machine_busy_cores"] = (os.cpu_count() or 1) * (busy1[0] - busy0[0]) / (busy1[1] - busy0[1])
    return out


def pooled(ws: list[dict]) -> dict:
    ws = [w for w in ws if w.get("steps")]
    secs = sum(w["seconds"] for w in ws)
    if not secs:
        return {}
    spent = {k: sum(w["spent"][k] for w in ws) for k in ws[0]["spent"]}
    share = {k: round(v / secs, 4) for k, v in spent.items() if k != "upload"}
    return {
        "tokens_per_s": round(sum(w["tokens"] for w in ws) / secs, 1),
        "step_ms": round(1000 * secs / sum(w["steps"] for w in ws), 1),
        "steps": sum(w["steps"] for w in ws),
        "rank0_share": share,
        "rank0_fragment_io_share": round(share.get("apply", 0.0) + share.get("send", 0.0), 4),
        "upload_thread_share": round(spent.get("upload", 0.0) / secs, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="rounds of one window per variant (default 6; --quick 1)")
    ap.add_argument("--window-s", type=float, default=None, help="window length (default 10; --quick 4)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="steps every job runs before the windows (default P + 6)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (ledger, store, logs)")
    # Worker mode (this file run by torchrun, or alone for the classic learner):
    ap.add_argument("--worker", action="store_true", help=_hidden())
    ap.add_argument("--classic", action="store_true", help=_hidden())
    ap.add_argument("--config", help=_hidden())
    ap.add_argument("--learner", help=_hidden())
    ap.add_argument("--progress", help=_hidden())
    ap.add_argument("--gate", help=_hidden())
    ap.add_argument("--variant", help=_hidden())
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    exit_on_sigterm()
    from ddiloco.platform.ledger import runs as runs_q
    from ddiloco.testing.net import wait_for
    from ddiloco.testing.processes import ProcessRun

    cfg = bench_config(args.quick)
    args.rounds = args.rounds or (1 if args.quick else 6)
    args.window_s = args.window_s or (4.0 if args.quick else 10.0)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else cfg.fragments.period + 6
    tmp = Path(tempfile.mkdtemp(prefix="ddiloco-ddp-bench-"))
    run = ProcessRun(tmp, cfg)
    jobs: dict[str, Job] = {}
    windows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    order_log = []
    try:
        run.synchronizer("bench-sync")

        def v0() -> bool:
            with run.ctx.transaction() as s:
                return len(runs_q.latest_version_numbers(s, run.ctx.run_id)) == cfg.fragments.count

        wait_for(v0, 300, "the synchronizer to publish version 0")
        gate = tmp / "gate"
        set_gate(gate, "*")
        log = open(tmp / "jobs.log", "ab")  # noqa: SIM115 - closed in finally
        for v in VARIANTS:
            jobs[v] = Job(v, run.config_path, tmp, log)
        for v, job in jobs.items():

            def warmed(job=job) -> bool:
                if job.proc.poll() is not None:
                    raise RuntimeError(f"{job.variant} exited {job.proc.returncode}; see {tmp / 'jobs.log'}")
                rows = job.lines()
                return bool(rows) and rows[-1][1] >= args.warmup_steps and len(job.ranks()) == job.nproc

            wait_for(warmed, 600, f"{v} to warm up", interval_s=0.5)
        set_gate(gate, "-")
        print(f"{len(jobs)} jobs warmed up ({args.warmup_steps} steps); {args.rounds} rounds of {args.window_s:.0f}s windows", flush=True)
        # Every round a different permutation: over 6 rounds each variant is first, second and last
        # equally often, so a steady drift in the machine's load favours none.
        orders = list(itertools.permutations(VARIANTS))
        for r in range(args.rounds):
            for v in orders[r % len(orders)]:
                w = window(jobs[v], gate, args.window_s, settle_s=1.0)
                windows[v].append(w)
                order_log.append(v)
                io = w.get("spent", {})
                print(
                    f"round {r + 1} {v:8s}: {w.get('tokens', 0) / max(w.get('seconds', 1e-9), 1e-9):8.0f} tokens/s "
                    f"over {w.get('steps', 0):3d} steps"
                    + (
                        f", rank 0: apply {io['apply'] / w['seconds']:.1%} send {io['send'] / w['seconds']:.1%} "
                        f"control {io['control'] / w['seconds']:.1%}"
                        if w.get("steps")
                        else ""
                    ),
                    flush=True,
                )
    finally:
        if jobs:
            set_gate(tmp / "gate", "*")
        for job in jobs.values():
            if job.proc.poll() is None:
                job.proc.terminate()  # torchrun passes SIGTERM on; the ranks stop together and flush
        for job in jobs.values():
            try:
                job.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.proc.kill()
                job.proc.wait(timeout=10)
        run.stop_all()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")

    summary: dict = {v: pooled(ws) for v, ws in windows.items()}

    def ratios(a: str, b: str) -> list[float]:
        out = []
        for wa, wb in zip(windows[a], windows[b]):
            if wa.get("steps") and wb.get("steps"):
                out.append((wa["tokens"] / wa["seconds"]) / (wb["tokens"] / wb["seconds"]))
        return out

    for a, b in (("ddp2", "classic"), ("ddp2", "ddp1"), ("ddp1", "classic")):
        if summary[a] and summary[b]:
            summary[f"{a}_vs_{b}"] = {
                "pooled": round(summary[a]["tokens_per_s"] / summary[b]["tokens_per_s"], 3),
                "median_of_rounds": round(median(ratios(a, b)), 3),
            }
    print(json.dumps(summary, indent=2))
    write_results(
        NAME,
        {
            **header(NAME, args),
            "setup": {
                "model": cfg.model.model_dump(include={"n_layer", "d_model", "n_head", "seq_len"}),
                "batch_per_rank": cfg.learners.batch_size,
                "fragments": cfg.fragments.count,
                "codec": cfg.compression.codec,
                "torch_threads_per_rank": cfg.learners.torch_threads,
                "window_order": order_log,
            },
            "summary": summary,
            "windows": windows,
            "notes": (
                "tokens_per_s: learner tokens (summed over ranks) per wall second while the job was the only one thawed; "
                "rank0_share: share of rank 0's wall time per phase (train includes DDP's gradient all-reduce; control "
                "absorbs waiting for the slower rank); rank0_fragment_io_share = apply + send on the training thread; "
                "upload_thread_share: rank 0's upload-thread busy seconds per wall second (off the step path). "
                "machine_busy_cores: all cores' busy share during the window, other users included."
            ),
        },
        args.json,
    )
    return 0


def _hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
