"""Goodput simulator: how run time grows with N and M, the 2.4M-chip week, and the paper's table.

Prints and writes (default benchmarks/results/simulate.json):
  * wall time of one simulated week per (N, M) for the decoupled regime (learner timelines plus
    the synchronizer replay), and per N for dp and dp_elastic, with the failure count;
  * the 2.4M-chip week: the decoupled regime alone at M = 8 (goal < 10 s) and the whole column
    (every regime, M in 1..16);
  * the full goodput table against the paper's, with the delta per cell and PASS/FAIL at ±4 points;
  * the rule of thumb (M learners on N chips ~ one learner on N / M chips);
and saves the plot (default docs/goodput.png).

    .venv/bin/python benchmarks/simulate_scaling.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddiloco.simulator import SimulationConfig, simulate_cluster, simulate_table, trace_for  # noqa: E402
from ddiloco.simulator.report import TARGET_CHIPS, compare_to_target, row_label, rule_of_thumb, save_plot  # noqa: E402

GOAL_WEEK_S = 10.0
LEARNERS = (1, 2, 4, 8, 16)


def timed(fn, *args, **kwargs):
    """(result, wall seconds). CPU seconds of the last call are kept in CPU[0]: the machine may be
    shared, and CPU time is what the simulation itself costs."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    CPU[0] = time.process_time() - cpu
    return out, time.perf_counter() - wall


CPU = [0.0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/simulate.json")
    ap.add_argument("--plot", default="docs/goodput.png")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = SimulationConfig(seed=args.seed)
    print(f"config: {cfg.model_dump(mode='json')}")

    # 1. Run time against N and M (one simulated week each).
    timing = []
    print("\nrun time of one simulated week (s)")
    print(f"{'chips':>10} {'failures':>9} {'dp':>6} {'elastic':>8} " + " ".join(f"{'dec M=' + str(m):>9}" for m in LEARNERS))
    for n in TARGET_CHIPS:
        trace, t_trace = timed(trace_for, cfg, n, max(LEARNERS))
        _, t_dp = timed(simulate_cluster, cfg, n, (1,), ("dp",), trace)
        cpu_dp = CPU[0]
        _, t_el = timed(simulate_cluster, cfg, n, (1,), ("dp_elastic",), trace)
        cpu_el = CPU[0]
        per_m, cpu_m = {}, {}
        for m in LEARNERS:
            _, per_m[m] = timed(simulate_cluster, cfg, n, (m,), ("decoupled",), trace)
            cpu_m[m] = CPU[0]
        timing.append({
            "chips": n, "failures": int(len(trace.times)), "trace_s": round(t_trace, 4), "dp_s": round(t_dp, 3),
            "dp_elastic_s": round(t_el, 3), "dp_cpu_s": round(cpu_dp, 3), "dp_elastic_cpu_s": round(cpu_el, 3),
            "decoupled_s": {str(m): round(x, 3) for m, x in per_m.items()},
            "decoupled_cpu_s": {str(m): round(x, 3) for m, x in cpu_m.items()},
        })
        print(f"{n:>10,} {len(trace.times):>9,} {t_dp:>6.2f} {t_el:>8.2f} " + " ".join(f"{per_m[m]:>9.2f}" for m in LEARNERS)
              + f"   cpu: {cpu_dp:.2f} {cpu_el:.2f} " + " ".join(f"{cpu_m[m]:.2f}" for m in LEARNERS))

    # 2. The 2.4M-chip week.
    big = TARGET_CHIPS[-1]
    _, t_one = timed(simulate_cluster, cfg, big, (8,), ("decoupled",))
    cpu_one = CPU[0]
    _, t_column = timed(simulate_cluster, cfg, big, LEARNERS)
    cpu_column = CPU[0]
    print(f"\n2.4M chips, one week: decoupled M=8 alone {t_one:.2f} s wall / {cpu_one:.2f} s CPU (goal < "
          f"{GOAL_WEEK_S:.0f} s: {'PASS' if t_one < GOAL_WEEK_S else 'FAIL'}); every regime and M in 1..16: "
          f"{t_column:.2f} s wall / {cpu_column:.2f} s CPU")

    # 3. The table against the paper's.
    results, t_table = timed(simulate_table, cfg, TARGET_CHIPS, LEARNERS)
    rows = [r.row for r in results]
    cells = compare_to_target(rows)
    print(f"\ngoodput % vs paper (whole table simulated in {t_table:.1f} s)")
    keys = [("dp", 1), ("dp_elastic", 1), ("decoupled", 2), ("decoupled", 4), ("decoupled", 8), ("decoupled", 16)]
    print(f"{'':20}" + "".join(f"{n:>22,}" for n in TARGET_CHIPS))
    for regime, m in keys:
        line = f"{row_label(regime, m):20}"
        for n in TARGET_CHIPS:
            c = next(c for c in cells if (c["regime"], c["learners"], c["chips"]) == (regime, m, n))
            line += f"{c['goodput_pct']:>8.1f} ({c['target_pct']:.0f}, {c['delta_points']:+.1f}) {c['result']}"
        print(line)
    passed = sum(c["result"] == "PASS" for c in cells)
    print(f"cells within ±4 points: {passed}/{len(cells)}")
    for title, metric, regime in (("goodput %, synchronous DiLoCo (no paper target)", "goodput", "diloco_sync"),
                                  ("uptime %, decoupled", "uptime", "decoupled"),
                                  ("uptime %, synchronous DiLoCo", "uptime", "diloco_sync")):
        print(f"\n{title}")
        for m in LEARNERS:
            vals = [next(r for r in rows if (r.regime, r.learners, r.chips) == (regime, m, n)) for n in TARGET_CHIPS]
            print(f"{row_label(regime, m):20}" + "".join(f"{100 * getattr(v, metric):>22.1f}" for v in vals))
    print("\nuptime %, data-parallel: " + "; ".join(
        f"{r.regime} @ {r.chips:,}: {100 * r.uptime:.1f}" for r in rows if r.regime in ("dp", "dp_elastic")))
    print("physical bound: " + ", ".join(f"{r.chips:,}: {100 * r.bound:.2f}%" for r in rows if r.regime == "dp"))

    # 4. The rule of thumb.
    rot, t_rot = timed(rule_of_thumb, cfg, rows)
    print("\nrule of thumb: decoupled (N, M) vs one elastic learner on N/M chips (points); paper's own table in brackets")
    for c in rot:
        paper = "" if c["paper_delta_points"] is None else f" [paper {c['paper_delta_points']:+.0f}]"
        print(f"  M={c['learners']:>2} N={c['chips']:>9,}: {c['decoupled_pct']:5.1f} vs {c['one_learner_on_n_over_m_pct']:5.1f} "
              f"({c['delta_points']:+.2f}){paper}")

    save_plot(rows, args.plot)
    print(f"\nplot: {args.plot}")
    out = {
        "benchmark": "simulate_scaling",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "config": cfg.model_dump(mode="json"),
        "timing": timing,
        "week_2_4m": {"decoupled_m8_s": round(t_one, 3), "decoupled_m8_cpu_s": round(cpu_one, 3),
                      "all_regimes_s": round(t_column, 3), "all_regimes_cpu_s": round(cpu_column, 3), "goal_s": GOAL_WEEK_S,
                      "result": "PASS" if t_one < GOAL_WEEK_S else "FAIL"},
        "table_s": round(t_table, 2),
        "rows": [r.to_dict() for r in rows],
        "details": [{"regime": r.row.regime, "learners": r.row.learners, "chips": r.row.chips, **r.details} for r in results],
        "vs_target": cells,
        "cells_pass": passed,
        "cells_total": len(cells),
        "rule_of_thumb": rot,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=float))
    print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
