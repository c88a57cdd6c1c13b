from __future__ import annotations

import pytest
import torch

from ddiloco.platform.config import ModelConfig
from ddiloco.platform.fragments import (
    Fragment,
    due_fragments,
    imbalance,
    partition,
    partition_module,
)
from ddiloco.platform.models import build_model


def test_partition_literal_case() -> None:
    shapes = [("a", (10,), 4), ("b", (6,), 4), ("c", (5,), 4), ("d", (4,), 4), ("e", (3,), 4)]
    frags = partition(shapes, 2)
    # a(10) -> f0; b(6) -> f1; c(5) -> f1 (6 < 10); d(4) -> f0 (10 < 11); e(3) -> f1 (11 < 14)
    assert frags == [
        Fragment(index=0, names=("a", "d"), numel=14, nbytes=56),
        Fragment(index=1, names=("b", "c", "e"), numel=14, nbytes=56),
    ]
    assert imbalance(frags) == 1.0


def test_partition_keeps_model_order_and_uses_bytes_per_element() -> None:
    # z is last in the model but largest; names inside a fragment follow the model's order.
    shapes = [("x", (2, 2), 4), ("y", (8,), 2), ("z", (3, 3), 4)]
    frags = partition(shapes, 2)
    assert [f.names for f in frags] == [("z",), ("x", "y")]
    assert [f.nbytes for f in frags] == [36, 32]
    assert [f.numel for f in frags] == [9, 12]


def test_partition_ties_by_index_and_is_deterministic() -> None:
    shapes = [(f"t{i}", (4,), 4) for i in range(6)]
    a = partition(shapes, 3)
    assert [f.names for f in a] == [("t0", "t3"), ("t1", "t4"), ("t2", "t5")]
    assert a == partition(list(shapes), 3)


def test_partition_zero_sized_tensors_never_leave_a_fragment_empty() -> None:
    shapes = [("a", (0,), 4), ("b", (0,), 4), ("c", (0,), 4)]
    assert all(f.names for f in partition(shapes, 3))


def test_partition_count_errors() -> None:
    with pytest.raises(ValueError, match=r"fragments.count \(4\).*\(3\)"):
        partition([("a", (1,), 4), ("b", (1,), 4), ("c", (1,), 4)], 4)
    with pytest.raises(ValueError, match="fragments.count"):
        partition([("a", (1,), 4)], 0)
    with pytest.raises(ValueError, match="unique"):
        partition([("a", (1,), 4), ("a", (2,), 4)], 1)


def test_partition_single_fragment_holds_everything() -> None:
    model = build_model(ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=16))
    (frag,) = partition_module(model, 1)
    assert frag.names == tuple(n for n, _ in model.named_parameters())
    assert frag.numel == sum(p.numel() for p in model.parameters())


def test_partition_balance_on_default_gpt() -> None:
    model = build_model(ModelConfig())
    n = len(list(model.parameters()))
    for count in (4, 24):
        frags = partition_module(model, count)
        names = [name for f in frags for name in f.names]
        assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each exactly once
        assert all(f.names for f in frags)
        print(f"P={count}: {n} tensors, imbalance {imbalance(frags):.3f}")
    assert imbalance(partition_module(model, 4)) < 1.5
    # Whole tensors: with P = 24 the largest tensor bounds the imbalance; greedy reaches that bound.
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    frags = partition_module(model, 24)
    assert max(f.nbytes for f in frags) == largest


def test_partition_module_skips_frozen_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[0].bias.requires_grad_(False)
    names = [n for f in partition_module(model, 2) for n in f.names]
    assert sorted(names) == ["0.weight", "1.bias", "1.weight"]


@pytest.mark.parametrize(
    "count, every, expected",
    [
        # every == count: exactly one fragment per step, p = step mod count.
        (4, 4, {1: [1], 2: [2], 3: [3], 4: [0], 5: [1], 8: [0]}),
        # one fragment: fragment 0 every `every` steps.
        (1, 3, {1: [], 2: [], 3: [0], 6: [0], 7: []}),
        # every < count: several fragments per step.
        (4, 2, {1: [1, 3], 2: [0, 2], 3: [1, 3]}),
        # every > count: some steps send nothing.
        (2, 4, {1: [1], 2: [], 3: [], 4: [0], 5: [1]}),
    ],
)
def test_due_fragments_schedule(count: int, every: int, expected: dict[int, list[int]]) -> None:
    assert due_fragments(0, count, every) == []
    for step, due in expected.items():
        assert due_fragments(step, count, every) == due, step


def test_due_fragments_every_fragment_once_per_period() -> None:
    sent = [p for step in range(1, 25) for p in due_fragments(step, 24, 24)]
    assert sorted(sent) == list(range(24))
    with pytest.raises(ValueError):
        due_fragments(1, 0, 1)
