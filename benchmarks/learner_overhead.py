"""Learner overhead: tokens/s of a learner inside the platform vs a bare torch loop, same model and batch.

  * bare: build_model + AdamW + the same data stream (build_dataset(...).train_batches) and the same
    step (training_loss, zero_grad, backward, clip_grad_norm_, step) — nothing else. It reads each step's
    loss as the learner does (``LateRead``: on a GPU one step late, so that neither loop makes the host wait for
    the step it just queued and the ratio charges the platform only for its own work).
  * platform: a real ``Learner`` with its link's background threads on a file:// store and a SQLite ledger in a temp
    dir, trading fragments with a real synchronizer running as its own OS process
    (``python -m ddiloco synchronizer``), default fragments (P = 24, one sent per step) and int8
    compression: uploads and downloads run on the learner's background threads while it trains,
    and received versions are swapped in by its main thread.

Both run in this process on one torch thread (as a learner process does, learners.torch_threads = 1)
with the default demo model (ModelConfig defaults: 2 layers, d_model 128, seq 128; batch 16);
--quick uses a small model (1 layer, d_model 64, seq 64, batch 8, P = 4) and is only a smoke check.
Short windows of a fixed length alternate bare / platform in an ABBA order, many of them, so load
drift on the shared machine hits both alike. One Learner serves every platform window; between them
its background I/O is paused (polling and heartbeats gated, queued uploads drained first), so its
threads are idle during a bare window. An untimed platform window comes first (the synchronizer's
first merge and the learner's first receipts). No evaluator process is started: it would only add
CPU load from another process, not learner overhead.

Besides tokens/s, each window records where the main thread's wall time went (Linux schedstat):
on a CPU, waiting in the run queue (the machine is oversubscribed), or blocked (GIL, locks, I/O),
and the CPU used by the learner's background threads and the synchronizer process.

Goal: platform tokens/s >= 0.95 x bare tokens/s (median of the per-pair ratios).

``--device cuda`` runs both on the GPU (the learner's bf16 autocast, batches copied to the device in
the step, as the learner does) and writes learner_overhead_cuda.json: on a GPU a step takes
milliseconds, so whatever the platform adds on the main thread weighs far more than on a CPU.

``--model llama100m`` trains sync_sustain's 100 M-parameter Hugging Face Llama (d 768, 12 layers,
vocabulary 32,000, seq 1024; batch 8, 8,192 tokens a step), built from an inline LlamaConfig (no
download; --quick: a tiny Llama of the same code path). ``--parallelism ddp|fsdp|hsdp`` sets
``learners.parallelism`` of the learner's RunConfig (ddp, the default, is left out of the config, so
that run is the default config); the bare loop stays a plain model (at world 1 the learner's ddp
wraps nothing either, so for fsdp the ratio includes what the wrapper costs). Results go to
``learner_overhead[_cuda][_<model>_<parallelism>].json``: the suffix only when --model or
--parallelism is given (``--model demo`` without --parallelism keeps the published names).

``--batch-size B --seq-len S`` shrink the step (results: ``..._b<B>s<S>.json``). On a CPU, ``--batch-size 1
--seq-len 32`` steps the demo model in about the time an H100 steps it at batch 16 (6-7 ms, mostly host work:
launching small ops): a CPU stand-in for a host-bound GPU learner, where what the link's threads take from the
training thread (the GIL) weighs as it does there and one fragment goes out every few milliseconds.

``--io-off-pairs N`` ends with N more pairs in which the learner's link does no I/O (its uploads dropped before
they are encoded, its polls stopped): what is left is the training thread's own work (the step's bookkeeping, the
increments handed over), so ``link_io_off.ratio_median_of_pairs`` says how much of the gap the link's threads make.

``--sync-device cpu|auto|cuda`` is where the benchmark's synchronizer merges (``synchronizer.merge_device``). The
default, cpu, stands in for a synchronizer on a machine of its own, as a run has it: on a one-GPU machine ``auto``
puts its merges on the learner's GPU, and the two processes' CUDA contexts then take turns on it, so the learner's
ratio would also charge it the GPU time the synchronizer takes (the GPU rows before 2026-12-06 ran that way). Any
other value ends the results name in ``_sync<value>``, so that its rows sit beside the default's.

``--decode-on-device`` runs the learner with ``learners.decode_on_device`` (a GPU learner decodes the versions it
receives on its GPU, only their compressed bytes copied up; results: ``..._devdecode.json``).

``--link-process`` runs the learner with ``learners.link_process`` (its link's ledger and store I/O in a child
process of its own; results: ``..._linkproc.json``) and counts that process's CPU beside the synchronizer's.

Host copies are counted per platform step: the float32 bytes of the fragment increments sent beside
the encoded bytes uploaded, received fragments handed to the main thread (host tensors, copied to the
device on a GPU) and the learner's state saves (model and AdamW, every learners.save_optimizer_every steps).

    python benchmarks/learner_overhead.py [--quick] [--windows 6] [--window-s 8] [--device cpu|cuda]
        [--model demo|llama100m] [--parallelism ddp|fsdp|hsdp] [--batch-size B --seq-len S]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (
    base_parser,
    exit_on_sigterm,
    geomean,
    header,
    machine_busy,
    median,
    process_cpu_s,
    thread_sched,
    verdict,
    write_results,
)
from sync_sustain import LLAMA_100M

from ddiloco.learner_worker.device import LateRead, autocast, resolve_device
from ddiloco.learner_worker.dist import Dist, ensure_process_group
from ddiloco.learner_worker.flops import model_cost
from ddiloco.learner_worker.learner import Learner
from ddiloco.learner_worker.link import LearnerLink
from ddiloco.learner_worker.linkio import IOProcess
from ddiloco.learner_worker.parallel import shard_replica
from ddiloco.platform.config import build_config
from ddiloco.platform.data import Batch, build_dataset
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.models import build_model, training_loss
from ddiloco.platform.units import format_flops
from ddiloco.testing.net import wait_for
from ddiloco.testing.processes import ProcessRun

NAME = "learner_overhead"
GOAL_RATIO = 0.95
LEARNER = "us-0"


MODELS = ("demo", "llama100m")
QUICK_LLAMA = {
    "kind": "hf", "vocab_size": 512, "seq_len": 64,
    "hf_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True},
}
"""--quick --model llama100m: the same code path (transformers' Llama) at a size that steps in milliseconds on a CPU."""
SYNC_DEVICE = "cpu"
"""Where the benchmark's synchronizer merges unless --sync-device says otherwise: off the learner's GPU, as in a run."""
LLAMA_BATCH = 8
"""Sequences a step for llama100m: 8 x 1024 = 8,192 tokens, sync_sustain's step."""


def bench_config(name: str, quick: bool = False, device: str = "cpu", model: str = "demo", parallelism: str | None = None,
                 batch_size: int | None = None, seq_len: int | None = None, link_process: bool = False,
                 sync_device: str = SYNC_DEVICE, decode_on_device: bool = False):
    learners: dict = {"regions": [{"name": "us", "learners": 1}], "device": device}
    if link_process:
        learners["link_process"] = True
    if decode_on_device:
        learners["decode_on_device"] = True
    data: dict = {"name": name, "learners": learners, "synchronizer": {"merge_device": sync_device}}
    if quick:
        # --quick only checks the benchmark works: a small model and P = 4 start in a few seconds.
        data.update(
            model={"n_layer": 1, "d_model": 64, "n_head": 2, "seq_len": 64},
            data={"max_bytes": 400_000, "val_batches": 2},
            fragments={"count": 4},
        )
        learners["batch_size"] = 8
    if model == "llama100m":
        data["model"] = QUICK_LLAMA if quick else LLAMA_100M
        learners["batch_size"] = 8 if quick else LLAMA_BATCH
    if parallelism is not None and parallelism != "ddp":
        # ddp is LearnersConfig's default: a ddp run is the default config, left as it is.
        learners["parallelism"] = parallelism
    if batch_size is not None:
        learners["batch_size"] = batch_size
    if seq_len is not None:
        data["model"] = {**data.get("model", {}), "seq_len": seq_len}
    return build_config(data)


def result_name(device: str, model: str | None, parallelism: str | None, batch_size: int | None = None,
                seq_len: int | None = None, link_process: bool = False, sync_device: str = SYNC_DEVICE,
                decode_on_device: bool = False) -> str:
    """learner_overhead[_cuda][_<model>_<parallelism>][_b<batch>s<seq>][_linkproc][_devdecode][_sync<device>]: the
    published demo-model names stay as they were."""
    name = NAME if device == "cpu" else f"{NAME}_{device}"
    if model not in (None, "demo") or parallelism is not None:
        name += f"_{model or 'demo'}_{parallelism or 'ddp'}"
    if batch_size is not None or seq_len is not None:
        name += f"_b{batch_size or 'default'}s{seq_len or 'default'}"
    if link_process:
        name += "_linkproc"
    if decode_on_device:
        name += "_devdecode"
    if sync_device != SYNC_DEVICE:
        name += f"_sync{sync_device}"
    return name


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform as host

    return f"cpu ({host.processor() or host.machine()})"


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Bare:
    """The plain torch loop the learner's train_step is measured against (its model wrapped as the learner's is)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.learners.device)
        self.model = build_model(cfg.model, seed=cfg.seed).to(self.device)
        self.model.train()
        if cfg.learners.parallelism != "ddp":
            # Wrapped as the learner wraps its replica (FSDP2 at world 1): the ratio charges the platform, not FSDP.
            ensure_process_group(Dist.single(self.device))
            shard_replica(self.model, cfg.learners.parallelism, cfg.learners.shard_size, 0, 1, self.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2), weight_decay=cfg.inner.weight_decay
        )
        self.batches = build_dataset(cfg.data, cfg.model).train_batches(0, 1, cfg.learners.batch_size, seed=cfg.seed * 1_000_003)
        self.loss_read = LateRead(late=self.device.type == "cuda")
        self.steps = 0

    def step(self) -> int:
        batch = next(self.batches)
        warm = self.cfg.inner.warmup_steps
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.inner.lr * min(1.0, (self.steps + 1) / warm) if warm > 0 else self.cfg.inner.lr
        if self.device.type != "cpu":
            inputs = batch.inputs.to(self.device, non_blocking=True)
            batch = Batch(inputs=inputs, targets=batch.targets.to(self.device, non_blocking=True), tokens=batch.tokens)
        with autocast(self.device):
            loss = training_loss(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self.optimizer.step()
        self.loss_read.put(loss.detach())
        self.steps += 1
        return batch.tokens


SYNC_PID: int | None = None
LINKIO_PID: int | None = None
"""The learner's link I/O process, with --link-process."""


def _snapshot(bg_threads: list[int]) -> dict:
    bg = [thread_sched(t) for t in bg_threads]
    return {
        "main": thread_sched(),
        "bg_cpu": sum(b[0] for b in bg if b is not None),
        "sync_cpu": process_cpu_s(SYNC_PID) if SYNC_PID else None,
        "linkio_cpu": process_cpu_s(LINKIO_PID) if LINKIO_PID else None,
        "machine": machine_busy(),
    }


def wait_for_version_0(run: ProcessRun) -> None:
    """Until the run's synchronizer has published every fragment's version 0."""

    def published() -> bool:
        with run.ctx.transaction() as s:
            return len(runs_q.latest_version_numbers(s, run.ctx.run_id)) == run.cfg.fragments.count

    wait_for(published, 120, "the synchronizer to publish version 0")


def run_window(step, seconds: float, bg_threads: list[int] | None = None) -> dict:
    """Steps until ``seconds`` have passed; tokens, elapsed seconds, steps and where the time went."""
    bg_threads = bg_threads or []
    tokens = steps = 0
    a = _snapshot(bg_threads)
    t0 = time.perf_counter()
    while True:
        tokens += step()
        steps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    b = _snapshot(bg_threads)
    out = {"tokens": tokens, "elapsed_s": elapsed, "steps": steps}
    if a["main"] and b["main"]:
        cpu, wait = b["main"][0] - a["main"][0], b["main"][1] - a["main"][1]
        out["main_thread"] = {"cpu_s": cpu, "runqueue_wait_s": wait, "blocked_s": max(0.0, elapsed - cpu - wait)}
    out["background_threads_cpu_s"] = b["bg_cpu"] - a["bg_cpu"]
    if a["sync_cpu"] is not None and b["sync_cpu"] is not None:
        out["synchronizer_cpu_s"] = b["sync_cpu"] - a["sync_cpu"]
    if a["linkio_cpu"] is not None and b["linkio_cpu"] is not None:
        out["link_process_cpu_s"] = b["linkio_cpu"] - a["linkio_cpu"]
    if a["machine"] and b["machine"]:
        busy, total = b["machine"][0] - a["machine"][0], b["machine"][1] - a["machine"][1]
        out["machine_busy_cores"] = (os.cpu_count() or 1) * busy / total if total else None
    return out


class Platform:
    """One real Learner for the whole benchmark, whose background I/O is paused during bare windows.

    Pausing gates the link's ``poll`` and ``heartbeat`` (instance attributes patched here, the
    learner's code is unchanged) and waits for in-flight uploads, so a bare window runs with the
    link's threads idle, and windows can be short and many without restarting a learner. Main-thread
    time per phase comes from the learner's own timing spans (``Learner.timings``)."""

    def __init__(self, run: ProcessRun) -> None:
        _, region, _ = run.cfg.learners.resolve(LEARNER)
        self.link = link = LearnerLink(run.ctx, LEARNER, region)
        self.learner = learner = Learner(run.cfg, LEARNER, index=0, num_learners=1, link=link, clock=run.ctx.now)
        learner.start()
        self.counts = {"sent": 0, "received": 0}
        self.running = threading.Event()
        self.running.set()
        self.io_off = False
        self.dropped = 0
        """Submissions the link took and dropped with its I/O off."""
        self.in_flight = 0
        self._lock = threading.Lock()
        poll, beat = link.poll, link.heartbeat

        def gated_poll() -> list[int]:
            return poll() if self.running.is_set() else []

        def gated_heartbeat(now: float, stats, force: bool = False) -> None:
            if self.running.is_set() or force:
                beat(now, stats, force)

        def counted(fn):
            def wrapper(*a, **kw):
                with self._lock:
                    self.in_flight += 1
                try:
                    return fn(*a, **kw)
                finally:
                    with self._lock:
                        self.in_flight -= 1

            return wrapper

        link.poll = gated_poll
        link.heartbeat = gated_heartbeat
        # A batch of uploads on the upload thread counts as in flight (the learner's state is saved on its main thread).
        link.uploader.upload = counted(link.uploader.upload)
        self._count_host_copies()
        learner.start_background_io()

    def _count_host_copies(self) -> None:
        """Bytes the learner moves between the model and host memory (instance patches; the learner is unchanged)."""
        self.copied = dict.fromkeys(("increments_fp32", "received_from_host", "state_save"), 0)
        learner, link = self.learner, self.link
        self.fragment_bytes = [nbytes(f.tensors.values()) for f in learner.fragments]
        take, save = link.take_arrivals, learner.save_state

        def taken():
            arrived, awaiting = take()
            # Decoded in host memory; with learners.decode_on_device they arrive on the device (their blobs' bytes were
            # copied up: downloaded_blobs).
            self.copied["received_from_host"] += nbytes(t for _, ts in arrived.values() for t in ts.values() if not t.is_cuda)
            return arrived, awaiting

        def saved() -> None:
            save()
            # What a save writes: the model and AdamW's state (this rank's shards), through host memory.
            state = [t for st in learner.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
            self.copied["state_save"] += nbytes(learner.model.parameters()) + nbytes(state)

        link.take_arrivals, learner.save_state = taken, saved

    @property
    def threads(self) -> list[int]:
        return [t.native_id for t in self.link._threads if t.native_id is not None]

    def step(self) -> int:
        t0 = time.perf_counter()
        report = self.learner.step()
        self.learner.timings["step"] = self.learner.timings.get("step", 0.0) + time.perf_counter() - t0
        self.counts["sent"] += len(report.submitted)
        self.copied["increments_fp32"] += sum(self.fragment_bytes[p] for p in report.submitted)
        self.counts["received"] += len(report.received)
        if report.waiting:  # overlap 0 only; not the default
            self.link.wait_for_awaited(1.0)
        return report.tokens

    def pause(self, timeout_s: float = 30.0) -> float:
        """Stop polling and heartbeats and let queued uploads finish; returns the seconds that took."""
        t0 = time.perf_counter()
        self.running.clear()
        deadline = time.monotonic() + timeout_s
        # queued(): also the sends an upload thread has taken while it lingers for more (learners.upload_linger_s).
        while (self.link.outbox.qsize() or self.link.outbox.queued() or self.in_flight) and time.monotonic() < deadline:
            time.sleep(0.005)
        return time.perf_counter() - t0

    def resume(self) -> None:
        if not self.io_off:
            self.running.set()

    def stop_io(self) -> None:
        """From now on the link does no I/O: uploads are dropped before they are encoded, polls stay gated."""
        self.pause()
        self.io_off = True

        def dropped(outs, *_args, **_kwargs) -> None:  # whatever the uploader passes besides the submissions
            self.dropped += len(outs)

        self.link.uploader.upload = dropped

    def window(self, seconds: float) -> dict:
        self.resume()
        self.learner.timings.clear()
        self.counts.update(sent=0, received=0)
        self.copied.update(dict.fromkeys(self.copied, 0))
        upload_s0, bytes0 = self.link.uploader.upload_s, self.link.uploader.bytes_sent
        down0, dropped0 = self.link.downloader.bytes_received, self.dropped
        win = run_window(self.step, seconds, self.threads)
        drain_s = self.pause()
        self._check_link(sent=self.counts["sent"], uploaded=self.link.uploader.bytes_sent - bytes0,
                         dropped=self.dropped - dropped0)
        return {
            **win,
            "host_copies": dict(self.copied),
            "main_thread_s": dict(self.learner.timings),
            "sent": self.counts["sent"],
            "received": self.counts["received"],
            "upload_thread_s": self.link.uploader.upload_s - upload_s0,
            "bytes_sent": self.link.uploader.bytes_sent - bytes0,
            "bytes_received": self.link.downloader.bytes_received - down0,
            "drain_after_s": drain_s,
        }

    def _check_link(self, sent: int, uploaded: int, dropped: int) -> None:
        """Refuse to time a learner whose link stopped trading: a dead thread, or sends that never left, would make
        the platform look as cheap as the bare loop."""
        dead = [t.name for t in self.link._threads if not t.is_alive()]
        if dead:
            raise RuntimeError(f"the link's thread {', '.join(dead)} died during a window (its error is above); "
                               "the figures would time a learner that trades nothing")
        if sent and not (dropped if self.io_off else uploaded):
            raise RuntimeError(f"the learner sent {sent} fragments in a window and the link "
                               f"{'dropped' if self.io_off else 'uploaded'} none of them (its error is above)")

    def stop(self) -> None:
        self.resume()
        self.learner.stop()


def run_pair(i: int, bare: Bare, platform: Platform, window_s: float) -> dict:
    """One bare and one platform window, in ABBA order by ``i``, with their tokens/s and ratio."""
    order = ("bare", "platform") if i % 2 == 0 else ("platform", "bare")
    pair: dict = {"order": list(order)}
    for kind in order:
        pair[kind] = run_window(bare.step, window_s) if kind == "bare" else platform.window(window_s)
    b, p = pair["bare"], pair["platform"]
    pair["bare_tokens_per_s"] = b["tokens"] / b["elapsed_s"]
    pair["platform_tokens_per_s"] = p["tokens"] / p["elapsed_s"]
    pair["ratio"] = pair["platform_tokens_per_s"] / pair["bare_tokens_per_s"]
    return pair


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--windows", type=int, default=16, help="window pairs (bare + platform)")
    ap.add_argument("--window-s", type=float, default=3.0, help="length of one window in seconds")
    ap.add_argument("--warmup-s", type=float, default=10.0, help="untimed platform window before the pairs")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (ledger, store, synchronizer log)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the learner and the bare loop train")
    ap.add_argument("--model", choices=MODELS, default=None, help="demo (the default ModelConfig) or llama100m (Hugging Face Llama)")
    ap.add_argument("--parallelism", choices=("ddp", "fsdp", "hsdp"), default=None,
                    help="learners.parallelism of the learner (default: the config's, ddp)")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences a step (default: the model's benchmark batch)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default: the model's)")
    ap.add_argument("--link-process", action="store_true",
                    help="learners.link_process: the link's ledger and store I/O in a process of its own")
    ap.add_argument("--decode-on-device", action="store_true",
                    help="learners.decode_on_device: received versions decoded on the learner's GPU")
    ap.add_argument("--sync-device", choices=("cpu", "auto", "cuda"), default=SYNC_DEVICE,
                    help="where the benchmark's synchronizer merges (default cpu: off the learner's GPU, as in a run)")
    ap.add_argument("--io-off-pairs", type=int, default=None,
                    help="pairs at the end with the link's I/O off (default 0; 1 with --quick)")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    if args.quick:
        args.windows, args.window_s, args.warmup_s = 2, 1.5, 1.0
    if args.io_off_pairs is None:
        args.io_off_pairs = 1 if args.quick else 0
    torch.set_num_threads(1)

    tmp = Path(tempfile.mkdtemp(prefix="learner-overhead-"))
    run = ProcessRun(tmp, bench_config("overhead", args.quick, args.device, args.model or "demo", args.parallelism,
                                       args.batch_size, args.seq_len, args.link_process, args.sync_device,
                                       args.decode_on_device))
    cfg = run.cfg
    name = result_name(args.device, args.model, args.parallelism, args.batch_size, args.seq_len, args.link_process,
                       args.sync_device, args.decode_on_device)
    results = header(name, args)
    platform = None
    try:
        global SYNC_PID
        SYNC_PID = run.synchronizer("bench-sync").pid
        bare = Bare(cfg)  # built while the synchronizer starts
        for _ in range(2):
            bare.step()

        wait_for_version_0(run)
        n_params = sum(p.numel() for p in bare.model.parameters())
        print(
            f"model {args.model or 'demo'}: {n_params / 1e6:.2f} M params on {device_name(bare.device)}, "
            f"parallelism {args.parallelism or 'ddp (default)'}, batch {cfg.learners.batch_size} x "
            f"seq {cfg.model.seq_len}; P = {cfg.fragments.count}, codec {cfg.compression.codec}; "
            f"synchronizer merges on {args.sync_device}; torch threads {torch.get_num_threads()}; "
            f"{args.windows} pairs of {args.window_s:.1f}s windows"
        )

        platform = Platform(run)
        if isinstance(platform.link.io, IOProcess):
            global LINKIO_PID
            LINKIO_PID = platform.link.io.pid
        # Untimed: the synchronizer's first merge is slow (its first torch.optim.SGD imports
        # torch._dynamo), and the learner side warms up; later windows see the steady state.
        warm = platform.window(args.warmup_s)
        results["warmup_window"] = {"seconds": args.warmup_s, "steps": warm["steps"], "sent": warm["sent"], "received": warm["received"]}
        print(f"warm-up platform window ({args.warmup_s:.0f}s): {warm['steps']} steps, sent {warm['sent']}, received {warm['received']}")

        pairs = []
        for i in range(args.windows):
            pair = run_pair(i, bare, platform, args.window_s)
            pairs.append(pair)
            b, p, order = pair["bare"], pair["platform"], pair["order"]
            mt = p["main_thread_s"]
            print(
                f"pair {i + 1}/{args.windows} ({'/'.join(order)}): bare {pair['bare_tokens_per_s']:7.0f} tok/s ({b['steps']} steps), "
                f"platform {pair['platform_tokens_per_s']:7.0f} tok/s ({p['steps']} steps, sent {p['sent']}, received {p['received']}), "
                f"ratio {pair['ratio']:.3f}; send {mt.get('learner.send', 0) * 1e3:.0f} ms, apply {mt.get('learner.apply', 0) * 1e3:.0f} ms"
            )

        io_off = []
        if args.io_off_pairs:
            platform.stop_io()
            for i in range(args.io_off_pairs):
                io_off.append(run_pair(i, bare, platform, args.window_s))
                print(f"link I/O off, pair {i + 1}/{args.io_off_pairs} ({'/'.join(io_off[-1]['order'])}): "
                      f"ratio {io_off[-1]['ratio']:.3f}")

        bare_tok = sum(p["bare"]["tokens"] for p in pairs)
        bare_s = sum(p["bare"]["elapsed_s"] for p in pairs)
        plat_tok = sum(p["platform"]["tokens"] for p in pairs)
        plat_s = sum(p["platform"]["elapsed_s"] for p in pairs)
        pooled = (plat_tok / plat_s) / (bare_tok / bare_s)
        med = median([p["ratio"] for p in pairs])
        mt_total: dict[str, float] = {}
        for p in pairs:
            for k, v in p["platform"]["main_thread_s"].items():
                mt_total[k] = mt_total.get(k, 0.0) + v
        step_s = mt_total.get("step", 0.0)
        # The published keys, from the learner's own span names.
        parts = {
            "train_step": "learner.train_step",
            "send": "learner.send",
            "apply_received": "learner.apply",
            "save_state": "learner.save_state",
        }
        accounted = sum(mt_total.get(span, 0.0) for span in parts.values())
        share = {k: mt_total.get(span, 0.0) / step_s for k, span in parts.items()}
        share["other_in_step"] = (step_s - accounted) / step_s
        plat_steps = sum(p["platform"]["steps"] for p in pairs)
        sent = sum(p["platform"]["sent"] for p in pairs)
        received = sum(p["platform"]["received"] for p in pairs)
        # Bare step time vs the platform's train_step alone: how much slower the same compute runs while the
        # background threads work (GIL and cores shared), as opposed to main-thread work the platform adds.
        bare_step_s = bare_s / sum(p["bare"]["steps"] for p in pairs)
        train_step_s = mt_total.get("learner.train_step", 0.0) / plat_steps

        def per_step_split(kind: str) -> dict:
            ws = [p[kind] for p in pairs if "main_thread" in p[kind]]
            n = sum(w["steps"] for w in ws)
            if not n:
                return {}
            out = {k: round(sum(w["main_thread"][k] for w in ws) / n * 1e3, 2) for k in ("cpu_s", "runqueue_wait_s", "blocked_s")}
            out = {k.replace("_s", "_ms"): v for k, v in out.items()}
            wall = sum(w["elapsed_s"] for w in ws)
            out["background_threads_cpu_share"] = round(sum(w["background_threads_cpu_s"] for w in ws) / wall, 4)
            if all("synchronizer_cpu_s" in w for w in ws):
                out["synchronizer_cpu_share"] = round(sum(w["synchronizer_cpu_s"] for w in ws) / wall, 4)
            if all("link_process_cpu_s" in w for w in ws):
                out["link_process_cpu_share"] = round(sum(w["link_process_cpu_s"] for w in ws) / wall, 4)
            busy = [w.get("machine_busy_cores") for w in ws if w.get("machine_busy_cores") is not None]
            if busy:
                out["machine_busy_cores"] = round(sum(busy) / len(busy), 2)
            return out

        split = {"bare": per_step_split("bare"), "platform": per_step_split("platform")}

        def off_queue_rate(kind: str) -> float | None:
            """Tokens per second of wall time the main thread was NOT waiting for a CPU."""
            ws = [p[kind] for p in pairs]
            if not all("main_thread" in w for w in ws):
                return None
            return sum(w["tokens"] for w in ws) / sum(w["elapsed_s"] - w["main_thread"]["runqueue_wait_s"] for w in ws)

        copied = {k: sum(p["platform"]["host_copies"][k] for p in pairs) for k in pairs[0]["platform"]["host_copies"]}
        copied["uploaded_encoded"] = sum(p["platform"]["bytes_sent"] for p in pairs)
        copied["downloaded_blobs"] = sum(p["platform"]["bytes_received"] for p in pairs)
        host_bytes = {k: round(v / plat_steps) for k, v in copied.items()}

        rb, rp = off_queue_rate("bare"), off_queue_rate("platform")
        cost = model_cost(cfg.model, bare.device)
        achieved = {kind: (tok / sec) for kind, tok, sec in (("bare", bare_tok, bare_s), ("platform", plat_tok, plat_s))}
        ratio_off_queue = rp / rb if rb and rp else None
        ok = med >= GOAL_RATIO
        results.update(
            {
                "model_name": args.model or "demo",
                "model_params": n_params,
                "parallelism": args.parallelism or "ddp",
                "parallelism_note": "learners.parallelism of the platform learner; the bare loop is the same model wrapped the "
                                    "same way (FSDP2 at world 1 for fsdp, a plain model for ddp)",
                "device_name": device_name(bare.device),
                "model": cfg.model.model_dump(),
                "batch_size": cfg.learners.batch_size,
                "fragments": cfg.fragments.count,
                "codec": cfg.compression.codec,
                "synchronizer": "separate OS process (python -m ddiloco synchronizer), eval off",
                "decode_on_device": args.decode_on_device,
                "synchronizer_merge_device": args.sync_device,
                "synchronizer_merge_device_note": "synchronizer.merge_device of the benchmark's synchronizer: cpu stands in "
                "for one on a machine of its own; auto on a one-GPU machine shares the learner's GPU",
                "window_s": args.window_s,
                "pairs": [
                    {
                        "order": p["order"],
                        "bare_tokens_per_s": round(p["bare_tokens_per_s"], 1),
                        "platform_tokens_per_s": round(p["platform_tokens_per_s"], 1),
                        "ratio": round(p["ratio"], 4),
                        "bare_steps": p["bare"]["steps"],
                        "platform_steps": p["platform"]["steps"],
                        "sent": p["platform"]["sent"],
                        "received": p["platform"]["received"],
                        "main_thread_ms": {k: round(v * 1e3, 1) for k, v in p["platform"]["main_thread_s"].items()},
                        "upload_thread_ms": round(p["platform"]["upload_thread_s"] * 1e3, 1),
                    }
                    for p in pairs
                ],
                "bare_tokens_per_s": round(bare_tok / bare_s, 1),
                "platform_tokens_per_s": round(plat_tok / plat_s, 1),
                "ratio_median_of_pairs": round(med, 4),
                "ratio_geomean_of_pairs": round(geomean([p["ratio"] for p in pairs]), 4),
                "ratio_pooled": round(pooled, 4),
                "ratio_excluding_runqueue_wait": round(ratio_off_queue, 4) if ratio_off_queue else None,
                "ratio_excluding_runqueue_wait_note": "tokens per second of main-thread wall time minus its run-queue wait "
                "(time runnable but without a CPU), platform / bare: the ratio on a machine with a core to spare",
                "main_thread_share": {k: round(v, 4) for k, v in share.items()},
                "per_step_ms": {
                    "bare_step": round(bare_step_s * 1e3, 2),
                    "platform_step": round(step_s / plat_steps * 1e3, 2),
                    "platform_train_step": round(train_step_s * 1e3, 2),
                    "send": round(mt_total.get("learner.send", 0.0) / max(sent, 1) * 1e3, 3),
                    "apply_received_per_fragment": round(mt_total.get("learner.apply", 0.0) / max(received, 1) * 1e3, 3),
                },
                "train_step_slowdown_vs_bare": round(train_step_s / bare_step_s, 4),
                "model_flops_per_token": cost.flops_per_token,
                "model_flops_per_s": {k: float(f"{cost.per_device_flops(v, 1):.4g}") if cost.flops_per_token else None
                                      for k, v in achieved.items()},
                "mfu": {k: round(cost.mfu(v, 1), 4) if cost.mfu(v, 1) is not None else None for k, v in achieved.items()},
                "mfu_note": "model FLOPs (forward and backward, counted on the meta device; recomputation not counted) per "
                f"second over the device's dense bf16 peak ({cost.describe()})",
                "main_thread_per_step": split,
                "main_thread_per_step_note": "per step of the main thread: cpu_ms on a CPU, runqueue_wait_ms runnable but "
                "waiting for a CPU (machine oversubscribed), blocked_ms neither (GIL, locks, I/O); *_cpu_share: CPU "
                "seconds per wall second of the learner's background threads / the synchronizer process; machine_busy_cores: "
                "all processes on the machine",
                "host_bytes_per_step": host_bytes,
                "host_bytes_per_step_note": "per platform step: increments_fp32 = float32 bytes of the fragment increments "
                "sent (what copying them to host memory would move), uploaded_encoded = the encoded blob bytes written (what "
                "reaches host memory when the learner encodes on its device), received_from_host = received fragments the main "
                "thread folds in (decoded in host memory, copied to the device on a GPU), downloaded_blobs = the blob bytes the link "
                "read from the store for them (with decode_on_device, what is copied to the device), state_save = the model "
                "and AdamW state copied to host memory for restarts",
                "main_thread_blocked_ms_per_step": {k: split[k].get("blocked_ms") for k in split},
                "fragments_sent": sent,
                "fragments_received": received,
                "link_io_off": {
                    "pairs": len(io_off),
                    "ratios": [round(p["ratio"], 4) for p in io_off],
                    "ratio_median_of_pairs": round(median([p["ratio"] for p in io_off]), 4) if io_off else None,
                    "train_step_slowdown_vs_bare": round(
                        (sum(p["platform"]["main_thread_s"].get("learner.train_step", 0.0) for p in io_off)
                         / sum(p["platform"]["steps"] for p in io_off))
                        / (sum(p["bare"]["elapsed_s"] for p in io_off) / sum(p["bare"]["steps"] for p in io_off)), 4)
                    if io_off else None,
                    "note": "extra pairs at the end with the learner's link doing no I/O (uploads dropped before they are "
                    "encoded, polls stopped): the training thread's own work alone, against the same bare loop",
                },
                "goal": {"ratio_min": GOAL_RATIO, "measure": "median of per-pair ratios", "pass": ok},
            }
        )
        print()
        print(
            f"tokens/s: bare {bare_tok / bare_s:.0f}, platform {plat_tok / plat_s:.0f}; ratio median of pairs {med:.3f}, "
            f"pooled {pooled:.3f}"
        )
        if ratio_off_queue:
            print(f"ratio excluding the main thread's run-queue wait (a machine with a core to spare): {ratio_off_queue:.3f}")
        print(
            f"platform main thread: train_step {share['train_step']:.1%}, send {share['send']:.2%}, "
            f"apply_received {share['apply_received']:.2%}, state save {share['save_state']:.2%}, "
            f"other {share['other_in_step']:.2%} of step time"
        )
        print(
            f"per step: bare {bare_step_s * 1e3:.1f} ms, platform train_step {train_step_s * 1e3:.1f} ms "
            f"(x{train_step_s / bare_step_s:.3f}); send {results['per_step_ms']['send']:.2f} ms/fragment, "
            f"apply {results['per_step_ms']['apply_received_per_fragment']:.2f} ms/fragment; {sent} sent, {received} received"
        )
        if cost.flops_per_token:
            print("model FLOP/s: " + ", ".join(
                f"{k} {format_flops(cost.per_device_flops(v, 1))}/s" + (f" (MFU {cost.mfu(v, 1):.1%})" if cost.peak_flops else "")
                for k, v in achieved.items()) + f"; {cost.describe()}")
        print("host bytes per platform step: " + ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in host_bytes.items()))
        for kind in ("bare", "platform"):
            sp = split[kind]
            if sp:
                print(
                    f"{kind:8} main thread per step: cpu {sp['cpu_ms']:.1f} ms, run-queue wait {sp['runqueue_wait_ms']:.1f} ms, "
                    f"blocked {sp['blocked_ms']:.1f} ms; learner bg threads {sp['background_threads_cpu_share']:.1%} of a core, "
                    f"synchronizer {sp.get('synchronizer_cpu_share', float('nan')):.1%}; "
                    + (f"link I/O process {sp['link_process_cpu_share']:.1%}; " if "link_process_cpu_share" in sp else "") +
                    f"machine busy {sp.get('machine_busy_cores', float('nan')):.2f} cores"
                )
        if io_off:
            lio = results["link_io_off"]
            print(f"with the link's I/O off ({len(io_off)} pairs): ratio {lio['ratio_median_of_pairs']:.3f}, "
                  f"train_step x{lio['train_step_slowdown_vs_bare']:.3f} of the bare step")
        print(f"goal: platform >= {GOAL_RATIO} x bare tokens/s: {verdict(ok)}")
    finally:
        if platform is not None:
            platform.stop()
        run.stop_all()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    write_results(name, results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
