"""Tiny Hugging Face checkpoints with random weights, saved by transformers, for parity tests.

Parity tests compare a megatron-core model against the Hugging Face implementation of the same
checkpoint; they need small models of each supported architecture (Qwen2: QKV bias; Qwen3: QK
layernorm, explicit head_dim; Llama: no biases) that exercise grouped-query attention and, on
request, tied embeddings. Nothing is downloaded: configs are built here and weights are random
(seeded), written with ``save_pretrained`` as safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TINY_ARCHS", "save_tiny_hf_model", "tiny_hf_config"]

TINY_ARCHS: tuple[str, ...] = ("qwen2", "qwen3", "llama", "qwen3_moe", "glm4_moe")


def tiny_hf_config(model_type: str, *, tie_word_embeddings: bool = False, **overrides: Any) -> Any:
    """A transformers config of ``model_type`` with 2 layers, hidden 64, 4 query / 2 KV heads."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }
    cls: type[transformers.PretrainedConfig]
    if model_type == "qwen2":
        cls = transformers.Qwen2Config
    elif model_type == "qwen3":
        cls = transformers.Qwen3Config
        common["head_dim"] = 24  # != hidden / heads, as in real Qwen3 models
    elif model_type == "llama":
        cls = transformers.LlamaConfig
    elif model_type == "qwen3_moe":  # 4 experts of width 48, top 2, QK layernorm like Qwen3
        cls = transformers.Qwen3MoeConfig
        common.update(head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    elif model_type == "glm4_moe":  # DeepSeek-V3 router: 8 experts in 2 groups, 1 group chosen, top 2
        cls = transformers.Glm4MoeConfig
        common.update(
            num_hidden_layers=3,
            head_dim=24,
            partial_rotary_factor=0.5,
            attention_bias=True,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=0,  # transformers' model has no MTP layers
        )
    else:
        raise ValueError(
            f"model_type {model_type!r} has no tiny config; choose one of {', '.join(TINY_ARCHS)}"
        )
    common.update(overrides)
    return cls(**common)


def save_tiny_hf_model(
    model_type: str, path: str | Path, *, tie_word_embeddings: bool = False, seed: int = 0, **overrides: Any
) -> Path:
    """Save a randomly initialised tiny ``model_type`` causal LM (fp32 safetensors) to ``path``.

    Weights are drawn with a larger std than the default init so that every layer changes the
    logits measurably (a mapping bug cannot hide behind near-zero weights).
    """
    import torch
    import transformers

    config = tiny_hf_config(model_type, tie_word_embeddings=tie_word_embeddings, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                # an MoE router: logits far apart, so no top-k choice is a near tie that rounding could flip
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith(
                "e_score_correction_bias"
            ):  # DeepSeek-V3 / GLM expert bias: non-zero, so it matters
                buffer.copy_(0.3 * torch.randn_like(buffer))
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path
