"""What the bounds on untrusted input cost honest input, and how fast hostile input is refused.

Each figure is a ratio against a baseline measured in the same run:
  * an honest submission's read as the synchronizer does it (``get_with_metadata``: ranged read, sha256,
    bounded parse; then decoded into its row) vs the same path without the bounds (read whole, sha256,
    safetensors, header JSON, decode) — the bounds' overhead per submission (goal <= 1.10x); the parse
    alone vs safetensors' own ``load`` is reported too (a fixed ~0.1-0.5 ms per blob)
  * a poison blob (a 100,000-deep JSON header) refused vs an honest decode of a blob of the same size
  * a 300-byte claim in front of a large file refused (ranged read) vs reading the file whole
  * the 535-byte YAML alias bomb refused vs loading the tiny example config
  * the dashboard's escaping of a run id vs formatting it unescaped

    python benchmarks/hostile_inputs.py [--quick] [--repeats 20] [--json benchmarks/results/hostile_inputs.json]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from ddiloco.platform.compression import decode_delta_into, encode_delta
from ddiloco.platform.config import load_config
from ddiloco.platform.store import BlobCorruptError, FragmentStore, decode_tensors, encode_tensors, sha256_hex

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, base_parser, best_of, header, verdict, write_results  # noqa: E402

NAME = "hostile_inputs"
GOAL_OVERHEAD = 1.10
ALIAS_BOMB = "model:\n  kwargs:\n    a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 9)
)


def honest_blob(tensors: int, numel: int) -> bytes:
    """An int8 delta of ``tensors`` tensors (a fragment of a mid-sized model), as the learner sends it."""
    g = torch.Generator().manual_seed(0)
    enc, meta = encode_delta({f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)}, "int8")
    return encode_tensors(enc, meta)


def refuse(fn) -> None:  # noqa: ANN001
    try:
        fn()
    except BlobCorruptError:
        return
    raise AssertionError("a poison input was accepted")


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tensors", type=int, default=64, help="tensors in the honest fragment")
    ap.add_argument("--numel", type=int, default=65_536, help="elements per tensor")
    ap.add_argument("--big-mb", type=int, default=256, help="size of the file behind the 300-byte claim")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.tensors, args.big_mb = 3, 16, 32
        if args.json is None:
            args.json = str(Path(tempfile.gettempdir()) / f"ddiloco-{NAME}.quick.json")  # never the published figures
    load_start = os.getloadavg()[0]
    results: dict = {**header(NAME, args), "load_avg_1m_start": load_start}

    blob = honest_blob(args.tensors, args.numel)
    st_s = best_of(lambda: st_load(blob), args.repeats)
    ours_s = best_of(lambda: decode_tensors(blob), args.repeats)
    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as tmp:
        store = FragmentStore(f"file://{tmp}/store")
        info = store.put_bytes("r/submissions/f0/l/honest.safetensors", blob)
        path = store.path(info.key)

        layout = [(f"layers.{i}.weight", (args.numel,)) for i in range(args.tensors)]
        row = torch.empty(args.tensors * args.numel)

        def unbounded_read() -> None:
            # The synchronizer's per-submission path without the bounds: read whole, checksum, safetensors,
            # header JSON for the metadata, decode into its row.
            data = store.fs.cat_file(path)
            assert sha256_hex(data) == info.sha256
            tensors = st_load(data)
            meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
            decode_delta_into(tensors, meta, layout, row)

        def bounded_read() -> None:
            tensors, meta = store.get_with_metadata(info.key, info.sha256, info.nbytes)
            decode_delta_into(tensors, meta, layout, row)

        # Interleaved, best of each: the machine's load drifts.
        plain_read_s, bounded_read_s = float("inf"), float("inf")
        for _ in range(args.repeats):
            plain_read_s = min(plain_read_s, best_of(unbounded_read, 1))
            bounded_read_s = min(bounded_read_s, best_of(bounded_read, 1))
    overhead = bounded_read_s / plain_read_s
    results["honest_decode"] = {
        "bytes": len(blob), "tensors": args.tensors, "safetensors_load_s": st_s, "bounded_decode_s": ours_s,
        "parse_ratio": ours_s / st_s, "unbounded_read_s": plain_read_s, "bounded_read_s": bounded_read_s,
        "read_overhead": overhead, "goal_max": GOAL_OVERHEAD, "pass": overhead <= GOAL_OVERHEAD,
    }

    depth = 100_000
    poison = len(b"[" * depth + b"]" * depth).to_bytes(8, "little") + b"[" * depth + b"]" * depth
    same_size = encode_tensors({"w": torch.zeros(max(1, len(poison) // 4))})
    same_size_s = best_of(lambda: decode_tensors(same_size), args.repeats)
    poison_s = best_of(lambda: refuse(lambda: decode_tensors(poison)), args.repeats)
    results["deep_header"] = {"bytes": len(poison), "refuse_s": poison_s, "honest_same_size_decode_s": same_size_s,
                              "ratio": poison_s / same_size_s}

    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as tmp:
        store = FragmentStore(f"file://{tmp}/store")
        key = "r/submissions/f0/l/big.safetensors"
        path = store.path(key)
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(os.urandom(args.big_mb << 20))  # real bytes: the whole read is what a claim must not cost
        refuse_s = best_of(lambda: refuse(lambda: store.get_bytes(key, "0" * 64, 300)), args.repeats)
        whole_s = best_of(lambda: store.fs.cat_file(path), max(1, args.repeats // 5))
        tracemalloc.start()
        refuse(lambda: store.get_bytes(key, "0" * 64, 300))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    results["small_claim_big_file"] = {"file_mb": args.big_mb, "refuse_s": refuse_s, "read_whole_s": whole_s,
                                       "ratio": refuse_s / whole_s, "refuse_peak_alloc_bytes": peak}

    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as tmp:
        bomb = Path(tmp) / "bomb.yaml"
        bomb.write_text(ALIAS_BOMB)
        tiny = ROOT / "examples" / "tiny.yaml"

        def refuse_bomb() -> None:
            try:
                load_config(bomb)
            except ValueError:
                return
            raise AssertionError("the alias bomb was accepted")

        bomb_s = best_of(refuse_bomb, args.repeats)
        tiny_s = best_of(lambda: load_config(tiny), args.repeats)
    results["alias_bomb"] = {"bytes": len(ALIAS_BOMB), "refuse_s": bomb_s, "tiny_config_load_s": tiny_s, "ratio": bomb_s / tiny_s}

    from ddiloco.ui.widgets import md

    run_id = "demo-20261122-212345"
    n = 10_000
    t0 = time.perf_counter()
    for _ in range(n):
        f"#### {md(run_id)}"
    escaped_s = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        f"#### {run_id}"
    plain_s = (time.perf_counter() - t0) / n
    results["markdown_escape"] = {"per_string_s": escaped_s, "plain_format_s": plain_s}
    results["load_avg_1m_end"] = os.getloadavg()[0]

    d, p, c, a = results["honest_decode"], results["deep_header"], results["small_claim_big_file"], results["alias_bomb"]
    print(f"load average (1 min): {load_start:.2f} at start, {results['load_avg_1m_end']:.2f} at end")
    print(f"honest {d['tensors']}-tensor blob of {d['bytes'] / 1e6:.1f} MB: bounded parse {d['bounded_decode_s'] * 1e3:.3f} ms vs "
          f"safetensors alone {d['safetensors_load_s'] * 1e3:.3f} ms = {d['parse_ratio']:.2f}x")
    print(f"  submission read (file://, ranged, sha256, bounded parse, decode) {d['bounded_read_s'] * 1e3:.2f} ms vs the same "
          f"unbounded {d['unbounded_read_s'] * 1e3:.2f} ms = {d['read_overhead']:.3f}x (goal <= {GOAL_OVERHEAD}x): {verdict(d['pass'])}")
    print(f"{depth:,}-deep JSON header ({p['bytes'] / 1e3:.0f} kB) refused in {p['refuse_s'] * 1e3:.2f} ms = "
          f"{p['ratio']:.2f}x an honest decode of the same size")
    print(f"300-byte claim, {c['file_mb']} MB file: refused in {c['refuse_s'] * 1e3:.3f} ms ({c['refuse_peak_alloc_bytes']:,} B "
          f"allocated) vs {c['read_whole_s'] * 1e3:.1f} ms to read it whole = {c['ratio']:.5f}x")
    print(f"{a['bytes']}-byte alias bomb refused in {a['refuse_s'] * 1e3:.2f} ms = {a['ratio']:.2f}x loading examples/tiny.yaml")
    print(f"markdown escape of a run id: {escaped_s * 1e6:.2f} us (plain f-string {plain_s * 1e6:.3f} us)")
    write_results(NAME, results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
