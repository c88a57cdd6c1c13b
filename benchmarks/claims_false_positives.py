"""Honest work must never be rejected: seeded demo-like runs, every submission's fate counted.

Each run is the demo's shape in the deterministic in-process mode: the default model, four learners
in two regions (one at half speed), one learner down for 20% of the run from 30% on (it comes back
as a new incarnation with a fresh optimizer, as after a crash), int8, P = H = 24, run defaults
otherwise. ``--slow-link`` gives another learner an upload link that carries a quarter of what it sends
(the int8 bytes of the model per period, over 4), so from the first step its sends queue and fold together
into increments of several periods (results: ``claims_false_positives_slowlink.json``). Every submission
is honest, so every rejection is a false positive of the synchronizer's checks (claims, norms, staleness,
blobs); the reasons are listed. Goal: 0 over at least 10 seeds.
The detection side (every lie and outsized update of the issue rejected) is tests/test_hostile_claims.py.

    python benchmarks/claims_false_positives.py [--quick] [--seeds 10] [--steps 120] [--jobs N] [--slow-link]
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import base_parser, header, write_results  # noqa: E402

NAME = "claims_false_positives"


def demo_like(seed: int, quick: bool):
    from ddiloco.platform.config import build_config

    data: dict = {
        "name": f"fp-{seed}",
        "seed": seed,
        "learners": {"regions": [{"name": "us", "learners": 2}, {"name": "eu", "learners": 2, "speeds": [1.0, 0.5]}]},
    }
    if quick:
        data["model"] = {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32}
        data["learners"]["batch_size"] = 4
        data["data"] = {"max_bytes": 400_000, "val_batches": 2}
        data["fragments"] = {"count": 4}
    return build_config(data)


def one_run(args: tuple[int, int, bool, bool]) -> dict:
    import torch
    from sqlalchemy import select

    from ddiloco.inprocess import Outage, run_inprocess
    from ddiloco.platform.config import tokens_per_step
    from ddiloco.platform.ledger import reports as reports_q
    from ddiloco.platform.ledger.models import Submission
    from ddiloco.platform.models import build_model

    seed, steps, quick, slow_link = args
    torch.set_num_threads(1)
    cfg = demo_like(seed, quick)
    ids = cfg.learners.learner_ids()
    victim, slow = ids[1][0], ids[0][0]
    outages = [Outage(victim, 0.3 * steps, 0.5 * steps)]
    numel = sum(p.numel() for p in build_model(cfg.model, seed=cfg.seed).parameters())
    slow_bps = numel / cfg.fragments.period / 4  # int8: a byte per element, sent once a period, at a quarter the pace
    links = {slow: slow_bps} if slow_link else None
    t0 = time.perf_counter()
    total = cfg.learners.count * steps * tokens_per_step(cfg.model, cfg.learners.batch_size)
    run = run_inprocess(cfg, total_tokens=total, step_time_s=1.0, outages=outages, upload_bps=links)
    with run.ctx.reading() as s:
        rows = list(s.execute(select(Submission.status, Submission.reject_reason, Submission.learner_id, Submission.fragment,
                                     Submission.c_steps, Submission.base_version, Submission.created_at,
                                     Submission.tokens_new)).all())
        acct = reports_q.token_accounting(s, run.ctx.run_id)
    fates = Counter(r[0] for r in rows)
    reasons = Counter((r[1] or "").split(":")[0] for r in rows if r[0] == "rejected")
    details = [{"learner": r[2], "fragment": r[3], "c_steps": r[4], "base": r[5], "at_s": round((r[6] - rows[0][6]).total_seconds(), 1),
                "reason": r[1]} for r in rows if r[0] == "rejected"]
    slow_steps = [r[4] for r in rows if r[2] == slow]
    slow_merged = sum(r[7] for r in rows if r[2] == slow and r[0] == "merged")
    return {"seed": seed, "submissions": len(rows), "fates": dict(fates), "rejected": fates.get("rejected", 0),
            "reasons": dict(reasons), "rejections": details, "victim": victim, "outage_s": [0.3 * steps, 0.5 * steps],
            "slow_link": None if links is None else {
                "learner": slow, "upload_bps": round(slow_bps), "submissions": len(slow_steps),
                "most_steps": max(slow_steps, default=0), "coalesced": run.links[slow].coalesced,
                "tokens_trained": run.learners[slow].tokens_total, "tokens_merged": slow_merged,
                "cadence_changes": run.links[slow].cadence_changes, "cadences": run.links[slow].cadences},
            "tokens_balanced": acct.balanced, "real_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=120, help="inner steps per learner at full speed")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--slow-link", action="store_true", help="one learner uploads at a quarter of the pace its sends need")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = 2, 24
    results = header(NAME, args)
    work = [(seed, args.steps, args.quick, args.slow_link) for seed in range(args.seeds)]
    if args.jobs > 1:
        import multiprocessing as mp

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            runs = list(pool.map(one_run, work))
    else:
        runs = [one_run(w) for w in work]
    for r in runs:
        print(f"seed {r['seed']}: {r['submissions']} submissions {r['fates']}, rejected {r['rejected']} {r['reasons']}, "
              f"tokens balanced {r['tokens_balanced']} ({r['real_s']} s)" + (f"; slow link {r['slow_link']}" if r["slow_link"] else ""))
        for d in r["rejections"]:
            print(f"    {d}")
    submissions = sum(r["submissions"] for r in runs)
    rejected = sum(r["rejected"] for r in runs)
    results.update(runs=runs, submissions=submissions, honest_rejected=rejected,
                   false_positive_rate=rejected / max(1, submissions), goal="0 honest submissions rejected over >= 10 seeds")
    ok = rejected == 0 and len(runs) >= 10
    verdict = "smoke run, no verdict" if args.quick else ("PASS" if ok else "FAIL")
    print(f"false positives: {rejected} of {submissions} honest submissions over {len(runs)} seeded runs: {verdict}")
    if not args.quick:
        write_results(NAME + ("_slowlink" if args.slow_link else ""), results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
