"""Host work of the GPU quality plan's in-process regimes, per learner step, besides the training steps themselves.

The GPU plan (``ddiloco bench quality --scale gpu``, docs/quality.md) trains 8 learners of a 30M-parameter Llama in one
process, on one GPU, with the synchronizer on the CPU. Whatever the loop does on the host besides queueing training
steps (ledger exchanges, uploads of encoded fragments, the synchronizer's passes, downloads and fold-ins, diloco's
float32 round of eight 120 MB blobs) adds to the regime's wall-clock wherever the GPU waits for it. This runs the same
rows at the plan's full width (model, fragments, learners, codecs) with tiny arithmetic (``--seq-len 32 --batch-size
1`` by default, so that training does not drown the rest) and reports, over the last three quarters of the run:

  * host ms per step call: the event loop's wall time minus the training steps' (``Learner.train_step``), per call of
    ``Learner.step`` (diloco's calls include its learners' waits for a merge);
  * train ms per step: the training steps' own time, the baseline measured in the same run (host_over_train);
  * minor page faults per step call (4 KiB pages the kernel had to fault in: fresh memory);
  * the final validation loss, which the loop's scheduling must not change.

It calls ``keep_freed_memory`` as a quality row does (``--plain-malloc``: glibc's defaults, for the comparison; it also
runs against older code, ``PYTHONPATH=<a checkout of it>``, which has no such call).

    python benchmarks/inprocess_host.py [--quick] [--regimes diloco,decoupled] [--steps 48] [--plain-malloc]
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, header, write_results  # noqa: E402

NAME = "inprocess_host"


def measure(regime: str, steps: int, seq_len: int, batch_size: int, manifest: str) -> dict[str, Any]:
    """One row of the GPU plan at full width and the given sequence and batch, its learners on the CPU."""
    from ddiloco.bench.quality import plan as P
    from ddiloco.inprocess import run_inprocess
    from ddiloco.learner_worker.learner import Learner
    from ddiloco.platform.config import tokens_per_step

    spec = next(s for s in P.gpu_specs(P.GPU) if s.regime == regime)
    sections = P.gpu_sections(False, "cpu")
    sections["model"]["seq_len"] = seq_len
    sections["model"]["hf_config"]["max_position_embeddings"] = seq_len
    sections["learners"].update(batch_size=batch_size, compile=False)
    sections["data"].update(manifest=manifest, val_batches=1)
    original = P.gpu_sections
    P.gpu_sections = lambda quick, device="auto": sections
    try:
        cfg = P.build_run_config(spec, P.GPU, False, "cpu")
    finally:
        P.gpu_sections = original
    total = P.GPU.learners * steps * tokens_per_step(cfg.model, cfg.learners.batch_size)

    calls: list[tuple[float, int]] = []
    trains: list[tuple[float, float]] = []
    step, train_step = Learner.step, Learner.train_step

    def timed_step(self: Learner, *a: Any, **k: Any) -> Any:
        calls.append((time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt))
        return step(self, *a, **k)

    def timed_train(self: Learner) -> Any:
        t = time.perf_counter()
        out = train_step(self)
        trains.append((t, time.perf_counter() - t))
        return out

    Learner.step, Learner.train_step = timed_step, timed_train
    try:
        t0 = time.perf_counter()
        run = run_inprocess(cfg, total_tokens=total, step_time_s=1.0, eval_every_tokens=total, device=torch.device("cpu"))
        wall = time.perf_counter() - t0
    finally:
        Learner.step, Learner.train_step = step, train_step
    first = len(calls) // 4
    (start, faults0), (end, faults1) = calls[first], calls[-1]
    n = len(calls) - 1 - first
    train_s = sum(d for t, d in trains if start <= t < end)
    trained = sum(1 for t, _ in trains if start <= t < end)
    host_ms = 1e3 * (end - start - train_s) / n
    train_ms = 1e3 * train_s / max(1, trained)
    return {
        "regime": regime, "learners": P.GPU.learners, "steps_per_learner": steps, "wall_s": round(wall, 1),
        "step_calls_measured": n, "host_ms_per_step_call": round(host_ms, 2), "train_ms_per_step": round(train_ms, 2),
        "host_over_train": round(host_ms / train_ms, 4) if train_ms else None,
        "minor_faults_per_step_call": round((faults1 - faults0) / n), "val_loss": run.evals[-1].val_loss,
    }


def imported_code() -> str | None:
    """The commit of the checkout the imported ``ddiloco`` comes from (with PYTHONPATH, not this one's)."""
    import subprocess

    import ddiloco

    where = Path(ddiloco.__file__).resolve().parent
    out = subprocess.run(["git", "-C", str(where), "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None if out.returncode == 0 else None


def main() -> None:
    ap = base_parser(__doc__)
    ap.add_argument("--regimes", default="diloco,decoupled", help="comma-separated rows of the GPU plan")
    ap.add_argument("--steps", type=int, default=48, help="steps a learner (diloco: a round every 24)")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--plain-malloc", action="store_true", help="leave glibc's malloc as it is (no keep_freed_memory)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.regimes = 8, "decoupled"
        if args.json is None:
            args.json = str(Path(tempfile.gettempdir()) / f"ddiloco-{NAME}.quick.json")  # never the published figures
    from ddiloco.bench.quality.plan import GPU_REGIMES
    from ddiloco.bench.quality.run import prepare_gpu_data

    regimes = [r for r in args.regimes.split(",") if r]
    bad = [r for r in regimes if r not in GPU_REGIMES or r == "data_parallel"]
    if bad or not regimes:
        ap.error(f"--regimes: choose among {', '.join(r for r in GPU_REGIMES if r != 'data_parallel')}, got {args.regimes!r}")
    torch.set_num_threads(1)
    kept = False
    if not args.plain_malloc:
        from ddiloco.platform.memory import keep_freed_memory

        kept = keep_freed_memory()
    manifest, _, _ = prepare_gpu_data(True)  # the quick corpus: tokens < 512 are valid ids of the 8,192-token model
    results = header(NAME, args)
    results["ddiloco_code"] = imported_code()
    results["keep_freed_memory"] = kept
    results["rows"] = []
    for regime in regimes:
        row = measure(regime, args.steps, args.seq_len, args.batch_size, manifest)
        results["rows"].append(row)
        print(f"{regime:16s} host {row['host_ms_per_step_call']:7.2f} ms a step call, train {row['train_ms_per_step']:7.2f} ms a step "
              f"(host/train {row['host_over_train']}), {row['minor_faults_per_step_call']} page faults a call, "
              f"val {row['val_loss']:.4f}, {row['wall_s']} s", flush=True)
    write_results(NAME, results, args.json)


if __name__ == "__main__":
    main()
