"""Fragment-store throughput: put+get of a ~100 MB fragment set through FragmentStore.

Compares, in the same run and on the same disk:
  * FragmentStore on file:// (safetensors encode, sha256, write + fsync, atomic link; read, sha256 check, decode)
  * a raw file copy of the same serialized bytes (shutil.copyfile, then read back) — the goal is a
    store/raw ratio >= 0.8
  * a raw copy that also fsyncs (what the store guarantees), for context
  * FragmentStore on s3:// through s3fs to an in-process moto server

    python benchmarks/store_throughput.py [--mb 100] [--tensors 24] [--repeats 3] [--json benchmarks/results/store.json]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddiloco.platform.store import FragmentStore, encode_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, header, verdict, write_results  # noqa: E402

GOAL_RATIO = 0.8


def make_fragments(total_mb: float, n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n fragments of one float32 tensor each, ~total_mb MB in all."""
    numel = int(total_mb * 1e6 / 4 / n)
    g = torch.Generator().manual_seed(seed)
    return [{f"layer{i}.weight": torch.randn(numel, generator=g)} for i in range(n)]


def bench_store(url: str, frags: list[dict[str, torch.Tensor]], tag: str) -> tuple[float, float, int]:
    store = FragmentStore(url)
    infos = []
    t0 = time.perf_counter()
    for i, f in enumerate(frags):
        infos.append(store.put(f"bench/{tag}/f{i}/v0.safetensors", f, {"fragment": str(i)}))
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    for info in infos:
        got = store.get(info.key, info.sha256)
        assert got  # decoded, checksum verified
    t_get = time.perf_counter() - t0
    return t_put, t_get, sum(i.nbytes for i in infos)


def bench_raw(src_dir: Path, dst_dir: Path, blobs: list[bytes], fsync: bool) -> tuple[float, float, int]:
    """shutil.copyfile of pre-serialized files (already in the page cache), then read them back."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    src_dir.mkdir(parents=True, exist_ok=True)
    srcs = []
    for i, b in enumerate(blobs):
        p = src_dir / f"f{i}.bin"
        if not p.exists():
            p.write_bytes(b)
        srcs.append(p)
    t0 = time.perf_counter()
    dsts = []
    for p in srcs:
        d = dst_dir / p.name
        shutil.copyfile(p, d)
        if fsync:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        dsts.append(d)
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    total = 0
    for d in dsts:
        with open(d, "rb") as f:
            total += len(f.read())
    t_get = time.perf_counter() - t0
    return t_put, t_get, total


def components(frags: list[dict[str, torch.Tensor]], blobs: list[bytes], work: Path) -> dict:
    """MB/s of each step a put/get does, measured here, to show where the store's time goes."""
    import hashlib

    from ddiloco.platform.store import decode_tensors

    mb = sum(map(len, blobs)) / 1e6

    def rate(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return round(mb / (time.perf_counter() - t0), 1)

    def write_fsync() -> None:
        for i, b in enumerate(blobs):
            with open(work / f"c{i}", "wb") as f:
                f.write(b)
                f.flush()
                os.fsync(f.fileno())

    work.mkdir(parents=True, exist_ok=True)
    return {
        "encode_safetensors_mb_s": rate(lambda: [encode_tensors(f) for f in frags]),
        "sha256_mb_s": rate(lambda: [hashlib.sha256(b).hexdigest() for b in blobs]),
        "decode_safetensors_mb_s": rate(lambda: [decode_tensors(b) for b in blobs]),
        "write_fsync_mb_s": rate(write_fsync),
        "read_mb_s": rate(lambda: [(work / f"c{i}").read_bytes() for i in range(len(blobs))]),
    }


def summarize(runs: list[tuple[float, float, int]]) -> dict:
    nbytes = runs[0][2]
    mb = nbytes / 1e6
    t_put = statistics.median(r[0] for r in runs)
    t_get = statistics.median(r[1] for r in runs)
    return {
        "mb": round(mb, 2),
        "put_s": round(t_put, 4),
        "get_s": round(t_get, 4),
        "put_mb_s": round(mb / t_put, 1),
        "get_mb_s": round(mb / t_get, 1),
        "roundtrip_mb_s": round(mb / (t_put + t_get), 1),
        "repeats": len(runs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--mb", type=float, default=100.0, help="size of the fragment set in MB")
    ap.add_argument("--tensors", type=int, default=24, help="fragments (one float32 tensor each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="local directory to benchmark in (default: the system temp dir)")
    ap.add_argument("--no-s3", action="store_true", help="skip the moto S3 measurement")
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.repeats = min(args.mb, 10.0), 1

    frags = make_fragments(args.mb, args.tensors)
    blobs = [encode_tensors(f, {"fragment": str(i)}) for i, f in enumerate(frags)]
    base = Path(tempfile.mkdtemp(prefix="store-bench-", dir=args.dir))
    results: dict = {
        **header("store", args),
        "fragment_set": {"tensors": args.tensors, "dtype": "float32", "mb": round(sum(map(len, blobs)) / 1e6, 2)},
        "dir": str(base),
    }
    try:
        store_runs, raw_runs, raw_sync_runs = [], [], []
        for r in range(args.repeats):
            # Interleave the three so drift in the machine's load hits all of them alike.
            store_runs.append(bench_store(f"file://{base}/store", frags, f"r{r}"))
            raw_runs.append(bench_raw(base / "src", base / f"raw{r}", blobs, fsync=False))
            raw_sync_runs.append(bench_raw(base / "src", base / f"rawsync{r}", blobs, fsync=True))
        results["components"] = components(frags, blobs, base / "components")
        results["file_store"] = summarize(store_runs)
        results["raw_copy"] = summarize(raw_runs)
        results["raw_copy_fsync"] = summarize(raw_sync_runs)
        ratio = results["file_store"]["roundtrip_mb_s"] / results["raw_copy"]["roundtrip_mb_s"]
        ratio_sync = results["file_store"]["roundtrip_mb_s"] / results["raw_copy_fsync"]["roundtrip_mb_s"]
        results["ratio_vs_raw_copy"] = round(ratio, 3)
        results["ratio_vs_raw_copy_fsync"] = round(ratio_sync, 3)
        results["goal"] = {"ratio_min": GOAL_RATIO, "pass": ratio >= GOAL_RATIO}
    finally:
        shutil.rmtree(base, ignore_errors=True)

    if not args.no_s3:
        results["s3_moto"] = bench_s3(frags, args.repeats)

    fs, raw, raws = results["file_store"], results["raw_copy"], results["raw_copy_fsync"]
    print(f"fragment set: {args.tensors} float32 tensors, {results['fragment_set']['mb']} MB serialized")
    print(f"{'':22} {'put MB/s':>10} {'get MB/s':>10} {'put+get MB/s':>13}")
    rows = [("FragmentStore file://", fs), ("raw copyfile+read", raw), ("raw copy+fsync+read", raws)]
    if "s3_moto" in results:
        rows.append(("FragmentStore s3 (moto)", results["s3_moto"]))
    for name, r in rows:
        print(f"{name:22} {r['put_mb_s']:>10.1f} {r['get_mb_s']:>10.1f} {r['roundtrip_mb_s']:>13.1f}")
    c = results["components"]
    print(
        "where a put/get goes (MB/s): encode {encode_safetensors_mb_s}, sha256 {sha256_mb_s}, write+fsync "
        "{write_fsync_mb_s}; read {read_mb_s}, decode {decode_safetensors_mb_s}".format(**c)
    )
    print(f"ratio store/raw copy: {results['ratio_vs_raw_copy']:.2f}  (store/raw copy+fsync: {results['ratio_vs_raw_copy_fsync']:.2f})")
    print(f"goal: file:// store >= {GOAL_RATIO:.1f} x raw file copy: {verdict(results['goal']['pass'])}")
    write_results("store", results, args.json)
    return 0


def bench_s3(frags: list[dict[str, torch.Tensor]], repeats: int) -> dict:
    from ddiloco.platform.config import environment
    from ddiloco.testing.s3 import S3Server

    with S3Server() as server, environment(server.env()):
        bucket = server.bucket("bench")
        runs = [bench_store(f"s3://{bucket}/root", frags, f"r{r}") for r in range(repeats)]
        return summarize(runs)


if __name__ == "__main__":
    sys.exit(main())
