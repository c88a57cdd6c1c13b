"""model.kind hf (transformers causal LMs) and torchtitan: built from config, trained, evaluated, fragmented."""

from __future__ import annotations

import pytest
import torch
from support import TINY_LLAMA, upload

from ddiloco.platform.config import ConfigError, ModelConfig, build_config
from ddiloco.platform.data import Batch
from ddiloco.platform.fragments import partition_module
from ddiloco.platform.models import build_model, compute_loss, evaluate
from ddiloco.platform.models.weights import INDEX_FILE, WEIGHTS_FILE, load_weights, read_weights
from ddiloco.synchronizer.evaluation import load_params

pytest.importorskip("transformers")



def tiny(**over) -> ModelConfig:
    return ModelConfig(kind="hf", hf_config=dict(TINY_LLAMA), vocab_size=256, seq_len=32, **over)


def batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, 256, (4, 33), generator=g)
    return Batch(inputs=window[:, :-1], targets=window[:, 1:], tokens=4 * 32)


def test_hf_model_is_seeded_and_its_loss_is_next_token_cross_entropy():
    a, b, c = build_model(tiny(), seed=1), build_model(tiny(), seed=1), build_model(tiny(), seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    x = batch()
    loss, info = compute_loss(a, x)
    logits = a(x.inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x.targets.reshape(-1))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert info["loss"] == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()
    assert a.model.embed_tokens.weight.grad is not None
    val, acc = evaluate(a, [x, batch(1)])
    assert acc is None and 5.0 < val < 6.0  # about log(256) at initialisation


def test_tied_embeddings_are_one_tensor_in_one_fragment_and_stay_tied_after_loading():
    model = build_model(tiny(), seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    fragments = partition_module(model, 4)
    assert sum("model.embed_tokens.weight" in f.names for f in fragments) == 1
    other = build_model(tiny(), seed=7)
    load_params(model, dict(other.named_parameters()))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, other.model.embed_tokens.weight)


def test_vocabulary_and_context_must_agree_with_the_hf_config():
    with pytest.raises(ConfigError, match=r"model.vocab_size \(256\) differs from the Hugging Face config's vocab_size \(32000\)"):
        build_config({"model": {"kind": "hf", "hf_config": {**TINY_LLAMA, "vocab_size": 32000}}})
    with pytest.raises(ConfigError, match=r"model.seq_len \(128\) exceeds the Hugging Face config's max_position_embeddings \(64\)"):
        build_config({"model": {"kind": "hf", "hf_config": TINY_LLAMA}})
    with pytest.raises(ConfigError, match="exactly one of model.hf_config and model.hf_path"):
        build_config({"model": {"kind": "hf"}})
    with pytest.raises(ConfigError, match="needs a model_type"):
        build_config({"model": {"kind": "hf", "hf_config": {"hidden_size": 32}}})


def test_hf_path_builds_the_saved_architecture_and_checks_it(tmp_path):
    saved = build_model(tiny(), seed=0)
    saved.save_pretrained(tmp_path / "llama")
    rebuilt = build_model(ModelConfig(kind="hf", hf_path=str(tmp_path / "llama"), vocab_size=256, seq_len=32), seed=0)
    assert [(n, p.shape) for n, p in rebuilt.named_parameters()] == [(n, p.shape) for n, p in saved.named_parameters()]
    with pytest.raises(ConfigError, match=r"model.vocab_size \(512\) differs"):
        build_model(ModelConfig(kind="hf", hf_path=str(tmp_path / "llama"), vocab_size=512, seq_len=32))
    with pytest.raises(ConfigError, match="no config.json there"):
        build_model(ModelConfig(kind="hf", hf_path=str(tmp_path / "nowhere"), seq_len=32))


def test_hf_path_and_init_from_read_a_save_pretrained_folder_at_any_url(store_url, tmp_path):
    saved = build_model(tiny(), seed=0)
    saved.save_pretrained(tmp_path / "llama", max_shard_size="20KB")  # sharded: model.safetensors.index.json and its shards
    assert (tmp_path / "llama" / INDEX_FILE).is_file() and not (tmp_path / "llama" / WEIGHTS_FILE).exists()
    url = upload(tmp_path / "llama", f"{store_url}/llama")
    cfg = ModelConfig(kind="hf", hf_path=url, init_from=url, vocab_size=256, seq_len=32)
    rebuilt = load_weights(build_model(cfg, seed=1), read_weights(cfg.init_from or ""), "model.init_from")
    assert [(n, p.shape) for n, p in rebuilt.named_parameters()] == [(n, p.shape) for n, p in saved.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.parameters(), saved.parameters(), strict=True))
    with pytest.raises(ConfigError, match=r"model.vocab_size \(512\) differs"):
        build_model(ModelConfig(kind="hf", hf_path=url, vocab_size=512, seq_len=32))
    with pytest.raises(ConfigError, match="no config.json there"):
        build_model(ModelConfig(kind="hf", hf_path=f"{store_url}/nowhere", seq_len=32))


def _titan_or_skip() -> None:
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as err:
        pytest.skip(f"torchtitan's llama3 does not import here: {err}")


def test_torchtitan_llama_trains_on_cpu_and_is_seeded():
    _titan_or_skip()
    cfg = ModelConfig(kind="torchtitan", titan_args={"dim": 32, "n_layers": 2, "n_heads": 4, "multiple_of": 32}, vocab_size=256, seq_len=32)
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    x = batch()
    loss, _ = compute_loss(a, x)
    loss.backward()
    assert all(p.grad is not None for p in a.parameters())
    # Causal: changing the last input token leaves every earlier position's logits alone.
    changed = x.inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(a(x.inputs)[:, :-1], a(changed)[:, :-1])
    assert 5.0 < evaluate(a, [x])[0] < 6.5
    with pytest.raises(ConfigError, match="unknown keys"):
        build_model(ModelConfig(kind="torchtitan", titan_args={"hidden": 3}))
