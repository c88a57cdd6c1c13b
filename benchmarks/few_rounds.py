"""DiLoCo against data-parallel when outer rounds are few: the GPU quality plan's shape at CPU sizes.

The GPU plan (``ddiloco bench quality --scale gpu``, docs/quality.md) gives each learner 480 inner steps, so its
DiLoCo regimes take 20 outer rounds of H = 24 (each of its P = 24 fragments, 20 merges). On an H200 its synchronous
DiLoCo row ended 77% above data-parallel. This trains the same plan (8 learners, 480 steps, H = P = 24, the inner lr
2e-3 with 24 warm-up steps and the cosine to 10%, the quick corpus) on a model a CPU can train 30,720 steps of, and
varies what the issue asks to vary when a goal is missed: the outer lr and momentum, H, plain averaging, overwrite
instead of blend on receipt, the outer lr's warm-up (and the inner lr); and the plan's chaos row (stragglers and
outages at once), with its quorum and grace. Each row's final validation loss is divided by data-parallel's and by one learner's alone, both
trained in the same run.

Sizes: ``tiny`` (the ``--quick`` plan's Llama: d 32, 1 layer, sequences of 32, 2 a step), ``mid`` (d 128, 2
layers, sequences of 64, 8 a step) and ``big`` (d 192, 3 layers, the same sequences and batch). Seeded: ``--jobs``
changes the time taken, not the figures.

    python benchmarks/few_rounds.py [--quick] [--size mid] [--rows data_parallel,single,diloco,...] [--jobs 2]
"""

from __future__ import annotations

import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, header, write_results  # noqa: E402

NAME = "few_rounds"
M, STEPS, H = 8, 480, 24
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "mid": {"model": {"seq_len": 64, "hf_config": {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 4,
                                                   "max_position_embeddings": 64}},
            "learners": {"batch_size": 8}},
    # ~3.4x mid's non-embedding parameters at the same tokens: does the gap to data-parallel shrink as the model grows?
    "big": {"model": {"seq_len": 64, "hf_config": {"hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 3,
                                                   "num_attention_heads": 6, "num_key_value_heads": 6,
                                                   "max_position_embeddings": 64}},
            "learners": {"batch_size": 8}},
}
_BEST = {"fragments": {"every": 12}, "outer": {"lr": 0.3, "momentum": 0.95}}
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (the GPU plan's regime it starts from, what it changes)
    "data_parallel": ("data_parallel", {}),
    "single": ("data_parallel", {}),  # one learner: M = 1, its 480 steps (1/8 of the tokens)
    "diloco": ("diloco", {}),
    "diloco_lr0.4": ("diloco", {"outer": {"lr": 0.4}}),
    "diloco_lr1.0_m0.5": ("diloco", {"outer": {"lr": 1.0, "momentum": 0.5}}),
    "diloco_average": ("diloco", {"outer": {"lr": 1.0, "momentum": 0.0}}),
    "diloco_average_h12": ("diloco", {"outer": {"lr": 1.0, "momentum": 0.0}, "fragments": {"every": 12}}),
    "decoupled": ("decoupled", {}),
    "decoupled_m0.5": ("decoupled", {"outer": {"momentum": 0.5}}),
    "decoupled_lr1.0_m0.5": ("decoupled", {"outer": {"lr": 1.0, "momentum": 0.5}}),
    "decoupled_average": ("decoupled", {"outer": {"lr": 1.0, "momentum": 0.0}}),
    "decoupled_overwrite": ("decoupled", {"merge": {"on_receipt": "overwrite"}}),
    "decoupled_h12": ("decoupled", {"fragments": {"every": 12}}),
    "decoupled_h6": ("decoupled", {"fragments": {"every": 6}}),
    "decoupled_chaos": ("decoupled_chaos", {}),
    # The outer lr's warm-up over each fragment's first 5 (or 10) of its 20 outer steps.
    "diloco_warmup5": ("diloco", {"outer": {"warmup_versions": 5}}),
    "diloco_warmup10": ("diloco", {"outer": {"warmup_versions": 10}}),
    "decoupled_warmup5": ("decoupled", {"outer": {"warmup_versions": 5}}),
    "decoupled_warmup10": ("decoupled", {"outer": {"warmup_versions": 10}}),
    "decoupled_warmup5_lr0.7": ("decoupled", {"outer": {"warmup_versions": 5, "lr": 0.7}}),
    "decoupled_h12_warmup10": ("decoupled", {"fragments": {"every": 12}, "outer": {"warmup_versions": 10}}),
    # Plain averaging at the shorter periods: is the outer step what makes H = 6 end above H = 12?
    "decoupled_h12_average": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 1.0, "momentum": 0.0}}),
    "decoupled_h6_average": ("decoupled", {"fragments": {"every": 6}, "outer": {"lr": 1.0, "momentum": 0.0}}),
    # ... and a smaller outer lr where each fragment takes more outer steps (the run's: 0.5).
    "decoupled_h12_lr0.3": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.3}}),
    "decoupled_h6_lr0.25": ("decoupled", {"fragments": {"every": 6}, "outer": {"lr": 0.25}}),
    "decoupled_lr0.3": ("decoupled", {"outer": {"lr": 0.3}}),
    "decoupled_h12_lr0.2": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.2}}),
    "decoupled_h6_lr0.15": ("decoupled", {"fragments": {"every": 6}, "outer": {"lr": 0.15}}),
    # The best outer lr of each period with the warm-up over a quarter of a fragment's versions.
    "decoupled_lr0.3_warmup5": ("decoupled", {"outer": {"lr": 0.3, "warmup_versions": 5}}),
    "decoupled_h12_lr0.3_warmup10": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.3, "warmup_versions": 10}}),
    # At the best outer step found (H = 12, lr 0.3): the chaos row, and the outer momentum.
    "decoupled_chaos_h12_lr0.3": ("decoupled_chaos", {"fragments": {"every": 12}, "outer": {"lr": 0.3}}),
    "decoupled_h12_lr0.3_m0.8": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.3, "momentum": 0.8}}),
    "decoupled_h12_lr0.3_m0.95": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.3, "momentum": 0.95}}),
    "decoupled_h12_lr0.5_m0.8": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.5, "momentum": 0.8}}),
    # Around the best of those (momentum 0.95): its lr, a heavier momentum, the plan's H = 24, and its chaos row.
    "decoupled_h12_lr0.2_m0.95": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.2, "momentum": 0.95}}),
    "decoupled_h12_lr0.3_m0.98": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.3, "momentum": 0.98}}),
    "decoupled_lr0.3_m0.95": ("decoupled", {"outer": {"lr": 0.3, "momentum": 0.95}}),
    "decoupled_chaos_h12_lr0.3_m0.95": ("decoupled_chaos", {"fragments": {"every": 12}, "outer": {"lr": 0.3, "momentum": 0.95}}),
    # At that outer step: rebase on receipt, a larger lr, and the chaos row merging more learners at once (a quorum of
    # half the live learners, or a grace window of up to H steps instead of 5).
    "decoupled_h12_lr0.3_m0.95_rebase": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.3, "momentum": 0.95},
                                                       "merge": {"on_receipt": "rebase"}}),
    "decoupled_h12_lr0.4_m0.95": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.4, "momentum": 0.95}}),
    "decoupled_chaos_h12_lr0.3_m0.95_q0.5": ("decoupled_chaos", {"fragments": {"every": 12}, "outer": {"lr": 0.3, "momentum": 0.95},
                                                                 "quorum": {"min_fraction": 0.5}}),
    "decoupled_chaos_h12_lr0.3_m0.95_grace12": ("decoupled_chaos", {"fragments": {"every": 12},
                                                                    "outer": {"lr": 0.3, "momentum": 0.95}, "grace": {"max_s": 12.0}}),
    # Larger outer lrs at momentum 0.95, and the chaos row's quorum at more of the live learners and at lr 0.4.
    "decoupled_h12_lr0.5_m0.95": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.5, "momentum": 0.95}}),
    "decoupled_h12_lr0.6_m0.95": ("decoupled", {"fragments": {"every": 12}, "outer": {"lr": 0.6, "momentum": 0.95}}),
    "decoupled_chaos_h12_lr0.3_m0.95_q0.75": ("decoupled_chaos", {"fragments": {"every": 12}, "outer": {"lr": 0.3, "momentum": 0.95},
                                                                  "quorum": {"min_fraction": 0.75}}),
    "decoupled_chaos_h12_lr0.4_m0.95_q0.5": ("decoupled_chaos", {"fragments": {"every": 12}, "outer": {"lr": 0.4, "momentum": 0.95},
                                                                 "quorum": {"min_fraction": 0.5}}),
    # The blend on receipt's alpha (the run's: 0.5), overwrite instead, and the overlap tau (2) at the best outer step.
    "decoupled_h12_lr0.3_m0.95_alpha0.25": ("decoupled", {**_BEST, "merge": {"blend_alpha": 0.25}}),
    "decoupled_h12_lr0.3_m0.95_alpha0.75": ("decoupled", {**_BEST, "merge": {"blend_alpha": 0.75}}),
    "decoupled_h12_lr0.3_m0.95_overwrite": ("decoupled", {**_BEST, "merge": {"on_receipt": "overwrite"}}),
    "decoupled_h12_lr0.3_m0.95_tau1": ("decoupled", {"fragments": {"every": 12, "overlap": 1}, "outer": _BEST["outer"]}),
    "decoupled_h12_lr0.3_m0.95_tau4": ("decoupled", {"fragments": {"every": 12, "overlap": 4}, "outer": _BEST["outer"]}),
    # The inner lr (the plan's 2e-3) halved and doubled, for data-parallel as for Decoupled: each against its best.
    # ... and at the best outer step, for the larger batch (--batch 16), where data-parallel's best inner lr is higher.
    "decoupled_h12_lr0.3_m0.95_ilr3e-3": ("decoupled", {**_BEST, "inner": {"lr": 3e-3}}),
    "decoupled_h12_lr0.3_m0.95_ilr4e-3": ("decoupled", {**_BEST, "inner": {"lr": 4e-3}}),
    "decoupled_chaos_h12_lr0.3_m0.95_q0.5_ilr3e-3": ("decoupled_chaos", {**_BEST, "quorum": {"min_fraction": 0.5},
                                                                         "inner": {"lr": 3e-3}}),
    # The outer lr's warm-up (the last knob) at the best outer step, over a quarter of a fragment's 40 versions.
    "decoupled_h12_lr0.3_m0.95_warmup10": ("decoupled", {**_BEST, "outer": {**_BEST["outer"], "warmup_versions": 10}}),
    # The period around the best outer step's H = 12, and a smaller inner lr for both sides.
    "decoupled_h8_lr0.3_m0.95": ("decoupled", {**_BEST, "fragments": {"every": 8}}),
    "decoupled_h16_lr0.3_m0.95": ("decoupled", {**_BEST, "fragments": {"every": 16}}),
    "decoupled_h12_lr0.3_m0.95_ilr1.5e-3": ("decoupled", {**_BEST, "inner": {"lr": 1.5e-3}}),
    "data_parallel_lr1.5e-3": ("data_parallel", {"inner": {"lr": 1.5e-3}}),
    "data_parallel_lr1e-3": ("data_parallel", {"inner": {"lr": 1e-3}}),
    "data_parallel_lr3e-3": ("data_parallel", {"inner": {"lr": 3e-3}}),
    "data_parallel_lr4e-3": ("data_parallel", {"inner": {"lr": 4e-3}}),
    "decoupled_lr1e-3": ("decoupled", {"inner": {"lr": 1e-3}}),
    "decoupled_lr4e-3": ("decoupled", {"inner": {"lr": 4e-3}}),
}


def train(name: str, size: str, steps: int, evals: int, batch: int | None = None, manifest: str | None = None,
          seed: int = 0) -> dict[str, Any]:
    """One row, on the CPU (in a pool worker or here); ``batch``: sequences a learner step, if not the size's;
    ``manifest``: the corpus, if not the quick plan's; ``seed``: the model's init and the data's order."""
    from ddiloco.bench.quality import plan as P
    from ddiloco.bench.quality.run import run_spec
    from ddiloco.platform.memory import keep_freed_memory

    regime, change = ROWS[name]
    # The full plan's inner schedule and fragments (P = H = 24) on the --quick plan's model and corpus, resized.
    base = P.deep_merge({"inner": {"lr": 2e-3, "warmup_steps": H}, "fragments": {"count": H, "every": H}}, SIZES[size])
    if batch is not None:
        base = P.deep_merge(base, {"learners": {"batch_size": batch}})
    if manifest is not None:
        base = P.deep_merge(base, {"data": {"manifest": manifest}})
    plan_spec = next(s for s in P.gpu_specs(P.GPU_QUICK) if s.regime == regime)
    # The plan's row with its stragglers and outages (decoupled_chaos), its config resized and changed.
    spec = replace(plan_spec, overrides=P.deep_merge(P.deep_merge(base, plan_spec.overrides), change), seed=seed)
    scale = P.Scale(P.GPU_QUICK.name, steps=steps, learners=1 if name == "single" else M, evals=evals)
    keep_freed_memory()  # as a quality row's process does
    row = run_spec(spec, scale, True, "cpu")
    return {"val_loss": row.val_loss, "tokens": row.tokens, "merges": row.merges, "real_s": row.real_s,
            "mean_learners_per_merge": row.mean_learners_per_merge, "tokens_merged": row.tokens_merged,
            "goodput": row.goodput, "knobs": row.knobs, "curve": [[c[0], c[2]] for c in row.curve]}


def main() -> None:
    ap = base_parser(__doc__)
    ap.add_argument("--size", choices=sorted(SIZES), default="mid")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, among {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=STEPS, help="inner steps a learner (a round every H = 24)")
    ap.add_argument("--batch", type=int, default=None, help="sequences a learner step (default: the size's; the global "
                    "batch is 8 of them): with --steps, more rounds at the same tokens")
    ap.add_argument("--corpus-bytes", type=int, default=None, help="train on this much of the installed packages' "
                    "sources (each side; the quick plan's 2 MB by default): with --batch, as many epochs at more tokens")
    ap.add_argument("--evals", type=int, default=10, help="evaluations a row, besides the one at 0 tokens")
    ap.add_argument("--jobs", type=int, default=1, help="rows trained at once (one core each)")
    ap.add_argument("--seed", type=int, default=0, help="model init and data order of every row (how large a gap chance makes)")
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    if not rows or any(r not in ROWS for r in rows):
        ap.error(f"--rows: choose among {', '.join(ROWS)}, got {args.rows!r}")
    if args.steps < 1 or args.evals < 1 or args.jobs < 1 or any(v is not None and v < 1 for v in (args.batch, args.corpus_bytes)):
        ap.error("--steps, --evals, --jobs, --batch and --corpus-bytes must be at least 1")
    if args.quick:
        args.size, args.steps, args.evals = "tiny", 48, 2
        rows = [r for r in rows if r in ("data_parallel", "single", "diloco", "decoupled")]
        if args.json is None:
            args.json = str(Path(tempfile.gettempdir()) / f"ddiloco-{NAME}.quick.json")  # never the published figures
    # The baselines first: every other row is divided by them.
    rows = [r for r in ("data_parallel", "single") if r in rows] + [r for r in rows if r not in ("data_parallel", "single")]

    from ddiloco.bench.quality.run import prepare_gpu_data
    from ddiloco.platform.manifest import read_manifest

    url = prepare_gpu_data(True, args.corpus_bytes)[0]  # the quick corpus (or a larger slice), made once; the workers find it
    manifest = None if args.corpus_bytes is None else url
    results = header(NAME, args)
    # each row's knobs hold its batch and outer step; the corpus's training tokens give the epochs a row trains
    results.update(size=args.size, learners=M, period=H, corpus_train_tokens=sum(s.tokens for s in read_manifest(url).train), rows={})
    t0 = time.perf_counter()
    if args.jobs == 1:
        done = {r: train(r, args.size, args.steps, args.evals, args.batch, manifest, args.seed) for r in rows}
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {r: pool.submit(train, r, args.size, args.steps, args.evals, args.batch, manifest, args.seed) for r in rows}
            done = {r: f.result() for r, f in futures.items()}
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    dp = done.get("data_parallel", {}).get("val_loss")
    single = done.get("single", {}).get("val_loss")
    for r in rows:
        out = done[r]
        out["over_data_parallel"] = out["val_loss"] / dp if dp else None
        out["over_single"] = out["val_loss"] / single if single else None
        results["rows"][r] = out
        ratio = "" if dp is None else f"  / data-parallel {out['over_data_parallel']:.3f}"
        alone = "" if single is None else f"  / one learner {out['over_single']:.3f}"
        print(f"{r:22s} val loss {out['val_loss']:.4f}{ratio}{alone}  ({out['merges']} merges, {out['real_s']} s)", flush=True)
    write_results(NAME, results, args.json)


if __name__ == "__main__":
    main()
