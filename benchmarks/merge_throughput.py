"""Synchronizer merge throughput: outer gradients decoded + checked + merged + stepped, vs memcpy.

The synchronizer's own code path on one fragment of realistic size (default: 25.2 M float32
parameters = two d_model 1024 transformer blocks, whole tensors) and M submissions of it (default 8),
through a ``MergeWorkspace`` kept from merge to merge as the synchronizer keeps its own:

    for each submission: decode_delta_into (codec -> its row of the [M x N] buffer, with its norm)
                         -> check_finite + check_norm   (what Fetcher._validate does after the read)
    then: merge_fragment (token weights, RDA, participation scale, Nesterov outer step) -> recycle
          the version it replaced                      (what Synchronizer._merge / Publisher.publish do)

Store I/O is ``store_throughput.py``'s job; a second figure adds the in-memory part of a read
(sha256 + safetensors parse of the blob bytes).

Bytes counted:
  * float32 bytes = M x N x 4: the outer gradients the pipeline produces and consumes (the goal's figure)
  * wire bytes    = the encoded payload of the M submissions (codes + scales), what was sent

Baseline, same run, interleaved round by round: ``np.copyto`` of M x N x 4 bytes (M copies of an
N-float32 array into a preallocated one). Goal: pipeline GB/s (float32 bytes) >= 0.25 x memcpy GB/s.
torch runs on one thread, as the synchronizer process does. With ``--device cuda`` (or auto on a
machine with a GPU) the merge runs on the GPU, as the synchronizer's does: the blobs' codes are
copied to it and decoded there; a device-to-device copy of the same bytes is reported beside the
host memcpy, and the figures go to ``merge_throughput_cuda.json``.

    python benchmarks/merge_throughput.py [--quick] [--params 25e6] [--submissions 8] [--rounds 5] [--device auto]
"""

from __future__ import annotations

import hashlib
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, header, median, verdict, write_results

from ddiloco.platform.compression import decode_delta, decode_delta_into, encode_delta, encoded_nbytes
from ddiloco.platform.store import decode_tensors, encode_tensors
from ddiloco.synchronizer import policy as pol
from ddiloco.synchronizer.merge import (
    FlatDelta,
    FlatLayout,
    GlobalFragment,
    Member,
    MergePolicy,
    MergeWorkspace,
    merge_fragment,
)

NAME = "merge_throughput"
GOAL_RATIO = 0.25
CODECS = ("int8", "int4", "bf16")
POLICY = MergePolicy(method="rda", weighting="tokens", lr=0.7, momentum=0.9, nesterov=True)


def fragment_shapes(target_params: float) -> dict[str, tuple[int, ...]]:
    """Whole transformer-block tensors (d_model chosen so two blocks hold ~target_params)."""
    # Two blocks hold ~24 d^2 parameters.
    d = max(64, round((target_params / 24) ** 0.5 / 64) * 64)
    shapes: dict[str, tuple[int, ...]] = {}
    for b in range(2):
        p = f"blocks.{b}."
        shapes.update(
            {
                p + "ln1.weight": (d,),
                p + "ln1.bias": (d,),
                p + "attn.qkv.weight": (3 * d, d),
                p + "attn.qkv.bias": (3 * d,),
                p + "attn.proj.weight": (d, d),
                p + "attn.proj.bias": (d,),
                p + "ln2.weight": (d,),
                p + "ln2.bias": (d,),
                p + "mlp.fc.weight": (4 * d, d),
                p + "mlp.fc.bias": (4 * d,),
                p + "mlp.proj.weight": (d, 4 * d),
                p + "mlp.proj.bias": (d,),
            }
        )
    return shapes


def make_inputs(shapes: dict[str, tuple[int, ...]], m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    momentum = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}
    deltas = []
    for i in range(m):
        gi = torch.Generator().manual_seed(seed + 1 + i)
        deltas.append({n: torch.randn(s, generator=gi) * 1e-3 * (1 + 0.1 * i) for n, s in shapes.items()})
    # Token and step counts as learners report them: varied, so the weights differ.
    counts = [(20 + 2 * i, 2048 * (20 + 3 * i)) for i in range(m)]
    return params, momentum, deltas, counts


def pipeline(ws: MergeWorkspace, layout: FlatLayout, subs, current: GlobalFragment, counts, recent, stages: dict[str, float]):
    """The synchronizer's path from decoded blob tensors to the new fragment version."""
    sync = torch.cuda.synchronize if ws.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    rows = ws.rows(layout, len(subs))
    members = []
    for i, ((tensors, meta), (c_steps, c_tokens)) in enumerate(zip(subs, counts, strict=True)):
        delta = FlatDelta(layout, rows[i], decode_delta_into(tensors, meta, layout.items(), rows[i]))
        norm = delta.norm
        why = pol.check_finite(norm) or pol.check_norm(norm / c_steps, recent, 10.0)
        if why:
            raise AssertionError(f"a valid submission was rejected: {why}")
        members.append(Member(i, f"learner-{i}", delta, norm, c_steps, c_tokens, current.version))
    sync()
    t1 = time.perf_counter()
    out = merge_fragment(current, members, POLICY, live_learners=len(members), workspace=ws)
    sync()
    t2 = time.perf_counter()
    stages["decode_and_check"] = stages.get("decode_and_check", 0.0) + t1 - t0
    stages["merge_fragment"] = stages.get("merge_fragment", 0.0) + t2 - t1
    return out


def reference_params(subs, current: GlobalFragment, counts) -> dict[str, torch.Tensor]:
    """The same merge from dict-shaped deltas on a fresh CPU workspace (the gather path)."""
    members = [Member(i, f"learner-{i}", decode_delta(t, meta), 0.0, s, k, current.version)
               for i, ((t, meta), (s, k)) in enumerate(zip(subs, counts, strict=True))]
    return merge_fragment(current, members, POLICY, live_learners=len(members), workspace=MergeWorkspace("cpu")).params


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n].cpu() - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b)


def blob_part(blobs: list[bytes], shas: list[str]) -> None:
    """The in-memory part of a store read: sha256 check + safetensors parse."""
    for b, sha in zip(blobs, shas, strict=True):
        if hashlib.sha256(b).hexdigest() != sha:
            raise AssertionError("sha256 mismatch")
        decode_tensors(b)


def memcpy(src: np.ndarray, dst: np.ndarray, m: int) -> float:
    t0 = time.perf_counter()
    for _ in range(m):
        np.copyto(dst, src)
    return time.perf_counter() - t0


def device_copy(src: torch.Tensor, dst: torch.Tensor, m: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(m):
        dst.copy_(src)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def summarize(d: dict, f32_bytes: int, wire: int) -> dict:
    t_pipe, t_copy = median(d["pipeline_s"]), median(d["memcpy_s"])
    stage_s = {k: median(v) for k, v in d["stages"].items()}
    total = sum(stage_s.values())
    out = {
        "pipeline_s": round(t_pipe, 4),
        "memcpy_s": round(t_copy, 4),
        "pipeline_gb_s_float32": round(f32_bytes / t_pipe / 1e9, 3),
        "pipeline_gb_s_wire": round(wire / t_pipe / 1e9, 3),
        "memcpy_gb_s": round(f32_bytes / t_copy / 1e9, 3),
        "ratio_vs_memcpy": round(median(d["ratio"]), 4),
        "ratio_per_round": [round(x, 4) for x in d["ratio"]],
        "stage_s": {k: round(v, 4) for k, v in stage_s.items()},
        "stage_share": {k: round(v / total, 3) for k, v in sorted(stage_s.items(), key=lambda kv: -kv[1])},
        # A fresh model-sized buffer faults in one page per 4 KiB it touches: the workspace's reuse shows here.
        "minor_page_faults_per_merge": int(median(d["faults"])),
    }
    if d["device_copy_s"]:
        t_dev = median(d["device_copy_s"])
        out["device_copy_gb_s"] = round(f32_bytes / t_dev / 1e9, 3)
        out["ratio_vs_device_copy"] = round(t_dev / t_pipe, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--params", type=float, default=25e6, help="parameters in the fragment (float32)")
    ap.add_argument("--submissions", type=int, default=8, help="M: submissions merged at once")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the merge runs (auto: the GPU when torch sees one, as the synchronizer's merge_device)")
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.rounds, args.submissions = min(args.params, 1e6), min(args.rounds, 2), min(args.submissions, 4)
        if args.json is None:
            args.json = str(Path(tempfile.gettempdir()) / f"ddiloco-{NAME}.quick.json")  # never the published figures
    codecs = [c for c in args.codecs.split(",") if c]
    torch.set_num_threads(1)
    try:
        ws = MergeWorkspace(args.device)
    except ValueError as err:
        ap.error(f"--device {args.device}: {err}")
    load_start = uptime()

    shapes = fragment_shapes(args.params)
    layout = FlatLayout.of(shapes)
    n, m = layout.numel, args.submissions
    f32_bytes = m * n * 4
    print(f"fragment: {len(shapes)} tensors, {n / 1e6:.2f} M float32 params; M = {m} submissions; "
          f"float32 bytes per merge {f32_bytes / 1e6:.0f} MB; device {ws.device}; torch threads {torch.get_num_threads()}")
    print(f"load: {load_start}")

    t0 = time.perf_counter()
    params, momentum, deltas, counts = make_inputs(shapes, m)
    current = GlobalFragment(7, {k: v.to(ws.device) for k, v in params.items()}, {k: v.to(ws.device) for k, v in momentum.items()})
    encoded = {c: [encode_delta(d, c, args.block_size) for d in deltas] for c in codecs}
    del deltas
    recent = [1.0] * 8  # a norm history, so check_norm really compares
    blobs = {}
    for c in codecs:
        bl = [encode_tensors(t, meta) for t, meta in encoded[c]]
        blobs[c] = (bl, [hashlib.sha256(b).hexdigest() for b in bl])
    print(f"inputs built and encoded in {time.perf_counter() - t0:.1f}s")

    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(src)
    memcpy(src, dst, 1)  # fault the pages in
    dev_src = dev_dst = None
    if ws.device.type == "cuda":
        dev_src, dev_dst = torch.from_numpy(src).to(ws.device), torch.empty(n, device=ws.device)

    results = header(NAME, args)
    results.update(
        {
            "fragment": {"tensors": len(shapes), "params": n, "submissions": m, "block_size": args.block_size},
            "device": str(ws.device),
            "load": {"uptime_start": load_start},
            "bytes_counted": {
                "float32_bytes": "M x N x 4: the decoded float32 outer gradients the pipeline processes (the goal's figure)",
                "wire_bytes": "encoded payload of the M submissions (codes + per-block scales, no safetensors header)",
                "memcpy": "np.copyto of M x N x 4 bytes (M copies of an N-float32 array into a preallocated one); "
                "GB/s counts bytes copied once",
            },
            "pipeline": "decode_delta_into (into the workspace's rows, with norms) + check_finite + check_norm per submission; "
            "merge_fragment (one matrix-vector product per chunk, Nesterov step on flat buffers) with a kept MergeWorkspace",
            "codecs": {},
        }
    )
    runs = {c: {"pipeline_s": [], "memcpy_s": [], "device_copy_s": [], "ratio": [], "stages": {}, "faults": []} for c in codecs}
    blob_runs: dict[str, list[float]] = {c: [] for c in codecs}
    # Warm-up: one untimed pass per codec (sizes the workspace, as the first merge of a run does),
    # checked against the same merge from dict-shaped deltas.
    same = {}
    for c in codecs:
        out = pipeline(ws, layout, encoded[c], current, counts, recent, {})
        same[c] = max_rel_diff(out.params, reference_params(encoded[c], GlobalFragment(7, params, momentum), counts))
        ws.recycle(GlobalFragment(out.version, out.params, out.momentum))
        del out

    for r in range(args.rounds):
        for c in codecs:
            # memcpy right before each pipeline run, so load drift hits both alike.
            t_copy = memcpy(src, dst, m)
            stages: dict[str, float] = {}
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t1 = time.perf_counter()
            out = pipeline(ws, layout, encoded[c], current, counts, recent, stages)
            t_pipe = time.perf_counter() - t1
            runs[c]["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            # The synchronizer gives back the version a publish replaced; here, the one just made.
            ws.recycle(GlobalFragment(out.version, out.params, out.momentum))
            del out
            d = runs[c]
            d["pipeline_s"].append(t_pipe)
            d["memcpy_s"].append(t_copy)
            d["ratio"].append(t_copy / t_pipe)
            if dev_src is not None:
                d["device_copy_s"].append(device_copy(dev_src, dev_dst, m))
            for k, x in stages.items():
                d["stages"].setdefault(k, []).append(x)
            print(f"round {r + 1}/{args.rounds} {c:5}: pipeline {f32_bytes / t_pipe / 1e9:6.2f} GB/s, "
                  f"memcpy {f32_bytes / t_copy / 1e9:6.2f} GB/s, ratio {t_copy / t_pipe:.3f}")
            t2 = time.perf_counter()
            blob_part(*blobs[c])
            blob_runs[c].append(time.perf_counter() - t2)

    all_pass = True
    print()
    print(f"{'codec':6} {'f32 GB/s':>9} {'wire GB/s':>10} {'memcpy GB/s':>12} {'ratio':>7}  verdict   stages")
    for c in codecs:
        wire = sum(encoded_nbytes(t) for t, _ in encoded[c])
        entry = summarize(runs[c], f32_bytes, wire)
        d = runs[c]
        ratio_blob = median([tc / (tp + tb) for tc, tp, tb in zip(d["memcpy_s"], d["pipeline_s"], blob_runs[c], strict=True)])
        ok = entry["ratio_vs_memcpy"] >= GOAL_RATIO
        all_pass &= ok
        entry = {
            "float32_bytes": f32_bytes,
            "wire_bytes": wire,
            "compression_x": round(f32_bytes / wire, 2),
            **entry,
            "max_rel_diff_vs_reference": same[c],
            "pages_of_one_float32_fragment": n * 4 // 4096,
            "with_blob_decode": {
                "extra_s": round(median(blob_runs[c]), 4),
                "what": "plus sha256 + safetensors parse of the blob bytes (in memory, no disk)",
                "ratio_vs_memcpy": round(ratio_blob, 4),
            },
            "goal": {"ratio_min": GOAL_RATIO, "pass": ok},
        }
        results["codecs"][c] = entry
        shares = ", ".join(f"{k} {v:.0%}" for k, v in entry["stage_share"].items())
        print(f"{c:6} {entry['pipeline_gb_s_float32']:>9.2f} {entry['pipeline_gb_s_wire']:>10.2f} {entry['memcpy_gb_s']:>12.2f} "
              f"{entry['ratio_vs_memcpy']:>7.3f}  {verdict(ok):7}   {shares}; +sha256/parse: ratio {ratio_blob:.3f}; "
              f"vs reference {same[c]:.1e}; page faults per merge {entry['minor_page_faults_per_merge']} "
              f"(one fragment is {n * 4 // 4096} pages)")
        if "ratio_vs_device_copy" in entry:
            print(f"       device copy {entry['device_copy_gb_s']:.2f} GB/s: ratio vs device copy {entry['ratio_vs_device_copy']:.3f}")

    results["load"]["uptime_end"] = uptime()
    results["goal"] = {"ratio_min": GOAL_RATIO, "pass": all_pass}
    print(f"load: {results['load']['uptime_end']}")
    print(f"\ngoal: pipeline >= {GOAL_RATIO} x memcpy (float32 bytes), every codec: {verdict(all_pass)}")
    # GPU rows go beside the CPU figures, not over them.
    write_results(NAME if ws.device.type == "cpu" else f"{NAME}_{ws.device.type}", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
