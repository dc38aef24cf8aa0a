"""Tiny Qwen2-architecture Hugging Face configs, built locally (no download).

Each preset is a ``config.json``-style dict that ``transformers.Qwen2Config(**preset)`` accepts and that
:func:`verl_mcore_utils.transformer_config.hf_to_transformer_config` reads directly, so the engine
does not need transformers installed to build a model. All keep the Qwen2 traits: RMSNorm, SwiGLU,
RoPE, grouped-query attention and biases on the QKV projection only.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["PRESETS", "qwen2_preset"]

_SIZES: dict[str, dict[str, int]] = {
    # name: hidden, layers, heads, kv heads, ffn
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 192,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 704,
    },
    "base": {
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 2816,
    },
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 5504,
    },
}

PRESETS: tuple[str, ...] = tuple(_SIZES)


def qwen2_preset(name: str, *, vocab_size: int = 151936, **overrides: Any) -> dict[str, Any]:
    """Return the Hugging Face config dict of preset ``name`` with ``overrides`` applied."""
    if name not in _SIZES:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    config: dict[str, Any] = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "torch_dtype": "float32",
        **copy.deepcopy(_SIZES[name]),
    }
    unknown = set(overrides) - set(config) - {"head_dim"}
    if unknown:
        raise ValueError(f"unknown Qwen2 config key(s) {sorted(unknown)}; valid: {sorted(config)}")
    config.update(overrides)
    return config
