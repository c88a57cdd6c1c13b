"""What the upload linger buys (``learners.upload_linger_s``): one learner, its link lingering and not, in one run.

The learner and the bare loop are learner_overhead.py's (the same model, data, synchronizer process and pausing of the
link between windows). Each round runs a bare window and two platform windows of the same learner, its upload thread
lingering 0 s and the configured linger (``--linger-s``, default the config's), in an order that turns round by round
so that load drift hits every variant alike. Per variant: tokens/s against the bare windows (median of rounds), the
CPU of the link's threads a fragment sent, the main thread's blocked time a step (on a GPU host: the GIL the link's
threads hold, and waits for the device), and the sends registered per ledger exchange.

The default stands in for a host-bound GPU learner on a CPU (``--batch-size 1 --seq-len 32``, as learner_overhead.py's
``_b1s32`` rows): a step of a few milliseconds and a send each step, where the link's per-exchange work weighs most.

    python benchmarks/upload_linger.py [--quick] [--rounds 8] [--window-s 3] [--device cpu|cuda] [--linger-s 0.02]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import learner_overhead
from common import base_parser, exit_on_sigterm, header, median, write_results
from learner_overhead import Bare, Platform, bench_config, device_name, run_window, wait_for_version_0

from ddiloco.testing.processes import ProcessRun

NAME = "upload_linger"


def variant_window(platform: Platform, linger_s: float, seconds: float, exchanges: list[int]) -> dict:
    """One platform window with the upload thread lingering ``linger_s``; what it cost the learner."""
    platform.link.uploader.linger_s = linger_s
    n0 = len(exchanges)
    w = platform.window(seconds)
    batches = exchanges[n0:]
    return {
        "tokens_per_s": w["tokens"] / w["elapsed_s"],
        "steps": w["steps"],
        "sent": w["sent"],
        "link_cpu_ms_per_send": w["background_threads_cpu_s"] / max(w["sent"], 1) * 1e3,
        "blocked_ms_per_step": w["main_thread"]["blocked_s"] / w["steps"] * 1e3 if "main_thread" in w else None,
        "sends_per_exchange": sum(batches) / len(batches) if batches else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=8, help="rounds of one bare and two platform windows")
    ap.add_argument("--window-s", type=float, default=3.0)
    ap.add_argument("--warmup-s", type=float, default=6.0, help="untimed platform window first")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--linger-s", type=float, default=None, help="the linger compared with none (default: the config's)")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    if args.quick:
        args.rounds, args.window_s, args.warmup_s = 1, 1.0, 1.0
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="upload-linger-"))
    cfg = bench_config("linger", args.quick, args.device, batch_size=args.batch_size, seq_len=args.seq_len)
    linger = cfg.learners.upload_linger_s if args.linger_s is None else args.linger_s
    variants = {"none": 0.0, "linger": linger}
    run = ProcessRun(tmp, cfg)
    name = NAME if args.device == "cpu" else f"{NAME}_{args.device}"
    results = header(name, args)
    platform = None
    try:
        learner_overhead.SYNC_PID = run.synchronizer("bench-sync").pid
        bare = Bare(cfg)
        wait_for_version_0(run)
        platform = Platform(run)
        exchanges: list[int] = []
        handle = platform.link.uploader.handle

        def counted(items, *args, **kwargs):
            exchanges.append(sum(item is not None for item in items))
            return handle(items, *args, **kwargs)

        platform.link.uploader.handle = counted
        platform.window(args.warmup_s)
        kinds = ["bare", *variants]
        rounds = []
        for i in range(args.rounds):
            order = kinds[i % 3:] + kinds[:i % 3]
            r: dict = {"order": order}
            for kind in order:
                if kind == "bare":
                    w = run_window(bare.step, args.window_s)
                    r["bare_tokens_per_s"] = w["tokens"] / w["elapsed_s"]
                else:
                    r[kind] = variant_window(platform, variants[kind], args.window_s, exchanges)
            for kind in variants:
                r[kind]["ratio"] = r[kind]["tokens_per_s"] / r["bare_tokens_per_s"]
            rounds.append(r)
            print(f"round {i + 1}/{args.rounds} ({'/'.join(order)}): " + "; ".join(
                f"{k} ratio {r[k]['ratio']:.3f}, link {r[k]['link_cpu_ms_per_send']:.2f} ms CPU a send, "
                f"{r[k]['sends_per_exchange'] or 0:.2f} sends an exchange" for k in variants), flush=True)
        summary = {
            kind: {key: round(median([r[kind][key] for r in rounds if r[kind][key] is not None]), 4)
                   for key in ("ratio", "link_cpu_ms_per_send", "blocked_ms_per_step", "sends_per_exchange")}
            for kind in variants
        }
        results.update(
            device_name=device_name(bare.device), batch_size=cfg.learners.batch_size, seq_len=cfg.model.seq_len,
            fragments=cfg.fragments.count, linger_s=variants, rounds=rounds, median_of_rounds=summary,
            note="ratio: the learner's tokens/s over the same round's bare loop; link_cpu_ms_per_send: CPU of the link's "
            "threads (upload and poll) per fragment sent; blocked_ms_per_step: the main thread neither running nor "
            "waiting for a core; sends_per_exchange: fragments registered per ledger transaction of the upload thread",
        )
        print()
        for kind, s in summary.items():
            print(f"{kind:7} (linger {variants[kind] * 1e3:.0f} ms): ratio {s['ratio']:.3f}, link threads "
                  f"{s['link_cpu_ms_per_send']:.2f} ms CPU a send, main thread blocked {s['blocked_ms_per_step']:.2f} ms "
                  f"a step, {s['sends_per_exchange']:.2f} sends an exchange (median of {args.rounds} rounds)")
    finally:
        if platform is not None:
            platform.stop()
        run.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    write_results(name, results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
