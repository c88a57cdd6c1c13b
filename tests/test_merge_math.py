"""Merge math and the outer optimizer on tiny literal tensors."""

from __future__ import annotations

import pytest
import torch

from ddiloco.platform.config import RunConfig
from ddiloco.synchronizer.merge import (
    FlatDelta,
    FlatLayout,
    GlobalFragment,
    Member,
    MergePolicy,
    MergeWorkspace,
    merge_fragment,
    merge_vectors,
    norm_of,
    radial_directional_average,
    weighted_mean,
)
from ddiloco.synchronizer.outer import async_momentum, momentum_from_blob, momentum_to_blob, outer_step


def test_weighted_mean():
    out = weighted_mean([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])], [3.0, 1.0])
    torch.testing.assert_close(out, torch.tensor([0.75, 0.75]))


def test_rda_keeps_the_norm_of_orthogonal_updates():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    rda = radial_directional_average([a, b], [1.0, 1.0])
    mean = weighted_mean([a, b], [1.0, 1.0])
    assert float(torch.linalg.vector_norm(rda)) == pytest.approx(2.0)
    assert float(torch.linalg.vector_norm(mean)) == pytest.approx(2.0 / 2**0.5)
    torch.testing.assert_close(rda / rda.norm(), mean / mean.norm())


def test_rda_weights_norm_and_direction():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 4.0])
    rda = radial_directional_average([a, b], [3.0, 1.0])
    assert float(rda.norm()) == pytest.approx(0.75 * 1 + 0.25 * 4)
    direction = torch.tensor([0.75, 0.25]) / torch.tensor([0.75, 0.25]).norm()
    torch.testing.assert_close(rda / rda.norm(), direction)


def test_rda_of_one_update_is_the_update_and_zero_is_safe():
    v = torch.tensor([3.0, -4.0])
    torch.testing.assert_close(radial_directional_average([v], [2.0]), v)
    assert torch.equal(radial_directional_average([torch.zeros(2)], [1.0]), torch.zeros(2))


def test_bad_weights_and_method_are_refused():
    with pytest.raises(ValueError, match="not all zero"):
        weighted_mean([torch.ones(2)], [0.0])
    with pytest.raises(ValueError, match="merge.method"):
        merge_vectors([torch.ones(2)], [1.0], "median")


def test_flat_layout_puts_tensors_back_to_back():
    layout = FlatLayout.of({"b": (1,), "a": (2, 3)})
    assert layout.offsets == (0, 1, 7) and layout.numel == 7
    views = layout.views(torch.tensor([7.0, 0, 1, 2, 3, 4, 5]))
    assert views["b"].tolist() == [7.0] and views["a"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_outer_step_is_torch_nesterov_and_resumes_exactly():
    params = {"w": torch.tensor([1.0, 2.0])}
    grads = [torch.tensor([0.5, -1.0]), torch.tensor([0.1, 0.2]), torch.tensor([-0.3, 0.0])]
    # Reference: torch's SGD on one parameter, three steps in one optimizer.
    p = torch.nn.Parameter(params["w"].clone())
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    # Ours: each step from persisted state, as a restarted synchronizer would.
    state, momentum = params, None
    for g in grads:
        state, momentum = outer_step(state, {"w": g}, momentum, lr=0.7, beta=0.9)
        momentum = momentum_from_blob(momentum_to_blob(momentum))
    torch.testing.assert_close(state["w"], p.detach())
    assert params["w"].tolist() == [1.0, 2.0], "inputs must not be modified"


def test_outer_step_without_momentum_is_plain_sgd():
    new, mom = outer_step({"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}, None, lr=0.5, beta=0.0)
    assert new["w"].item() == 0.0 and mom == {}
    assert momentum_from_blob({}) is None


# --- RDA when directions cancel -------------------------------------------------------------------


def test_rda_of_opposite_updates_is_zero():
    v = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    rda = radial_directional_average([v, -v], [1.0, 1.0])
    assert float(rda.norm()) <= 1e-6 * float(v.norm())


def test_rda_of_directions_cancelling_up_to_rounding_is_zero():
    # Three unit vectors 120 degrees apart: their float32 sum is rounding, not a direction.
    s = 3**0.5 / 2
    vectors = [torch.tensor([2.0, 0.0]), torch.tensor([-1.0, 2 * s]), torch.tensor([-1.0, -2 * s])]
    rda = radial_directional_average(vectors, [1.0, 1.0, 1.0])
    assert float(rda.norm()) <= 1e-6 * 2.0


def test_rda_of_unequal_opposite_weights_keeps_the_heavier_direction():
    v = torch.tensor([0.0, 3.0, 4.0])
    rda = radial_directional_average([v, -v], [3.0, 1.0])
    torch.testing.assert_close(rda, v)


# --- merge_fragment: one fragment's whole merge ---------------------------------------------------


def member(submission: int, learner: str, delta: dict[str, torch.Tensor], c_steps: int = 1, c_tokens: int = 1,
           base_version: int = 0) -> Member:
    return Member(submission, learner, delta, norm_of(delta), c_steps, c_tokens, base_version)


SGD = {"momentum": 0.0, "lr": 1.0}
"""Outer step new = params - grad: the merged outer gradient can be read off the result."""


def test_merge_fragment_matches_synchronous_diloco():
    # Reference, written from the DiLoCo paper: outer gradient = global - local, averaged over
    # replicas, one torch Nesterov SGD step per round with the momentum carried over.
    rounds = [
        [torch.tensor([0.9, 2.2, -0.5]), torch.tensor([1.1, 1.8, -0.3]), torch.tensor([1.0, 2.1, -0.8])],
        [torch.tensor([0.2, 1.0, 0.0]), torch.tensor([0.4, 1.3, -0.2]), torch.tensor([0.1, 1.1, 0.3])],
    ]
    for m in (1, 3):
        g = torch.nn.Parameter(torch.tensor([1.0, 2.0, -0.6]))
        opt = torch.optim.SGD([g], lr=0.7, momentum=0.9, nesterov=True)
        current = GlobalFragment(0, {"w": g.detach().clone()}, None)
        policy = MergePolicy(method="mean", weighting="equal", lr=0.7, momentum=0.9)
        for r, locals_ in enumerate(rounds):
            g.grad = torch.stack([g.detach() - local for local in locals_[:m]]).mean(0)
            opt.step()
            members = [member(r * 10 + i, f"l{i}", {"w": current.params["w"] - local}, base_version=r)
                       for i, local in enumerate(locals_[:m])]
            out = merge_fragment(current, members, policy, live_learners=m)
            current = GlobalFragment(out.version, out.params, out.momentum)
            torch.testing.assert_close(current.params["w"], g.detach())
        assert current.version == len(rounds)


def test_an_outer_warm_up_is_torch_nesterov_under_a_linear_lr_ramp_per_fragment_version():
    # Reference: torch's SGD with LinearLR from 1/3 to 1 over 3 steps, the ramp outer.warmup_versions = 3 names.
    g = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.SGD([g], lr=0.7, momentum=0.9, nesterov=True)
    ramp = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / 3, total_iters=2)
    policy = MergePolicy.from_config(RunConfig.model_validate({"outer": {"lr": 0.7, "warmup_versions": 3},
                                                               "merge": {"method": "mean", "weighting": "equal"}}))
    assert policy.warmup == 3
    current = GlobalFragment(0, {"w": g.detach().clone()}, None)
    lrs = []
    for r in range(5):
        delta = torch.tensor([0.3, 0.1 * r - 0.2])
        g.grad = delta.clone()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        ramp.step()
        out = merge_fragment(current, [member(r, "a", {"w": delta}, base_version=r)], policy, live_learners=1)
        assert out.detail.get("outer_lr", policy.lr) == pytest.approx(lrs[-1])
        current = GlobalFragment(out.version, out.params, out.momentum)
        torch.testing.assert_close(current.params["w"], g.detach())
    assert lrs == pytest.approx([0.7 / 3, 1.4 / 3, 0.7, 0.7, 0.7])
    # Past the ramp a merge records no lr of its own; without one every step is at the full lr.
    assert "outer_lr" not in out.detail
    assert MergePolicy.from_config(RunConfig()).warmup == 0


def test_async_momentum_counts_periods_as_outer_steps_and_takes_away_what_staleness_adds_past_one_period():
    assert async_momentum(0.9, 1, 0) == pytest.approx(0.9)
    assert async_momentum(0.9, 0.5, 0) == pytest.approx(0.9)  # an update shorter than a period is one outer step
    assert async_momentum(0.9, 3, 0) == pytest.approx(0.9**3)
    # One period, however stale: an increment re-applies nothing, so the momentum is the configured one.
    assert async_momentum(0.9, 1, 1) == async_momentum(0.9, 1, 7) == 0.9
    assert async_momentum(0.9, 2, 1) == pytest.approx(0.81 - 0.5)
    assert async_momentum(0.9, 2, 3) == pytest.approx(0.81 - 0.75)
    assert async_momentum(0.9, 4, 3) == 0.0  # never negative
    assert async_momentum(0.0, 1, 0) == 0.0


def test_async_momentum_steps_a_slow_stale_learners_merge_with_less_momentum_and_leaves_one_period_alone():
    def policy_for(adjust: str) -> MergePolicy:
        return MergePolicy.from_config(RunConfig.model_validate(
            {"outer": {"lr": 0.5, "momentum": 0.9, "momentum_adjust": adjust}, "fragments": {"count": 4},
             "merge": {"method": "mean", "weighting": "equal"}}))
    fixed, adjusted = policy_for("none"), policy_for("async")
    assert (fixed.momentum_adjust, adjusted.momentum_adjust, adjusted.period) == ("none", "async", 4)
    m0 = {"w": torch.tensor([0.2, -0.4])}
    current = GlobalFragment(5, {"w": torch.tensor([1.0, 2.0])}, m0)
    delta = {"w": torch.tensor([0.3, 0.1])}

    # One period, fresh or a version behind: the same step with either policy, and no momentum recorded.
    for base in (5, 4):
        fresh = [member(1, "a", delta, c_steps=4, c_tokens=64, base_version=base)]
        a, b = (merge_fragment(current, fresh, p, live_learners=1) for p in (fixed, adjusted))
        torch.testing.assert_close(a.params["w"], b.params["w"])
        torch.testing.assert_close(a.momentum["w"], b.momentum["w"])
        assert "outer_momentum" not in b.detail

    # Two periods, one version behind: momentum 0.9 ** 2 - 1 / 2, as torch's Nesterov SGD takes it.
    slow = [member(2, "a", delta, c_steps=8, c_tokens=128, base_version=4)]
    out = merge_fragment(current, slow, adjusted, live_learners=1)
    beta = 0.9**2 - 0.5
    assert out.detail["outer_momentum"] == pytest.approx(beta)
    want, want_m = outer_step(current.params, delta, m0, lr=0.5, beta=beta)
    torch.testing.assert_close(out.params["w"], want["w"])
    torch.testing.assert_close(out.momentum["w"], want_m["w"])

    # Two periods, five versions behind: 0.81 - 5 / 6 < 0, so no momentum at all: a plain step, and the buffer is the
    # outer gradient (beta * m + g at beta 0).
    stale = [member(3, "a", delta, c_steps=8, c_tokens=128, base_version=0)]
    out = merge_fragment(current, stale, adjusted, live_learners=1)
    assert out.detail["outer_momentum"] == 0.0
    torch.testing.assert_close(out.params["w"], current.params["w"] - 0.5 * delta["w"])
    torch.testing.assert_close(out.momentum["w"], delta["w"])


def test_merge_fragment_sums_increments_then_weights_learners_by_tokens():
    current = GlobalFragment(5, {"w": torch.zeros(2)}, None)
    members = [
        # Learner a sent twice: 2 + 2 steps of 10 tokens each, increments adding to [4, 0].
        member(1, "a", {"w": torch.tensor([1.0, 0.0])}, c_steps=2, c_tokens=20, base_version=4),
        member(2, "a", {"w": torch.tensor([3.0, 0.0])}, c_steps=2, c_tokens=20, base_version=5),
        # Learner b: 2 steps of 10 tokens, [0, 8].
        member(3, "b", {"w": torch.tensor([0.0, 8.0])}, c_steps=2, c_tokens=20, base_version=5),
    ]
    out = merge_fragment(current, members, MergePolicy(method="mean", **SGD), live_learners=2)
    # w = c_tokens^2 / c_steps: a 40^2/4 = 400, b 20^2/2 = 200.
    torch.testing.assert_close(out.params["w"], -(torch.tensor([4.0, 0.0]) * 2 / 3 + torch.tensor([0.0, 8.0]) / 3))
    assert out.version == 6
    assert [(m["submission"], m["weight"], m["staleness"]) for m in out.detail["members"]] == [(1, 400.0, 1), (2, 400.0, 0), (3, 200.0, 0)]
    assert out.detail["learners"] == 2 and out.detail["base_version"] == 5


def test_merge_fragment_scales_by_participation():
    current = GlobalFragment(0, {"w": torch.zeros(2)}, None)
    members = [member(1, "a", {"w": torch.tensor([2.0, 4.0])})]
    scaled = merge_fragment(current, members, MergePolicy(method="mean", **SGD), live_learners=4)
    assert scaled.detail["participation_scale"] == 0.25
    torch.testing.assert_close(scaled.params["w"], torch.tensor([-0.5, -1.0]))
    unscaled = merge_fragment(current, members, MergePolicy(method="mean", participation_scaling=False, **SGD), live_learners=4)
    torch.testing.assert_close(unscaled.params["w"], torch.tensor([-2.0, -4.0]))


def test_plain_mean_is_chosen_per_tensor_not_per_fragment():
    current = GlobalFragment(0, {"tok_embed.weight": torch.zeros(2), "mlp.weight": torch.zeros(2)}, None)
    members = [
        member(1, "a", {"tok_embed.weight": torch.tensor([2.0, 0.0]), "mlp.weight": torch.tensor([2.0, 0.0])}),
        member(2, "b", {"tok_embed.weight": torch.tensor([0.0, 2.0]), "mlp.weight": torch.tensor([0.0, 2.0])}),
    ]
    out = merge_fragment(current, members, MergePolicy(method="rda", weighting="equal", plain_mean=("embed",), **SGD), live_learners=2)
    # The embedding: plain mean of orthogonal updates, [1, 1]. The rest of the fragment: RDA keeps the
    # norm 2 in the mean direction, [sqrt 2, sqrt 2].
    torch.testing.assert_close(out.params["tok_embed.weight"], torch.tensor([-1.0, -1.0]))
    torch.testing.assert_close(out.params["mlp.weight"], -torch.full((2,), 2**0.5))
    assert out.detail["method"] == "rda" and out.detail["plain_mean_tensors"] == ["tok_embed.weight"]


def test_merge_fragment_leaves_its_inputs_alone():
    current = GlobalFragment(0, {"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([0.25, 0.25])})
    delta = {"w": torch.tensor([0.5, -0.5])}
    merge_fragment(current, [member(1, "a", delta), member(2, "a", delta)], MergePolicy(), live_learners=1)
    assert current.params["w"].tolist() == [1.0, 1.0] and current.momentum["w"].tolist() == [0.25, 0.25]
    assert delta["w"].tolist() == [0.5, -0.5]


def test_merge_fragment_needs_a_member():
    with pytest.raises(ValueError, match="at least one member"):
        merge_fragment(GlobalFragment(0, {"w": torch.zeros(1)}, None), [], MergePolicy(), live_learners=1)


# --- the flat engine: rows in a reused workspace, against an independent float64 reference ----------


def reference_merge(current: GlobalFragment, members: list[Member], policy: MergePolicy, live: int) -> dict[str, torch.Tensor]:
    """The method written out in float64 from the design: sum each learner's increments, token weights,
    RDA per group (plain-mean tensors apart), participation scale, one torch Nesterov SGD step at the merge's
    momentum (outer.momentum_adjust)."""
    names = list(current.params)
    sums: dict[str, dict[str, torch.Tensor]] = {}
    counts: dict[str, list[int]] = {}
    for m in members:
        delta = m.delta if isinstance(m.delta, dict) else m.delta.layout.views(m.delta.row)
        acc = sums.setdefault(m.learner, {n: torch.zeros(current.params[n].shape, dtype=torch.float64) for n in names})
        for n in names:
            acc[n] += delta[n].double()
        c = counts.setdefault(m.learner, [0, 0])
        c[0], c[1] = c[0] + m.c_tokens, c[1] + m.c_steps
    w = torch.tensor([tok * tok / steps for tok, steps in counts.values()], dtype=torch.float64)
    w = w / w.sum()
    mean = [n for n in names if policy.method == "mean" or "embed" in n]
    grad = {}
    for group, rda in ((mean, False), ([n for n in names if n not in mean], True)):
        if not group:
            continue
        vecs = [torch.cat([s[n].reshape(-1) for n in group]) for s in sums.values()]
        if rda:
            norms = [float(v.norm()) for v in vecs]
            d = sum(wi * v / nv for wi, v, nv in zip(w, vecs, norms, strict=True))
            merged = d / d.norm() * sum(float(wi) * nv for wi, nv in zip(w, norms, strict=True))
        else:
            merged = sum(wi * v for wi, v in zip(w, vecs, strict=True))
        merged = merged * min(1.0, len(sums) / live)
        off = 0
        for n in group:
            k = current.params[n].numel()
            grad[n] = merged[off : off + k].view(current.params[n].shape)
            off += k
    beta = policy.momentum
    periods = sum(tok * steps for tok, steps in counts.values()) / sum(tok for tok, _ in counts.values()) / policy.period
    if policy.momentum_adjust == "async" and beta > 0 and periods > 1:  # steps uncapped here (max_steps None)
        stale = sum(m.c_tokens * (current.version - m.base_version) for m in members) / sum(m.c_tokens for m in members)
        beta = max(0.0, beta**periods - stale / (1 + stale))
    leaves = [torch.nn.Parameter(current.params[n].double().clone()) for n in names]
    opt = torch.optim.SGD(leaves, lr=policy.lr, momentum=beta, nesterov=beta > 0)
    for n, p in zip(names, leaves, strict=True):
        p.grad = grad[n].clone()
        if current.momentum is not None:
            opt.state[p]["momentum_buffer"] = current.momentum[n].double().clone()
    opt.step()
    return {n: p.detach() for n, p in zip(names, leaves, strict=True)}


def random_fragment(seed: int = 0, learners: tuple[str, ...] = ("a", "b", "a", "c", "d")) -> tuple[GlobalFragment, list[Member]]:
    """Three tensors (one a plain-mean embedding), momentum, and one member per entry of ``learners``
    (by default four learners, of which one sent twice)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"tok_embed.weight": (5, 3), "mlp.weight": (4, 6), "mlp.bias": (7,)}
    current = GlobalFragment(3, {n: torch.randn(s, generator=g) for n, s in shapes.items()},
                             {n: torch.randn(s, generator=g) * 0.1 for n, s in shapes.items()})
    members = [member(i, lid, {n: torch.randn(s, generator=g) * (i + 1) for n, s in shapes.items()},
                      c_steps=2 + i, c_tokens=64 * (3 + i), base_version=3) for i, lid in enumerate(learners)]
    return current, members


def as_rows(members: list[Member], layout: FlatLayout, rows: torch.Tensor) -> list[Member]:
    """The members decoded into ``rows`` as the synchronizer does (FlatDelta with per-tensor squared norms)."""
    out = []
    for m, row in zip(members, rows, strict=True):
        for n, view in layout.views(row).items():
            view.copy_(m.delta[n])
        sq = torch.tensor([float(v.double().pow(2).sum()) for v in layout.views(row).values()], dtype=torch.float64)
        out.append(Member(m.submission, m.learner, FlatDelta(layout, row, sq), m.norm, m.c_steps, m.c_tokens, m.base_version))
    return out


@pytest.mark.parametrize(("method", "chunk", "learners"), [
    ("rda", 4, "abacd"), ("mean", 4, "abacd"), ("rda", None, "abacd"), ("rda", 4, "aabaa"), ("mean", None, "aabaa")])
def test_flat_engine_matches_the_float64_reference(method: str, chunk: int | None, learners: str) -> None:
    current, members = random_fragment(learners=tuple(learners))
    policy = MergePolicy(method=method, lr=0.7, momentum=0.9)
    want = reference_merge(current, members, policy, live=5)
    ws = MergeWorkspace("cpu")
    ws.chunk = chunk  # 4: several chunks per tensor, one ending mid-tensor; None: whole tensors, as on a GPU
    layout = FlatLayout.of({n: tuple(t.shape) for n, t in current.params.items()})
    for ms in (members, as_rows(members, layout, ws.rows(layout, len(members)))):
        out = merge_fragment(current, ms, policy, live_learners=5, workspace=ws)
        for n in want:
            torch.testing.assert_close(out.params[n].double(), want[n], rtol=1e-5, atol=1e-6)
    assert [m["learner"] for m in out.detail["members"]] == sorted(learners, key=learners.index)


def test_rows_with_a_gap_are_gathered_not_misread() -> None:
    current, members = random_fragment(1)
    policy = MergePolicy(lr=0.7, momentum=0.9)
    layout = FlatLayout.of({n: tuple(t.shape) for n, t in current.params.items()})
    ws = MergeWorkspace("cpu")
    rows = ws.rows(layout, len(members) + 1)
    rows[1].fill_(float("nan"))  # a rejected submission's row, skipped by the members
    flat = as_rows(members[:1], layout, rows[:1]) + as_rows(members[1:], layout, rows[2:])
    out = merge_fragment(current, flat, policy, live_learners=5, workspace=ws)
    want = reference_merge(current, members, policy, live=5)
    for n in want:
        torch.testing.assert_close(out.params[n].double(), want[n], rtol=1e-5, atol=1e-6)


def test_a_kept_workspace_reuses_its_buffers_and_leaves_inputs_alone() -> None:
    current, members = random_fragment(2)
    policy = MergePolicy(lr=0.7, momentum=0.9)
    layout = FlatLayout.of({n: tuple(t.shape) for n, t in current.params.items()})
    ws = MergeWorkspace("cpu")
    rows = ws.rows(layout, len(members))
    flat = as_rows(members, layout, rows)
    before = {n: t.clone() for n, t in current.params.items()}
    rows_before = rows.clone()
    first = merge_fragment(current, flat, policy, live_learners=5, workspace=ws)
    second_current = GlobalFragment(first.version, first.params, first.momentum)
    second = merge_fragment(second_current, flat, policy, live_learners=5, workspace=ws)
    # Inputs untouched: the current version, the members' rows, and a version used as input.
    assert all(torch.equal(current.params[n], before[n]) for n in before)
    assert torch.equal(rows, rows_before)
    assert not any(first.params[n].data_ptr() == second.params[n].data_ptr() for n in first.params)
    # Once the owner drops the first version, the third merge writes into its buffers: no new allocation.
    used = {first.params["mlp.weight"].untyped_storage().data_ptr(), first.momentum["mlp.weight"].untyped_storage().data_ptr()}
    ws.recycle(second_current)
    third = merge_fragment(GlobalFragment(second.version, second.params, second.momentum), flat, policy, live_learners=5, workspace=ws)
    assert {third.params["mlp.weight"].untyped_storage().data_ptr(), third.momentum["mlp.weight"].untyped_storage().data_ptr()} == used
    assert ws.rows(layout, len(members)).data_ptr() == rows.data_ptr()
    assert ws._gather.numel() == 0, "the decoded rows were copied instead of used where they lie"
    ws.recycle(current)  # not from the workspace: left alone
    assert torch.equal(current.params["mlp.weight"], before["mlp.weight"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_merge_runs_on_cuda_and_agrees_with_the_cpu() -> None:
    from ddiloco.platform.compression import decode_delta, decode_delta_into, encode_delta

    current, members = random_fragment(3)
    policy = MergePolicy(lr=0.7, momentum=0.9)
    layout = FlatLayout.of({n: tuple(t.shape) for n, t in current.params.items()})
    sent = [encode_delta(m.delta, codec, block_size=4) for m, codec in zip(members, ["int8", "int4", "bf16", "none", "int8"], strict=True)]
    on_cpu = [member(m.submission, m.learner, decode_delta(*blob), m.c_steps, m.c_tokens, 3) for m, blob in zip(members, sent, strict=True)]
    cpu = merge_fragment(current, on_cpu, policy, live_learners=5, workspace=MergeWorkspace("cpu"))
    ws = MergeWorkspace("cuda")
    assert MergeWorkspace("auto").device.type == "cuda"
    rows = ws.rows(layout, len(members))
    flat = []
    for m, row, blob in zip(members, rows, sent, strict=True):
        sq = decode_delta_into(*blob, layout.items(), row)
        flat.append(Member(m.submission, m.learner, FlatDelta(layout, row, sq), m.norm, m.c_steps, m.c_tokens, m.base_version))
    gpu = merge_fragment(current, flat, policy, live_learners=5, workspace=ws)
    assert ws._gather.numel() == 0, "the decoded rows were copied instead of used where they lie"
    for n in cpu.params:
        assert gpu.params[n].device.type == "cuda"
        torch.testing.assert_close(gpu.params[n].cpu(), cpu.params[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gpu.momentum[n].cpu(), cpu.momentum[n], rtol=1e-5, atol=1e-6)


def test_a_backlog_burst_does_not_pin_its_rows_forever() -> None:
    from ddiloco.synchronizer.merge import SHRINK_AFTER

    layout = FlatLayout.of({"w": (10,)})
    ws = MergeWorkspace("cpu")
    burst = ws.rows(layout, 100)
    steady = ws.rows(layout, 4)
    assert steady.data_ptr() == burst.data_ptr()  # smaller requests reuse the buffer...
    for _ in range(SHRINK_AFTER):
        steady = ws.rows(layout, 4)
    assert steady.data_ptr() != burst.data_ptr()  # ...until the burst has clearly passed
    kept = ws.rows(layout, 8).data_ptr()
    for count in [4, 8] * SHRINK_AFTER:  # sizes that merely alternate keep one buffer
        assert ws.rows(layout, count).data_ptr() == kept


def test_the_synchronizer_merges_into_recycled_buffers() -> None:
    from support import sim_run

    from ddiloco.inprocess import sim_learner, sim_step

    cfg, clock, ctx, sync = sim_run(name="recycle", fragments={"count": 1}, quorum={"min_count": 1}, grace={"enabled": False},
                                    learners={"regions": [{"name": "us", "learners": 1}], "heartbeat_s": 1.0})
    learner = sim_learner(ctx, "us-0")
    learner.start(clock.t)
    bases = []  # held, so a fresh allocation can never come back at the same address
    for _ in range(8):
        clock.t += 1.0
        sim_step(learner, clock.t)
        sync.poll_once(clock.t)
        bases.append(next(iter(sync.state[0].params.values()))._base)
    assert sync.state[0].version >= 6
    # Versions after the first few are written into buffers of versions the synchronizer replaced.
    assert any(b is not None and any(b is earlier for earlier in bases[:i]) for i, b in enumerate(bases))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_merges_on_cuda_without_a_gpu_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="merges on cuda need a CUDA device, and torch sees none"):
        MergeWorkspace("cuda")
    assert MergeWorkspace("auto").device.type == "cpu"
