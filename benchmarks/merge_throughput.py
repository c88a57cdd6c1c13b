"""Synchronizer merge throughput: outer gradients decompressed + validated + merged + stepped, vs memcpy.

The synchronizer's own functions, on one fragment of realistic size (default: 25.2 M float32
parameters = two d_model 1024 transformer blocks, whole tensors) and M submissions of it (default 8):

    for each submission: decode_delta (codec -> float32) -> flatten -> norm -> check_finite + check_norm
    then: merge_vectors (rda) -> unflatten -> outer_step (Nesterov SGD with momentum)

which is what ``Synchronizer._validate`` + ``_merge`` do after the blob is read (store I/O is
``store_throughput.py``'s job; a second figure here adds the in-memory part of a read: sha256 +
safetensors decode of the blob bytes).

Bytes counted:
  * float32 bytes = M x N x 4: the outer gradients the pipeline produces and consumes (the goal's figure)
  * wire bytes    = the encoded payload of the M submissions (codes + scales), what was sent

Baseline, same run, interleaved round by round: ``np.copyto`` of M x N x 4 bytes (M copies of an
N-float32 array into a preallocated one). Goal: pipeline GB/s (float32 bytes) >= 0.25 x memcpy GB/s.
torch runs on one thread, as the synchronizer process does.

Also measured, for comparison only (NOT the lead's code): a ``proposed`` pipeline doing the same
work without fresh 100 MB buffers (decode straight into a reused [M, N] buffer, one norm per
submission, RDA as one GEMV, a flat Nesterov step without torch.optim), checked to give the same
result; a cProfile of the current pipeline when it fails; and (full run) the whole benchmark again
in a child process with PyTorch's THP_MEM_ALLOC_ENABLE=1 (huge pages for large CPU tensors).

    python benchmarks/merge_throughput.py [--quick] [--params 25e6] [--submissions 8] [--rounds 3]
"""

from __future__ import annotations

import cProfile
import hashlib
import io
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, header, median, verdict, write_results

from ddiloco.platform.compression import (
    CompressionError,
    _parse_metadata,
    _unpack4,
    decode_delta,
    encode_delta,
    encoded_nbytes,
)
from ddiloco.platform.store import decode_tensors, encode_tensors
from ddiloco.synchronizer import policy as pol
from ddiloco.synchronizer.merge import flatten, merge_vectors, unflatten
from ddiloco.synchronizer.outer import outer_step

NAME = "merge_throughput"
GOAL_RATIO = 0.25
CODECS = ("int8", "int4", "bf16")


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
    # Weights as the synchronizer computes them, from varied token and step counts.
    weights = [pol.token_weight(2048 * (20 + 3 * i), 20 + 2 * i) for i in range(m)]
    return params, momentum, deltas, weights


def pipeline(subs, shapes, names, params, momentum, weights, recent, stages: dict[str, float] | None = None):
    """The synchronizer's path from decoded blob tensors to the new fragment version."""
    st = stages if stages is not None else {}

    def lap(key: str, t0: float) -> float:
        t1 = time.perf_counter()
        st[key] = st.get(key, 0.0) + t1 - t0
        return t1

    t = time.perf_counter()
    vectors = []
    for tensors, meta in subs:
        delta = decode_delta(tensors, meta, expected=shapes)
        t = lap("decode_delta", t)
        vector = flatten(delta, names)
        t = lap("flatten", t)
        norm = float(torch.linalg.vector_norm(vector))
        why = pol.check_finite(norm) or pol.check_norm(norm, recent, 10.0)
        if why:
            raise AssertionError(f"a valid submission was rejected: {why}")
        t = lap("norm_and_checks", t)
        vectors.append(vector)
        del delta
    merged = merge_vectors(vectors, weights, "rda")
    t = lap("merge_vectors_rda", t)
    grad = unflatten(merged, params, names)
    t = lap("unflatten", t)
    new_params, new_momentum = outer_step(params, grad, momentum, lr=0.7, beta=0.9, nesterov=True)
    lap("outer_step", t)
    return new_params, new_momentum


# --- a proposed pipeline (NOT the lead's code): what the same work costs without fresh buffers ---------


def decode_into(tensors, meta, shapes, names, out: torch.Tensor) -> None:
    """decode_delta's checks, but writing each tensor straight into its slice of the flat ``out``."""
    codec, block_size, got = _parse_metadata(meta)
    if got != {n: tuple(s) for n, s in shapes.items()}:
        raise CompressionError("delta tensors do not match the fragment")
    off = 0
    for name in names:
        numel = int(np.prod(shapes[name]))
        dst = out[off : off + numel]
        off += numel
        q = tensors[name + "::q"]
        if codec in ("none", "bf16"):
            dst.copy_(q.reshape(-1))
            continue
        levels = 127 if codec == "int8" else 7
        if codec == "int4":
            q = _unpack4(q, numel)
        if numel and int(q.min()) < -levels:
            raise CompressionError("codes out of range")
        scale = tensors[name + "::scale"]
        full = numel // block_size
        if full:
            dst[: full * block_size].view(full, block_size).copy_(q[: full * block_size].view(full, block_size)).mul_(scale[:full, None])
        if numel % block_size:
            dst[full * block_size :].copy_(q[full * block_size :]).mul_(scale[full])


class Proposed:
    """Preallocated [M, N] decode buffer, one norm per submission, RDA as one GEMV, a flat Nesterov step."""

    def __init__(self, m: int, n: int) -> None:
        self.buf = torch.empty(m, n)
        self.direction = torch.empty(n)
        self.new_p = torch.empty(n)
        self.new_m = torch.empty(n)

    def run(self, subs, shapes, names, p_flat, m_flat, weights, recent, stages: dict[str, float] | None = None):
        st = stages if stages is not None else {}

        def lap(key: str, t0: float) -> float:
            t1 = time.perf_counter()
            st[key] = st.get(key, 0.0) + t1 - t0
            return t1

        t = time.perf_counter()
        norms = []
        for i, (tensors, meta) in enumerate(subs):
            decode_into(tensors, meta, shapes, names, self.buf[i])
            t = lap("decode_into_buffer", t)
            norm = float(torch.linalg.vector_norm(self.buf[i]))
            why = pol.check_finite(norm) or pol.check_norm(norm, recent, 10.0)
            if why:
                raise AssertionError(why)
            norms.append(norm)
            t = lap("norm_and_checks", t)
        m = len(subs)
        w = torch.tensor(weights, dtype=torch.float64)
        w = w / w.sum()
        target = float(sum(float(wi) * ni for wi, ni in zip(w, norms)))
        coeffs = torch.tensor([float(wi) / ni if ni > 1e-12 else 0.0 for wi, ni in zip(w, norms)], dtype=torch.float32)
        torch.mv(self.buf[:m].t(), coeffs, out=self.direction)
        dnorm = float(torch.linalg.vector_norm(self.direction))
        g = self.direction.mul_(target / dnorm) if dnorm > 1e-12 else self.direction.zero_()
        t = lap("rda_gemv", t)
        lr, beta = 0.7, 0.9
        torch.add(g, m_flat, alpha=beta, out=self.new_m)  # buf = beta * buf + g
        g.add_(self.new_m, alpha=beta)  # nesterov: g + beta * buf
        torch.add(p_flat, g, alpha=-lr, out=self.new_p)
        lap("outer_step_flat", t)
        return self.new_p, self.new_m


def blob_part(blobs: list[bytes], shas: list[str]):
    """The in-memory part of a store read: sha256 check + safetensors decode."""
    out = []
    for b, sha in zip(blobs, shas):
        if hashlib.sha256(b).hexdigest() != sha:
            raise AssertionError("sha256 mismatch")
        out.append(decode_tensors(b))
    return out


def memcpy(src: np.ndarray, dst: np.ndarray, m: int) -> float:
    t0 = time.perf_counter()
    for _ in range(m):
        np.copyto(dst, src)
    return time.perf_counter() - t0


def profile_pipeline(subs, shapes, names, params, momentum, weights, recent, top: int = 12) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    pipeline(subs, shapes, names, params, momentum, weights, recent)
    prof.disable()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})
    rows.sort(key=lambda r: r["tottime_s"], reverse=True)
    return rows[:top]


def check_same(cur, prop, names) -> float:
    """Largest relative difference between the current and the proposed pipeline's new params."""
    a = flatten(cur[0], names)
    return float((a - prop[0]).abs().max() / a.abs().max())


def summarize(d: dict, f32_bytes: int, wire: int) -> dict:
    t_pipe, t_copy = median(d["pipeline_s"]), median(d["memcpy_s"])
    ratio = median(d["ratio"])
    stage_s = {k: median(v) for k, v in d["stages"].items()}
    total = sum(stage_s.values())
    return {
        "pipeline_s": round(t_pipe, 4),
        "memcpy_s": round(t_copy, 4),
        "pipeline_gb_s_float32": round(f32_bytes / t_pipe / 1e9, 3),
        "pipeline_gb_s_wire": round(wire / t_pipe / 1e9, 3),
        "memcpy_gb_s": round(f32_bytes / t_copy / 1e9, 3),
        "ratio_vs_memcpy": round(ratio, 4),
        "ratio_per_round": [round(x, 4) for x in d["ratio"]],
        "stage_s": {k: round(v, 4) for k, v in stage_s.items()},
        "stage_share": {k: round(v / total, 3) for k, v in sorted(stage_s.items(), key=lambda kv: -kv[1])},
    }


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--params", type=float, default=25e6, help="parameters in the fragment (float32)")
    ap.add_argument("--submissions", type=int, default=8, help="M: submissions merged at once")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--profile", choices=("auto", "always", "never"), default="auto", help="cProfile a pipeline run (auto: when it fails)")
    ap.add_argument("--no-proposed", action="store_true", help="skip the proposed (buffer-reusing) pipeline")
    ap.add_argument("--compare-thp", choices=("auto", "yes", "no"), default="auto",
                    help="also run in a child process with THP_MEM_ALLOC_ENABLE=1 (auto: not with --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.rounds, args.submissions = min(args.params, 1e6), min(args.rounds, 2), min(args.submissions, 4)
    codecs = [c for c in args.codecs.split(",") if c]
    torch.set_num_threads(1)

    shapes = fragment_shapes(args.params)
    names = list(shapes)
    n = sum(int(np.prod(s)) for s in shapes.values())
    m = args.submissions
    f32_bytes = m * n * 4
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "")
    print(f"fragment: {len(shapes)} tensors, {n / 1e6:.2f} M float32 params; M = {m} submissions; "
          f"float32 bytes per merge {f32_bytes / 1e6:.0f} MB; torch threads {torch.get_num_threads()}; "
          f"THP_MEM_ALLOC_ENABLE={thp or '(unset)'}")

    t0 = time.perf_counter()
    params, momentum, deltas, weights = make_inputs(shapes, m)
    encoded = {c: [encode_delta(d, c, args.block_size) for d in deltas] for c in codecs}
    del deltas
    recent = [1.0] * 8  # a norm history, so check_norm really compares
    p_flat, m_flat = flatten(params, names), flatten(momentum, names)
    blobs = {}
    for c in codecs:
        bl = [encode_tensors(t, meta) for t, meta in encoded[c]]
        blobs[c] = (bl, [hashlib.sha256(b).hexdigest() for b in bl])
    print(f"inputs built and encoded in {time.perf_counter() - t0:.1f}s")

    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(src)
    memcpy(src, dst, 1)  # fault the pages in
    proposed = None if args.no_proposed else Proposed(m, n)

    results = header(NAME, args)
    results.update(
        {
            "fragment": {"tensors": len(shapes), "params": n, "submissions": m, "block_size": args.block_size},
            "env": {"THP_MEM_ALLOC_ENABLE": thp or None, "transparent_hugepage": _thp_mode()},
            "bytes_counted": {
                "float32_bytes": "M x N x 4: the decoded float32 outer gradients the pipeline processes (the goal's figure)",
                "wire_bytes": "encoded payload of the M submissions (codes + per-block scales, no safetensors header)",
                "memcpy": "np.copyto of M x N x 4 bytes (M copies of an N-float32 array into a preallocated one); "
                "GB/s counts bytes copied once",
            },
            "pipeline": "decode_delta -> flatten -> vector_norm + check_finite + check_norm (per submission); "
            "merge_vectors(rda) -> unflatten -> outer_step (Nesterov, momentum)",
            "codecs": {},
        }
    )
    variants = ["current"] + ([] if proposed is None else ["proposed"])
    runs = {(v, c): {"pipeline_s": [], "memcpy_s": [], "ratio": [], "stages": {}} for v in variants for c in codecs}
    blob_runs: dict[str, list[float]] = {c: [] for c in codecs}
    # Warm-up: one untimed pass per codec and variant; checks the proposal computes the same thing.
    same = {}
    for c in codecs:
        cur = pipeline(encoded[c], shapes, names, params, momentum, weights, recent)
        if proposed is not None:
            same[c] = check_same(cur, proposed.run(encoded[c], shapes, names, p_flat, m_flat, weights, recent), names)
        del cur

    for r in range(args.rounds):
        for c in codecs:
            for v in variants:
                # memcpy right before each pipeline run, so load drift hits both alike.
                t_copy = memcpy(src, dst, m)
                stages: dict[str, float] = {}
                t1 = time.perf_counter()
                if v == "current":
                    out = pipeline(encoded[c], shapes, names, params, momentum, weights, recent, stages)
                else:
                    out = proposed.run(encoded[c], shapes, names, p_flat, m_flat, weights, recent, stages)
                t_pipe = time.perf_counter() - t1
                del out
                d = runs[(v, c)]
                d["pipeline_s"].append(t_pipe)
                d["memcpy_s"].append(t_copy)
                d["ratio"].append(t_copy / t_pipe)
                for k, x in stages.items():
                    d["stages"].setdefault(k, []).append(x)
                print(f"round {r + 1}/{args.rounds} {c:5} {v:9}: pipeline {f32_bytes / t_pipe / 1e9:6.2f} GB/s, "
                      f"memcpy {f32_bytes / t_copy / 1e9:6.2f} GB/s, ratio {t_copy / t_pipe:.3f}")
            t2 = time.perf_counter()
            blob_part(*blobs[c])
            blob_runs[c].append(time.perf_counter() - t2)

    all_pass = True
    print()
    print(f"{'codec':6} {'variant':9} {'f32 GB/s':>9} {'wire GB/s':>10} {'memcpy GB/s':>12} {'ratio':>7}  verdict   slowest stage")
    for c in codecs:
        wire = sum(encoded_nbytes(t) for t, _ in encoded[c])
        entry = summarize(runs[("current", c)], f32_bytes, wire)
        d = runs[("current", c)]
        ratio_blob = median([tc / (tp + tb) for tc, tp, tb in zip(d["memcpy_s"], d["pipeline_s"], blob_runs[c])])
        ok = entry["ratio_vs_memcpy"] >= GOAL_RATIO
        all_pass &= ok
        entry = {
            "float32_bytes": f32_bytes,
            "wire_bytes": wire,
            "compression_x": round(f32_bytes / wire, 2),
            **entry,
            "with_blob_decode": {
                "extra_s": round(median(blob_runs[c]), 4),
                "what": "plus sha256 + safetensors decode of the blob bytes (in memory, no disk)",
                "ratio_vs_memcpy": round(ratio_blob, 4),
            },
            "goal": {"ratio_min": GOAL_RATIO, "pass": ok},
        }
        if proposed is not None:
            entry["proposed"] = {
                **summarize(runs[("proposed", c)], f32_bytes, wire),
                "max_rel_diff_vs_current": same[c],
                "pass": median(runs[("proposed", c)]["ratio"]) >= GOAL_RATIO,
            }
        results["codecs"][c] = entry
        for v, e in (("current", entry), ("proposed", entry.get("proposed"))):
            if e is None:
                continue
            top = next(iter(e["stage_share"]))
            print(f"{c:6} {v:9} {e['pipeline_gb_s_float32']:>9.2f} {e['pipeline_gb_s_wire']:>10.2f} {e['memcpy_gb_s']:>12.2f} "
                  f"{e['ratio_vs_memcpy']:>7.3f}  {verdict(e['ratio_vs_memcpy'] >= GOAL_RATIO):7}   {top} ({e['stage_share'][top]:.0%})")
    for c in codecs:
        e = results["codecs"][c]
        print(f"  {c} current stage shares: " + ", ".join(f"{k} {v:.0%}" for k, v in e["stage_share"].items())
              + f"; +sha256/safetensors decode: ratio {e['with_blob_decode']['ratio_vs_memcpy']:.3f}")
        if "proposed" in e:
            print(f"  {c} proposed stage shares: " + ", ".join(f"{k} {v:.0%}" for k, v in e["proposed"]["stage_share"].items())
                  + f"; max rel diff vs current {e['proposed']['max_rel_diff_vs_current']:.1e}")

    if args.profile == "always" or (args.profile == "auto" and not all_pass and not args.quick):
        results["profile"] = {}
        for c in codecs:
            rows = profile_pipeline(encoded[c], shapes, names, params, momentum, weights, recent)
            results["profile"][c] = rows
            print(f"\ncProfile, current pipeline, {c} (top by own time):")
            for row in rows[:6]:
                print(f"  {row['tottime_s']:8.4f}s  {row['calls']:5}  {row['function']}")

    if args.compare_thp == "yes" or (args.compare_thp == "auto" and not args.quick and not thp):
        results["with_THP_MEM_ALLOC_ENABLE"] = run_thp_child(args)

    results["goal"] = {"ratio_min": GOAL_RATIO, "pass": all_pass}
    print(f"\ngoal: current pipeline >= {GOAL_RATIO} x memcpy (float32 bytes), every codec: {verdict(all_pass)}")
    write_results(NAME, results, args.json)
    return 0


def _thp_mode() -> str | None:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return None


def run_thp_child(args) -> dict:
    """The same benchmark in a child process with PyTorch's THP_MEM_ALLOC_ENABLE=1 (huge pages for big tensors)."""
    import json
    import subprocess
    import tempfile

    print("\n--- the same, in a child process with THP_MEM_ALLOC_ENABLE=1 ---", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "thp.json"
        cmd = [sys.executable, __file__, "--params", str(args.params), "--submissions", str(args.submissions),
               "--rounds", str(args.rounds), "--codecs", args.codecs, "--profile", "never", "--compare-thp", "no",
               "--json", str(out)]
        env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1")
        proc = subprocess.run(cmd, env=env, text=True, capture_output=True, check=False)
        print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("round ")))
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:]}
        child = json.loads(out.read_text())
    return {
        c: {
            "ratio_vs_memcpy": e["ratio_vs_memcpy"],
            "pipeline_gb_s_float32": e["pipeline_gb_s_float32"],
            "memcpy_gb_s": e["memcpy_gb_s"],
            "stage_share": e["stage_share"],
            "pass": e["goal"]["pass"],
            **({"proposed_ratio_vs_memcpy": e["proposed"]["ratio_vs_memcpy"]} if "proposed" in e else {}),
        }
        for c, e in child["codecs"].items()
    }


if __name__ == "__main__":
    sys.exit(main())
