"""The GPU quality plan's synchronous DiLoCo row against textbook DiLoCo written in plain torch, and one learner alone.

The plan's diloco row (``ddiloco bench quality --scale gpu``, docs/quality.md) ended far above data-parallel on a GPU.
That is either the method at this budget (20 outer rounds of H = 24) or a defect of the platform's GPU path (bf16,
torch.compile, the side-stream encode, pinned receipts, the in-process loop). This trains, on the same device:

  * ``platform``: the plan's diloco row itself (``run_spec``: learners, ledger, store, synchronizer, in one process);
  * ``reference``: the same run in plain torch, apart from the platform's code but for its model, data streams, loss
    (bf16 autocast on a GPU), parameter groups and lr schedule: M replicas, H AdamW steps each, the mean of
    global - local as the outer gradient, torch's Nesterov SGD; evaluated on the same validation batches;
  * ``single``: one of those replicas trained alone on its own stream (1/M of the tokens): the floor any M-learner
    method has to beat.

Platform / reference near 1 says the platform trains DiLoCo as written; reference against data-parallel's published
loss then says what the method gives at this budget. Not a timing benchmark: each row's seconds are for orientation.

    python benchmarks/diloco_reference.py [--quick] [--steps 96] [--rows platform,reference,single] [--device auto]
                                          [--outer-warmup 5]
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, header, write_results  # noqa: E402

NAME = "diloco_reference"
ROWS = ("platform", "reference", "single")


def reference(cfg: Any, steps: int, evals: int, device: torch.device, *, replicas: int, shards: int,
              outer_lr: float, outer_momentum: float, outer_warmup: int = 0,
              say: Callable[[str], None]) -> dict[str, Any]:
    """DiLoCo in plain torch: ``replicas`` models on streams 0.. of ``shards``, a round every H steps. One replica with
    outer lr 1 and no momentum is that replica trained alone (the global model becomes it at every round).
    ``outer_warmup``: the outer lr ramps linearly over the first that many rounds (torch's LinearLR)."""
    from ddiloco.learner_worker.learner import _LossModule
    from ddiloco.learner_worker.schedule import lr_factor, param_groups, schedule_steps
    from ddiloco.platform.config import tokens_per_step
    from ddiloco.platform.data import build_dataset
    from ddiloco.platform.models import build_model
    from ddiloco.synchronizer.evaluation import evaluate_global

    icfg, H, bs = cfg.inner, cfg.fragments.period, cfg.learners.batch_size
    t0 = time.perf_counter()
    glob = build_model(cfg.model, seed=cfg.seed).to(device)
    outer = torch.optim.SGD(glob.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    ramp = (torch.optim.lr_scheduler.LinearLR(outer, start_factor=1 / outer_warmup, total_iters=outer_warmup - 1)
            if outer_warmup > 1 else None)
    models = [build_model(cfg.model, seed=cfg.seed).to(device) for _ in range(replicas)]
    nets = [_LossModule(m, device) for m in models]
    if cfg.learners.compile:
        nets = [torch.compile(n) for n in nets]
    opts = [torch.optim.AdamW(param_groups(m, icfg.weight_decay), lr=icfg.lr, betas=(icfg.beta1, icfg.beta2)) for m in models]
    data = build_dataset(cfg.data, cfg.model)
    streams = [data.train_batches(m, shards, bs, seed=cfg.seed * 1_000_003) for m in range(replicas)]
    total_steps = schedule_steps(cfg, 1)
    tps = tokens_per_step(cfg.model, bs)
    every = max(1, replicas * steps * tps // evals)
    gparams = list(glob.parameters())
    local = [list(m.parameters()) for m in models]

    def ev(tokens: int) -> None:
        loss, _ = evaluate_global(cfg, {}, model=glob)
        curve.append([tokens, loss])
        say(f"{tokens:13,} tokens, val loss {loss:.4f}, {time.perf_counter() - t0:.0f} s")

    with torch.no_grad():
        for ps in local:
            torch._foreach_copy_(ps, gparams)
    curve: list[list[float]] = []
    ev(0)
    trained, next_eval = 0, every
    for start in range(0, steps, H):
        n = min(H, steps - start)
        for m in range(replicas):
            models[m].train()
            for s in range(start, start + n):
                for g in opts[m].param_groups:
                    g["lr"] = icfg.lr * lr_factor(s, icfg, total_steps)
                opts[m].zero_grad(set_to_none=True)
                batch = next(streams[m])
                loss = nets[m](batch.inputs.to(device, non_blocking=True), batch.targets.to(device, non_blocking=True),
                               batch.tokens)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(models[m].parameters(), icfg.grad_clip)
                opts[m].step()
        trained += replicas * n * tps
        with torch.no_grad():
            for k, g in enumerate(gparams):
                g.grad = torch.stack([g - ps[k] for ps in local]).mean(0)
        outer.step()
        outer.zero_grad(set_to_none=True)
        if ramp is not None:
            ramp.step()
        with torch.no_grad():
            for ps in local:
                torch._foreach_copy_(ps, gparams)
        if trained >= next_eval or start + n >= steps:
            next_eval += every
            ev(trained)
    return {"val_loss": curve[-1][1], "tokens": trained, "curve": curve, "real_s": round(time.perf_counter() - t0, 2),
            "replicas": replicas, "outer_lr": outer_lr, "outer_momentum": outer_momentum, "outer_warmup": outer_warmup}


def main() -> None:
    ap = base_parser(__doc__)
    ap.add_argument("--steps", type=int, default=96, help="inner steps a learner (a round every H = 24; the plan: 480)")
    ap.add_argument("--evals", type=int, default=4, help="evaluations a row, besides the one at 0 tokens")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, among {', '.join(ROWS)}")
    ap.add_argument("--device", default="auto", help="auto (a GPU when there is one), cuda or cpu")
    ap.add_argument("--outer-warmup", type=int, default=0, help="platform and reference rows: the outer lr ramps over the "
                    "first this many rounds (outer.warmup_versions; the plan's row: 0)")
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    if not rows or any(r not in ROWS for r in rows):
        ap.error(f"--rows: choose among {', '.join(ROWS)}, got {args.rows!r}")
    if args.steps < 1 or args.evals < 1 or args.outer_warmup < 0:
        ap.error("--steps and --evals must be at least 1, --outer-warmup at least 0")
    if args.quick:
        args.steps = min(args.steps, 48)
        if args.json is None:
            args.json = str(Path(tempfile.gettempdir()) / f"ddiloco-{NAME}.quick.json")  # never the published figures

    from ddiloco.bench.quality import plan as P
    from ddiloco.bench.quality.run import prepare_gpu_data, run_spec
    from ddiloco.learner_worker.device import resolve_device
    from ddiloco.platform.memory import keep_freed_memory

    keep_freed_memory()  # as a quality row's process does
    prepare_gpu_data(args.quick)
    scale = P.Scale(P.GPU_QUICK.name if args.quick else P.GPU.name, steps=args.steps, learners=P.GPU.learners, evals=args.evals)
    spec = next(s for s in P.gpu_specs(scale) if s.regime == "diloco")
    if args.outer_warmup:
        spec = replace(spec, overrides=P.deep_merge(spec.overrides, {"outer": {"warmup_versions": args.outer_warmup}}))
    cfg = P.build_run_config(spec, scale, args.quick, args.device)
    device = resolve_device(cfg.learners.device)
    torch.set_num_threads(min(8, torch.get_num_threads()) if device.type == "cuda" else 1)
    results = header(NAME, args)
    results.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", scale=scale.name,
                   learners=scale.learners, period=cfg.fragments.period, outer={"lr": cfg.outer.lr, "momentum": cfg.outer.momentum,
                                                                             "warmup_versions": cfg.outer.warmup_versions},
                   rows={})
    for row in rows:
        def say(line: str, row: str = row) -> None:
            print(f"  {row:9s} {line}", flush=True)

        if row == "platform":
            r = run_spec(spec, scale, args.quick, args.device)
            out = {"val_loss": r.val_loss, "tokens": r.tokens, "curve": [[c[0], c[2]] for c in r.curve], "real_s": r.real_s,
                   "code": r.code}
        elif row == "reference":
            out = reference(cfg, scale.steps, scale.evals, device, replicas=scale.learners, shards=scale.learners,
                            outer_lr=cfg.outer.lr, outer_momentum=cfg.outer.momentum,
                            outer_warmup=cfg.outer.warmup_versions, say=say)
        else:
            out = reference(cfg, scale.steps, scale.evals, device, replicas=1, shards=scale.learners, outer_lr=1.0,
                            outer_momentum=0.0, say=say)
        results["rows"][row] = out
        print(f"{row:9s} val loss {out['val_loss']:.4f} after {out['tokens']:,} tokens, {out['real_s']} s", flush=True)
    got = results["rows"]
    if "platform" in got and "reference" in got:
        results["platform_over_reference"] = got["platform"]["val_loss"] / got["reference"]["val_loss"]
        print(f"platform / reference val loss: {results['platform_over_reference']:.4f}")
    if "reference" in got and "single" in got:
        results["reference_over_single"] = got["reference"]["val_loss"] / got["single"]["val_loss"]
        print(f"reference (M = {scale.learners}) / one learner alone: {results['reference_over_single']:.4f}")
    write_results(NAME, results, args.json)


if __name__ == "__main__":
    main()
