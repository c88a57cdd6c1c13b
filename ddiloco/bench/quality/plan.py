"""The quality benchmark's plan: which rows run, with which config, and the goals they are held to.

Pure data and pure functions: nothing here trains, reads the clock or writes a file (and nothing
imports torch, so the command refuses bad options at once)."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddiloco.inprocess import Outage
    from ddiloco.platform.config import RunConfig

MODELS = ("dense", "moe", "vision", "llama")
LLAMA_VOCAB = 2048
"""The byte-level BPE the llama rows train on the dense rows' corpus (``ddiloco data prepare``'s code)."""
REGIMES = ("data_parallel", "diloco", "streaming_diloco", "decoupled", "decoupled_stragglers", "decoupled_failures")
STRAGGLER_SPEEDS = (1.0, 0.5, 0.667, 1.0)
"""One learner 2x slower, one 1.5x slower (RegionConfig wants speeds in (0, 1])."""
FAILURE_FRACTION = 0.25
OUTAGES_PER_LEARNER = 3
OUTAGE_SEED = 1234

GOALS_VS_DILOCO = (("decoupled", 0.02), ("decoupled_stragglers", 0.03), ("decoupled_failures", 0.03))
"""(row, largest relative gap in validation loss to synchronous DiLoCo's) per model."""
GOAL_PREFIXES = (("", "diloco"), ("m8_", "m8_diloco"))
"""The goal lines hold at M = 4 (the rows above against ``diloco``) and at M = 8 (``m8_`` rows against ``m8_diloco``)."""
GOAL_COMM_RATIO = 200.0
"""Data-parallel's bytes per token over an int4 row's, at least."""


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


LLAMA_DATA_ROOT = "ddiloco-runs/bench-data"


def llama_corpus_bytes(quick: bool) -> int:
    return 400_000 if quick else 2_000_000


def llama_data_dir(quick: bool) -> str:
    """Where the llama rows' shards live (relative to the working directory; prepared once, then reused)."""
    return f"{LLAMA_DATA_ROOT}/stdlib-bpe{LLAMA_VOCAB}-{llama_corpus_bytes(quick)}"


# --- the GPU scale (issue #26): where the method's claim can fail ------------------------------------

GPU = Scale("gpu", steps=480, learners=8, evals=20)
"""8 learners x 480 steps x 128 sequences x 512 tokens = 251,658,240 tokens per regime (docs/quality.md has the sizing)."""
GPU_QUICK = Scale("gpu-quick", steps=24, learners=8, evals=4)
"""``--scale gpu --quick``: the same plan at tiny sizes (12,288 tokens a regime), which runs on a CPU in a minute or two."""
GPU_SCALES = (GPU.name, GPU_QUICK.name)
GPU_MODEL = "llama"
GPU_REGIMES = ("data_parallel", "diloco", "decoupled", "decoupled_chaos")
GPU_GOALS = (("decoupled", "data_parallel", 0.02), ("decoupled", "diloco", 0.01), ("decoupled_chaos", "data_parallel", 0.03))
"""(row, reference row, largest relative excess of the row's final validation loss over the reference's)."""
GPU_VOCAB, GPU_QUICK_VOCAB = 8192, 512
GPU_QUICK_CORPUS_BYTES = 2_000_000
"""--quick reads this much of the installed packages' sources (the full scale reads all of them)."""


def is_gpu(scale: Scale) -> bool:
    return scale.name in GPU_SCALES


def gpu_vocab(quick: bool) -> int:
    return GPU_QUICK_VOCAB if quick else GPU_VOCAB


def gpu_data_dir(quick: bool) -> str:
    """Where the GPU plan's token shards live (relative to the working directory; prepared once, reused while the
    installed packages are the same)."""
    return f"{LLAMA_DATA_ROOT}/site-packages-bpe{gpu_vocab(quick)}-{'quick' if quick else 'full'}"


def gpu_sections(quick: bool, device: str = "auto") -> dict[str, Any]:
    """The GPU plan's config sections: a Llama of 25.7M non-embedding parameters (d 512, 8 layers, SwiGLU 1408, tied
    8192-token embeddings), sequences of 512, 128 a learner step, bf16 autocast and torch.compile on the device; P = H = 24.
    --quick: the same shape of run, tiny (and not compiled: on a CPU compiling costs more than it saves)."""
    if quick:
        d, ffn, layers, heads, seq, batch, P, warm, lr = 32, 64, 1, 4, 32, 2, 4, 2, 3e-3
    else:
        d, ffn, layers, heads, seq, batch, P, warm, lr = 512, 1408, 8, 8, 512, 128, 24, 24, 2e-3
    vocab = gpu_vocab(quick)
    model = {"kind": "hf", "vocab_size": vocab, "seq_len": seq, "hf_config": {
        "model_type": "llama", "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "max_position_embeddings": seq,
        "tie_word_embeddings": True, "use_cache": False}}
    return {
        "model": model,
        "data": {"source": "tokens", "manifest": f"{gpu_data_dir(quick)}/manifest.json", "val_batches": 2 if quick else 4},
        "learners": {"batch_size": batch, "device": device, "compile": not quick},
        "inner": {"lr": lr, "warmup_steps": warm, "schedule": "cosine", "min_lr_ratio": 0.1},
        "fragments": {"count": P, "every": P},
    }


def gpu_specs(scale: Scale) -> list[RunSpec]:
    """The four rows of the GPU plan (``GPU_REGIMES``); the chaos row has the CPU plan's stragglers and outages at once."""
    M = scale.learners
    sync = deep_merge(SYNC, {"fragments": {"count": 1}, "quorum": {"min_count": M}})
    speeds = (STRAGGLER_SPEEDS * (M // len(STRAGGLER_SPEEDS) + 1))[:M]
    return [
        RunSpec(GPU_MODEL, "data_parallel", "regime"),
        RunSpec(GPU_MODEL, "diloco", "regime", sync),
        RunSpec(GPU_MODEL, "decoupled", "regime"),
        RunSpec(GPU_MODEL, "decoupled_chaos", "regime", speeds=speeds, failures=FAILURE_FRACTION),
    ]


_BEST_OUTER = {"fragments": {"every": 12}, "outer": {"lr": 0.3, "momentum": 0.95}}
GPU_FOLLOW_UPS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "decoupled_h12_lr0.3_m0.95": ("decoupled", "H = 12, outer lr 0.3, momentum 0.95", _BEST_OUTER),
    "decoupled_chaos_h12_lr0.3_m0.95_q0.5": ("decoupled_chaos", "H = 12, outer lr 0.3, momentum 0.95, quorum half the live learners",
                                             {**_BEST_OUTER, "quorum": {"min_fraction": 0.5}}),
}
"""Rows trained only when named (``--only``): the decoupled and chaos rows with the best settings that the plan's shape
found on a CPU (``benchmarks/few_rounds.py``), to see whether they carry over to this scale.
Name: (the row it changes, knob, config change)."""


def gpu_follow_up_specs(scale: Scale) -> list[RunSpec]:
    """``GPU_FOLLOW_UPS`` as sweep rows of the plan's rows (the goals and the default plan stay the four regimes)."""
    rows = {s.regime: s for s in gpu_specs(scale)}
    return [replace(rows[base], regime=name, group="sweep", overrides=deep_merge(rows[base].overrides, change), base=base, knob=knob)
            for name, (base, knob, change) in GPU_FOLLOW_UPS.items()]


GPU_SEEDS = (1, 2)
"""Seeds besides the plan's 0 that any GPU row can be trained at, only when named: ``<row>_seed<N>``."""


def gpu_seed_specs(scale: Scale) -> list[RunSpec]:
    """Every GPU row (the four regimes and the follow-ups) at each of ``GPU_SEEDS``: model init, data order and the
    outage schedule drawn again, as noise rows of the seed-0 row. Their ratios are taken to the same seed's
    data-parallel row (``data_parallel_seed<N>``), so a seed's pair says how far chance moves the plan's figures."""
    return [replace(s, regime=seeded(s.regime, n), group="noise", base=s.regime, knob=f"seed {n} (vs 0)", seed=n)
            for n in GPU_SEEDS for s in gpu_specs(scale) + gpu_follow_up_specs(scale)]


def seeded(regime: str, seed: int) -> str:
    """The name of ``regime`` trained at ``seed`` (seed 0: the name itself)."""
    return f"{regime}_seed{seed}" if seed else regime


def model_sections(model: str, quick: bool) -> dict[str, Any]:
    """The config sections of a model at a scale: model, data, batch, inner optimizer, fragments P and period H."""
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
    elif model == "llama":
        # A Hugging Face Llama (GQA, RoPE, SwiGLU, RMSNorm, tied embeddings) on BPE token shards of the
        # same standard-library text the byte-level rows read; the shards are prepared before the rows run.
        d, seq = (32, 32) if quick else (64, 64)
        m = {"kind": "hf", "vocab_size": LLAMA_VOCAB, "seq_len": seq, "hf_config": {
            "model_type": "llama", "hidden_size": d, "intermediate_size": 8 * d // 3 // 4 * 4, "num_hidden_layers": 1 if quick else 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": seq, "tie_word_embeddings": True}}
        data = {"source": "tokens", "manifest": f"{llama_data_dir(quick)}/manifest.json", "val_batches": 2 if quick else 16,
                "block_tokens": 16_384}
        batch, P, H = (4, 4, 4) if quick else (8, 24, 24)
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
    return sections


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
    adversary: float = 0.0
    """k > 0: the second learner sends -k times what it learned, with honest counts (a hostile learner)."""
    upload_shares: tuple[float, ...] | None = None
    """Each learner's upload bandwidth as a share of what sending every fragment every H steps with the
    run's codec takes (:func:`ddiloco.bench.quality.run.upload_demand`); None: uploads take no time."""


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
    """The six regimes every model runs (``REGIMES``)."""
    M = scale.learners
    return [
        RunSpec(model, "data_parallel", "regime"),
        RunSpec(model, "diloco", "regime", deep_merge(SYNC, {"fragments": {"count": 1}, "quorum": {"min_count": M}})),
        RunSpec(model, "streaming_diloco", "regime", deep_merge(SYNC, {"quorum": {"min_count": M}})),
        RunSpec(model, "decoupled", "regime"),
        RunSpec(model, "decoupled_stragglers", "regime", speeds=STRAGGLER_SPEEDS[:M]),
        RunSpec(model, "decoupled_failures", "regime", failures=FAILURE_FRACTION),
    ]


def reference_specs(model: str, scale: Scale) -> list[RunSpec]:
    """Synchronous DiLoCo under the same stragglers and outages: what the decoupled rows save in
    wall-clock (it waits for the slowest learner, and stalls while one is down)."""
    M = scale.learners
    sync = deep_merge(SYNC, {"fragments": {"count": 1}, "quorum": {"min_count": M}})
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
    sync = deep_merge(SYNC, {"fragments": {"count": 1}, "quorum": {"min_count": M}})
    lr7, over = {"outer": {"lr": 0.7}}, {"merge": {"on_receipt": "overwrite"}}
    return [
        RunSpec(model, "m8_diloco", "reference", sync, base="diloco", knob=f"M = {M} (vs {scale.learners}), same tokens", learners=M),
        RunSpec(model, "m8_decoupled", "ablation", base="decoupled", knob=f"M = {M} (vs {scale.learners}), same tokens", learners=M),
        RunSpec(model, "m8_overwrite", "ablation", over, base="m8_decoupled", knob=f"overwrite (vs blend 0.5), M = {M}", learners=M),
        RunSpec(model, "m8_lr0.7", "sweep", lr7, base="m8_decoupled", knob=f"outer.lr=0.7 (vs 0.5), M = {M}", learners=M),
        RunSpec(model, "m8_lr0.7_overwrite", "sweep", OLD_DEFAULTS, base="m8_lr0.7",
                knob=f"overwrite (vs blend 0.5) at outer.lr=0.7, M = {M}", learners=M),
        # The goal lines at M = 8 with the defaults: stragglers (the M = 4 speeds twice) and outages.
        RunSpec(model, "m8_decoupled_stragglers", "ablation", speeds=(STRAGGLER_SPEEDS * 2)[:M], base="m8_decoupled",
                knob=f"stragglers, M = {M}", learners=M),
        RunSpec(model, "m8_decoupled_failures", "ablation", failures=FAILURE_FRACTION, base="m8_decoupled",
                knob=f"outages, M = {M}", learners=M),
    ]


def schedule_specs(model: str, scale: Scale) -> list[RunSpec]:
    """Warm-up then cosine decay of the inner lr over the run's tokens, against warm-up then constant,
    for data-parallel, synchronous DiLoCo and decoupled (the outer step is unchanged)."""
    cos = {"inner": {"schedule": "cosine"}}
    knob = "inner lr cosine to 10% (vs constant after warm-up)"
    return [
        RunSpec(model, "data_parallel_cosine", "ablation", cos, base="data_parallel", knob=knob),
        RunSpec(model, "diloco_cosine", "ablation", deep_merge(regime_specs(model, scale)[1].overrides, cos), base="diloco", knob=knob),
        RunSpec(model, "decoupled_cosine", "ablation", cos, base="decoupled", knob=knob),
    ]


ATTACK_K = 3.0
"""The hostile learner's update is -3x its own: under the outlier bar (10x), so nothing rejects it."""

ROBUST_GATE = 0.01
"""Issue #16's gate for a robust option: with one hostile learner the validation loss stays within
this of the same run (same options) without it, and every fragment keeps publishing."""

ROBUST_PUBLISH_SHARE = 0.9
"""'Every fragment keeps publishing': the fragment merged least often has at least this share of the
merges of the same run's least-merged fragment without the hostile learner."""

ROBUST_OPTIONS = (
    ("clip2", {"merge": {"clip_factor": 2.0}}, "merge.clip_factor=2"),
    ("trim", {"merge": {"robust": "trimmed_mean"}}, "merge.robust=trimmed_mean"),
    ("trim_clip2", {"merge": {"robust": "trimmed_mean", "clip_factor": 2.0}}, "merge.robust=trimmed_mean and clip_factor=2"),
    ("drop", {"merge": {"robust": "drop_opposed"}}, "merge.robust=drop_opposed"),
)
"""(tag, overrides, knob) of each robust option the benchmark measures. At M = 4 the median is the
trimmed mean (both keep the middle two of four), so it has rows at M = 8 only."""
M8_ROBUST = (("median", {"merge": {"robust": "median"}}, "merge.robust=median"), ROBUST_OPTIONS[1], ROBUST_OPTIONS[3])


def robust_specs(model: str, scale: Scale, quick: bool = False) -> list[RunSpec]:
    """Each robust option on honest learners (``ablation_<tag>``: its cost) and with one hostile learner
    (``attack_flip3_<tag>``: its effect); at full scale also drop_opposed where honest learners are out of
    step (``_stragglers``, ``_failures``: merges of one or two learners, which cannot vote) and at M = 8 (``m8_``)."""
    flip = f"one learner sending -{ATTACK_K:g}x"
    out = [RunSpec(model, "attack_flip3", "ablation", base="decoupled", adversary=ATTACK_K,
                   knob=f"one learner sends -{ATTACK_K:g}x its update (vs all honest)")]
    for tag, ov, knob in ROBUST_OPTIONS:
        out += [RunSpec(model, f"ablation_{tag}", "ablation", ov, base="decoupled", knob=f"{knob} (vs off), honest learners"),
                RunSpec(model, f"attack_flip3_{tag}", "ablation", ov, base="attack_flip3", adversary=ATTACK_K,
                        knob=f"{knob} (vs off), {flip}")]
    if quick:
        return out
    S = STRAGGLER_SPEEDS[: scale.learners]
    tag, ov, knob = ROBUST_OPTIONS[3]
    out += [
        RunSpec(model, f"ablation_{tag}_stragglers", "ablation", ov, speeds=S, base="decoupled_stragglers",
                knob=f"{knob} (vs off), honest learners, stragglers"),
        RunSpec(model, f"ablation_{tag}_failures", "ablation", ov, failures=FAILURE_FRACTION, base="decoupled_failures",
                knob=f"{knob} (vs off), honest learners, outages"),
        RunSpec(model, "attack_flip3_stragglers", "ablation", speeds=S, base="decoupled_stragglers", adversary=ATTACK_K,
                knob=f"one learner sends -{ATTACK_K:g}x its update (vs all honest), stragglers"),
        RunSpec(model, f"attack_flip3_{tag}_stragglers", "ablation", ov, speeds=S, base="attack_flip3_stragglers",
                adversary=ATTACK_K, knob=f"{knob} (vs off), {flip}, stragglers"),
    ]
    M, m8 = M_LARGE, f"M = {M_LARGE}"
    out.append(RunSpec(model, "m8_attack_flip3", "ablation", base="m8_decoupled", adversary=ATTACK_K, learners=M,
                       knob=f"one learner sends -{ATTACK_K:g}x its update (vs all honest), {m8}"))
    for tag, ov, knob in M8_ROBUST:
        out += [RunSpec(model, f"m8_ablation_{tag}", "ablation", ov, base="m8_decoupled", learners=M,
                        knob=f"{knob} (vs off), honest learners, {m8}"),
                RunSpec(model, f"m8_attack_flip3_{tag}", "ablation", ov, base="m8_attack_flip3", adversary=ATTACK_K, learners=M,
                        knob=f"{knob} (vs off), {flip}, {m8}")]
    return out


def robust_gate_pairs(rows: Sequence[str]) -> list[tuple[str, str]]:
    """(row with the hostile learner, the same options without it) for every attack row in ``rows``."""
    out = []
    for r in rows:
        prefix, sep, rest = r.partition("attack_flip3")
        if not sep or prefix not in ("", f"m{M_LARGE}_"):
            continue
        options, faults = rest, ""
        for kind in ("_stragglers", "_failures"):
            if rest.endswith(kind):
                options, faults = rest[: -len(kind)], kind
        honest = f"{prefix}decoupled{faults}" if not options else f"{prefix}ablation{options}{faults}"
        if honest in rows:
            out.append((r, honest))
    return out


LINK_SLOW = 0.2
"""The slow learner's upload link: a fifth of what its fixed sends take (a tenth of the others')."""
LINK_WIDE = 2.0
"""The other learners' upload links when one is slow: twice what their sends take."""
LINK_THIN = 0.4
"""Every learner's upload link in the thin-link rows."""
ADAPTIVE_PAIRS = (("link_slow_adaptive", "link_slow_fixed"), ("link_thin_adaptive", "link_thin_fixed"),
                  ("decoupled", "ablation_fixed_cadence"))
"""(adaptive row, the same with a fixed cadence) that issue #18's goal compares."""
ADAPTIVE_GOAL = 0.005
"""An adaptive row's validation loss is at most this much above its fixed row's."""


def link_specs(model: str, scale: Scale) -> list[RunSpec]:
    """fragments.adaptive (each learner chooses its send period and codec from its link) against a fixed
    cadence, on the simulated upload links of ``run_inprocess``: one learner at a tenth of the others'
    bandwidth, every learner on a thin link, and links that take no time (the default, adaptive, is every
    other row of the plan)."""
    M = scale.learners
    adaptive, fixed = {"fragments": {"adaptive": True}}, {"fragments": {"adaptive": False}}
    slow = (LINK_WIDE,) * (M - 1) + (LINK_SLOW,)
    thin = (LINK_THIN,) * M
    what_slow = f"one learner's uploads at {LINK_SLOW:g}x what every H steps in the run's codec takes, the others' at {LINK_WIDE:g}x"
    what_thin = f"every learner's uploads at {LINK_THIN:g}x what every H steps in the run's codec takes"
    return [
        RunSpec(model, "link_slow_fixed", "ablation", fixed, base="ablation_fixed_cadence", upload_shares=slow,
                knob=f"{what_slow} (vs unlimited)"),
        RunSpec(model, "link_slow_adaptive", "ablation", adaptive, base="link_slow_fixed", upload_shares=slow,
                knob=f"fragments.adaptive (vs fixed), {what_slow}"),
        RunSpec(model, "link_thin_fixed", "ablation", fixed, base="ablation_fixed_cadence", upload_shares=thin,
                knob=f"{what_thin} (vs unlimited)"),
        RunSpec(model, "link_thin_adaptive", "ablation", adaptive, base="link_thin_fixed", upload_shares=thin,
                knob=f"fragments.adaptive (vs fixed), {what_thin}"),
        RunSpec(model, "ablation_fixed_cadence", "ablation", fixed, base="decoupled",
                knob="fragments.adaptive=false (vs the default, adaptive), uploads that take no time"),
        RunSpec(model, "ablation_float32_downloads", "ablation", {"compression": {"download_codec": "none"}}, base="decoupled",
                knob="compression.download_codec=none: every version downloaded whole in float32 (vs compact int8 differences "
                     "from a base)"),
        RunSpec(model, "link_thin_float32_downloads", "ablation", {"compression": {"download_codec": "none"}},
                base="link_thin_adaptive", upload_shares=thin,
                knob=f"compression.download_codec=none (vs compact), {what_thin}"),
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


FIXED_MOMENTUM = {"outer": {"momentum_adjust": "none"}}


def momentum_specs(model: str, scale: Scale) -> list[RunSpec]:
    """outer.momentum_adjust=none (every merge at the configured momentum) against the default, async (each merge's
    momentum lowered by the periods and the staleness its updates carry): without faults, with stragglers, with
    outages, behind slow and thin links, at M = 8."""
    S = STRAGGLER_SPEEDS[: scale.learners]
    M = scale.learners
    slow, thin = (LINK_WIDE,) * (M - 1) + (LINK_SLOW,), (LINK_THIN,) * M
    knob = "outer.momentum_adjust=none (vs async)"
    ov = FIXED_MOMENTUM
    return [
        RunSpec(model, "ablation_fixed_momentum", "ablation", ov, base="decoupled", knob=knob),
        RunSpec(model, "ablation_fixed_momentum_stragglers", "ablation", ov, speeds=S, base="decoupled_stragglers",
                knob=f"{knob}, stragglers"),
        RunSpec(model, "ablation_fixed_momentum_failures", "ablation", ov, failures=FAILURE_FRACTION,
                base="decoupled_failures", knob=f"{knob}, outages"),
        RunSpec(model, "link_slow_fixed_momentum", "ablation", ov, base="link_slow_adaptive", upload_shares=slow,
                knob=f"{knob}, one learner's link slow"),
        RunSpec(model, "link_thin_fixed_momentum", "ablation", ov, base="link_thin_adaptive", upload_shares=thin,
                knob=f"{knob}, every learner's link thin"),
        RunSpec(model, f"m{M_LARGE}_fixed_momentum", "ablation", ov, base=f"m{M_LARGE}_decoupled", learners=M_LARGE,
                knob=f"{knob}, M = {M_LARGE}"),
    ]


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
    """Every row of a benchmark: the six regimes per model, then the extra rows asked for."""
    specs: list[RunSpec] = []
    for model in models:
        specs += regime_specs(model, scale)
    # Ablations and the sweep on the dense model (or the first model asked for).
    extra = "dense" if "dense" in models else models[0]
    if ablations:
        specs += reference_specs(extra, scale)
        specs += ablation_specs(extra, scale)
        specs += robust_specs(extra, scale, quick)
        specs += link_specs(extra, scale)
        if not quick:
            specs += noise_specs(extra, scale)
            if "llama" in models and extra != "llama":
                specs += noise_specs("llama", scale)
    if sweep:
        specs += sweep_specs(extra, scale, quick)
        if not quick:
            for model in models:
                if model != extra:
                    specs += other_model_sweep(model, scale)
            # The defaults at M = 8 and the inner schedule, on both language-model families.
            for model in dict.fromkeys(m for m in (extra, "llama") if m in models):
                specs += many_learner_specs(model, scale)
                specs += schedule_specs(model, scale)
            for model in models:
                specs += receipt_specs(model, scale)
            specs += momentum_specs(extra, scale)
    if quick:
        specs = [s for s in specs if s.group == "regime" or s.regime in QUICK_EXTRA]
    return specs


def deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``a`` with ``b``'s values, section by section (neither is changed)."""
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def build_run_config(spec: RunSpec, scale: Scale, quick: bool, device: str = "auto") -> RunConfig:
    """A row's config; ``device`` is the GPU plan's ``learners.device`` (the CPU plan always trains on the CPU)."""
    from ddiloco.platform.config import build_config, tokens_per_step

    sections = gpu_sections(quick, device) if is_gpu(scale) else model_sections(spec.model, quick)
    region: dict[str, Any] = {"name": "dc", "learners": scale.learners}
    if spec.speeds:
        region["speeds"] = list(spec.speeds)
    data = deep_merge(sections, {"learners": {"regions": [region]}})
    data = deep_merge(data, spec.overrides)
    name = f"q-{spec.model}-{spec.regime}"[:64]
    cfg = build_config({"name": name, "seed": spec.seed, **data})
    # The inner schedule runs over the row's tokens: the run's budget is what the benchmark trains.
    budget = scale.learners * scale.steps * tokens_per_step(cfg.model, cfg.learners.batch_size)
    return build_config({"name": name, "seed": spec.seed, "token_budget": budget, **data})


# --- failure schedule ----------------------------------------------------------------------------


def outage_schedule(learner_ids: Sequence[str], horizon_s: float, fraction: float, seed: int,
                    per_learner: int = OUTAGES_PER_LEARNER, min_outage_s: float = 5.0) -> list[Outage]:
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
            for d, g in zip(down, gaps[1:], strict=True):
                out.append(Outage(lid, round(t, 3), round(t + d, 3)))
                t += d + g
        if not all_down_at_some_point(out, len(learner_ids)):
            return sorted(out, key=lambda o: (o.start_s, o.learner))
    raise RuntimeError("could not draw an outage schedule that keeps a learner up")


def all_down_at_some_point(outages: Sequence[Outage], learners: int) -> bool:
    edges = sorted([(o.start_s, 1) for o in outages] + [(o.end_s, -1) for o in outages])
    down = 0
    for _, d in edges:
        down += d
        if down >= learners:
            return True
    return False


def row_outages(learner_ids: Sequence[str], scale: Scale, failures: float = FAILURE_FRACTION, seed: int = 0) -> list[Outage]:
    """A row's outages: down ``failures`` of the span the run needs at the capacity that is left."""
    return outage_schedule(learner_ids, scale.steps / (1 - failures), failures, OUTAGE_SEED + seed)


def is_published_plan(models: Sequence[str], quick: bool, ablations: bool, sweep: bool, only: str | Sequence[str] | None) -> bool:
    """Whether these options run the whole benchmark, the only run whose results may be published."""
    return not quick and set(models) == set(MODELS) and ablations and sweep and not only
