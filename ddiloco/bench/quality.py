"""Training quality: Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel, at equal tokens.

Every run trains the same model from the same seed on the same learner shards, and stops when
the learners together have trained the same number of tokens (M learners x ``steps`` x batch x
sequence). The DiLoCo regimes all go through :func:`ddiloco.inprocess.run_inprocess` (the real
learner, ledger, store and synchronizer on a simulated clock; a learner step takes 1 simulated
second at full speed); data-parallel is a plain loop (M replicas' gradients averaged every step).

Rows (``regime``):

* ``data_parallel``: M replicas, gradients averaged every step (one model, M micro-batches).
* ``diloco``: synchronous DiLoCo: P = 1, every H steps, overlap 0, quorum M, plain mean, equal
  weights, no compression, overwrite, outer lr 0.7 (the exact-reduction and paper settings).
* ``streaming_diloco``: the same with P fragments, each every H steps (staggered).
* ``decoupled``: the run defaults (K = 1, adaptive grace, token weights, RDA, blend 0.5 on
  receipt, outer lr 0.5, int8, overlap 2).
* ``decoupled_stragglers``: the same with learner speeds 1, 0.5, 0.667, 1.
* ``decoupled_failures``: the same with a seeded outage schedule taking ~25% of learner-time.
* ablations and the sweep: the decoupled (or stragglers, outages) row with one knob changed;
  ``m8_*``: M = 8 learners at the same tokens; ``ablation_rebase*`` and ``m8_rebase``:
  ``merge.on_receipt: rebase`` against the default blend, on every model.

Goodput (in-process) = tokens merged into the global model / tokens the learners could have
trained in the learner-time allocated to the run (each learner at its own speed, over the whole
simulated span, down or not)."""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ddiloco.bench.provenance import git_state, json_safe, machine_info

LN256 = math.log(256)
MODELS = ("dense", "moe", "vision")
REGIMES = ("data_parallel", "diloco", "streaming_diloco", "decoupled", "decoupled_stragglers", "decoupled_failures")
STRAGGLER_SPEEDS = (1.0, 0.5, 0.667, 1.0)
"""One learner 2x slower, one 1.5x slower (RegionConfig wants speeds in (0, 1])."""
FAILURE_FRACTION = 0.25
OUTAGES_PER_LEARNER = 3
OUTAGE_SEED = 1234
GOAL_DECOUPLED = 0.02
GOAL_DEGRADED = 0.03
GOAL_COMM_RATIO = 200.0
ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results" / "quality.json"
BEGIN, END = "<!-- quality:begin (written by `ddiloco bench quality --docs`) -->", "<!-- quality:end -->"


# --- what is run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    name: str
    steps: int
    """Inner steps per learner at full speed (the data-parallel steps)."""
    learners: int
    evals: int
    """Evaluation points per run (besides the one at 0 tokens)."""


FULL = Scale("full", steps=192, learners=4, evals=12)
QUICK = Scale("quick", steps=12, learners=3, evals=3)
QUICK_EXTRA = ("diloco_stragglers", "ablation_overwrite", "ablation_int4", "ablation_no_grace", "sweep_lr0.7")
"""The extra rows --quick runs: enough to exercise every part of the report."""


def model_sections(model: str, quick: bool) -> tuple[dict[str, Any], int, int]:
    """(config sections, fragments P, period H) of a model at a scale."""
    if model in ("dense", "moe"):
        kind = "gpt" if model == "dense" else "moe_gpt"
        if quick:
            m = {"kind": kind, "n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32}
            batch, P, H, data = 4, 4, 4, {"source": "stdlib", "max_bytes": 400_000, "val_batches": 2}
        else:
            m = {"kind": kind, "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64}
            batch, P, H, data = 8, 24, 24, {"source": "stdlib", "max_bytes": 2_000_000, "val_batches": 16}
        if model == "moe":
            m.update({"n_experts": 4, "top_k": 2})
    elif model == "vision":
        m = {"kind": "vision", "image_size": 8, "n_classes": 10}
        # 23 batches of 16 = every one of the 359 held-out digits.
        batch, P, H, data = 16, 4, (4 if quick else 24), {"source": "digits", "val_batches": 4 if quick else 23}
    else:
        raise ValueError(f"unknown model {model!r}; expected one of {', '.join(MODELS)}")
    sections = {
        "model": m,
        "data": data,
        "learners": {"batch_size": batch},
        "inner": {"lr": 3e-3, "warmup_steps": 4 if quick else 20},
        "fragments": {"count": P, "every": H},
    }
    return sections, P, H


@dataclass(frozen=True)
class RunSpec:
    model: str
    regime: str
    group: str
    """regime, ablation or sweep"""
    overrides: dict[str, Any] = field(default_factory=dict)
    speeds: tuple[float, ...] | None = None
    failures: float = 0.0
    base: str | None = None
    """For an ablation or sweep point: the row it changes one knob of."""
    knob: str = ""
    seed: int = 0
    learners: int | None = None
    """M for this row when it differs from the scale's (steps then shrink so the tokens stay equal)."""


def spec_scale(spec: RunSpec, scale: Scale) -> Scale:
    """The scale a row runs at: the benchmark's, or M = ``spec.learners`` with the same total tokens."""
    if spec.learners is None or spec.learners == scale.learners:
        return scale
    total_steps = scale.learners * scale.steps
    if total_steps % spec.learners:
        raise ValueError(f"{scale.learners} x {scale.steps} steps do not split over {spec.learners} learners")
    return Scale(scale.name, steps=total_steps // spec.learners, learners=spec.learners, evals=scale.evals)


SYNC = {
    "fragments": {"overlap": 0},
    "grace": {"enabled": False},
    "merge": {"method": "mean", "weighting": "equal", "max_staleness": 0, "on_receipt": "overwrite"},
    "compression": {"codec": "none"},
    "outer": {"lr": 0.7, "momentum": 0.9},
}
"""Synchronous DiLoCo at the paper's settings (whatever the run defaults are)."""


def regime_specs(model: str, scale: Scale) -> list[RunSpec]:
    M = scale.learners
    return [
        RunSpec(model, "data_parallel", "regime"),
        RunSpec(model, "diloco", "regime", _merge(SYNC, {"fragments": {"count": 1}, "quorum": {"min_count": M}})),
        RunSpec(model, "streaming_diloco", "regime", _merge(SYNC, {"quorum": {"min_count": M}})),
        RunSpec(model, "decoupled", "regime"),
        RunSpec(model, "decoupled_stragglers", "regime", speeds=STRAGGLER_SPEEDS[:M]),
        RunSpec(model, "decoupled_failures", "regime", failures=FAILURE_FRACTION),
    ]


def reference_specs(model: str, scale: Scale) -> list[RunSpec]:
    """Synchronous DiLoCo under the same stragglers and outages: what the decoupled rows save in
    wall-clock (it waits for the slowest learner, and stalls while one is down)."""
    M = scale.learners
    sync = _merge(SYNC, {"fragments": {"count": 1}, "quorum": {"min_count": M}})
    return [
        RunSpec(model, "diloco_stragglers", "reference", sync, speeds=STRAGGLER_SPEEDS[:M], base="diloco", knob="stragglers"),
        RunSpec(model, "diloco_failures", "reference", sync, failures=FAILURE_FRACTION, base="diloco", knob="outages"),
    ]


def noise_specs(model: str, scale: Scale) -> list[RunSpec]:
    """The same two rows from another seed (model init and data order): how large a gap chance makes."""
    return [
        RunSpec(model, "diloco_seed1", "noise", regime_specs(model, scale)[1].overrides, base="diloco", knob="seed 1 (vs 0)", seed=1),
        RunSpec(model, "decoupled_seed1", "noise", base="decoupled", knob="seed 1 (vs 0)", seed=1),
    ]


def ablation_specs(model: str, scale: Scale) -> list[RunSpec]:
    """One knob of the platform's choices changed; grace and weights where they can matter (stragglers:
    homogeneous learners submit in lock-step, so every merge closes at once with equal weights)."""
    S = STRAGGLER_SPEEDS[: scale.learners]
    return [
        RunSpec(model, "ablation_mean", "ablation", {"merge": {"method": "mean"}}, base="decoupled", knob="merge.method=mean (vs rda)"),
        RunSpec(model, "ablation_overwrite", "ablation", {"merge": {"on_receipt": "overwrite"}}, base="decoupled",
                knob="merge.on_receipt=overwrite (vs blend 0.5)"),
        RunSpec(model, "ablation_fp32", "ablation", {"compression": {"codec": "none"}}, base="decoupled", knob="codec none (vs int8)"),
        RunSpec(model, "ablation_bf16", "ablation", {"compression": {"codec": "bf16"}}, base="decoupled", knob="codec bf16 (vs int8)"),
        RunSpec(model, "ablation_int4", "ablation", {"compression": {"codec": "int4"}}, base="decoupled", knob="codec int4 (vs int8)"),
        # At H = 24 int4 cannot reach 200x (4 bytes x 24 steps / 0.5 byte is 192x before any scale or
        # header); the same codec sending each fragment every 32 steps, and what that costs in loss.
        RunSpec(model, "ablation_int4_h32", "ablation", {"compression": {"codec": "int4"}, "fragments": {"every": 32}},
                base="ablation_int4", knob="H = 32 (vs 24), int4"),
        RunSpec(model, "ablation_no_grace", "ablation", {"grace": {"enabled": False}}, speeds=S, base="decoupled_stragglers",
                knob="K=1 without grace window (vs with), stragglers"),
        RunSpec(model, "ablation_equal_weights", "ablation", {"merge": {"weighting": "equal"}}, speeds=S, base="decoupled_stragglers",
                knob="equal weights (vs token weights), stragglers"),
    ]


OLD_DEFAULTS = {"outer": {"lr": 0.7}, "merge": {"on_receipt": "overwrite"}}
"""The run defaults before this benchmark changed them (DiLoCo's outer lr, DESIGN.md's overwrite)."""
OLD_KNOB = "outer.lr=0.7 and overwrite (vs 0.5, blend: the old defaults)"


def sweep_specs(model: str, scale: Scale, quick: bool) -> list[RunSpec]:
    """Outer lr under asynchrony (stragglers: merges are out of phase; outages), and gamma of the grace
    window, around the defaults (outer lr 0.5, blend 0.5)."""
    S = STRAGGLER_SPEEDS[: scale.learners]
    lrs = (0.7,) if quick else (0.3, 0.7)
    out = [
        RunSpec(model, f"sweep_lr{lr:g}", "sweep", {"outer": {"lr": lr}}, base="decoupled", knob=f"outer.lr={lr:g} (vs 0.5)")
        for lr in lrs
    ]
    if not quick:
        out += [
            RunSpec(model, f"sweep_stragglers_lr{lr:g}", "sweep", {"outer": {"lr": lr}}, speeds=S, base="decoupled_stragglers",
                    knob=f"outer.lr={lr:g} (vs 0.5), stragglers")
            for lr in lrs
        ]
        out += [
            RunSpec(model, "sweep_stragglers_gamma0.5", "sweep", {"grace": {"gamma": 0.5}}, speeds=S,
                    base="decoupled_stragglers", knob="grace.gamma=0.5 (vs 0.8), stragglers"),
            RunSpec(model, "sweep_lr0.7_seed1", "sweep", {"outer": {"lr": 0.7}}, base="decoupled_seed1",
                    knob="outer.lr=0.7 (vs 0.5), seed 1", seed=1),
            RunSpec(model, "sweep_failures_lr0.7", "sweep", {"outer": {"lr": 0.7}}, failures=FAILURE_FRACTION,
                    base="decoupled_failures", knob="outer.lr=0.7 (vs 0.5), outages"),
            RunSpec(model, "sweep_lr0.7_overwrite", "sweep", OLD_DEFAULTS, base="decoupled", knob=OLD_KNOB),
        ]
    return out


def other_model_sweep(model: str, scale: Scale) -> list[RunSpec]:
    """The old defaults on another model; for vision also under stragglers and outages, one knob
    at a time (the rows whose goals the old defaults missed)."""
    out = [RunSpec(model, "sweep_lr0.7_overwrite", "sweep", OLD_DEFAULTS, base="decoupled", knob=OLD_KNOB)]
    if model != "vision":
        return out
    S = STRAGGLER_SPEEDS[: scale.learners]
    for kind, kw in (("stragglers", {"speeds": S}), ("failures", {"failures": FAILURE_FRACTION})):
        what = "stragglers" if kind == "stragglers" else "outages"
        for tag, ov, knob in (("lr0.7", {"outer": {"lr": 0.7}}, "outer.lr=0.7 (vs 0.5)"),
                              ("overwrite", {"merge": {"on_receipt": "overwrite"}}, "overwrite (vs blend 0.5)"),
                              ("lr0.7_overwrite", OLD_DEFAULTS, OLD_KNOB)):
            out.append(RunSpec(model, f"sweep_{kind}_{tag}", "sweep", ov, base=f"decoupled_{kind}", knob=f"{knob}, {what}", **kw))
    return out


M_LARGE = 8


def many_learner_specs(model: str, scale: Scale) -> list[RunSpec]:
    """M = 8 learners at the same total tokens (half the steps each, so 4 rounds of H): does overwrite
    beat the 0.5 blend as M grows, as the paper reports?"""
    M = M_LARGE
    sync = _merge(SYNC, {"fragments": {"count": 1}, "quorum": {"min_count": M}})
    lr7, over = {"outer": {"lr": 0.7}}, {"merge": {"on_receipt": "overwrite"}}
    return [
        RunSpec(model, "m8_diloco", "reference", sync, base="diloco", knob=f"M = {M} (vs {scale.learners}), same tokens", learners=M),
        RunSpec(model, "m8_decoupled", "ablation", base="decoupled", knob=f"M = {M} (vs {scale.learners}), same tokens", learners=M),
        RunSpec(model, "m8_overwrite", "ablation", over, base="m8_decoupled", knob=f"overwrite (vs blend 0.5), M = {M}", learners=M),
        RunSpec(model, "m8_lr0.7", "sweep", lr7, base="m8_decoupled", knob=f"outer.lr=0.7 (vs 0.5), M = {M}", learners=M),
        RunSpec(model, "m8_lr0.7_overwrite", "sweep", OLD_DEFAULTS, base="m8_lr0.7",
                knob=f"overwrite (vs blend 0.5) at outer.lr=0.7, M = {M}", learners=M),
    ]


RECEIPT_ROWS = {"dense": ("", "stragglers", "failures"), "moe": ("",), "vision": ("stragglers", "failures")}
"""Where the rebase rows run: the base rows (``decoupled`` and its stragglers and outages variants) per model."""


def receipt_specs(model: str, scale: Scale) -> list[RunSpec]:
    """merge.on_receipt=rebase (θ ← G + (θ − S): the unsent progress carried onto the new version) against
    the default blend, without faults, with stragglers and with outages; on the dense model also at M = 8."""
    S = STRAGGLER_SPEEDS[: scale.learners]
    ov = {"merge": {"on_receipt": "rebase"}}
    out = []
    for kind in RECEIPT_ROWS.get(model, ()):
        kw: dict[str, Any] = {"speeds": S} if kind == "stragglers" else {"failures": FAILURE_FRACTION} if kind == "failures" else {}
        what = {"": "", "stragglers": ", stragglers", "failures": ", outages"}[kind]
        base = f"decoupled_{kind}" if kind else "decoupled"
        out.append(RunSpec(model, f"ablation_rebase{'_' + kind if kind else ''}", "ablation", ov, base=base,
                           knob=f"rebase (vs blend 0.5) on receipt{what}", **kw))
    if model == "dense":
        out.append(RunSpec(model, f"m{M_LARGE}_rebase", "ablation", ov, base=f"m{M_LARGE}_decoupled",
                           knob=f"rebase (vs blend 0.5) on receipt, M = {M_LARGE}", learners=M_LARGE))
    return out


def select(specs: Sequence[RunSpec], only: str | Sequence[str] | None) -> list[RunSpec]:
    """The rows named in ``only``: ``regime`` (every model) or ``model:regime``, comma-separated."""
    if not only:
        return list(specs)
    names = [x.strip() for x in (only.split(",") if isinstance(only, str) else only) if x.strip()]
    out = [s for s in specs if s.regime in names or f"{s.model}:{s.regime}" in names]
    unknown = [n for n in names if not any(n in (s.regime, f"{s.model}:{s.regime}") for s in specs)]
    if unknown:
        raise ValueError(f"no row named {', '.join(unknown)} in this plan")
    return out


def plan(models: Sequence[str], scale: Scale, quick: bool, ablations: bool = True, sweep: bool = True) -> list[RunSpec]:
    specs: list[RunSpec] = []
    for model in models:
        specs += regime_specs(model, scale)
    # Ablations and the sweep on the dense model (or the first model asked for).
    extra = "dense" if "dense" in models else models[0]
    if ablations:
        specs += reference_specs(extra, scale)
        specs += ablation_specs(extra, scale)
        if not quick:
            specs += noise_specs(extra, scale)
    if sweep:
        specs += sweep_specs(extra, scale, quick)
        if not quick:
            for model in models:
                if model != extra:
                    specs += other_model_sweep(model, scale)
            specs += many_learner_specs(extra, scale)
            for model in models:
                specs += receipt_specs(model, scale)
    if quick:
        specs = [s for s in specs if s.group == "regime" or s.regime in QUICK_EXTRA]
    return specs


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def build_run_config(spec: RunSpec, scale: Scale, quick: bool):
    from ddiloco.platform.config import build_config

    sections, _, _ = model_sections(spec.model, quick)
    region: dict[str, Any] = {"name": "dc", "learners": scale.learners}
    if spec.speeds:
        region["speeds"] = list(spec.speeds)
    data = _merge(sections, {"learners": {"regions": [region]}})
    data = _merge(data, spec.overrides)
    name = f"q-{spec.model}-{spec.regime}"[:64]
    return build_config({"name": name, "seed": spec.seed, **data})


# --- failure schedule ----------------------------------------------------------------------------


def outage_schedule(learner_ids: Sequence[str], horizon_s: float, fraction: float, seed: int,
                    per_learner: int = OUTAGES_PER_LEARNER, min_outage_s: float = 5.0):
    """Seeded outages: each learner is down ``fraction`` of ``horizon_s`` in ``per_learner`` spells
    of random length at random places; redrawn until at least one learner is always up."""
    from ddiloco.inprocess import Outage

    rng = random.Random(seed)
    min_outage_s = min(min_outage_s, fraction * horizon_s / (2 * per_learner))

    def split(total: float, n: int, floor: float) -> list[float]:
        w = [rng.expovariate(1.0) for _ in range(n)]
        s = sum(w)
        return [floor + (total - n * floor) * x / s for x in w]

    for _ in range(1000):
        out = []
        for lid in learner_ids:
            down = split(fraction * horizon_s, per_learner, min_outage_s)
            gaps = split((1 - fraction) * horizon_s, per_learner + 1, 1.0)
            t = gaps[0]
            for d, g in zip(down, gaps[1:]):
                out.append(Outage(lid, round(t, 3), round(t + d, 3)))
                t += d + g
        if not _all_down_at_some_point(out, len(learner_ids)):
            return sorted(out, key=lambda o: (o.start_s, o.learner))
    raise RuntimeError("could not draw an outage schedule that keeps a learner up")


def _all_down_at_some_point(outages: Sequence[Any], learners: int) -> bool:
    edges = sorted([(o.start_s, 1) for o in outages] + [(o.end_s, -1) for o in outages])
    down = 0
    for _, d in edges:
        down += d
        if down >= learners:
            return True
    return False


# --- one run -------------------------------------------------------------------------------------


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


def run_spec(spec: RunSpec, scale: Scale, quick: bool) -> Row:
    import torch

    torch.set_num_threads(1)
    _install_profiling()
    # The first AdamW of a process imports torch._dynamo (seconds): not the run's time.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    _PROFILE.clear()
    t0 = time.perf_counter()
    scale = spec_scale(spec, scale)
    cfg = build_run_config(spec, scale, quick)
    if spec.regime == "data_parallel":
        row = _run_data_parallel(spec, cfg, scale)
    else:
        row = _run_decoupled(spec, cfg, scale)
    row.real_s = round(time.perf_counter() - t0, 2)
    row.profile = {k: round(v, 3) for k, v in sorted(_PROFILE.items())}
    return row


def _knobs(cfg: Any, spec: RunSpec) -> dict[str, Any]:
    return {
        "learners": cfg.learners.count,
        "steps_per_learner": None,
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
        "speeds": list(spec.speeds) if spec.speeds else None,
        "failures": spec.failures,
    }


def _tokens_per_step(cfg: Any) -> int:
    return cfg.learners.batch_size * (1 if cfg.model.kind == "vision" else cfg.model.seq_len)


def _run_decoupled(spec: RunSpec, cfg: Any, scale: Scale) -> Row:
    from sqlalchemy import select

    from ddiloco.inprocess import run_inprocess
    from ddiloco.platform.ledger import queries as q
    from ddiloco.platform.ledger.models import Merge, Submission

    tps = _tokens_per_step(cfg)
    total = scale.learners * scale.steps * tps
    ids = [lid for lid, _, _ in cfg.learners.learner_ids()]
    outages = None
    if spec.failures > 0:
        horizon = scale.steps / (1 - spec.failures)
        outages = outage_schedule(ids, horizon, spec.failures, OUTAGE_SEED + spec.seed)
    run = run_inprocess(cfg, total_tokens=total, step_time_s=1.0, outages=outages, eval_every_tokens=max(1, total // scale.evals))
    final = run.evals[-1]
    elapsed = run.elapsed_s
    speeds = [s for _, _, s in cfg.learners.learner_ids()]
    capacity = sum(speeds) * elapsed * tps
    numel = {f.index: f.numel for f in run.sync.layout.fragments}
    with run.ctx.reading() as s:
        acct = q.token_accounting(s, run.ctx.run_id)
        subs = list(s.scalars(select(Submission).where(Submission.run_id == run.ctx.run_id)))
        merges = list(s.scalars(select(Merge).where(Merge.run_id == run.ctx.run_id)))
    sent = sum(sb.nbytes for sb in subs)
    payload = sum(_payload_bytes(numel[sb.fragment], sb.codec, cfg.compression.block_size) for sb in subs)
    grace = [m.grace_window_s for m in merges if m.grace_window_s >= 0]
    knobs = _knobs(cfg, spec)
    knobs["steps_per_learner"] = scale.steps
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
        knobs=knobs,
        base=spec.base,
        knob=spec.knob,
        curve=[[e.tokens, e.t_s, e.val_loss, e.val_accuracy] for e in run.evals],
    )


def _payload_bytes(numel: int, codec: str, block_size: int) -> int:
    if codec == "none":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    scales = 4 * -(-numel // block_size)
    return (numel if codec == "int8" else -(-numel // 2)) + scales


def _run_data_parallel(spec: RunSpec, cfg: Any, scale: Scale) -> Row:
    """M replicas' gradients averaged every step: one model, M micro-batches (one per learner shard,
    the same streams the DiLoCo learners read), each loss / M, one AdamW step."""
    import torch

    from ddiloco.platform.data import build_dataset
    from ddiloco.platform.models import build_model, compute_loss, evaluate

    M, icfg = scale.learners, cfg.inner
    model = build_model(cfg.model, seed=cfg.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=icfg.lr, betas=(icfg.beta1, icfg.beta2), weight_decay=icfg.weight_decay)
    data = build_dataset(cfg.data, cfg.model)
    streams = [data.train_batches(m, M, cfg.learners.batch_size, seed=cfg.seed * 1_000_003) for m in range(M)]
    val = data.val_batches(cfg.learners.batch_size)
    tps = _tokens_per_step(cfg)
    total = M * scale.steps * tps
    every = max(1, total // scale.evals)
    n_params = sum(p.numel() for p in model.parameters())
    curve: list[list[float | None]] = []

    def ev(tokens: int, t: float) -> None:
        t0 = time.perf_counter()
        loss, acc = evaluate(model, val)
        _PROFILE["eval"] = _PROFILE.get("eval", 0.0) + time.perf_counter() - t0
        curve.append([tokens, t, loss, acc])

    ev(0, 0.0)
    trained, next_eval = 0, every
    t0 = time.perf_counter()
    for step in range(scale.steps):
        lr = icfg.lr * min(1.0, (step + 1) / icfg.warmup_steps) if icfg.warmup_steps > 0 else icfg.lr
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        for m in range(M):
            loss, _ = compute_loss(model, next(streams[m]))
            (loss / M).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), icfg.grad_clip)
        opt.step()
        trained += M * tps
        if trained >= next_eval:
            next_eval += every
            _PROFILE["learner.compute"] = _PROFILE.get("learner.compute", 0.0) + time.perf_counter() - t0
            ev(trained, float(step + 1))
            t0 = time.perf_counter()
    _PROFILE["learner.compute"] = _PROFILE.get("learner.compute", 0.0) + time.perf_counter() - t0
    if curve[-1][0] != trained:
        ev(trained, float(scale.steps))
    final = curve[-1]
    # Every replica sends its float32 gradient every step (one direction, as for the DiLoCo rows).
    sent = M * scale.steps * 4 * n_params
    knobs = {"learners": M, "steps_per_learner": scale.steps, "batch": cfg.learners.batch_size, "params": n_params,
             "lr": icfg.lr, "gradient": "float32, every step"}
    return Row(
        model=spec.model, regime=spec.regime, group=spec.group, tokens=trained, val_loss=final[2], val_accuracy=final[3],
        bytes_per_token=sent / trained, goodput=1.0, wall_clock_s=float(scale.steps), tokens_merged=trained, bytes_sent=sent,
        payload_bytes_per_token=sent / trained, lost_fraction=0.0, merges=scale.steps, mean_learners_per_merge=float(M),
        mean_grace_window_s=0.0, real_s=0.0, knobs=knobs, curve=curve,
    )


# --- where the time goes -------------------------------------------------------------------------

_PROFILE: dict[str, float] = {}
_INSTALLED = False


def _install_profiling() -> None:
    """Add wall time of the learner's and synchronizer's main methods, and SQL statements, to _PROFILE."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from ddiloco.learner_worker.worker import Learner
    from ddiloco.synchronizer.service import Synchronizer

    timed = {
        Learner: {"train_step": "learner.compute", "poll_versions": "learner.poll_versions", "heartbeat": "learner.heartbeat",
                  "upload_many": "learner.upload", "send": "learner.send", "start": "learner.start", "__init__": "learner.init"},
        Synchronizer: {"poll_once": "sync.poll_once", "_merge": "sync.merge", "evaluate_now": "eval",
                       "_maybe_collect_garbage": "sync.gc", "__init__": "sync.init"},
    }
    for cls, methods in timed.items():
        for name, key in methods.items():
            setattr(cls, name, _timed(getattr(cls, name), key))

    def before(conn, cursor, statement, parameters, context, executemany):
        conn.info.setdefault("_q_t0", []).append(time.perf_counter())

    def after(conn, cursor, statement, parameters, context, executemany):
        t0 = conn.info["_q_t0"].pop()
        _PROFILE["sql.s"] = _PROFILE.get("sql.s", 0.0) + time.perf_counter() - t0
        _PROFILE["sql.statements"] = _PROFILE.get("sql.statements", 0.0) + 1

    event.listen(Engine, "before_cursor_execute", before)
    event.listen(Engine, "after_cursor_execute", after)


def _timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _PROFILE[key] = _PROFILE.get(key, 0.0) + time.perf_counter() - t0
            _PROFILE[key + ".calls"] = _PROFILE.get(key + ".calls", 0.0) + 1

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(fn, "__name__", key)
    return wrapper


def time_breakdown(rows: Sequence[Row]) -> dict[str, Any]:
    """Where the benchmark's seconds went, over the in-process rows (nested timers, see the docs)."""
    p: dict[str, float] = {}
    steps = 0
    real = 0.0
    for r in rows:
        if r.regime == "data_parallel":
            continue
        real += r.real_s
        steps += int(r.profile.get("learner.compute.calls", 0))
        for k, v in r.profile.items():
            p[k] = p.get(k, 0.0) + v
    if not real:
        return {}

    def g(k: str) -> float:
        return p.get(k, 0.0)

    parts = {
        "train_step (forward, backward, AdamW)": g("learner.compute"),
        "learner: send (outer gradient, encode, blob, ledger row)": g("learner.send"),
        "learner: poll for new versions (ledger + blob reads)": g("learner.poll_versions"),
        "learner: heartbeats": g("learner.heartbeat"),
        "learner: start (build model, register, bootstrap)": g("learner.start") + g("learner.init"),
        "synchronizer: merges (read, validate, merge, outer step, publish)": g("sync.merge"),
        "synchronizer: poll overhead (lease, statuses, pending queries)": g("sync.poll_once") - g("sync.merge") - g("sync.gc"),
        "synchronizer: blob garbage collection": g("sync.gc"),
        "evaluation of the global model": g("eval"),
    }
    parts["other (event loop, drain, run setup, accounting)"] = real - sum(parts.values())
    return {
        "real_s": round(real, 1),
        "learner_steps": steps,
        "ms_per_learner_step": round(1000 * real / max(1, steps), 2),
        "share": {k: round(v / real, 4) for k, v in parts.items()},
        "seconds": {k: round(v, 1) for k, v in parts.items()},
        "sql_statements": int(g("sql.statements")),
        "sql_statements_per_learner_step": round(g("sql.statements") / max(1, steps), 2),
        "sql_s": round(g("sql.s"), 1),
        "sql_share": round(g("sql.s") / real, 4),
        "sync_polls": int(g("sync.poll_once.calls")),
    }


# --- the benchmark -------------------------------------------------------------------------------


def _run_one(args: tuple[RunSpec, Scale, bool]) -> Row:
    spec, scale, quick = args
    row = run_spec(spec, scale, quick)
    print(f"  {row.model:6s} {row.regime:30s} loss {row.val_loss:.4f}  goodput {row.goodput:.3f}  "
          f"B/token {row.bytes_per_token:9.2f}  {row.real_s:6.1f}s", flush=True)
    return row


def run_all(specs: Sequence[RunSpec], scale: Scale, quick: bool, jobs: int = 1) -> list[Row]:
    work = [(s, scale, quick) for s in specs]
    if jobs <= 1:
        return [_run_one(w) for w in work]
    # Longest first, so the pool does not end waiting for one slow run.
    order = sorted(range(len(work)), key=lambda i: -_cost(work[i][0]))
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {i: pool.submit(_run_one, work[i]) for i in order}
        return [futures[i].result() for i in range(len(work))]


def _cost(spec: RunSpec) -> float:
    c = {"dense": 1.0, "moe": 2.0, "vision": 0.4}.get(spec.model, 1.0)
    return c * (0.3 if spec.regime == "data_parallel" else 1.0)


def find(rows: Sequence[Row], model: str, regime: str) -> Row | None:
    return next((r for r in rows if r.model == model and r.regime == regime), None)


def goals(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The issue's goals as PASS/FAIL lines, with their figures."""
    out: list[dict[str, Any]] = []
    models = [m for m in MODELS if any(r.model == m for r in rows)]
    for m in models:
        ref = find(rows, m, "diloco")
        if ref is None:
            continue
        for regime, tol in (("decoupled", GOAL_DECOUPLED), ("decoupled_stragglers", GOAL_DEGRADED), ("decoupled_failures", GOAL_DEGRADED)):
            r = find(rows, m, regime)
            if r is None:
                continue
            gap = r.val_loss / ref.val_loss - 1
            out.append({"goal": f"{m}: {regime} within {100 * tol:.0f}% of diloco's val loss", "pass": gap <= tol,
                        "figure": f"{r.val_loss:.4f} vs {ref.val_loss:.4f} ({100 * gap:+.2f}%)", "value": gap})
        dp = find(rows, m, "data_parallel")
        if dp is not None:
            ratio = ref.val_loss / dp.val_loss
            out.append({"goal": f"{m}: diloco at or below data-parallel's val loss (ratio diloco/dp <= 1)", "pass": ratio <= 1.0,
                        "figure": f"diloco {ref.val_loss:.4f} / dp {dp.val_loss:.4f} = {ratio:.4f}", "value": ratio})
            dec = find(rows, m, "decoupled")
            if dec is not None:
                ratio = dec.val_loss / dp.val_loss
                out.append({"goal": f"{m}: decoupled at or below data-parallel's val loss (ratio decoupled/dp <= 1)",
                            "pass": ratio <= 1.0, "figure": f"decoupled {dec.val_loss:.4f} / dp {dp.val_loss:.4f} = {ratio:.4f}",
                            "value": ratio})
    for m in models:
        dp = find(rows, m, "data_parallel")
        if dp is None:
            continue
        for int4 in [r for r in rows if r.model == m and r.regime in ("ablation_int4", "ablation_int4_h32")]:
            ratio = dp.bytes_per_token / int4.bytes_per_token
            payload = dp.payload_bytes_per_token / int4.payload_bytes_per_token
            H = int4.knobs["every"]
            cost = ""
            ref = find(rows, m, "diloco")
            if ref is not None:
                cost = f"; val loss {int4.val_loss:.4f}, {100 * (int4.val_loss / ref.val_loss - 1):+.2f}% vs diloco"
            out.append({"goal": f"{m}: bytes/token >= {GOAL_COMM_RATIO:.0f}x below data-parallel with int4 outer gradients "
                                f"(H = {H})",
                        "pass": ratio >= GOAL_COMM_RATIO,
                        "figure": f"{dp.bytes_per_token:.1f} / {int4.bytes_per_token:.3f} B/token = {ratio:.0f}x "
                                  f"(payload only, without blob headers: {payload:.0f}x{cost})",
                        "value": ratio})
    return out


def _loss_at(row: Row, tokens: float) -> float | None:
    """Validation loss of the evaluation nearest ``tokens`` (the curves share their token grid)."""
    pts = [c for c in row.curve if c[2] is not None]
    if not pts:
        return None
    return min(pts, key=lambda c: abs(c[0] - tokens))[2]


def _late_mean(row: Row | None, share: float = 0.25) -> float | None:
    """Mean validation loss of the evaluations in the last ``share`` of the row's tokens."""
    if row is None:
        return None
    pts = [c[2] for c in row.curve if c[2] is not None and c[0] >= (1 - share) * row.tokens - 1]
    return sum(pts) / len(pts) if pts else None


def notes(rows: Sequence[Row]) -> list[str]:
    """Figures that explain the PASS/FAIL lines: the DP ratio along training, seed noise, wall-clock saved."""
    out = []
    for m in MODELS:
        dp, ref, dec = find(rows, m, "data_parallel"), find(rows, m, "diloco"), find(rows, m, "decoupled")
        if dp is not None and ref is not None:
            parts = []
            for frac in (0.25, 0.5, 0.75, 1.0):
                a, b = _loss_at(ref, frac * ref.tokens), _loss_at(dp, frac * ref.tokens)
                if a is not None and b is not None:
                    parts.append(f"{frac:.0%}: {a / b:.3f}")
            out.append(f"{m}: diloco/data-parallel val-loss ratio along training (share of tokens: ratio) " + ", ".join(parts))
        if ref is not None:
            gaps = []
            for regime in ("decoupled", "decoupled_stragglers", "decoupled_failures"):
                r = find(rows, m, regime)
                a, b = _late_mean(r), _late_mean(ref)
                if a is not None and b is not None:
                    gaps.append(f"{regime} {100 * (a / b - 1):+.2f}%")
            if gaps:
                out.append(f"{m}: gap to diloco averaged over the evaluations of the last quarter of training (less sensitive to "
                           f"where an oscillating curve ends): " + ", ".join(gaps))
        s0, s1, d1 = find(rows, m, "diloco"), find(rows, m, "diloco_seed1"), find(rows, m, "decoupled_seed1")
        if s0 is not None and s1 is not None:
            out.append(f"{m}: seed noise: diloco seed 1 vs seed 0 {100 * (s1.val_loss / s0.val_loss - 1):+.2f}%")
            if d1 is not None and dec is not None:
                out.append(f"{m}: decoupled vs diloco: {100 * (dec.val_loss / s0.val_loss - 1):+.2f}% at seed 0, "
                           f"{100 * (d1.val_loss / s1.val_loss - 1):+.2f}% at seed 1")
        for kind in ("stragglers", "failures"):
            d, sy = find(rows, m, f"decoupled_{kind}"), find(rows, m, f"diloco_{kind}")
            if d is not None and sy is not None:
                out.append(f"{m}: with {kind}, equal tokens took {d.wall_clock_s:.0f} simulated s decoupled vs {sy.wall_clock_s:.0f} s "
                           f"synchronous (goodput {d.goodput:.3f} vs {sy.goodput:.3f}; val loss {d.val_loss:.4f} vs {sy.val_loss:.4f})")
    return out


def ablation_lines(rows: Sequence[Row]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r.group not in ("ablation", "sweep", "reference", "noise") or r.base is None:
            continue
        base = find(rows, r.model, r.base)
        if base is None:
            continue
        d = r.val_loss / base.val_loss - 1
        out.append({"model": r.model, "row": r.regime, "knob": r.knob, "base": r.base, "val_loss": r.val_loss,
                    "base_val_loss": base.val_loss, "delta": d, "lower": "tie" if abs(d) < 1e-5 else (r.regime if d < 0 else r.base)})
    return out


def run_benchmark(*, quick: bool = False, models: Sequence[str] = MODELS, json_path: Path | None = None,
                  docs: bool = False, jobs: int = 1, ablations: bool = True, sweep: bool = True,
                  plots_dir: Path | None = None, only: str | Sequence[str] | None = None) -> dict[str, Any]:
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; expected some of {', '.join(MODELS)}")
    scale = QUICK if quick else FULL
    specs = select(plan(list(models), scale, quick, ablations=ablations, sweep=sweep), only)
    print(f"quality benchmark ({scale.name}): {len(specs)} runs, {scale.learners} learners x {scale.steps} steps, jobs={jobs}", flush=True)
    t0 = time.perf_counter()
    rows = run_all(specs, scale, quick, jobs)
    total_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "benchmark": "quality",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **git_state(),
        "machine": machine_info(),
        "scale": asdict(scale),
        "jobs": jobs,
        "total_real_s": round(total_s, 1),
        "rows": [_row_json(r) for r in rows],
        "goals": goals(rows),
        "ablations": ablation_lines(rows),
        "notes": notes(rows),
        "cpu_s": _cpu_s(),
        "time_breakdown": time_breakdown(rows),
        "outages": [asdict(o) for o in outage_schedule([f"dc-{i}" for i in range(scale.learners)], scale.steps / (1 - FAILURE_FRACTION),
                                                       FAILURE_FRACTION, OUTAGE_SEED)],
    }
    print()
    print(format_table(rows))
    print()
    for g in result["goals"]:
        print(f"{'PASS' if g['pass'] else 'FAIL'}  {g['goal']}: {g['figure']}")
    for n in result["notes"]:
        print(f"NOTE  {n}")
    for a in result["ablations"]:
        print(f"{a['row'].split('_')[0].upper():9s} {a['model']} {a['knob']}: {a['val_loss']:.4f} vs {a['base_val_loss']:.4f} "
              f"({100 * a['delta']:+.2f}%), lower loss: {a['lower']}")
    tb = result["time_breakdown"]
    if tb:
        print(f"\ntime: {tb['real_s']} s in-process, {tb['ms_per_learner_step']} ms per learner step, "
              f"{tb['sql_statements_per_learner_step']} SQL statements per learner step ({100 * tb['sql_share']:.0f}% of the time)")
        for k, v in sorted(tb["share"].items(), key=lambda kv: -kv[1]):
            print(f"  {100 * v:5.1f}%  {k}")
    print(f"\ntotal {total_s:.0f} s")
    path = Path(json_path) if json_path else RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(result), indent=1) + "\n")
    print(f"wrote {path}")
    pdir = plots_dir if plots_dir is not None else (DOCS if docs else path.parent)
    plots = save_plots(rows, pdir)
    result["plots"] = [str(p) for p in plots]
    if docs:
        write_docs(result, rows, DOCS / "quality.md")
    return result


def rows_from_json(data: dict[str, Any]) -> list[Row]:
    names = {f for f in Row.__dataclass_fields__}
    return [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]


def render(json_path: Path, docs: bool = True) -> None:
    """Redo the plots (and docs/quality.md) from a results file, without training anything."""
    data = json.loads(Path(json_path).read_text())
    rows = rows_from_json(data)
    data["goals"], data["ablations"], data["notes"] = goals(rows), ablation_lines(rows), notes(rows)
    Path(json_path).write_text(json.dumps(json_safe(data), indent=1) + "\n")
    save_plots(rows, DOCS if docs else Path(json_path).parent)
    if docs:
        write_docs(data, rows, DOCS / "quality.md")


def _row_json(r: Row) -> dict[str, Any]:
    d = asdict(r)
    # The keys first.
    head = ["model", "regime", "tokens", "val_loss", "val_accuracy", "bytes_per_token", "goodput"]
    return {**{k: d[k] for k in head}, **{k: v for k, v in d.items() if k not in head}}


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its finished children (the worker pool)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return round(own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime, 1)


# --- reporting -----------------------------------------------------------------------------------


def format_table(rows: Sequence[Row], markdown: bool = False) -> str:
    cols = ["model", "regime", "tokens", "val loss", "vs diloco", "val acc", "bytes/token", "goodput", "wall-clock (sim s)", "merges", "learners/merge"]
    lines = []
    for r in rows:
        ref = find(rows, r.model, "diloco")
        vs = f"{100 * (r.val_loss / ref.val_loss - 1):+.2f}%" if ref is not None else ""
        lines.append([r.model, r.regime, f"{r.tokens:,}", f"{r.val_loss:.4f}", vs,
                      "" if r.val_accuracy is None else f"{r.val_accuracy:.3f}", f"{r.bytes_per_token:.3f}", f"{r.goodput:.3f}",
                      f"{r.wall_clock_s:.0f}", str(r.merges), f"{r.mean_learners_per_merge:.2f}"])
    if markdown:
        out = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" if i < 2 else "---:" for i in range(len(cols))) + " |"]
        out += ["| " + " | ".join(x) + " |" for x in lines]
        return "\n".join(out)
    widths = [max(len(c), *(len(x[i]) for x in lines)) for i, c in enumerate(cols)]
    fmt = lambda xs: "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(xs, widths)))
    return "\n".join([fmt(cols)] + [fmt(x) for x in lines])


STYLE = {
    "data_parallel": ("black", "-"),
    "diloco": ("tab:red", "-"),
    "streaming_diloco": ("tab:orange", "--"),
    "decoupled": ("tab:blue", "-"),
    "decoupled_stragglers": ("tab:green", "-."),
    "decoupled_failures": ("tab:purple", ":"),
    "diloco_stragglers": ("tab:green", (0, (1, 1))),
    "diloco_failures": ("tab:purple", (0, (5, 1, 1, 1))),
}


def save_plots(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """docs/quality-<model>.png: val loss vs tokens and vs simulated wall-clock, one line per regime;
    and quality-<model>-ablations.png for the model with ablations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for model in MODELS:
        mine = [r for r in rows if r.model == model]
        if not mine:
            continue
        main = [r for r in mine if r.group in ("regime", "reference")]
        extra = [r for r in mine if r.group in ("ablation", "sweep", "noise") or r.regime in ("decoupled", "decoupled_stragglers")]
        for kind, sel in (("", main), ("-ablations", extra)):
            if not sel or (kind and len(sel) <= 2):
                continue
            fig, axes = plt.subplots(1, 2, figsize=(14, 4.6), dpi=100)
            cmap = plt.get_cmap("tab20")
            for i, r in enumerate(sel):
                color, ls = STYLE.get(r.regime, (cmap(i % 20), "-"))
                pts = [c for c in r.curve if c[2] is not None]
                label = f"{r.regime} ({r.val_loss:.3f})"
                axes[0].plot([c[0] for c in pts], [c[2] for c in pts], linestyle=ls, color=color, label=label, lw=1.6)
                axes[1].plot([c[1] for c in pts], [c[2] for c in pts], linestyle=ls, color=color, label=label, lw=1.6)
            unit = "examples" if model == "vision" else "tokens"
            axes[0].set_xlabel(f"{unit} trained (all learners)")
            axes[1].set_xlabel("simulated wall-clock (s; one full-speed step = 1 s)")
            lo = min(c[2] for r in sel for c in r.curve if c[2] is not None)
            hi = min(max(c[2] for r in sel for c in r.curve if c[2] is not None), lo * 1.8 + 0.5)
            if kind:  # many close lines: show the second half of training, where they differ
                hi = max(c[2] for r in sel for c in r.curve if c[2] is not None and c[0] >= 0.5 * r.tokens)
            for ax in axes:
                ax.set_ylabel("validation loss")
                ax.grid(alpha=0.3)
                ax.set_ylim(lo - 0.05 * abs(lo), hi + 0.02 * abs(hi))
            axes[1].legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
            fig.suptitle(f"{model}: validation loss by regime{' (ablations and sweep)' if kind else ''}")
            fig.tight_layout()
            p = out_dir / f"quality-{model}{kind}.png"
            fig.savefig(p)
            plt.close(fig)
            paths.append(p)
    return paths


def write_docs(result: dict[str, Any], rows: Sequence[Row], path: Path) -> None:
    """Rewrite the generated block of docs/quality.md (the rest of the page is prose kept as is)."""
    m = result["machine"]
    lines = [
        BEGIN,
        "",
        (
            f"Run of {result['date'][:10]} on commit `{(result.get('commit') or 'unknown')[:10]}`"
            f"{' (with uncommitted changes)' if result.get('dirty') else ''}, {m['cores']} cores "
            f"(load average {m['load_avg_1m']} at the end), torch {m['torch']}, {result['jobs']} worker process(es), "
            f"{result['total_real_s']:.0f} s in all ({result.get('cpu_s', 0):.0f} CPU seconds). "
            f"Scale: {result['scale']['learners']} learners x {result['scale']['steps']} steps at full speed; "
            "`vs diloco` is the relative difference in validation loss."
        ),
        "",
        format_table(rows, markdown=True),
        "",
        "Goals:",
        "",
    ]
    lines += [f"- **{'PASS' if g['pass'] else 'FAIL'}** {g['goal']}: {g['figure']}" for g in result["goals"]]
    lines += ["", "Notes:", ""] + [f"- {n}" for n in result.get("notes", [])]
    lines += ["", "Ablations, sweep, references and seed noise (each row changes one thing of its base row):", "",
              "| model | row | what changes | val loss | base row | base val loss | change | lower loss |",
              "| --- | --- | --- | ---: | --- | ---: | ---: | --- |"]
    lines += [f"| {a['model']} | {a['row']} | {a['knob']} | {a['val_loss']:.4f} | {a['base']} | {a['base_val_loss']:.4f} | "
              f"{100 * a['delta']:+.2f}% | {a['lower']} |" for a in result["ablations"]]
    tb = result.get("time_breakdown") or {}
    if tb:
        intro = (
            f"Where the time goes (in-process rows: {tb['real_s']} s, {tb['learner_steps']} learner steps, "
            f"{tb['ms_per_learner_step']} ms per learner step; {tb['sql_statements_per_learner_step']} SQL statements "
            f"per learner step taking {100 * tb['sql_share']:.0f}% of the time):"
        )
        lines += ["", intro, "", "| part | share | seconds |", "| --- | ---: | ---: |"]
        lines += [f"| {k} | {100 * v:.1f}% | {tb['seconds'][k]:.1f} |" for k, v in sorted(tb["share"].items(), key=lambda kv: -kv[1])]
    lines += ["", END]
    block = "\n".join(lines)
    text = path.read_text() if path.exists() else "# Training quality\n\n" + BEGIN + "\n" + END + "\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, few steps: checks the benchmark runs (~1 min)")
    ap.add_argument("--json", default=None, help=f"where to write the results (default {RESULTS.relative_to(ROOT)})")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: dense,moe,vision")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False, help="rewrite docs/quality.md and its plots")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (runs are independent and seeded)")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", default=None, metavar="ROWS",
                    help="run only these rows: comma-separated regime or model:regime names (e.g. vision:decoupled_failures)")
    ap.add_argument("--render", default=None, metavar="JSON", help="only redo plots and docs from a results file")
    args = ap.parse_args(argv)
    if args.render:
        render(Path(args.render), docs=args.docs)
        return 0
    run_benchmark(quick=args.quick, models=[m for m in args.models.split(",") if m], json_path=Path(args.json) if args.json else None,
                  docs=args.docs, jobs=args.jobs, ablations=not args.no_ablations, sweep=not args.no_sweep, only=args.only)
    return 0
