"""``model.kind: torchtitan``: torchtitan's Llama 3 decoder (torchtitan 0.3), built on CPU from ``model.titan_args``.

torchtitan's language-model attention backends are flex, flex_flash and varlen: FlexAttention has
no backward on CPU and varlen calls CUDA's flash-attention kernel, so the adapter puts torchtitan's
own ``ScaledDotProductAttention`` (causal, RoPE at default positions) in every layer. Importing
``torchtitan.models`` needs ``triton`` (a module-level import of its expert-parallel kernels) even
on CPU; the error says so when it is missing."""

from __future__ import annotations

from typing import Any

from torch import nn

from ddiloco.platform.config import ConfigError, ModelConfig

TITAN_DEFAULTS: dict[str, Any] = {
    "dim": 128,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": None,
    "multiple_of": 64,
    "ffn_dim_multiplier": None,
    "rope_theta": 500000.0,
    "enable_weight_tying": False,
}
"""``model.titan_args`` keys and their defaults; vocab_size and the RoPE length come from model.vocab_size and model.seq_len."""


def _import_titan() -> Any:
    try:
        import torchtitan.models.llama3 as llama3
    except ImportError as err:
        raise ConfigError(f"model.kind 'torchtitan' needs torchtitan's llama3 model, which does not import here: {err}") from None
    return llama3


def titan_config(cfg: ModelConfig) -> Any:
    """torchtitan's ``Llama3Model.Config`` for ``cfg`` (SDPA attention, torchtitan's own initialisers)."""
    unknown = sorted(set(cfg.titan_args) - set(TITAN_DEFAULTS))
    if unknown:
        raise ConfigError(f"model.titan_args: unknown keys {unknown}; known: {sorted(TITAN_DEFAULTS)}")
    a = {**TITAN_DEFAULTS, **cfg.titan_args}
    if a["dim"] % a["n_heads"]:
        raise ConfigError(f"model.titan_args: dim ({a['dim']}) must be divisible by n_heads ({a['n_heads']})")
    llama3 = _import_titan()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, vocab = a["dim"], cfg.vocab_size
    # The same private layer builder torchtitan's own flavours (debugmodel, 1B, 8B, …) use.
    layers = llama3._build_llama3_layers(
        n_layers=a["n_layers"],
        dim=dim,
        n_heads=a["n_heads"],
        n_kv_heads=a["n_kv_heads"],
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=a["multiple_of"], ffn_dim_multiplier=a["ffn_dim_multiplier"]),
        rope=ComplexRoPE.Config(dim=dim // a["n_heads"], max_seq_len=cfg.seq_len, theta=a["rope_theta"], scaling="none"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=a["enable_weight_tying"],
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=layers,
    )


def build_titan(cfg: ModelConfig) -> nn.Module:
    """torchtitan's Llama 3, its parameters initialised by torchtitan (the caller seeds torch's RNG)."""
    model = titan_config(cfg).build()
    # The buffers go where the parameters are: on the meta device when only its shapes are wanted (FLOP counts).
    model.init_states(buffer_device=next(model.parameters()).device)
    return model
