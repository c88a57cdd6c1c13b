"""Merge math and the outer optimizer on tiny literal tensors."""

from __future__ import annotations

import pytest
import torch

from ddiloco.synchronizer.merge import flatten, merge_vectors, radial_directional_average, unflatten, weighted_mean
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
