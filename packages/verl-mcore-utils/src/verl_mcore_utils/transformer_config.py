"""Hugging Face config -> megatron-core TransformerConfig: dense Qwen2 / Qwen3 / Llama, Qwen3-MoE and GLM-4.5 (MoE)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "MOE_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "hf_get",
    "hf_mtp_num_layers",
    "hf_num_experts",
    "hf_to_transformer_config",
]

#: Mixture-of-experts architectures: megatron-core MoE layers (router + sequential experts) on the local spec.
MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe")
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", *MOE_MODEL_TYPES)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_get(hf_config: Mapping[str, Any] | Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a config.json-style mapping or a transformers PretrainedConfig."""
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def hf_num_experts(hf_config: Mapping[str, Any] | Any) -> int:
    """Routed experts per MoE layer (0 for a dense model).

    Qwen3-MoE checkpoints name it ``num_experts``; transformers 5 writes ``num_local_experts`` (its attribute
    map's name) when it saves one; DeepSeek-V3 / GLM-4.5 name it ``n_routed_experts``.
    """
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf_get(hf_config, key, None):
            return int(hf_get(hf_config, key))
    return 0


def hf_mtp_num_layers(hf_config: Mapping[str, Any] | Any) -> int:
    """Multi-token-prediction layers a Hugging Face config declares (0 when none).

    DeepSeek-V3 / MiMo / GLM name them ``num_nextn_predict_layers``, Qwen3-Next ``mtp_num_hidden_layers``.
    """
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        value = hf_get(hf_config, key)
        if value:
            return int(value)
    return 0


def hf_to_transformer_config(
    hf_config: Mapping[str, Any] | Any,
    *,
    dtype: str = "bfloat16",
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    sequence_parallel: bool = False,
    use_cpu_initialization: bool = True,
    overrides: Mapping[str, Any] | None = None,
) -> TransformerConfig:
    """Build the TransformerConfig of a dense decoder described by a Hugging Face config.

    All fused kernels that need Transformer Engine or apex are switched off, so the result runs with
    megatron-core's local layer spec on CPU and CUDA. ``overrides`` are TransformerConfig fields set
    last (verl's override_transformer_config); an unknown field is an error listing the valid ones.
    """
    model_type = hf_get(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = hf_get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; dense Qwen2/Qwen3/Llama use 'silu' (SwiGLU)")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    moe = (
        _moe_fields(hf_config, tensor_model_parallel_size, sequence_parallel=sequence_parallel)
        if model_type == "qwen3_moe"
        else {}
    )
    if model_type == "glm4_moe":  # DeepSeek-V3's router and shared experts
        from verl_mcore_utils.moe_glm import glm4_moe_fields

        moe = glm4_moe_fields(hf_config, experts=hf_num_experts(hf_config))
    dispatcher = "alltoall" if not moe or torch.cuda.is_available() else "allgather"
    kwargs: dict[str, Any] = {
        **_model_fields(hf_config, model_type),
        **moe,
        # Fusions that need TE / apex / custom CUDA kernels: off, so CPU and plain CUDA both work.
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "params_dtype": _DTYPES[dtype],
        # megatron-core refuses pipeline parallelism without the dtype of the tensors sent between stages
        "pipeline_dtype": _DTYPES[dtype],
        "bf16": dtype == "bfloat16",
        "fp16": dtype == "float16",
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": virtual_pipeline_model_parallel_size,
        # stages exchange activations of any length (packed micro-batches differ): shapes travel first. Only
        # megatron-core's schedules read it (p2p shape exchange); a model on a host without CUDA runs the
        # engine's own CPU pipeline, which always sends shapes, so there it stays off for MoE models:
        # megatron-core refuses it with the allgather dispatcher those models get (see below).
        "variable_seq_lengths": pipeline_model_parallel_size > 1 and dispatcher == "alltoall",
        # megatron-core refuses variable_seq_lengths with the default allgather MoE dispatcher even for dense
        # models (0.19); alltoall is what verl sets too. An MoE model on a host without CUDA gets allgather:
        # megatron-core's alltoall dispatcher creates a CUDA stream when it is built.
        "moe_token_dispatcher_type": dispatcher,
        "context_parallel_size": context_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
        "expert_tensor_parallel_size": expert_tensor_parallel_size,
        "sequence_parallel": sequence_parallel,
        "use_cpu_initialization": use_cpu_initialization,
    }
    kwargs.update(_checked_overrides(overrides or {}))
    return TransformerConfig(**kwargs)


def _model_fields(hf_config: Mapping[str, Any] | Any, model_type: str) -> dict[str, Any]:
    """The TransformerConfig fields that describe the architecture of the Hugging Face config."""
    hidden = hf_get(hf_config, "hidden_size")
    heads = hf_get(hf_config, "num_attention_heads")
    head_dim = hf_get(hf_config, "head_dim") or hidden // heads
    attention_bias = bool(hf_get(hf_config, "attention_bias", False))
    return {
        "num_layers": hf_get(hf_config, "num_hidden_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": hf_get(hf_config, "intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": hf_get(hf_config, "num_key_value_heads", heads),
        "kv_channels": head_dim,
        "layernorm_epsilon": hf_get(hf_config, "rms_norm_eps", 1e-6),
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": model_type == "qwen2" or attention_bias,
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe") or bool(hf_get(hf_config, "use_qk_norm", False)),
        "attention_dropout": float(hf_get(hf_config, "attention_dropout", 0.0) or 0.0),
        "hidden_dropout": 0.0,
        "init_method_std": hf_get(hf_config, "initializer_range", 0.02),
    }


def _moe_fields(
    hf_config: Mapping[str, Any] | Any, tensor_model_parallel_size: int, *, sequence_parallel: bool
) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config.

    Routing: Qwen3-MoE takes the softmax over all experts, keeps the top k and, with ``norm_topk_prob``,
    renormalises them; a softmax over the top-k logits is the same thing, which is megatron-core's
    ``moe_router_pre_softmax=False``; without renormalisation it is ``pre_softmax=True``. The load-balancing
    loss is the Switch-style aux loss with ``router_aux_loss_coef``. Experts are grouped (``moe_grouped_gemm``,
    on as in verl's Qwen3-MoE config): :class:`verl_mcore_utils.grouped_experts.GroupedExperts` with torch's
    grouped GEMM (no Transformer Engine); ``moe_grouped_gemm=False`` gives megatron-core's sequential MLPs.
    """
    sparse_step = hf_get(hf_config, "decoder_sparse_step", 1)
    dense_layers = list(hf_get(hf_config, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense_layers:
        raise ValueError(
            f"qwen3_moe with dense layers (decoder_sparse_step={sparse_step}, mlp_only_layers={dense_layers}) is"
            " not supported: every decoder layer must be an MoE layer (decoder_sparse_step=1, mlp_only_layers=[])"
        )
    if tensor_model_parallel_size != 1 and not sequence_parallel:  # megatron-core's rule (it asserts it)
        raise ValueError(
            f"tensor_model_parallel_size={tensor_model_parallel_size} with the mixture-of-experts model"
            f" {hf_get(hf_config, 'model_type')!r} needs sequence_parallel=True (megatron-core routes each TP"
            " rank's sequence shard); set megatron.sequence_parallel=true or tensor_model_parallel_size=1"
        )
    return {
        "num_moe_experts": hf_num_experts(hf_config),
        "moe_ffn_hidden_size": int(hf_get(hf_config, "moe_intermediate_size")),
        "moe_router_topk": int(hf_get(hf_config, "num_experts_per_tok")),
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not bool(hf_get(hf_config, "norm_topk_prob", False)),
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf_get(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        "moe_grouped_gemm": True,
    }


def _checked_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """User overrides of TransformerConfig fields; an unknown field is an error listing the valid ones."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in TransformerConfig.__dataclass_fields__:
            valid = ", ".join(sorted(TransformerConfig.__dataclass_fields__))
            raise ValueError(
                f"override_transformer_config key {key!r} is not a TransformerConfig field; valid: {valid}"
            )
        if key == "attention_backend" and isinstance(value, str):
            value = _attention_backend(value)
        out[key] = value
    return out


def _attention_backend(name: str) -> Any:
    """verl configs write attention_backend as a string ("flash"); megatron-core wants its AttnBackend enum.

    With our local layer spec the core attention is chosen by the spec, so the value only matters for
    Transformer Engine specs; an unknown name is still an error rather than a silently ignored string.
    """
    from megatron.core.transformer.enums import AttnBackend

    try:
        return AttnBackend[name]
    except KeyError:
        raise ValueError(
            f"override_transformer_config.attention_backend {name!r} is not one of {', '.join(b.name for b in AttnBackend)}"
        ) from None
