"""The soak as a benchmark (issue #29): ``ddiloco chaos-suite --soak`` at 125 faults/hour for as long as asked.

A seeded Poisson stream of faults drawn from the matrix (learner SIGKILL / SIGSTOP, synchronizer shard SIGKILL,
evaluator SIGKILL, PostgreSQL restart, store outage, region partition), overlapping when the draw says so, on a run of
the demo's model and learners (4 in 2 regions) on a private PostgreSQL server, moto's S3 server and real processes
(:mod:`ddiloco.testing.soak`). Goals: 0 tokens lost, invariants hold at every check, goodput >= 0.9 of the availability
bound the schedule leaves, no long-lived process (through the soak, or 10+ minutes after its own warm-up before a
fault took it) growing in RSS by more than 10% after warm-up.

    python benchmarks/chaos_soak.py [--quick] [--minutes 30] [--rate 125] [--seed 29]

Writes ``benchmarks/results/chaos_soak.json`` for the 30-minute goal and ``chaos_soak_<N>min.json`` for any other
length (the hour is a benchmark of its own, not a replacement of the goal's figures); ``--quick`` (a 1-minute soak)
writes under the system temp dir unless ``--json`` says where, never over the published figures."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import base_parser, exit_on_sigterm, header, verdict, write_results  # noqa: E402

NAME = "chaos_soak"
GOODPUT_OF_BOUND = 0.9
RSS_GROWTH = 1.10


def main(argv: list[str] | None = None) -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long faults are drawn for (the goal: 30; as a benchmark: 60)")
    ap.add_argument("--rate", type=float, default=125.0, help="faults per hour")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--check-every-s", type=float, default=60.0)
    ap.add_argument("--workdir", default=None, help="where process logs go (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes = 1.0
        if args.json is None:
            args.json = str(Path(tempfile.gettempdir()) / f"ddiloco-{NAME}.quick.json")
    elif args.json is None and args.minutes != 30.0:
        args.json = str(HERE / "results" / f"{NAME}_{args.minutes:g}min.json")
    exit_on_sigterm()

    from ddiloco.testing.soak import DRIVER, LONG_LIVED_S, run_growth, run_soak, soak_passed

    results = header(NAME, args)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="ddiloco-soak-"))
    report = run_soak(duration_s=args.minutes * 60, rate_per_hour=args.rate, seed=args.seed, workdir=workdir,
                      check_every_s=args.check_every_s, warmup_s=min(60.0, args.minutes * 60 / 4))
    r = report.to_dict()
    worst = max((g["rss_ratio"] for g in run_growth(report)), default=1.0)
    driver = next((g["rss_ratio"] for g in r["growth"] if g["process"] == DRIVER), None)
    goals = {
        "tokens_lost_0": report.lost == 0,
        "invariants_hold": report.invariants_ok,
        "every_fault_applied": report.all_applied,
        f"goodput_of_bound_>=_{GOODPUT_OF_BOUND}": report.goodput_of_bound >= GOODPUT_OF_BOUND,
        "rss_growth_<=_10%": worst <= RSS_GROWTH,
    }
    results.update(soak=r, goals=goals, passed=soak_passed(report), largest_rss_ratio=worst, driver_rss_ratio=driver)
    kinds: dict[str, int] = {}
    for a in report.timeline:
        kinds[a.fault.kind] = kinds.get(a.fault.kind, 0) + 1
    print(f"{len(report.timeline)} faults in {report.duration_s / 60:.0f} min ({args.rate:g}/h, seed {args.seed}): "
          + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    print(f"goodput {report.goodput:.3f}, the schedule's bound {report.availability_bound:.3f}: {report.goodput_of_bound:.3f} of it")
    print("tokens " + ", ".join(f"{k} {v:,}" for k, v in report.tokens.items()))
    print("longest gap between versions: " + ", ".join(f"shard {g['shard']} {g['gap_s']:.1f} s" for g in report.longest_gap_s))
    judged = run_growth(report)
    print(f"largest RSS growth of a run's long-lived process after warm-up: x{worst:.3f} ({len(judged)} processes: "
          f"{sum(g['whole_soak'] for g in judged)} lived through the soak, "
          f"the others were sampled {LONG_LIVED_S / 60:.0f}+ minutes before a fault"
          f" took them); this driver (moto's S3 store in its memory): x{driver or 1.0:.3f}")
    for goal, ok in goals.items():
        print(f"  {goal}: {verdict(ok)}")
    write_results(NAME, results, args.json)
    return 0 if soak_passed(report) else 1


if __name__ == "__main__":
    raise SystemExit(main())
