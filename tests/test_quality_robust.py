"""The quality benchmark's robust rows: their plan, the issue's gate lines, and targeted runs added to the published results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ddiloco.bench.quality import plan as P
from ddiloco.bench.quality import report as R
from ddiloco.bench.quality.run import Row
from ddiloco.cli import app


def row(regime: str, val_loss: float, fewest: int | None = 8, base: str | None = None, model: str = "dense") -> Row:
    return Row(model=model, regime=regime, group="regime" if base is None else "ablation", tokens=100, val_loss=val_loss,
               val_accuracy=None, bytes_per_token=1.0, goodput=1.0, wall_clock_s=10.0, tokens_merged=100, bytes_sent=100,
               payload_bytes_per_token=1.0, lost_fraction=0.0, merges=192, mean_learners_per_merge=4.0, mean_grace_window_s=0.0,
               real_s=1.0, knobs={}, base=base, knob="k", fewest_versions=fewest)


def test_the_robust_rows_run_by_name_with_their_options():
    specs = P.select(P.plan(["dense"], P.FULL, quick=False), "ablation_trim,attack_flip3_trim,m8_attack_flip3_median")
    by_name = {s.regime: s for s in specs}
    assert by_name["attack_flip3_trim"].adversary == P.ATTACK_K and by_name["attack_flip3_trim"].base == "attack_flip3"
    assert by_name["ablation_trim"].adversary == 0 and by_name["ablation_trim"].base == "decoupled"
    assert P.build_run_config(by_name["ablation_trim"], P.FULL, quick=False).merge.robust == "trimmed_mean"
    m8 = P.build_run_config(by_name["m8_attack_flip3_median"], P.spec_scale(by_name["m8_attack_flip3_median"], P.FULL), quick=False)
    assert (m8.merge.robust, m8.learners.count) == ("median", 8)
    assert not [s for s in P.plan(["dense"], P.QUICK, quick=True) if "attack" in s.regime]


def test_drop_opposed_has_rows_under_stragglers_and_outages_against_the_same_row_with_robust_off():
    names = ["ablation_drop_stragglers", "ablation_drop_failures", "attack_flip3_stragglers", "attack_flip3_drop_stragglers"]
    by_name = {s.regime: s for s in P.select(P.plan(["dense"], P.FULL, quick=False), names)}
    for name, base, speeds, failures, adversary in (
            ("ablation_drop_stragglers", "decoupled_stragglers", P.STRAGGLER_SPEEDS, 0.0, 0.0),
            ("ablation_drop_failures", "decoupled_failures", None, P.FAILURE_FRACTION, 0.0),
            ("attack_flip3_stragglers", "decoupled_stragglers", P.STRAGGLER_SPEEDS, 0.0, P.ATTACK_K),
            ("attack_flip3_drop_stragglers", "attack_flip3_stragglers", P.STRAGGLER_SPEEDS, 0.0, P.ATTACK_K)):
        s = by_name[name]
        assert (s.base, s.speeds, s.failures, s.adversary, s.learners) == (base, speeds, failures, adversary, None), name
        assert P.build_run_config(s, P.FULL, quick=False).merge.robust == ("drop_opposed" if "drop" in name else "none"), name


def test_each_attack_row_is_paired_with_the_same_options_without_the_attacker():
    names = ["decoupled", "attack_flip3", "ablation_trim", "attack_flip3_trim", "attack_flip3_clip2", "m8_decoupled",
             "m8_attack_flip3", "m8_ablation_median", "m8_attack_flip3_median", "decoupled_stragglers", "attack_flip3_stragglers",
             "ablation_drop_stragglers", "attack_flip3_drop_stragglers", "attack_flip3_failures"]
    assert P.robust_gate_pairs(names) == [("attack_flip3", "decoupled"), ("attack_flip3_trim", "ablation_trim"),
                                          ("m8_attack_flip3", "m8_decoupled"), ("m8_attack_flip3_median", "m8_ablation_median"),
                                          ("attack_flip3_stragglers", "decoupled_stragglers"),
                                          ("attack_flip3_drop_stragglers", "ablation_drop_stragglers")]


def test_the_gate_needs_the_loss_within_one_percent_and_every_fragment_publishing():
    rows = [row("ablation_trim", 2.0, base="decoupled"), row("attack_flip3_trim", 2.019, base="attack_flip3"),
            row("ablation_clip2", 2.0, base="decoupled"), row("attack_flip3_clip2", 2.021, base="attack_flip3"),
            row("ablation_x", 2.0, fewest=10, base="decoupled"), row("attack_flip3_x", 2.0, fewest=9, base="attack_flip3"),
            row("ablation_y", 2.0, fewest=10, base="decoupled"), row("attack_flip3_y", 2.0, fewest=8, base="attack_flip3")]
    got = {g["goal"].split(":")[1].split()[0]: g for g in R.robust_goals(rows)}
    assert got["attack_flip3_trim"]["pass"] and "+0.95%" in got["attack_flip3_trim"]["figure"]
    assert not got["attack_flip3_clip2"]["pass"]
    assert got["attack_flip3_x"]["pass"]  # 9 of 10 merges per fragment: still publishing
    assert not got["attack_flip3_y"]["pass"] and "8 vs 10" in got["attack_flip3_y"]["figure"]


def result(rows: list[Row], date: str) -> dict:
    machine = {"cores": 2, "load_avg_1m": 1.0, "python": "3.11.7", "torch": "2"}
    return {"date": date, "commit": "abc", "dirty": False, "machine": machine, "jobs": 1, "total_real_s": 5.0,
            "scale": {"name": "full", "learners": 4, "steps": 192}, "rows": [R.row_json(r) for r in rows],
            "goals": R.goals(rows), "ablations": R.ablation_lines(rows)}


def test_a_targeted_run_is_kept_apart_and_replaced_by_a_run_of_the_same_rows():
    full = result([row("decoupled", 2.3), row("diloco", 2.4)], "2026-01-01")
    first = result([row("decoupled", 2.35), row("attack_flip3", 2.8, base="decoupled")], "2026-02-01")
    other = result([row("ablation_trim", 2.36, base="decoupled"), row("decoupled", 2.35)], "2026-02-02")
    again = result([row("decoupled", 2.35), row("attack_flip3", 2.7, base="decoupled")], "2026-02-03")
    published = R.with_targeted(R.with_targeted(R.with_targeted(full, first), other), again)
    assert published["rows"] == full["rows"] and published["goals"] == full["goals"]
    assert [t["date"] for t in published["targeted"]] == ["2026-02-02", "2026-02-03"]
    block = R.docs_block({**published, "notes": [], "time_breakdown": {}}, R.rows_from_json(published))
    assert block.count("Targeted run of") == 2 and "| dense | attack_flip3 | k | 2.7000 | decoupled | 2.3500 | +14.89% |" in block
    rescored = R.rescored(published)
    assert rescored["targeted"][1]["ablations"] == again["ablations"]


@pytest.mark.parametrize("args", [[], ["--only", "decoupled", "--quick"], ["--only", "decoupled", "--publish"],
                                  ["--only", "decoupled", "--render", "results.json"]])
def test_adding_to_the_published_results_needs_a_targeted_full_scale_run(args: list[str], tmp_path: Path):
    # A checkout of its own, and a model list refused right after the check: were the check gone, nothing would train.
    for d in ("ddiloco", "docs", "benchmarks/results"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "docs" / "quality.md").write_text("# page\n")
    out = CliRunner().invoke(app, ["bench", "quality", "--repo", str(tmp_path), "--add-to-published", "--models", "bogus", *args])
    said = " ".join(re.sub("[│╭╮╰╯─]", " ", out.output).split())  # the message as typer boxes it, unwrapped
    assert out.exit_code == 2 and "it needs --only at full scale" in said
    assert (tmp_path / "docs" / "quality.md").read_text() == "# page\n"
