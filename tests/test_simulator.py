"""The goodput simulator: closed-form cases, monotonicity, determinism, the real policy, the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

import ddiloco.synchronizer.policy as policy
from ddiloco.simulator import SimulationConfig, effective_failures, simulate_cluster
from ddiloco.simulator import regimes as regimes_mod
from ddiloco.simulator.command import simulate_command
from ddiloco.simulator.group import expected_max_normal, snapshot_interval, straggler_speed
from ddiloco.simulator.report import compare_to_target, rule_of_thumb

pytestmark = pytest.mark.timeout(60)

T = 10_000.0  # seconds in the hand-computed cases
DAY = 86_400.0


def cfg_for(**kw) -> SimulationConfig:
    base = dict(days=T / DAY, checkpoint_s=0.0, chip_speed_cv=0.0, slice_chips=1)
    base.update(kw)
    return SimulationConfig(**base)


def trace(times, slices, *, n_slices, chips=None, repair_s=500.0, horizon=T):
    return effective_failures(
        np.asarray(times, float), np.asarray(slices, int), n_slices=n_slices, chips=chips or n_slices,
        horizon_s=horizon, repair_s=repair_s,
    )


def by_regime(results):
    return {(r.row.regime, r.row.learners): r for r in results}


# --- closed forms -------------------------------------------------------------------------------------


def test_no_failures_gives_full_goodput_and_uptime_in_every_regime():
    cfg = cfg_for()
    results = simulate_cluster(cfg, 8, learners=(1, 2, 4), trace=trace([], [], n_slices=8))
    assert len(results) == 2 + 2 * 3
    for r in results:
        assert r.row.goodput == pytest.approx(1.0, abs=1e-12), r.row
        assert r.row.uptime == pytest.approx(1.0, abs=1e-12), r.row
        assert r.row.bound == 1.0


def test_snapshot_cost_without_failures_is_the_only_loss():
    # Cycles of 300 s compute + 10 s snapshot: 32 cycles (9,920 s) then 80 s of compute.
    cfg = cfg_for(checkpoint_s=10.0, checkpoint_interval_s=300.0)
    (dp,) = simulate_cluster(cfg, 4, regimes=("dp",), trace=trace([], [], n_slices=4))
    assert dp.row.goodput == pytest.approx((32 * 300 + 80) / T)


def test_one_dp_failure_costs_the_restart_plus_the_work_since_the_last_snapshot():
    # Interrupted at 1,000 s: 3 snapshots done (930 s), 70 s of work lost; restart 60 s; then
    # 8,940 s = 28 cycles (8,400 s of work) + 260 s of work kept at the end.
    cfg = cfg_for(checkpoint_s=10.0, checkpoint_interval_s=300.0, restart_s=60.0, repair_s=500.0)
    (dp,) = simulate_cluster(cfg, 4, regimes=("dp",), trace=trace([1000.0], [2], n_slices=4))
    assert dp.row.goodput == pytest.approx((900 + 8400 + 260) / T)
    assert dp.row.uptime == pytest.approx((930 + 8940) / T)
    assert dp.details["lost_share"] == pytest.approx(70 / T)
    assert dp.row.bound == pytest.approx(1 - 500 / (4 * T))


def test_one_elastic_failure_costs_two_pauses_and_a_slice_while_it_is_repaired():
    # 4 slices; slice 0 out at 1,000 s for 500 s. Downscale 10 s, then 3/4 capacity until the
    # repair at 1,500 s, then a 20 s upscale. Continuous snapshots: nothing rolled back.
    cfg = cfg_for(downscale_s=10.0, upscale_s=20.0, repair_s=500.0)
    (el,) = simulate_cluster(cfg, 4, regimes=("dp_elastic",), trace=trace([1000.0], [0], n_slices=4))
    expected = 1000 + 490 * 0.75 + (T - 1520)
    assert el.row.goodput == pytest.approx(expected / T)
    assert el.row.uptime == pytest.approx((T - 30) / T)


def test_decoupled_learners_lose_only_their_own_failure_and_keep_the_model_moving():
    # 2 learners of 2 slices; learner 0 loses a slice as above, learner 1 never stops.
    cfg = cfg_for(downscale_s=10.0, upscale_s=20.0, repair_s=500.0)
    tr = trace([1000.0], [0], n_slices=4)
    learner0 = 1000 + 490 * 0.5 + (T - 1520)
    res = by_regime(simulate_cluster(cfg, 4, learners=(2,), regimes=("decoupled",), trace=tr))
    dec = res[("decoupled", 2)]
    assert dec.row.goodput == pytest.approx((learner0 + T) / (2 * T))
    assert dec.row.uptime == pytest.approx(1.0)  # K = 1: learner 1 carries the model
    assert dec.details["unmerged_share"] == 0.0

    # K = 2 (a fixed count): the model stalls while learner 0 is in a pause, but no work is lost.
    cfg2 = cfg.model_copy(update={"quorum": cfg.quorum.model_copy(update={"min_count": 2})})
    dec2 = by_regime(simulate_cluster(cfg2, 4, learners=(2,), regimes=("decoupled",), trace=tr))[("decoupled", 2)]
    assert dec2.row.uptime == pytest.approx(1 - 30 / T)
    assert dec2.row.goodput == pytest.approx(dec.row.goodput)


def test_synchronous_diloco_waits_for_the_slowest_learner():
    cfg = cfg_for(downscale_s=10.0, upscale_s=20.0, repair_s=500.0)
    tr = trace([1000.0], [0], n_slices=4)
    res = by_regime(simulate_cluster(cfg, 4, learners=(2,), regimes=("diloco_sync", "decoupled"), trace=tr))
    sync, dec = res[("diloco_sync", 2)], res[("decoupled", 2)]
    assert sync.row.goodput < dec.row.goodput
    # Both learners are held back by learner 0's 30 s of pauses and its 490 s at half capacity.
    assert sync.row.goodput == pytest.approx(1 - (30 + 245) / T, abs=W_TOL)


W_TOL = 120 / T  # one outer round of slack for the last, partial round


def test_straggler_speed_is_the_expected_slowest_chip():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(1000) == pytest.approx(3.24, abs=0.03)
    cfg = cfg_for(chip_speed_cv=0.01)
    (dp,) = simulate_cluster(cfg, 1000, regimes=("dp",), trace=trace([], [], n_slices=1000))
    assert dp.row.goodput == pytest.approx(1 / (1 + 0.01 * expected_max_normal(1000)))
    assert straggler_speed(1000, 0.01) == pytest.approx(dp.row.goodput)


def test_young_interval_and_effective_failures():
    assert snapshot_interval(0.5, None, 210.0) == pytest.approx(math.sqrt(2 * 0.5 * 210))
    assert snapshot_interval(0.0, None, 210.0) is None
    assert snapshot_interval(1.0, 30.0, 210.0) == 30.0
    # Slice 1 is hit at 0, 100 (under repair: dropped) and 600 (repaired at 500: kept).
    tr = trace([600.0, 0.0, 100.0, 50.0], [1, 1, 1, 0], n_slices=2, repair_s=500.0, horizon=1000.0)
    assert tr.times.tolist() == [0.0, 50.0, 600.0]
    assert tr.slices.tolist() == [1, 0, 1]


# --- statistics over real traces ------------------------------------------------------------------------


def test_goodput_falls_with_chips_and_rises_with_mtbi():
    def goodputs(chips, mtbi):
        cfg = SimulationConfig(days=1.0, mtbi_years=mtbi)
        res = by_regime(simulate_cluster(cfg, chips, learners=(4,), regimes=("dp", "dp_elastic", "decoupled")))
        return np.array([res[k].row.goodput for k in (("dp", 1), ("dp_elastic", 1), ("decoupled", 4))])

    small, mid, large = goodputs(50_000, 1.0), goodputs(200_000, 1.0), goodputs(800_000, 1.0)
    assert np.all(small > mid) and np.all(mid > large)
    fragile, sturdy = goodputs(200_000, 0.5), goodputs(200_000, 2.0)
    assert np.all(fragile < mid) and np.all(mid < sturdy)
    assert np.all(large[2] > large[:2])  # decoupled beats both data-parallel regimes


def test_seeded_runs_are_reproducible():
    cfg = SimulationConfig(days=0.5, seed=3)
    a = [r.row for r in simulate_cluster(cfg, 100_000, learners=(1, 4))]
    b = [r.row for r in simulate_cluster(cfg, 100_000, learners=(1, 4))]
    c = [r.row for r in simulate_cluster(cfg.model_copy(update={"seed": 4}), 100_000, learners=(1, 4))]
    assert a == b
    assert a != c


def test_decoupled_regime_decides_with_the_synchronizers_policy(monkeypatch):
    calls = {"decide": 0, "grace": 0}
    real_decide, real_grace = policy.decide_merge, policy.grace_window

    def counting_decide(*args, **kwargs):
        calls["decide"] += 1
        return real_decide(*args, **kwargs)

    def counting_grace(*args, **kwargs):
        calls["grace"] += 1
        return real_grace(*args, **kwargs)

    monkeypatch.setattr(policy, "decide_merge", counting_decide)
    monkeypatch.setattr(policy, "grace_window", counting_grace)
    assert regimes_mod.policy is policy  # the simulator holds the module, not a copy
    (dec,) = simulate_cluster(SimulationConfig(days=0.2), 50_000, learners=(4,), regimes=("decoupled",))
    assert calls["decide"] == dec.details["policy_decisions"] > dec.details["merges"] > 0
    assert calls["grace"] == dec.details["merges"] + 1
    assert not any(hasattr(regimes_mod, name) for name in ("quorum_time", "decide_merge", "grace_window"))


def test_bad_settings_fail_early_with_a_reason():
    cfg = SimulationConfig(days=0.1, quorum={"min_count": 2})
    with pytest.raises(ValueError, match="quorum.min_count"):
        simulate_cluster(cfg, 10_000, learners=(1, 2), regimes=("decoupled",))
    with pytest.raises(ValueError, match="unknown regime"):
        simulate_cluster(SimulationConfig(days=0.1), 10_000, regimes=("ring",))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="restart_s"):
        SimulationConfig(restart_s=-1)


def test_target_comparison_and_rule_of_thumb():
    cfg = SimulationConfig(days=0.5)
    rows = [r.row for r in simulate_cluster(cfg, 300_000, learners=(1, 2), regimes=("dp", "dp_elastic", "decoupled"))]
    cells = compare_to_target(rows)
    assert {(c["regime"], c["learners"]) for c in cells} == {("dp", 1), ("dp_elastic", 1), ("decoupled", 2)}
    assert all(c["result"] in ("PASS", "FAIL") for c in cells)
    (check,) = rule_of_thumb(cfg, rows)
    assert check["learners"] == 2 and check["chips"] == 300_000
    assert abs(check["delta_points"]) < 2.0  # two learners of 150k ~ one learner of 150k
    assert check["paper_delta_points"] == 0.0  # paper: 88 (M=2, 300k) vs 88 (elastic, 150k)


# --- the command ---------------------------------------------------------------------------------------


def test_cli_prints_the_table_and_writes_json_and_plot(tmp_path):
    app = typer.Typer()
    app.command("simulate")(simulate_command)
    app.command("noop")(lambda: None)
    out, png = tmp_path / "rows.json", tmp_path / "g.png"
    result = CliRunner().invoke(
        app,
        ["simulate", "--chips", "150000,300000", "--learners", "1,2", "--days", "0.25", "--json", str(out), "--plot", str(png)],
    )
    assert result.exit_code == 0, result.output
    assert "goodput" in result.output and "Decoupled M=2" in result.output
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * (2 + 2 * 2)
    for row in rows:
        assert set(row) == {"regime", "learners", "chips", "goodput", "uptime", "bound"}
        assert row["regime"] in ("dp", "dp_elastic", "diloco_sync", "decoupled")
        assert 0 <= row["goodput"] <= 1 and 0 <= row["uptime"] <= 1 and 0 <= row["bound"] <= 1
    assert png.stat().st_size > 10_000

    bad = CliRunner().invoke(app, ["simulate", "--chips", "many", "--plot", str(png)])
    assert bad.exit_code != 0
