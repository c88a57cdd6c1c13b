"""Merge math and the outer optimizer on tiny literal tensors."""

from __future__ import annotations

import pytest
import torch

from ddiloco.synchronizer.merge import (
    GlobalFragment,
    Member,
    MergePolicy,
    flatten,
    merge_fragment,
    merge_vectors,
    norm_of,
    radial_directional_average,
    unflatten,
    weighted_mean,
)
from ddiloco.synchronizer.outer import momentum_from_blob, momentum_to_blob, outer_step


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


def test_flatten_roundtrip():
    t = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([7.0])}
    flat = flatten(t, ["b", "a"])
    assert flat.tolist() == [7.0, 0, 1, 2, 3, 4, 5]
    back = unflatten(flat, t, ["b", "a"])
    assert torch.equal(back["a"], t["a"]) and torch.equal(back["b"], t["b"])


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
