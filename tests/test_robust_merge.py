"""merge.robust: the coordinate-wise trimmed mean and median on tiny literal tensors, and in a fragment's merge."""

from __future__ import annotations

import pytest
import torch

from ddiloco.platform.config import ConfigError, build_config
from ddiloco.synchronizer.merge import (
    FlatDelta,
    FlatLayout,
    GlobalFragment,
    Member,
    MergePolicy,
    MergeWorkspace,
    merge_fragment,
    norm_of,
    opposed_learners,
    robust_terms,
    trim_count,
    trimmed_mean,
)

SGD = {"momentum": 0.0, "lr": 1.0, "participation_scaling": False}
"""Outer step new = params - grad: the merged outer gradient is minus the result."""


def member(submission: int, learner: str, w: list[float], c_steps: int = 1, c_tokens: int = 1) -> Member:
    delta = {"w": torch.tensor(w)}
    return Member(submission, learner, delta, norm_of(delta), c_steps, c_tokens, 0)


def flat_members(ws: MergeWorkspace, shapes: dict, members: list[Member]) -> list[Member]:
    """The same members decoded into the workspace's rows, as the synchronizer's fetch leaves them."""
    layout = FlatLayout.of(shapes)
    flat = []
    for m, row in zip(members, ws.rows(layout, len(members)), strict=True):
        for n, view in layout.views(row).items():
            view.copy_(m.delta[n])
        sq = torch.tensor([float(v.double().pow(2).sum()) for v in layout.views(row).values()], dtype=torch.float64)
        flat.append(Member(m.submission, m.learner, FlatDelta(layout, row, sq), m.norm, m.c_steps, m.c_tokens, m.base_version))
    return flat


def merged(members: list[Member], policy: MergePolicy, workspace: MergeWorkspace | None = None) -> torch.Tensor:
    current = GlobalFragment(0, {"w": torch.zeros(len(members[0].delta["w"]))}, None)
    return -merge_fragment(current, members, policy, live_learners=4, workspace=workspace).params["w"]


# --- the rule ------------------------------------------------------------------------------------


def test_trimmed_mean_drops_the_extremes_of_each_column():
    x = torch.tensor([[1.0, 5.0], [2.0, -9.0], [30.0, 6.0], [4.0, 7.0]])
    # Column 0 keeps 2 and 4 (drops 1 and 30); column 1 keeps 5 and 6 (drops -9 and 7).
    torch.testing.assert_close(trimmed_mean(x, x, torch.ones(4), 1), torch.tensor([3.0, 5.5]))
    # Survivors are averaged with their weights: column 0 is (1 * 2 + 3 * 4) / 4.
    torch.testing.assert_close(trimmed_mean(x, x, torch.tensor([1.0, 1.0, 1.0, 3.0]), 1), torch.tensor([3.5, 5.5]))
    assert torch.equal(trimmed_mean(x, x, torch.ones(4), 0), x.mean(0))


def test_a_weight_cannot_buy_an_extreme_value_out_of_the_trim():
    x = torch.tensor([[1.0], [2.0], [3.0], [-100.0]])
    out = trimmed_mean(x, x, torch.tensor([1.0, 1.0, 1.0, 1000.0]), 1)
    torch.testing.assert_close(out, torch.tensor([1.5]))


def test_rows_are_ranked_by_one_tensor_and_averaged_from_another():
    ranked = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[10.0], [20.0], [30.0]])
    torch.testing.assert_close(trimmed_mean(ranked, values, torch.ones(3), 1), torch.tensor([20.0]))


def test_ties_are_broken_by_row_order():
    x = torch.tensor([[1.0], [1.0], [1.0]])
    values = torch.tensor([[7.0], [8.0], [9.0]])
    assert trimmed_mean(x, values, torch.ones(3), 1).tolist() == [8.0]


def test_a_trim_that_leaves_nothing_is_refused():
    with pytest.raises(ValueError, match="cannot trim 2 of 4"):
        trimmed_mean(torch.zeros(4, 1), torch.zeros(4, 1), torch.ones(4), 2)


@pytest.mark.parametrize(("learners", "rule", "fraction", "want"), [
    (4, "none", 0.25, 0), (2, "trimmed_mean", 0.25, 0), (2, "median", 0.25, 0),
    (3, "trimmed_mean", 0.25, 1), (4, "trimmed_mean", 0.25, 1), (8, "trimmed_mean", 0.25, 2), (8, "trimmed_mean", 0.1, 1),
    (5, "trimmed_mean", 0.45, 2), (3, "median", 0.25, 1), (4, "median", 0.25, 1), (8, "median", 0.25, 3), (9, "median", 0.25, 4),
])
def test_trim_count(learners: int, rule: str, fraction: float, want: int):
    assert trim_count(learners, rule, fraction) == want


def test_robust_rda_terms_are_unit_scales_and_the_trimmed_mean_norm():
    scales, target = robust_terms([25.0, 25.0, 100.0, 2500.0], [1.0, 1.0, 1.0, 1.0], "rda", 1)
    assert scales == [0.2, 0.2, 0.1, 0.02]
    assert target == pytest.approx(7.5)  # norms 5, 5, 10, 50: drop 5 and 50
    assert robust_terms([4.0, 9.0, 1.0], [1.0, 1.0, 1.0], "mean", 1) == ([1.0, 1.0, 1.0], None)


# --- in a fragment's merge -----------------------------------------------------------------------


def test_the_median_drops_a_sign_flipping_learner():
    honest = [member(1, "a", [1.0, 2.0]), member(2, "b", [1.2, 1.8])]
    attacker = member(3, "c", [-3.3, -6.3])  # -3 x [1.1, 2.1]
    policy = MergePolicy(method="mean", weighting="equal", robust="median", **SGD)
    torch.testing.assert_close(merged([*honest, attacker], policy), torch.tensor([1.0, 1.8]))
    torch.testing.assert_close(merged([*honest, attacker], MergePolicy(method="mean", weighting="equal", **SGD)),
                               torch.tensor([-1.1 / 3, -2.5 / 3]))


def test_robust_rda_trims_the_attackers_row_and_norm():
    honest = [member(1, "a", [3.0, 4.0]), member(2, "b", [4.0, 3.0]), member(3, "c", [0.0, 5.0])]
    policy = MergePolicy(method="rda", weighting="equal", robust="trimmed_mean", trim_fraction=0.25, **SGD)
    # Column 0 keeps a and c (drops the attacker's -15 and b's 4): units 0.6, 0 -> 0.3; column 1 keeps
    # a and b (drops the attacker's 0 and c's 5): 0.8, 0.6 -> 0.7. Norm: 5, 5, 5, 15 -> drop 5 and 15 -> 5.
    want = 5 * torch.tensor([0.3, 0.7]) / 0.58**0.5
    for k in (3.0, 30.0):  # the attacker's size changes nothing: its row is trimmed in every coordinate
        out = merged([*honest, member(4, "d", [-5.0 * k, 0.0])], policy)
        torch.testing.assert_close(out, want)
    plain = merged([*honest, member(4, "d", [-15.0, 0.0])], MergePolicy(method="rda", weighting="equal", **SGD))
    # Without the trim the attacker pulls the direction to [0.1, 0.6] and stretches the step to 7.5.
    torch.testing.assert_close(plain, 7.5 * torch.tensor([0.1, 0.6]) / 0.37**0.5)


def test_a_learners_increments_are_summed_before_the_trim():
    members = [member(1, "a", [1.0, 0.0]), member(2, "a", [0.0, 2.0]), member(3, "b", [3.0, 3.0]), member(4, "c", [-1.0, 5.0])]
    policy = MergePolicy(method="mean", weighting="equal", robust="median", **SGD)
    # Learners a [1, 2], b [3, 3], c [-1, 5]: medians 1 and 3 (the four increments apart would give 0.5 and 2.5).
    torch.testing.assert_close(merged(members, policy), torch.tensor([1.0, 3.0]))


def test_token_weights_average_the_survivors():
    members = [member(1, "a", [1.0]), member(2, "b", [2.0], c_tokens=3), member(3, "c", [4.0], c_tokens=3), member(4, "d", [9.0])]
    policy = MergePolicy(method="mean", weighting="tokens", robust="trimmed_mean", **SGD)
    # w = c_tokens^2 / c_steps: b and c weigh 9 each, so the survivors' mean is 3; a and d are trimmed.
    torch.testing.assert_close(merged(members, policy), torch.tensor([3.0]))


def test_two_learners_fall_back_and_say_so():
    members = [member(1, "a", [1.0, 2.0]), member(2, "b", [-3.0, 0.5])]
    current = GlobalFragment(0, {"w": torch.zeros(2)}, None)
    plain = merge_fragment(current, members, MergePolicy(), live_learners=2)
    for clip, says in ((None, "no clipping (merge.clip_factor is off)"), (2.0, "clipped to 2x")):
        out = merge_fragment(current, members, MergePolicy(robust="median", clip_factor=clip), live_learners=2)
        assert torch.equal(out.params["w"], plain.params["w"]) and torch.equal(out.momentum["w"], plain.momentum["w"])
        robust = out.detail["robust"]
        assert (robust["rule"], robust["learners"], robust["trimmed_per_end"]) == ("median", 2, 0)
        assert "too few for median" in robust["fallback"] and says in robust["fallback"] and robust["applied"] is False
    assert "robust" not in plain.detail


def test_opposed_learners_are_dropped_one_at_a_time_while_their_mean_cosine_is_negative():
    cos = torch.tensor([[1.0, 0.5, 0.4, -0.9],
                        [0.5, 1.0, -0.2, -0.9],
                        [0.4, -0.2, 1.0, -0.6],
                        [-0.9, -0.9, -0.6, 1.0]])
    # Means with the rest: 0, -0.2, -0.133, -0.8: the last goes; without it 0.45, 0.15, 0.1: none more.
    dropped = opposed_learners(cos, 2)
    assert [i for i, _ in dropped] == [3] and dropped[0][1] == pytest.approx(-0.8)
    assert opposed_learners(cos, 0) == []
    honest = torch.tensor([[1.0, 0.1, 0.2], [0.1, 1.0, -0.05], [0.2, -0.05, 1.0]])
    assert opposed_learners(honest, 1) == []


def test_drop_opposed_merges_a_sign_flipping_learner_with_no_weight():
    honest = [member(1, "a", [3.0, 4.0]), member(2, "b", [4.0, 3.0]), member(3, "c", [0.0, 5.0])]
    attacker = member(4, "d", [-15.0, 0.0])  # cosines with a, b, c: -0.6, -0.8, 0
    policy = MergePolicy(method="rda", weighting="equal", robust="drop_opposed", **SGD)
    current = GlobalFragment(0, {"w": torch.zeros(2)}, None)
    out = merge_fragment(current, [*honest, attacker], policy, live_learners=4)
    # RDA of the honest three: units [0.6, 0.8], [0.8, 0.6], [0, 1] -> direction [1.4, 2.4], norm 5.
    torch.testing.assert_close(-out.params["w"], 5 * torch.tensor([1.4, 2.4]) / (1.4**2 + 2.4**2) ** 0.5)
    assert out.detail["robust"] == {"rule": "drop_opposed", "learners": 4, "applied": True,
                                    "dropped": [{"learner": "d", "mean_cosine": round(-1.4 / 3, 4)}]}
    assert [m["weight"] for m in out.detail["members"]] == [1.0, 1.0, 1.0, 0.0]
    # Of three learners, one opposed to both others still goes; all honest, nobody does, and the merge is RDA's own.
    three = merge_fragment(current, [*honest[:2], attacker], policy, live_learners=3)
    assert [d["learner"] for d in three.detail["robust"]["dropped"]] == ["d"]
    alone = merge_fragment(current, honest, policy, live_learners=3)
    assert alone.detail["robust"]["dropped"] == []
    assert torch.equal(alone.params["w"], merge_fragment(current, honest, MergePolicy(method="rda", weighting="equal", **SGD),
                                                         live_learners=3).params["w"])


def reference(members: list[Member], current: GlobalFragment, policy: MergePolicy) -> dict[str, torch.Tensor]:
    """The robust merge written out on whole float64 vectors: per group, sum each learner's increments,
    rank raw values, average RDA units (or raw values for the plain-mean tensors) of the survivors with
    token weights, stretch to the trimmed mean of the norms, then SGD with lr 1."""
    names = list(current.params)
    sums: dict[str, torch.Tensor] = {}
    tokens: dict[str, list[int]] = {}
    for m in members:
        flat = torch.cat([m.delta[n].double().reshape(-1) for n in names])
        sums[m.learner] = sums.get(m.learner, torch.zeros_like(flat)) + flat
        c = tokens.setdefault(m.learner, [0, 0])
        c[0], c[1] = c[0] + m.c_tokens, c[1] + m.c_steps
    w = torch.tensor([t * t / s for t, s in tokens.values()], dtype=torch.float64)
    x = torch.stack(list(sums.values()))
    trim = trim_count(len(sums), policy.robust, policy.trim_fraction)
    sizes = [current.params[n].numel() for n in names]
    out, off = {}, 0
    for n, k in zip(names, sizes, strict=True):
        out[n] = slice(off, off + k)
        off += k
    embed = [n for n in names if "embed" in n]
    rest = [n for n in names if n not in embed]
    grad = torch.zeros(off, dtype=torch.float64)
    for n in embed:
        grad[out[n]] = trimmed_mean(x[:, out[n]], x[:, out[n]], w, trim)
    cols = torch.cat([torch.arange(off)[out[n]] for n in rest])
    xr = x[:, cols]
    norms = xr.norm(dim=1)
    d = trimmed_mean(xr, xr / norms[:, None], w, trim)
    grad[cols] = d / d.norm() * trimmed_mean(norms[:, None], norms[:, None], w, trim)[0]
    return {n: current.params[n].double() - grad[out[n]].view(current.params[n].shape) for n in names}


@pytest.mark.parametrize(("rule", "chunk", "learners"), [
    ("trimmed_mean", 4, "abacde"), ("median", 4, "abacde"), ("median", None, "abcd"), ("trimmed_mean", 5, "aabbcc")])
def test_flat_robust_engine_matches_the_float64_reference(rule: str, chunk: int | None, learners: str) -> None:
    g = torch.Generator().manual_seed(3)
    shapes = {"tok_embed.weight": (5, 3), "mlp.weight": (4, 6), "mlp.bias": (7,)}
    current = GlobalFragment(2, {n: torch.randn(s, generator=g) for n, s in shapes.items()}, None)
    members = []
    for i, lid in enumerate(learners):
        delta = {n: torch.randn(s, generator=g) * (i + 1) for n, s in shapes.items()}
        members.append(Member(i, lid, delta, norm_of(delta), 2 + i, 64 * (3 + i), 2))
    policy = MergePolicy(robust=rule, trim_fraction=0.3, **SGD)
    want = reference(members, current, policy)
    ws = MergeWorkspace("cpu")
    ws.chunk = chunk  # 4 or 5: several chunks per tensor, some ending mid-tensor; None: whole tensors, as on a GPU
    flat = flat_members(ws, shapes, members)
    for ms in (members, flat):
        out = merge_fragment(current, ms, policy, live_learners=len(set(learners)), workspace=ws)
        for n in want:
            torch.testing.assert_close(out.params[n].double(), want[n], rtol=1e-5, atol=1e-6)
        assert out.detail["robust"]["trimmed_per_end"] == trim_count(len(set(learners)), rule, 0.3)


def test_the_config_validates_the_option():
    cfg = build_config({"merge": {"robust": "trimmed_mean", "trim_fraction": 0.2}})
    policy = MergePolicy.from_config(cfg)
    assert (policy.robust, policy.trim_fraction) == ("trimmed_mean", 0.2)
    assert MergePolicy.from_config(build_config({})).robust == "none"
    assert MergePolicy.from_config(build_config({"merge": {"robust": "drop_opposed"}})).robust == "drop_opposed"
    with pytest.raises(ConfigError, match="merge.robust"):
        build_config({"merge": {"robust": "krum"}})
    with pytest.raises(ConfigError, match="merge.trim_fraction"):
        build_config({"merge": {"trim_fraction": 0.5}})


@pytest.mark.parametrize("chunk", [4, None])
def test_drop_opposed_on_flat_rows_equals_the_merge_without_the_attacker(chunk: int | None) -> None:
    g = torch.Generator().manual_seed(5)
    shapes = {"tok_embed.weight": (5, 3), "mlp.weight": (4, 6)}
    common = {n: torch.randn(s, generator=g) for n, s in shapes.items()}  # what every honest learner learned, plus noise
    current = GlobalFragment(1, {n: torch.randn(s, generator=g) for n, s in shapes.items()}, None)
    members = []
    for i, lid in enumerate("abcad"):
        delta = {n: common[n] + 0.3 * torch.randn(s, generator=g) for n, s in shapes.items()}
        if lid == "d":
            delta = {n: -3 * t for n, t in delta.items()}
        members.append(Member(i, lid, delta, norm_of(delta), 2, 64, 1))
    ws = MergeWorkspace("cpu")
    ws.chunk = chunk
    flat = flat_members(ws, shapes, members)
    out = merge_fragment(current, flat, MergePolicy(robust="drop_opposed", **SGD), live_learners=4, workspace=ws)
    assert [d["learner"] for d in out.detail["robust"]["dropped"]] == ["d"]
    want = merge_fragment(current, members[:4], MergePolicy(**SGD), live_learners=4)
    for n in shapes:
        torch.testing.assert_close(out.params[n], want.params[n])
