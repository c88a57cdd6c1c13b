"""The outer momentum behind a slow link (``outer.momentum_adjust``): a learner whose uploads lag sends updates of
several periods, based on versions it has not seen merged, and a fixed Nesterov momentum makes the global model
overshoot.

The run is the flow test's (``tests/test_flows.py``: a one-layer byte GPT, two learners, quorum 1): us-0 at full speed,
eu-0 at a sixteenth of it, in the deterministic in-process mode (a step is one simulated second). us-0's upload link
carries ``--bps`` bytes a simulated second (a float32 fragment a step takes ``fragment_bytes`` a second; the adaptive
cadence chooses its period and codec). Per link, three variants from the same seed: the fixed momentum (the default,
the baseline), ``momentum_adjust: async`` and no outer momentum at all. Per row: the global model's validation loss at
each of its evaluations, the last, and the highest after the first fifth of the run (an overshoot).

    python benchmarks/async_momentum.py [--quick] [--bps 0,3000,1500,700,350] [--seed 0]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import base_parser, header, write_results

from ddiloco.inprocess import run_inprocess
from ddiloco.platform.config import RunConfig, build_config
from ddiloco.platform.models import build_model

NAME = "async_momentum"
VARIANTS = {
    "fixed": {"outer": {"momentum_adjust": "none"}},
    "async": {"outer": {"momentum_adjust": "async"}},
    "no_momentum": {"outer": {"momentum": 0.0}},
}
"""The variants of every link; ``fixed`` (the default) is the baseline."""


def run_config(variant: dict[str, Any], seed: int) -> RunConfig:
    """The flow test's run: a one-layer byte GPT, us-0 at full speed and eu-0 at 1/16, the platform's defaults."""
    return build_config({
        "name": "async-momentum", "seed": seed,
        "model": {"kind": "gpt", "n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32},
        "data": {"max_bytes": 400_000, "val_batches": 2},
        "learners": {"batch_size": 4, "regions": [{"name": "us", "learners": 1},
                                                  {"name": "eu", "learners": 1, "speeds": [1 / 16]}]},
        "inner": {"lr": 3e-3, "warmup_steps": 3},
        "fragments": {"count": 4},
        "compression": {"codec": "none"},
        "ledger": {"url": "sqlite://"},
        "storage": {"url": "memory://unused"},
        **variant,
    })


def one(variant: str, bps: float, seed: int, tokens: int, evals: int) -> dict[str, Any]:
    cfg = run_config(VARIANTS[variant], seed)
    points: list[float] = []
    t0 = time.perf_counter()
    run_inprocess(cfg, total_tokens=tokens, step_time_s=1.0, eval_every_tokens=tokens // evals,
                  upload_bps={"us-0": bps} if bps else None, on_eval=lambda p: points.append(p.val_loss))
    later = points[1 + len(points) // 5:]
    return {"variant": variant, "bps": bps or None, "val_loss": points[-1], "peak_after_first_fifth": max(later),
            "curve": points, "real_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--bps", default="0,3000,1500,700,350", help="us-0's upload bytes a simulated second (0: unlimited)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    links = [float(x) for x in args.bps.split(",")] if not args.quick else [0.0, 1500.0]
    tokens, evals = (2 * 300 * 4 * 32, 8) if not args.quick else (2 * 60 * 4 * 32, 4)
    results = header(NAME, args)
    cfg = run_config({}, args.seed)
    results["fragment_bytes"] = sum(p.numel() for p in build_model(cfg.model).parameters()) * 4 // cfg.fragments.count
    rows = []
    print(f"{'link B/s':>9}  {'variant':12} {'val loss':>9} {'peak':>7} {'vs fixed':>9}")
    for bps in links:
        base = None
        for variant in VARIANTS:
            r = one(variant, bps, args.seed, tokens, evals)
            base = base or r
            r["ratio_to_fixed"] = r["val_loss"] / base["val_loss"]
            rows.append(r)
            print(f"{bps or 'none':>9}  {variant:12} {r['val_loss']:9.4f} {r['peak_after_first_fifth']:7.3f} "
                  f"{r['ratio_to_fixed']:9.3f}", flush=True)
    results["rows"] = rows
    write_results(NAME, results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
