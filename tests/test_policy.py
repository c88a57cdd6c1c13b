"""The synchronizer's decisions with literal values; time moves by editing numbers."""

from __future__ import annotations

import ast
import inspect
import math
import textwrap

import pytest

from ddiloco.platform.config import MergeConfig
from ddiloco.synchronizer import policy as pol
from ddiloco.synchronizer.policy import PendingEntry as P


def test_quorum_size_count_and_fraction():
    assert pol.quorum_size(pol.QuorumPolicy(min_count=3), live_learners=8) == 3
    assert pol.quorum_size(pol.QuorumPolicy(min_count=None, min_fraction=0.5), live_learners=5) == 3
    assert pol.quorum_size(pol.QuorumPolicy(min_count=None, min_fraction=0.5), live_learners=4) == 2
    assert pol.quorum_size(pol.QuorumPolicy(min_count=None, min_fraction=0.25), live_learners=0) == 1


def test_waits_for_quorum_of_distinct_learners():
    pending = [P("a", 10.0), P("a", 11.0)]
    d = pol.decide_merge(12.0, pending, {"a", "b", "c"}, quorum=2, grace_s=1.0)
    assert not d.merge and d.reason == "waiting for quorum: 1/2 learners submitted"


def test_grace_window_waits_then_closes():
    pending = [P("a", 10.0), P("b", 10.5)]
    live = {"a", "b", "c"}
    early = pol.decide_merge(11.0, pending, live, quorum=2, grace_s=1.0)
    assert not early.merge
    assert early.quorum_reached_at == 10.5 and early.wait_until == 11.5
    assert "0.50s left" in early.reason
    late = pol.decide_merge(11.5, pending, live, quorum=2, grace_s=1.0)
    assert late.merge and late.reason.startswith("grace window of 1.00s closed with 2/3")


def test_closes_early_when_every_live_learner_submitted():
    d = pol.decide_merge(10.1, [P("a", 10.0), P("b", 10.0)], {"a", "b"}, quorum=1, grace_s=100.0)
    assert d.merge and d.reason == "every live learner submitted (2/2)"


def test_no_grace_merges_at_quorum():
    d = pol.decide_merge(10.0, [P("a", 10.0)], {"a", "b"}, quorum=1, grace_s=5.0, grace_enabled=False)
    assert d.merge and "no grace window" in d.reason


def test_grace_window_formula_and_clamps():
    policy = pol.GracePolicy(enabled=True, gamma=0.5, overlap_steps=2, min_s=0.0, max_s=10.0)
    stats = pol.TimingStats(step_s=3.0, quorum_s=1.0, sync_s=0.5)
    assert pol.grace_window(stats, policy) == pytest.approx(0.5 * (2 * 3.0 - 1.0 - 0.5))
    assert pol.grace_window(pol.TimingStats(step_s=100.0), policy) == 10.0
    assert pol.grace_window(pol.TimingStats(step_s=0.1, quorum_s=5.0), policy) == 0.0
    assert pol.grace_window(pol.TimingStats(), pol.GracePolicy(min_s=0.25)) == 0.25
    assert pol.grace_window(stats, pol.GracePolicy(enabled=False)) == 0.0


def test_moving_averages():
    s = pol.update_stats(pol.TimingStats(), 0.5, step_s=2.0)
    assert s.step_s == 2.0 and s.quorum_s is None
    s = pol.update_stats(s, 0.5, step_s=4.0, sync_s=1.0)
    assert s.step_s == 3.0 and s.sync_s == 1.0


def test_the_budget_ends_a_run_on_merged_tokens_with_its_reason():
    assert pol.budget_end(9_999, 10_000) is None
    assert pol.budget_end(10_000, 10_000) == "token budget reached: 10,000 tokens merged of 10,000"
    assert pol.budget_end(1_327_104, 1_000_000) == "token budget reached: 1,327,104 tokens merged of 1,000,000"


def test_token_weights_reward_quantity_and_quality():
    assert pol.token_weight(1000, 10) == 1000 * 100
    # Same tokens in fewer, larger steps weigh more.
    assert pol.token_weight(1000, 5) > pol.token_weight(1000, 10)
    assert pol.token_weight(1000, 10, "equal") == 1.0
    with pytest.raises(ValueError, match="merge.weighting"):
        pol.token_weight(1, 1, "median")


def test_validation_reasons():
    assert pol.check_staleness(10, 7, 4) is None
    assert pol.check_staleness(10, 5, 4) == "stale: based on v5, 5 versions behind v10 (max 4)"
    assert "newer than" in pol.check_staleness(3, 4, 4)
    assert pol.check_finite(math.nan) == "non-finite values (NaN or Inf) in the update"
    assert pol.check_finite(1.0) is None
    assert pol.check_norm(100.0, [1.0, 2.0], 10.0) is None  # too little history to judge
    assert pol.check_norm(19.0, [1.0, 2.0, 2.0, 2.0], 10.0) is None
    assert pol.check_norm(21.0, [1.0, 2.0, 2.0, 2.0], 10.0).startswith("norm outlier: 21 > 10 x recent max 2")
    assert pol.check_counts(0, 10) == "empty update: c_steps=0, c_tokens=10"


def test_participation_scale():
    assert pol.participation_scale(2, 4) == 0.5
    assert pol.participation_scale(5, 4) == 1.0
    assert pol.participation_scale(1, 0) == 1.0


def test_norm_outliers_are_judged_against_the_recent_maximum_as_the_config_says():
    # Median 1, maximum 5: 20 is 20x the median but only 4x the maximum, so it is kept.
    recent = [1.0, 1.0, 1.0, 5.0]
    assert pol.check_norm(20.0, recent, 10.0) is None
    assert pol.check_norm(51.0, recent, 10.0) is not None
    # The field's documentation names the same yardstick.
    doc = _attribute_doc(MergeConfig, "norm_outlier_factor")
    assert "median" not in doc and ("largest" in doc or "maximum" in doc), doc


def _attribute_doc(cls: type, name: str) -> str:
    """The docstring written under a class attribute (pydantic keeps none at run time)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for stmt, nxt in zip(body, body[1:], strict=False):
        if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", None) == name:
            return nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else ""
    raise AssertionError(f"{cls.__name__}.{name} not found")
