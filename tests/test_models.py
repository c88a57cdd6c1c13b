from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddiloco.platform.config import DataConfig, ModelConfig
from ddiloco.platform.data import Batch, build_dataset
from ddiloco.platform.models import build_model, compute_loss, evaluate

TINY_GPT = dict(n_layer=1, d_model=32, n_head=2, seq_len=32)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny models: intra-op threads only add contention (and slow down badly on a busy machine).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _bytes_batch(cfg: ModelConfig, b: int = 3, seed: int = 0) -> Batch:
    x = torch.randint(0, 256, (b, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return Batch(inputs=x[:, :-1], targets=x[:, 1:], tokens=b * cfg.seq_len)


def test_gpt_forward_shapes_and_parameter_names() -> None:
    cfg = ModelConfig(**TINY_GPT)
    model = build_model(cfg)
    logits = model(torch.zeros(3, 20, dtype=torch.long))
    assert logits.shape == (3, 20, 256)
    names = [n for n, _ in model.named_parameters()]
    assert "tok_embed.weight" in names and "pos_embed.weight" in names and "lm_head.weight" in names
    # Untied: every parameter is a distinct tensor.
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert len(set(ptrs)) == len(ptrs)


def test_gpt_rejects_sequences_longer_than_seq_len() -> None:
    model = build_model(ModelConfig(**TINY_GPT))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_build_is_deterministic_and_does_not_touch_global_rng() -> None:
    cfg = ModelConfig(**TINY_GPT)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    assert torch.equal(torch.rand(1), expected_next)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["tok_embed.weight"], sc["tok_embed.weight"])


def test_gpt_is_causal() -> None:
    cfg = ModelConfig(**TINY_GPT)
    model = build_model(cfg).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10] = (x[0, 10] + 1) % 256
    with torch.no_grad():
        la, lb = model(x), model(y)
    assert torch.allclose(la[0, :10], lb[0, :10], atol=1e-6)
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_gpt_trains_on_stdlib_bytes() -> None:
    cfg = ModelConfig(**TINY_GPT)
    ds = build_dataset(DataConfig(max_bytes=200_000), cfg)
    model = build_model(cfg)
    val = ds.val_batches(16)
    before, acc = evaluate(model, val)
    assert acc is None
    assert before == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = ds.train_batches(0, 1, 16, seed=0)
    for _ in range(50):
        loss, info = compute_loss(model, next(batches))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after, _ = evaluate(model, val)
    assert set(info) == {"loss"}
    assert after < before - 1.5, (before, after)


def test_moe_aux_loss_and_router_gradients() -> None:
    cfg = ModelConfig(kind="moe_gpt", n_experts=4, top_k=2, aux_loss_coef=0.5, **TINY_GPT)
    model = build_model(cfg)
    batch = _bytes_batch(cfg)
    total, info = compute_loss(model, batch)
    assert set(info) == {"loss", "aux"}
    # n_experts * sum(f_i * P_i) is 1.0 at perfect balance and never below 0.
    assert info["aux"] > 0
    assert total.item() == pytest.approx(info["loss"] + 0.5 * info["aux"], rel=1e-5)
    total.backward()
    for block in model.blocks:
        grad = block.mlp.router.weight.grad
        assert grad is not None and grad.abs().sum() > 0
    expert_grads = [e.fc.weight.grad for e in model.blocks[0].mlp.experts]
    assert any(g is not None and g.abs().sum() > 0 for g in expert_grads)


def test_moe_aux_loss_literal_case() -> None:
    from ddiloco.platform.models.moe import MoEMLP

    mlp = MoEMLP(d_model=8, n_experts=2, top_k=1, dropout=0.0)
    with torch.no_grad():
        mlp.router.weight.zero_()  # uniform probabilities 0.5 / 0.5; top-1 picks expert 0 for all
    mlp(torch.randn(5, 8))
    # f = (1, 0), P = (0.5, 0.5): 2 * (1 * 0.5) = 1.0
    assert mlp.aux_loss.item() == pytest.approx(1.0)


def test_moe_top1_router_gets_gradient_without_aux() -> None:
    cfg = ModelConfig(kind="moe_gpt", n_experts=2, top_k=1, aux_loss_coef=0.0, **TINY_GPT)
    model = build_model(cfg)
    loss, _ = compute_loss(model, _bytes_batch(cfg))
    loss.backward()
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0


def test_vision_trains_above_chance() -> None:
    cfg = ModelConfig(kind="vision")
    ds = build_dataset(DataConfig(source="digits"), cfg)
    model = build_model(cfg)
    x = torch.zeros(2, 1, 8, 8)
    assert model(x).shape == (2, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = ds.train_batches(0, 1, 32, seed=0)
    for _ in range(60):
        loss, _ = compute_loss(model, next(batches))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.train()
    val_loss, acc = evaluate(model, ds.val_batches(32))
    assert model.training  # restored
    assert acc is not None and acc > 0.6, acc
    assert val_loss < 1.5


def test_import_model_from_tests_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    cfg = ModelConfig(kind="import", import_path="fixtures_models:tiny_mlp", kwargs={"in_features": 5, "out_features": 2})
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    batch = Batch(inputs=torch.randn(4, 5), targets=torch.tensor([0, 1, 1, 0]), tokens=4)
    loss, info = compute_loss(a, batch)
    loss.backward()
    assert set(info) == {"loss"}
    val_loss, acc = evaluate(a, [batch])
    assert val_loss == pytest.approx(info["loss"], rel=1e-5)
    assert acc is not None and 0.0 <= acc <= 1.0


def test_import_model_stdlib_path_with_dotted_attribute() -> None:
    model = build_model(ModelConfig(kind="import", import_path="torch.nn:Identity"))
    assert isinstance(model, torch.nn.Identity)


@pytest.mark.parametrize(
    "path, match",
    [
        ("no_such_module_xyz:factory", "cannot import"),
        ("torch.nn:NoSuchFactory", "has no attribute"),
        ("fixtures_models:not_a_module", "not a torch.nn.Module"),
    ],
)
def test_import_model_errors_name_the_field(monkeypatch: pytest.MonkeyPatch, path: str, match: str) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(ValueError, match=match) as err:
        build_model(ModelConfig(kind="import", import_path=path))
    assert "model.import_path" in str(err.value)


def test_import_model_bad_kwargs() -> None:
    cfg = ModelConfig(kind="import", import_path="torch.nn:Linear", kwargs={"bogus": 1})
    with pytest.raises(ValueError, match="model.kwargs"):
        build_model(cfg)


def test_model_own_compute_loss_is_used() -> None:
    class Own(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(2.0))

        def compute_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            loss = self.w * batch.inputs.sum()
            return loss, {"loss": loss.item() if not loss.requires_grad else float(loss.detach())}

    batch = Batch(inputs=torch.ones(3), targets=torch.zeros(3), tokens=3)
    loss, info = compute_loss(Own(), batch)
    assert loss.item() == 6.0 and info == {"loss": 6.0}
    assert evaluate(Own(), [batch]) == (6.0, None)


def test_evaluate_weights_by_tokens_and_restores_mode() -> None:
    class Fixed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x  # the inputs are the logits

    # Batch 1: CE log(2) over 1 example; batch 2: CE ~0 over 3 examples.
    b1 = Batch(inputs=torch.zeros(1, 2), targets=torch.tensor([0]), tokens=1)
    b2 = Batch(inputs=torch.tensor([[100.0, 0.0]] * 3), targets=torch.tensor([0, 0, 0]), tokens=3)
    model = Fixed().eval()
    loss, acc = evaluate(model, [b1, b2])
    assert loss == pytest.approx(torch.log(torch.tensor(2.0)).item() / 4, rel=1e-5)
    assert acc == 1.0  # argmax of a tie picks class 0
    assert not model.training
