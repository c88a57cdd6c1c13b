"""The quality benchmark's runs: one row of the plan trained and measured, alone or in a process pool.

The DiLoCo rows go through :func:`ddiloco.inprocess.run_inprocess`; data-parallel is a plain loop.
Where a row's real seconds go comes from the timing spans in the code itself
(:mod:`ddiloco.platform.spans`) and from counting SQL statements for the row's duration."""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ddiloco.bench.quality.plan import RunSpec, Scale, build_run_config, is_gpu, row_outages, spec_scale

if TYPE_CHECKING:
    import torch

    from ddiloco.platform.config import RunConfig


@dataclass
class Row:
    model: str
    regime: str
    group: str
    tokens: int
    val_loss: float
    val_accuracy: float | None
    bytes_per_token: float
    goodput: float
    wall_clock_s: float
    """Simulated span of the run (a learner step at full speed = 1 s)."""
    tokens_merged: int
    bytes_sent: int
    payload_bytes_per_token: float
    """Encoded tensor bytes only (without the safetensors header of each blob)."""
    lost_fraction: float
    """Share of the allocated learner-time spent down."""
    merges: int
    mean_learners_per_merge: float
    mean_grace_window_s: float
    real_s: float
    knobs: dict[str, Any]
    base: str | None = None
    knob: str = ""
    curve: list[list[float | None]] = field(default_factory=list)
    """[tokens, simulated seconds, val loss, val accuracy] per evaluation."""
    profile: dict[str, float] = field(default_factory=dict)
    """Real seconds and calls per profile key (:data:`PROFILE_KEYS`)."""
    fewest_versions: int | None = None
    """Merges of the fragment merged least often (every fragment kept publishing when it is near
    ``merges`` / fragments); None for data-parallel."""
    robust_applied: int | None = None
    """Merges a ``merge.robust`` rule judged (the rest had too few learners and fell back); None without one."""
    robust_dropped: int | None = None
    """Learners' updates ``merge.robust: drop_opposed`` merged with no weight, over the run."""
    links: dict[str, dict[str, Any]] | None = None
    """Per learner, what its upload queue went through (``inprocess.LinkFigures``) in a row with simulated
    upload links; None without."""
    bytes_per_val_token: float | None = None
    """UTF-8 bytes of text per validation target token (1 for byte-level models, None for images):
    ``val_loss / bytes_per_val_token`` is nats per byte, comparable across tokenizers."""
    scale: str | None = None
    """The plan's scale (``full``, ``quick``, ``gpu``, ``gpu-quick``) the row was trained at."""
    code: str | None = None
    """sha256 of the package's sources it was trained with (:func:`ddiloco.bench.provenance.code_digest`)."""
    device: str | None = None
    """Where it trained: ``cpu``, or the GPU's name."""
    corpus: dict[str, Any] | None = None
    """The token corpus it read (token shards only): the manifest's corpus digest, tokenizer and shard sha256s."""

    @property
    def nats_per_byte(self) -> float | None:
        return None if not self.bytes_per_val_token else self.val_loss / self.bytes_per_val_token

    @property
    def train_tokens_per_s(self) -> float | None:
        """Tokens per second of the training steps alone (forward, backward, AdamW), over the whole row."""
        secs = self.profile.get("learner.compute")
        return self.tokens / secs if secs else None


PROFILE_KEYS = {
    "learner.train_step": "learner.compute",
    "learner.poll": "learner.poll_versions",
    "sync.eval": "eval",
    "sql": "sql.s",
    "sql.calls": "sql.statements",
}
"""Span names under the profile keys the report and the published results have always used; other
spans keep their own names."""


def profile_of(totals: Mapping[str, float]) -> dict[str, float]:
    """Span totals (``name`` seconds, ``name.calls``) under the report's profile keys, rounded."""
    out: dict[str, float] = {}
    for key, value in totals.items():
        name, calls = (key[: -len(".calls")], ".calls") if key.endswith(".calls") else (key, "")
        out[PROFILE_KEYS.get(key) or PROFILE_KEYS.get(name, name) + calls] = round(value, 3)
    return dict(sorted(out.items()))


@contextmanager
def counting_sql() -> Iterator[None]:
    """Count every SQL statement and its time as the span ``sql`` while the block runs; the listeners
    are removed again when it ends."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from ddiloco.platform import spans

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        conn.info.setdefault("bench_sql_t0", []).append(time.perf_counter())

    def after(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        spans.add("sql", time.perf_counter() - conn.info["bench_sql_t0"].pop())

    event.listen(Engine, "before_cursor_execute", before)
    event.listen(Engine, "after_cursor_execute", after)
    try:
        yield
    finally:
        event.remove(Engine, "before_cursor_execute", before)
        event.remove(Engine, "after_cursor_execute", after)


def run_spec(spec: RunSpec, scale: Scale, quick: bool, device: str = "auto") -> Row:
    """Train one row and measure it, with the profile of its real time. The CPU plan trains on the CPU; the GPU
    plan where ``device`` says (``auto``: the GPU when there is one)."""
    import torch

    from ddiloco.bench.provenance import code_digest
    from ddiloco.learner_worker.device import resolve_device
    from ddiloco.platform import spans

    gpu = is_gpu(scale)
    t0 = time.perf_counter()
    scale = spec_scale(spec, scale)
    cfg = build_run_config(spec, scale, quick, device)
    where = resolve_device(cfg.learners.device) if gpu else torch.device("cpu")
    # Pool workers share the cores; a row on a GPU is alone, and its synchronizer's merges and decoding use a few.
    torch.set_num_threads(min(8, os.cpu_count() or 1) if where.type == "cuda" else 1)
    # The first AdamW of a process imports torch._dynamo (seconds): not the run's time.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    t0 = time.perf_counter()
    with spans.collecting() as totals, counting_sql():
        dp = spec.regime.startswith("data_parallel")
        # A GPU row trains for minutes alone: it says how far it is at each evaluation. The CPU plan's rows run many
        # at a time in pool workers and stay quiet.
        say = progress_printer(spec.regime, scale, cfg) if gpu else None
        row = _run_data_parallel(spec, cfg, scale, where, say) if dp else _run_decoupled(spec, cfg, scale, where, say)
    row.real_s = round(time.perf_counter() - t0, 2)
    row.profile = profile_of(totals)
    row.bytes_per_val_token = bytes_per_val_token(cfg)
    row.scale, row.code, row.corpus = scale.name, code_digest(), corpus_summary(cfg)
    row.device = torch.cuda.get_device_name(where) if where.type == "cuda" else where.type
    return row


def corpus_summary(cfg: RunConfig) -> dict[str, Any] | None:
    """What a row's token corpus is: the manifest's corpus digest and sizes, the tokenizer's and every shard's sha256."""
    if cfg.data.source != "tokens" or cfg.data.manifest is None:
        return None
    from ddiloco.platform.manifest import read_manifest

    m = read_manifest(cfg.data.manifest)
    keys = ("corpus", "corpus_sha256", "python", "train_bytes", "val_bytes", "train_files", "val_files", "documents")
    return {
        **{k: m.extra[k] for k in keys if k in m.extra},
        "packages": len(m.extra.get("packages", ())),
        "tokenizer_sha256": m.tokenizer_sha256,
        "vocab_size": m.vocab_size,
        "train_tokens": m.train_tokens,
        "val_tokens": m.val.tokens,
        "shards": [{"path": e.path, "tokens": e.tokens, "sha256": e.sha256} for e in [*m.train, m.val]],
    }


def bytes_per_val_token(cfg: RunConfig) -> float | None:
    """Text bytes per target token of the validation batches every evaluation reads.

    Byte-level sources: 1. Token shards of a byte-level BPE: each vocabulary entry is spelled in
    ByteLevel's alphabet, one character per byte, so a token's length is its byte count (special
    tokens, the document separator, count 0)."""
    src = cfg.data.source
    if src == "digits":
        return None
    if src in ("stdlib", "glob"):
        return 1.0
    import numpy as np

    from ddiloco.platform.data import build_dataset
    from ddiloco.platform.manifest import read_manifest, resolve

    if cfg.data.manifest is None:
        return None
    manifest = read_manifest(cfg.data.manifest)
    if manifest.tokenizer is None:
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(resolve(cfg.data.manifest, manifest.tokenizer))
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    nbytes = np.array([0 if (t := tok.id_to_token(i)) is None or t in special else len(t) for i in range(tok.get_vocab_size())])
    val = build_dataset(cfg.data, cfg.model).val_batches(cfg.learners.batch_size)
    total = sum(int(nbytes[b.targets.numpy()].sum()) for b in val)
    tokens = sum(int(b.targets.numel()) for b in val)
    return total / tokens if tokens else None


def prepare_bench_data(quick: bool) -> str:
    """The llama rows' BPE shards (trained on the byte-level rows' corpus), prepared once and reused."""
    from pathlib import Path

    from ddiloco.bench.quality.plan import LLAMA_VOCAB, llama_corpus_bytes, llama_data_dir
    from ddiloco.data_prepare import file_corpus, prepare

    out = llama_data_dir(quick)
    if not (Path(out) / "manifest.json").exists():
        prepare(file_corpus("stdlib", max_bytes=llama_corpus_bytes(quick)), out, train_tokenizer=LLAMA_VOCAB,
                shard_tokens=10**9, val_fraction=0.05)
    return out


def prepare_gpu_data(quick: bool, corpus_bytes: int | None = None) -> tuple[str, dict[str, Any], bool]:
    """The GPU plan's BPE shards of the installed packages' Python sources: (manifest URL, the corpus's record, whether
    they were prepared now). Prepared once and reused while the installed packages are the same (the manifest's corpus
    digest); another environment's shards are prepared again, their manifest removed first so no run reads them half-written.
    ``corpus_bytes`` (with ``quick``): a slice of that size instead of --quick's, in a folder of its own."""
    from pathlib import Path

    from ddiloco.bench.quality.plan import GPU_QUICK_CORPUS_BYTES, LLAMA_DATA_ROOT, gpu_data_dir, gpu_vocab
    from ddiloco.data_prepare import VAL_SHARE, prepare, site_packages_corpus
    from ddiloco.platform.manifest import read_manifest

    out = gpu_data_dir(quick)
    if quick and corpus_bytes is not None:
        out = f"{LLAMA_DATA_ROOT}/site-packages-bpe{gpu_vocab(quick)}-{corpus_bytes}"
    url = f"{out}/manifest.json"
    # --quick's slice is small: a larger share of it validates, so the evaluation windows do not overlap much.
    size = (corpus_bytes or GPU_QUICK_CORPUS_BYTES) if quick else None
    corpus = site_packages_corpus(size, val_share=0.05 if quick else VAL_SHARE)
    if Path(url).exists():
        if read_manifest(url).extra.get("corpus_sha256") == corpus.record["corpus_sha256"]:
            return url, read_manifest(url).extra, False
        Path(url).unlink()
    manifest = prepare(corpus, out, train_tokenizer=gpu_vocab(quick), val_fraction=VAL_SHARE)
    return url, manifest.extra, True


def _knobs(cfg: RunConfig, spec: RunSpec, scale: Scale) -> dict[str, Any]:
    return {
        "learners": cfg.learners.count,
        "steps_per_learner": scale.steps,
        "batch": cfg.learners.batch_size,
        "fragments": cfg.fragments.count,
        "every": cfg.fragments.period,
        "overlap": cfg.fragments.overlap,
        "quorum": cfg.quorum.min_count,
        "grace": cfg.grace.enabled,
        "gamma": cfg.grace.gamma,
        "method": cfg.merge.method,
        "weighting": cfg.merge.weighting,
        "on_receipt": cfg.merge.on_receipt,
        "codec": cfg.compression.codec,
        "outer_lr": cfg.outer.lr,
        "outer_momentum": cfg.outer.momentum,
        "outer_warmup": cfg.outer.warmup_versions,
        "speeds": list(spec.speeds) if spec.speeds else None,
        "failures": spec.failures,
        "clip_factor": cfg.merge.clip_factor,
        "robust": cfg.merge.robust,
        "trim_fraction": cfg.merge.trim_fraction if cfg.merge.robust == "trimmed_mean" else None,
        "adversary": spec.adversary or None,
        "adaptive": cfg.fragments.adaptive,
        "upload_shares": list(spec.upload_shares) if spec.upload_shares else None,
        "seed": cfg.seed,
    }


def progress_printer(regime: str, scale: Scale, cfg: RunConfig) -> Callable[[int, float], None]:
    """A line for each evaluation of a row: the share of its tokens trained, the validation loss, the real seconds."""
    from ddiloco.platform.config import tokens_per_step

    total = scale.learners * scale.steps * tokens_per_step(cfg.model, cfg.learners.batch_size)
    t0 = time.perf_counter()

    def say(tokens: int, val_loss: float) -> None:
        print(f"   {regime}: {tokens / total:4.0%} of {total / 1e6:.1f}M tokens, val loss {val_loss:.4f}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)

    return say


def _run_decoupled(spec: RunSpec, cfg: RunConfig, scale: Scale, device: torch.device,
                   say: Callable[[int, float], None] | None = None) -> Row:
    from sqlalchemy import select

    from ddiloco.inprocess import run_inprocess
    from ddiloco.platform.compression import codec_nbytes
    from ddiloco.platform.config import tokens_per_step
    from ddiloco.platform.ledger import reports as reports_q
    from ddiloco.platform.ledger.models import Merge, Submission

    tps = tokens_per_step(cfg.model, cfg.learners.batch_size)
    total = scale.learners * scale.steps * tps
    ids = [lid for lid, _, _ in cfg.learners.learner_ids()]
    outages = row_outages(ids, scale, spec.failures, spec.seed) if spec.failures > 0 else None
    adversaries = {ids[1]: spec.adversary} if spec.adversary > 0 else None
    upload_bps = None
    if spec.upload_shares:
        demand = upload_demand(cfg)
        upload_bps = {lid: share * demand for lid, share in zip(ids, spec.upload_shares, strict=True)}
    run = run_inprocess(cfg, total_tokens=total, step_time_s=1.0, outages=outages, eval_every_tokens=max(1, total // scale.evals),
                        upload_bps=upload_bps, adversaries=adversaries, device=device,
                        on_eval=None if say is None else lambda e: say(e.tokens, e.val_loss))
    final = run.evals[-1]
    elapsed = run.elapsed_s
    speeds = [s for _, _, s in cfg.learners.learner_ids()]
    capacity = sum(speeds) * elapsed * tps
    numel = {f.index: f.numel for f in run.sync.layout.fragments}
    with run.ctx.reading() as s:
        acct = reports_q.token_accounting(s, run.ctx.run_id)
        subs = list(s.scalars(select(Submission).where(Submission.run_id == run.ctx.run_id)))
        merges = list(s.scalars(select(Merge).where(Merge.run_id == run.ctx.run_id)))
    sent = sum(sb.nbytes for sb in subs)
    payload = sum(codec_nbytes(numel[sb.fragment], sb.codec, cfg.compression.block_size) for sb in subs)
    grace = [m.grace_window_s for m in merges if m.grace_window_s >= 0]
    per_fragment = Counter(m.fragment for m in merges)
    robust = [json.loads(m.detail_json).get("robust") for m in merges] if cfg.merge.robust != "none" else None
    return Row(
        model=spec.model,
        regime=spec.regime,
        group=spec.group,
        tokens=run.tokens_trained,
        val_loss=final.val_loss,
        val_accuracy=final.val_accuracy,
        bytes_per_token=sent / max(1, run.tokens_trained),
        goodput=acct.merged / capacity if capacity else math.nan,
        wall_clock_s=elapsed,
        tokens_merged=acct.merged,
        bytes_sent=sent,
        payload_bytes_per_token=payload / max(1, run.tokens_trained),
        lost_fraction=run.down_s / (len(speeds) * elapsed) if elapsed else 0.0,
        merges=len(merges),
        mean_learners_per_merge=sum(m.included for m in merges) / max(1, len(merges)),
        mean_grace_window_s=sum(grace) / len(grace) if grace else 0.0,
        real_s=0.0,
        knobs=_knobs(cfg, spec, scale),
        base=spec.base,
        knob=spec.knob,
        curve=[[e.tokens, e.t_s, e.val_loss, e.val_accuracy] for e in run.evals],
        links=None if upload_bps is None else {lid: _link_json(f, upload_bps[lid]) for lid, f in run.links.items()},
        fewest_versions=min(per_fragment.get(f, 0) for f in numel),
        robust_applied=None if robust is None else sum(1 for r in robust if r["applied"]),
        robust_dropped=None if robust is None else sum(len(r.get("dropped", ())) for r in robust),
    )


def upload_demand(cfg: RunConfig, step_time_s: float = 1.0) -> float:
    """Bytes per second a learner's uploads take when it sends every fragment every H steps with the run's
    codec (payload: values and scales, without blob headers), at ``step_time_s`` per step."""
    from ddiloco.platform.compression import codec_nbytes
    from ddiloco.platform.models import build_model

    model = build_model(cfg.model, seed=cfg.seed)
    c = cfg.compression
    return sum(codec_nbytes(p.numel(), c.codec, c.block_size) for p in model.parameters()) / (cfg.fragments.period * step_time_s)


def _link_json(f: Any, bandwidth: float) -> dict[str, Any]:
    return {"upload_bps": round(bandwidth, 1), "max_oldest_unsent_s": round(f.max_oldest_unsent_s, 2),
            "mean_oldest_unsent_s": round(f.queue_s / max(1, f.steps), 2), "coalesced": f.coalesced,
            "cadence_changes": f.cadence_changes, "steps_per_cadence": dict(sorted(f.cadences.items()))}


def _run_data_parallel(spec: RunSpec, cfg: RunConfig, scale: Scale, device: torch.device,
                       say: Callable[[int, float], None] | None = None) -> Row:
    """M replicas' gradients averaged every step: one model, M micro-batches (one per learner shard,
    the same streams the DiLoCo learners read), each loss / M, one AdamW step. The forward and loss are
    the learners' own (bf16 autocast on a GPU, torch.compile when ``learners.compile``)."""
    import torch

    from ddiloco.learner_worker.learner import _LossModule
    from ddiloco.learner_worker.schedule import lr_factor, param_groups
    from ddiloco.platform.config import tokens_per_step
    from ddiloco.platform.data import build_dataset
    from ddiloco.platform.models import build_model
    from ddiloco.platform.spans import span
    from ddiloco.synchronizer.evaluation import evaluate_global

    M, icfg = scale.learners, cfg.inner
    model = build_model(cfg.model, seed=cfg.seed).to(device)
    model.train()
    net = _LossModule(model, device)
    net = torch.compile(net) if cfg.learners.compile else net
    # The learners' own parameter groups and schedule: the rows differ in how replicas meet, nothing else.
    opt = torch.optim.AdamW(param_groups(model, icfg.weight_decay), lr=icfg.lr, betas=(icfg.beta1, icfg.beta2))
    data = build_dataset(cfg.data, cfg.model)
    streams = [data.train_batches(m, M, cfg.learners.batch_size, seed=cfg.seed * 1_000_003) for m in range(M)]
    tps = tokens_per_step(cfg.model, cfg.learners.batch_size)
    total = M * scale.steps * tps
    every = max(1, total // scale.evals)
    n_params = sum(p.numel() for p in model.parameters())
    curve: list[list[float | None]] = []

    # The spans the in-process rows' learner and evaluation use, so every row's profile reads alike.
    def ev(tokens: int, t: float) -> None:
        with span("sync.eval"):
            loss, acc = evaluate_global(cfg, {}, model=model)
        curve.append([tokens, t, loss, acc])
        if say is not None:
            say(tokens, loss)

    ev(0, 0.0)
    trained, next_eval = 0, every
    for step in range(scale.steps):
        with span("learner.train_step"):
            lr = icfg.lr * lr_factor(step, icfg, scale.steps)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            for m in range(M):
                batch = next(streams[m])
                loss = net(batch.inputs.to(device, non_blocking=True), batch.targets.to(device, non_blocking=True), batch.tokens)
                (loss / M).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), icfg.grad_clip)
            opt.step()
        trained += M * tps
        if trained >= next_eval:
            next_eval += every
            ev(trained, float(step + 1))
    if curve[-1][0] != trained:
        ev(trained, float(scale.steps))
    final = curve[-1]
    # Every replica sends its float32 gradient every step (one direction, as for the DiLoCo rows).
    sent = M * scale.steps * 4 * n_params
    knobs = {"learners": M, "steps_per_learner": scale.steps, "batch": cfg.learners.batch_size, "params": n_params,
             "lr": icfg.lr, "gradient": "float32, every step", "seed": cfg.seed}
    return Row(
        model=spec.model, regime=spec.regime, group=spec.group, tokens=trained, val_loss=final[2], val_accuracy=final[3],
        bytes_per_token=sent / trained, goodput=1.0, wall_clock_s=float(scale.steps), tokens_merged=trained, bytes_sent=sent,
        payload_bytes_per_token=sent / trained, lost_fraction=0.0, merges=scale.steps, mean_learners_per_merge=float(M),
        mean_grace_window_s=0.0, real_s=0.0, knobs=knobs, curve=curve, base=spec.base, knob=spec.knob,
    )


def _run_one(args: tuple[RunSpec, Scale, bool, str]) -> Row:
    from ddiloco.platform.memory import keep_freed_memory

    spec, scale, quick, device = args
    # A row of a few minutes frees and allocates the same blob-sized buffers every round: reuse them (in this process,
    # a pool worker's or the command's own) rather than fault fresh pages in each time.
    keep_freed_memory()
    row = run_spec(spec, scale, quick, device)
    print(f"  {row.model:6s} {row.regime:30s} loss {row.val_loss:.4f}  goodput {row.goodput:.3f}  "
          f"B/token {row.bytes_per_token:9.2f}  {row.real_s:6.1f}s", flush=True)
    return row


def run_all(specs: Sequence[RunSpec], scale: Scale, quick: bool, jobs: int = 1, *, device: str = "auto",
            done: Callable[[Row], None] | None = None) -> list[Row]:
    """Every row, in plan order (runs are seeded: ``jobs`` changes the time taken, not the figures); ``done`` is
    called with each row as soon as it is trained, so a plan cut short keeps the rows it finished."""
    work = [(s, scale, quick, device) for s in specs]
    if jobs <= 1:
        rows = []
        for w in work:
            rows.append(_run_one(w))
            if done is not None:
                done(rows[-1])
        return rows
    # Longest first, so the pool does not end waiting for one slow run.
    order = sorted(range(len(work)), key=lambda i: -_cost(work[i][0]))
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(_run_one, work[i]): i for i in order}
        rows_at: dict[int, Row] = {}
        for future in as_completed(futures):
            rows_at[futures[future]] = future.result()
            if done is not None:
                done(rows_at[futures[future]])
        return [rows_at[i] for i in range(len(work))]


def _cost(spec: RunSpec) -> float:
    c = {"dense": 1.0, "moe": 2.0, "vision": 0.4, "llama": 1.5}.get(spec.model, 1.0) * (spec.learners or 4) / 4
    return c * (0.3 if spec.regime.startswith("data_parallel") else 1.0)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (the worker pool)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return round(own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime, 1)
