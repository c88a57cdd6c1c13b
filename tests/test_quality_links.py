"""The quality benchmark's link rows (issue #18): their plan and links, and the adaptive-vs-fixed goal lines."""

from __future__ import annotations

import pytest

from ddiloco.bench.quality import plan as P
from ddiloco.bench.quality import report as R
from ddiloco.bench.quality.run import Row, upload_demand


def row(regime: str, val_loss: float, links: dict | None = None, base: str | None = None) -> Row:
    return Row(model="dense", regime=regime, group="regime" if base is None else "ablation", tokens=100, val_loss=val_loss,
               val_accuracy=None, bytes_per_token=1.0, goodput=1.0, wall_clock_s=10.0, tokens_merged=100, bytes_sent=100,
               payload_bytes_per_token=1.0, lost_fraction=0.0, merges=192, mean_learners_per_merge=4.0, mean_grace_window_s=0.0,
               real_s=1.0, knobs={"every": 24}, base=base, knob="k", links=links)


def test_the_link_rows_run_by_name_with_their_links_and_cadence():
    specs = {s.regime: s for s in P.select(P.plan(["dense"], P.FULL, quick=False), [a for pair in P.ADAPTIVE_PAIRS for a in pair])}
    assert specs["link_slow_fixed"].upload_shares == (P.LINK_WIDE,) * 3 + (P.LINK_SLOW,)
    assert specs["link_thin_adaptive"].upload_shares == (P.LINK_THIN,) * 4 and specs["ablation_fixed_cadence"].upload_shares is None
    for adaptive, fixed in P.ADAPTIVE_PAIRS:
        # One is the other with one knob changed (the default, adaptive, is the base of the fixed row without links).
        assert fixed == specs[adaptive].base or adaptive == specs[fixed].base
        assert specs[adaptive].upload_shares == specs[fixed].upload_shares
        assert P.build_run_config(specs[adaptive], P.FULL, quick=False).fragments.adaptive
        assert not P.build_run_config(specs[fixed], P.FULL, quick=False).fragments.adaptive
    assert not [s for s in P.plan(["dense"], P.QUICK, quick=True) if s.regime.startswith("link_")]


def test_a_link_share_is_of_what_every_h_steps_in_the_run_codec_takes():
    cfg = P.build_run_config(spec("decoupled"), P.FULL, quick=False)
    # The dense GPT: 136,960 parameters in int8 (one byte each, a 4-byte scale per 64) over H = 24 one-second steps.
    assert cfg.compression.codec == "int8" and cfg.fragments.period == 24
    demand = upload_demand(cfg)
    assert 136_960 * (1 + 4 / 64) / 24 <= demand <= 136_960 * (1 + 4 / 64) / 24 + 29 * 4 / 24


def spec(regime: str) -> P.RunSpec:
    return next(s for s in P.plan(["dense"], P.FULL, quick=False) if s.regime == regime)


@pytest.mark.parametrize("adaptive, waited, lines", [
    (2.30, 30.0, [True, True]),  # lower where the fixed learners' queue grew: both lines pass
    (2.3114, 30.0, [True, False]),  # within 0.5% but not lower: the second line fails
    (2.32, 0.0, [False]),  # 0.9% worse, and the fixed queue never grew: one line
])
def test_an_adaptive_row_is_held_to_its_fixed_row(adaptive, waited, lines):
    fixed = row("link_thin_fixed", 2.30114, links={"dc-0": {"max_oldest_unsent_s": waited}}, base="decoupled")
    goals = R.adaptive_goals([fixed, row("link_thin_adaptive", adaptive, base="link_thin_fixed")])
    assert [g["pass"] for g in goals] == lines
    assert goals[0]["goal"] == "dense: link_thin_adaptive within 0.5% of link_thin_fixed's val loss"
    if len(lines) > 1:
        assert goals[1]["goal"].endswith("an increment waited 30 s, more than a send period of 24 s)")
