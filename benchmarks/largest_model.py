"""Largest model one learner trains on one device, by ``learners.parallelism`` (DDP vs FSDP), and its tokens/s.

For each parallelism in turn, Hugging Face Llama sizes are tried in increasing order (0.1 B to 11 B
parameters, vocabulary 32,000, seq 1024, batch 4: 4,096 tokens a step), each built from an inline
LlamaConfig (no download): its parameters are first counted on the meta device, then the model is built
directly on the device and trained for a few steps the way a one-rank learner trains (the learner's own
loss module, AdamW over its parameter groups, bf16 autocast on a GPU, grad clipping, a host sync on the
loss each step), holding what the learner holds beside them: its fragment states (``fragment_states``: a float32
snapshot of every parameter on the device, the base of the next outer-gradient increment) and, each step, the
increment of the next fragment (a send every step, kept until the next one replaces it, as the outbox keeps one
until it is encoded). The first out-of-memory error ends that parallelism; the largest size that trained, its
tokens/s and peak memory are recorded.

  * ddp: what a one-rank learner does under ``learners.parallelism: ddp``: no wrapper at world 1
    (DistributedDataParallel wraps the model only when a learner has several ranks);
  * fsdp: the learner's own ``shard_replica`` (FSDP2 ``fully_shard`` per block, then the root; bf16
    compute with fp32 shards and reduction on GPUs) over a process group of one rank;
  * ddp+ac, fsdp+ac: the same with ``learners.activation_checkpoint: full`` (the learner's ``checkpoint_blocks``:
    each block keeps only its inputs and recomputes the rest in the backward pass), compared with the same run's
    plain form: how much larger a model fits, and what the recomputation costs in tokens/s;
  * ddp+sac, fsdp+sac: ``selective`` (each block also keeps its matrix products' and attention's outputs and
    recomputes only the rest), compared with the plain form the same way.

At world 1 FSDP shards nothing: what it can change is the transient memory (one block's bf16 weights
gathered at a time, where autocast keeps a bf16 copy of every weight through a step). The baseline is
the same run's ddp figure: ratios fsdp / ddp of the largest parameter count and of tokens/s at the
largest size both trained. Goal (a sanity bound, not a speed claim): fsdp trains a model at least as
large as ddp.

Time-bounded: each parallelism stops before a size whose predicted time (the previous size's, scaled by
parameters) would pass ``--budget-s``; results are written after every size, so a ``timeout`` that cuts
the run short still leaves what was measured. ``--quick`` runs three tiny Llamas on the CPU (seconds), fsdp+ac and fsdp+sac too.

    python benchmarks/largest_model.py [--quick] [--device auto|cpu|cuda] [--parallelism ddp,fsdp[,fsdp+ac][,fsdp+sac]] [--budget-s 60]
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, exit_on_sigterm, header, median, verdict, write_results

from ddiloco.learner_worker.device import LateRead, autocast, resolve_device
from ddiloco.learner_worker.flops import ModelCost, peak_flops
from ddiloco.learner_worker.learner import Tally, _LossModule, fragment_states
from ddiloco.learner_worker.parallel import Layout
from ddiloco.learner_worker.schedule import param_groups
from ddiloco.platform.config import build_config
from ddiloco.platform.fragments import partition_module
from ddiloco.platform.models import build_model
from ddiloco.platform.models.cost import meta_model, model_size, state_bytes_per_rank

NAME = "largest_model"
VOCAB, SEQ, BATCH = 32_000, 1024, 4
# (hidden, layers, attention heads, kv heads, SwiGLU width): Llama shapes, about 0.1 B to 11 B parameters at vocabulary 32,000.
SIZES: list[tuple[int, int, int, int, int]] = [
    (768, 12, 12, 4, 2048),  # sync_sustain's llama100m (tied embeddings)
    (1024, 24, 16, 4, 2816),
    (1536, 24, 16, 4, 4096),
    (2048, 24, 16, 4, 5632),
    (2560, 32, 20, 4, 6912),
    (3072, 36, 24, 8, 8192),
    (3584, 36, 28, 4, 9728),
    (4096, 32, 32, 8, 11008),  # Llama 7B's shape
    (5120, 40, 40, 8, 13824),  # Llama 13B's shape
]
QUICK_VOCAB, QUICK_SEQ, QUICK_BATCH = 512, 64, 2
QUICK_SIZES = [(32, 1, 2, 1, 64), (64, 2, 4, 2, 128), (96, 2, 4, 2, 256)]


def model_config(size: tuple[int, int, int, int, int], vocab: int, seq: int) -> dict[str, Any]:
    hidden, layers, heads, kv_heads, ffn = size
    return {
        "kind": "hf", "vocab_size": vocab, "seq_len": seq,
        "hf_config": {"model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
                      "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": seq,
                      "tie_word_embeddings": hidden < 1024},
    }


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def count_params(cfg) -> int:
    """Parameters of the model ``cfg`` describes, built on the meta device (no memory, no init)."""
    return sum(p.numel() for p in meta_model(cfg.model).parameters())


def oom_errors() -> tuple[type[BaseException], ...]:
    return (torch.cuda.OutOfMemoryError, MemoryError)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def try_size(cfg, parallelism: str, device: torch.device, steps: int, batch: int, flops_per_token: float | None = None,
             ) -> dict[str, Any]:
    """Build, wrap and train one size; its figures, or the out-of-memory error that stopped it.

    Everything it allocates is local, so it is freed when this returns (the caller collects and empties the cache)."""
    out: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    phase = "build"
    try:
        with torch.device(device):
            model = build_model(cfg.model, seed=cfg.seed)  # straight onto the device: no host copy of a large model
        model = model.to(device)  # a no-op unless the factory ignored the default device
        model.train()
        parallelism, _, extra = parallelism.partition("+")
        parts = partition_module(model, cfg.fragments.count)  # as the learner: planned on the whole replica
        layout = Layout("ddp")
        if extra in ("ac", "sac"):
            from ddiloco.learner_worker.parallel import checkpoint_blocks

            checkpoint_blocks(model, "full" if extra == "ac" else "selective")
        if parallelism != "ddp":
            from ddiloco.learner_worker.dist import Dist, ensure_process_group
            from ddiloco.learner_worker.parallel import shard_replica

            phase = "shard"
            ensure_process_group(Dist.single(device))
            layout = shard_replica(model, parallelism, None, 0, 1, device)
        states = fragment_states(model, parts, layout, Tally())
        for st in states:
            torch._foreach_copy_(st.snapshot, st.views)
        out["snapshot_bytes"] = sum(t.numel() * t.element_size() for st in states for t in st.snapshot)
        net = _LossModule(model, device)
        inner = cfg.inner
        optimizer = torch.optim.AdamW(param_groups(model, inner.weight_decay), lr=inner.lr, betas=(inner.beta1, inner.beta2))
        out["build_s"] = round(time.perf_counter() - t0, 3)
        gen = torch.Generator(device="cpu").manual_seed(0)
        tokens = torch.randint(cfg.model.vocab_size, (batch, cfg.model.seq_len + 1), generator=gen).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        n_tokens = inputs.numel()
        step_s: list[float] = []
        loss_read, loss_value = LateRead(late=device.type == "cuda"), float("nan")
        increment: list[torch.Tensor] | None = None
        phase = "train"
        for i in range(steps + 1):  # the first step (AdamW's state allocated, kernels chosen) is not timed
            t = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with autocast(device):
                loss = net(inputs, targets, n_tokens)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
            optimizer.step()
            # A send every step, each of the next fragment: its increment lives until the next one replaces it (the
            # link's outbox holds one until it is encoded), the most a learner keeps at once.
            del increment
            increment, _, _ = states[i % len(states)].take_increment(keep=True)
            read = loss_read.put(loss.detach())  # as the learner reads it: on a GPU one step late
            loss_value = read if read is not None else loss_value
            if i:
                step_s.append(time.perf_counter() - t)
        med = median(step_s)
        out.update(status="trained", step_s=round(med, 4), tokens_per_step=n_tokens, tokens_per_s=round(n_tokens / med, 1),
                   loss=round(loss_value, 4), sends=steps + 1, fragments=len(states))
        # Recomputation is not counted: model FLOPs, as torchtitan's MFU.
        mfu = ModelCost(flops_per_token, peak_flops(device)[0], device.type).mfu(n_tokens / med, 1)
        out.update(model_flops_per_token=flops_per_token, mfu=round(mfu, 4) if mfu is not None else None)
    except oom_errors() as err:
        out.update(status="oom", phase=phase, error=str(err).splitlines()[0][:300] if str(err) else type(err).__name__)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    if device.type == "cuda":
        out["peak_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    return out


def search(run: dict[str, Any], parallelism: str, sizes: list, vocab: int, seq: int, batch: int, device: torch.device,
           steps: int, budget_s: float, on_size: Callable[[], None]) -> None:
    """Sizes in increasing order until the first OOM, the end of the list, or the time budget; fills ``run``
    and calls ``on_size`` after each size (the results so far are written)."""
    t0 = time.perf_counter()
    tried: list[dict[str, Any]] = []
    run.update(tried=tried, budget_s=budget_s, stopped_by="running")
    last: dict[str, Any] | None = None
    stopped_by = "sizes exhausted"
    for size in sizes:
        cfg = build_config({"model": model_config(size, vocab, seq)})
        counted = model_size(cfg.model)  # one meta-device build: the parameters and the FLOPs per token
        params = counted.params
        elapsed = time.perf_counter() - t0
        if last is not None:
            predicted = last["seconds"] * params / last["params"]
            if elapsed + predicted > budget_s:
                stopped_by = f"time budget: {fmt_params(params)} predicted {predicted:.0f} s with {elapsed:.0f} of {budget_s:.0f} s spent"
                break
        rec = {"params": params, "shape": dict(zip(("hidden", "layers", "heads", "kv_heads", "ffn"), size)),
               # What `ddiloco config` plans a one-rank learner to keep: weights, gradients, AdamW's moments and the
               # outer snapshot, all of which this loop holds.
               "planned_state_gb": round(state_bytes_per_rank(params, "ddp", 1) / 2**30, 2),
               **try_size(cfg, parallelism, device, steps, batch, counted.flops_per_token)}
        release(device)
        tried.append(rec)
        line = f"  {parallelism:4} {fmt_params(params):>9}: {rec['status']}"
        if rec["status"] == "trained":
            line += f", {rec['tokens_per_s']:.0f} tok/s ({rec['step_s'] * 1e3:.0f} ms/step)"
            if rec.get("mfu") is not None:
                line += f", MFU {rec['mfu']:.1%}"
        else:
            line += f" ({rec['phase']}: {rec['error'][:120]})"
        if "peak_allocated_gb" in rec:
            line += f", peak {rec['peak_allocated_gb']:.1f} GiB allocated (planned state {rec['planned_state_gb']:.1f} GiB)"
        print(line + f"; {rec['seconds']:.1f} s", flush=True)
        run["largest_trained"] = next((r for r in reversed(tried) if r["status"] == "trained"), None)
        on_size()
        if rec["status"] == "oom":
            stopped_by = f"out of memory at {fmt_params(params)}"
            break
        last = rec
    run["stopped_by"] = stopped_by
    run["seconds"] = round(time.perf_counter() - t0, 1)
    run["largest_trained"] = next((r for r in reversed(tried) if r["status"] == "trained"), None)


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """fsdp / ddp: the largest parameter counts, and tokens/s at the largest size both trained."""
    base, other = runs.get("ddp"), runs.get("fsdp")
    if not base or not other or not base.get("largest_trained") or not other.get("largest_trained"):
        return {"largest_params_fsdp_vs_ddp": None, "tokens_per_s_fsdp_vs_ddp": None, "pass": False}
    both = {r["params"]: r for r in base["tried"] if r["status"] == "trained"}
    common = [r for r in other["tried"] if r["status"] == "trained" and r["params"] in both]
    at = max(common, key=lambda r: r["params"]) if common else None
    ratio_params = other["largest_trained"]["params"] / base["largest_trained"]["params"]
    return {
        "largest_params_fsdp_vs_ddp": round(ratio_params, 4),
        "tokens_per_s_fsdp_vs_ddp": round(at["tokens_per_s"] / both[at["params"]]["tokens_per_s"], 4) if at else None,
        "tokens_per_s_compared_at_params": at["params"] if at else None,
        "pass": ratio_params >= 1.0,
    }


def compare_recompute(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each ``X+ac`` and ``X+sac`` run against its plain ``X`` of the same run: the largest parameter counts, and
    tokens/s at the largest size both trained (the recomputation's cost)."""
    out: dict[str, Any] = {}
    for name, run in runs.items():
        plain = runs.get(name.partition("+")[0])
        if not name.endswith(("+ac", "+sac")) or not plain or not plain.get("largest_trained") or not run.get("largest_trained"):
            continue
        both = {r["params"]: r for r in plain["tried"] if r["status"] == "trained"}
        common = [r for r in run["tried"] if r["status"] == "trained" and r["params"] in both]
        at = max(common, key=lambda r: r["params"]) if common else None
        out[name] = {
            "largest_params_vs_plain": round(run["largest_trained"]["params"] / plain["largest_trained"]["params"], 4),
            "tokens_per_s_vs_plain": round(at["tokens_per_s"] / both[at["params"]]["tokens_per_s"], 4) if at else None,
            "tokens_per_s_compared_at_params": at["params"] if at else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: the GPU when torch sees one")
    ap.add_argument("--parallelism", default=None,
                    help="comma separated, in order (ddp first: it is the baseline); ddp+ac / fsdp+ac recompute activations, "
                    "ddp+sac / fsdp+sac all but the matrix products' and attention's "
                    "(default ddp,fsdp; --quick: ddp,fsdp,fsdp+ac,fsdp+sac)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds per parallelism (default 60; --quick: 600, so a busy machine does not cut its three sizes)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per size (after one untimed)")
    ap.add_argument("--max-params", type=float, default=None, help="skip sizes above this many parameters")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    device = resolve_device(args.device)
    if args.budget_s is None:
        args.budget_s = 600.0 if args.quick else 60.0
    if args.quick:
        sizes, vocab, seq, batch = QUICK_SIZES, QUICK_VOCAB, QUICK_SEQ, QUICK_BATCH
        if args.json is None:
            args.json = str(Path(tempfile.gettempdir()) / f"ddiloco-{NAME}.quick.json")  # never the published figures
    else:
        sizes, vocab, seq, batch = SIZES, VOCAB, SEQ, BATCH
    if args.max_params:
        sizes = [s for s in sizes if count_params(build_config({"model": model_config(s, vocab, seq)})) <= args.max_params]
    if args.parallelism is None:
        args.parallelism = "ddp,fsdp,fsdp+ac,fsdp+sac" if args.quick else "ddp,fsdp"
    parallelisms = [p for p in args.parallelism.split(",") if p]
    for p in parallelisms:
        if p.partition("+")[0] not in ("ddp", "fsdp") or p.partition("+")[2] not in ("", "ac", "sac"):
            ap.error(f"--parallelism: {p!r} is not ddp or fsdp, alone or with +ac or +sac")
    name = NAME if device.type == "cpu" else f"{NAME}_{device.type}"
    results = header(name, args)
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    results.update(
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        device_memory_gb=round(memory, 1) if memory else None,
        vocab_size=vocab, seq_len=seq, batch_size=batch, tokens_per_step=batch * seq,
        step="the learner's: its _LossModule (bf16 autocast on a GPU), AdamW over its param_groups, clip_grad_norm_, a host "
        "sync on the loss; its fragment states (a float32 snapshot of every parameter) and one fragment's increment taken "
        "each step; random tokens (the data pipeline is not what is measured)",
        parallelism_note="ddp: no wrapper at world 1 (as the learner); fsdp: the learner's shard_replica over one rank",
        runs={},
    )
    print(f"largest_model on {results['device_name']}" + (f" ({memory:.0f} GiB)" if memory else "") +
          f": batch {batch} x seq {seq}, vocab {vocab}; {args.steps} timed steps per size; {args.budget_s:.0f} s per parallelism",
          flush=True)

    def save() -> None:
        results["comparison"] = compare(results["runs"])
        results["activation_checkpoint"] = compare_recompute(results["runs"])
        results["goal"] = {"measure": "largest parameter count trained, fsdp / ddp", "ratio_min": 1.0,
                           "pass": results["comparison"]["pass"]}
        write_results(name, results, args.json)

    for par in parallelisms:
        results["runs"][par] = {}
        search(results["runs"][par], par, sizes, vocab, seq, batch, device, args.steps, args.budget_s, on_size=save)
        save()
    print()
    for par, run in results["runs"].items():
        top = run["largest_trained"]
        got = f"{fmt_params(top['params'])} at {top['tokens_per_s']:.0f} tok/s" if top else "nothing"
        print(f"{par}: largest trained {got}; stopped by {run['stopped_by']}")
    c = results["comparison"]
    print(f"fsdp / ddp: largest params {c['largest_params_fsdp_vs_ddp']}, tokens/s {c['tokens_per_s_fsdp_vs_ddp']}")
    for par, r in results["activation_checkpoint"].items():
        print(f"{par} / {par.partition('+')[0]}: largest params {r['largest_params_vs_plain']}, tokens/s {r['tokens_per_s_vs_plain']}")
    print(f"goal: fsdp trains a model at least as large as ddp: {verdict(c['pass'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
