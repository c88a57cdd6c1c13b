"""Loader throughput and memory: can the token-shard data path feed a learner, and does its memory grow with the corpus?

  * throughput: tokens/s of the learner's batch iterator (``build_dataset(...).train_batches``,
    data.source tokens) over uint16 shards on ``file://`` and on ``s3://`` (moto's server on loopback),
    against the training tokens/s of the default model (ModelConfig defaults, batch 16, one torch
    thread, as a learner runs) measured in the same run on batches from the same iterator.
    Goal: loader >= 20x training on both stores.
  * memory: a fresh process iterates shards of a small and a large corpus (10 MB and 1 GB; --quick
    8 MB and 40 MB) for the same number of batches, spread over the whole corpus by ``start_batch``
    seeks, and reports its resident set (VmRSS, VmHWM; RssAnon and RssFile). Goal: the large corpus
    costs no more than the small one (within 16 MB).

The corpora are random token ids in a temporary folder, deleted at the end. A full run writes
benchmarks/results/loader_throughput.json; --quick writes under the system temp dir unless --json.

    python benchmarks/loader_throughput.py [--quick]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import base_parser, exit_on_sigterm, header, verdict, write_results

SHARD_BYTES = 64 << 20
GOAL_RATIO = 20.0
GOAL_RSS_MB = 16.0


def write_corpus(root: Path, total_bytes: int, vocab: int, seed: int = 0) -> list[str]:
    """uint16 shards of random ids under ``root`` (the last, small one validates); their paths."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    left, i = total_bytes // 2, 0
    while left > 0:
        n = min(left, SHARD_BYTES // 2)
        path = root / f"train-{i:04d}.bin"
        rng.integers(0, vocab, n, dtype=np.uint16).tofile(path)
        paths.append(str(path))
        left -= n
        i += 1
    val = root / "val.bin"
    rng.integers(0, vocab, 1 << 16, dtype=np.uint16).tofile(val)
    return [*paths, str(val)]


def loader_rate(data, model, batch_size: int, seconds: float) -> float:
    """Tokens/s of ``train_batches`` for about ``seconds`` (shard 0 of 1, from a fresh iterator)."""
    from ddiloco.platform.data import build_dataset

    ds = build_dataset(data, model)
    it = ds.train_batches(0, 1, batch_size, seed=0)
    next(it)
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += next(it).tokens
    return tokens / (time.perf_counter() - t0)


def training_rate(data, cfg, seconds: float) -> float:
    """Tokens/s of the default model's inner step (AdamW, one torch thread) on batches from the same loader."""
    import torch

    from ddiloco.platform.data import build_dataset
    from ddiloco.platform.models import build_model, compute_loss

    torch.set_num_threads(1)
    model = build_model(cfg.model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    it = build_dataset(data, cfg.model).train_batches(0, 1, cfg.learners.batch_size, seed=0)

    def step() -> int:
        batch = next(it)
        loss, _ = compute_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return batch.tokens

    for _ in range(3):
        step()
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += step()
    return tokens / (time.perf_counter() - t0)


_RSS_CHILD = r"""
import json, sys, numpy as np
from ddiloco.platform.config import DataConfig, ModelConfig
from ddiloco.platform.data import build_dataset
shards, batches, batch_size = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = ModelConfig()
ds = build_dataset(DataConfig(source="tokens", shards=shards), model)
per_epoch = ds.train.tokens // (model.seq_len * batch_size)
# Jump through the whole corpus: every batch from another place (a block read per batch, the worst case).
for k in range(batches):
    next(ds.train_batches(0, 1, batch_size, seed=0, start_batch=k * max(1, per_epoch // batches)))
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
kb = lambda key: int(status[key].split()[0]) / 1024
print(json.dumps({"tokens": ds.train.tokens, "rss_mb": kb("VmRSS"), "hwm_mb": kb("VmHWM"),
                  "rss_anon_mb": kb("RssAnon"), "rss_file_mb": kb("RssFile")}))
"""


def rss_of(shards: list[str], batches: int, batch_size: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, json.dumps(shards), str(batches), str(batch_size)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = base_parser(__doc__)
    ap.add_argument("--seconds", type=float, default=None, help="measuring time per rate (default 10, --quick 2)")
    args = ap.parse_args()
    exit_on_sigterm()  # a timeout's SIGTERM still deletes the temporary corpora
    from ddiloco.platform.config import DataConfig, load_config

    cfg = load_config()
    model, batch = cfg.model, cfg.learners.batch_size
    seconds = args.seconds or (2.0 if args.quick else 10.0)
    small_mb, large_mb = (8, 40) if args.quick else (10, 1024)
    results = header("loader_throughput", args)
    results.update({"model": model.model_dump(), "batch_size": batch, "goal_ratio": GOAL_RATIO, "goal_rss_mb": GOAL_RSS_MB})
    tmp = Path(tempfile.mkdtemp(prefix="ddiloco-loader-"))
    try:
        shards = write_corpus(tmp / "small", small_mb << 20, model.vocab_size)
        local = DataConfig(source="tokens", shards=[f"file://{p}" for p in shards])
        train = training_rate(local, cfg, seconds)
        file_rate = loader_rate(local, model, batch, seconds)

        from ddiloco.platform.config import environment
        from ddiloco.testing.s3 import S3Server

        with S3Server() as server, environment(server.env()):
            import s3fs

            fs = s3fs.S3FileSystem()
            fs.mkdir("loader")
            for p in shards:
                fs.put_file(p, f"loader/small/{Path(p).name}")
            s3 = DataConfig(source="tokens", shards=[f"s3://loader/small/{Path(p).name}" for p in shards])
            s3_rate = loader_rate(s3, model, batch, seconds)
        results["throughput"] = {
            "train_tokens_per_s": train, "file_tokens_per_s": file_rate, "s3_tokens_per_s": s3_rate,
            "file_ratio": file_rate / train, "s3_ratio": s3_rate / train,
        }
        print(f"training (default model, 1 thread): {train:,.0f} tokens/s")
        print(f"loader file://: {file_rate:,.0f} tokens/s = {file_rate / train:.0f}x   {verdict(file_rate >= GOAL_RATIO * train)}")
        print(f"loader s3:// (moto): {s3_rate:,.0f} tokens/s = {s3_rate / train:.0f}x   {verdict(s3_rate >= GOAL_RATIO * train)}")

        n_batches = 200 if args.quick else 500
        small = rss_of(shards, n_batches, batch)
        shutil.rmtree(tmp / "small")
        large_shards = write_corpus(tmp / "large", large_mb << 20, model.vocab_size, seed=1)
        large = rss_of(large_shards, n_batches, batch)
        results["memory"] = {"small_mb": small_mb, "large_mb": large_mb, "batches": n_batches, "small": small, "large": large,
                             "growth_mb": large["hwm_mb"] - small["hwm_mb"]}
        grow = large["hwm_mb"] - small["hwm_mb"]
        print(f"resident memory, {small_mb} MB corpus: {small['hwm_mb']:.0f} MB peak (anon {small['rss_anon_mb']:.0f}, "
              f"file {small['rss_file_mb']:.0f}); {large_mb} MB corpus: {large['hwm_mb']:.0f} MB peak (anon {large['rss_anon_mb']:.0f}, "
              f"file {large['rss_file_mb']:.0f}); growth {grow:+.1f} MB   {verdict(grow <= GOAL_RSS_MB)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_avg_1m"] = os.getloadavg()[0]
    out = args.json
    if args.quick and out is None:
        out = str(Path(tempfile.gettempdir()) / "ddiloco-bench" / "loader_throughput.json")
    write_results("loader_throughput", results, out)


if __name__ == "__main__":
    main()
