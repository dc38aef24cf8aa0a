"""Build a megatron-core GPTModel from a Hugging Face config with the local (non-TE) layer spec."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_mcore_utils.attention import SDPACoreAttention
from verl_mcore_utils.compat import hf_rope_parameters, with_mlp_class
from verl_mcore_utils.grouped_experts import use_grouped_experts
from verl_mcore_utils.moe import make_moe_portable
from verl_mcore_utils.moe_layers import add_expert_bias, cpu_expert_bias, mixed_block_spec, mixed_layers
from verl_mcore_utils.rope import make_rope_portable
from verl_mcore_utils.sp_norm import block_spec_with_final_norm, with_sequence_parallel_norms
from verl_mcore_utils.sp_portable import install_portable_sequence_parallel
from verl_mcore_utils.swiglu import FusedSwiGLUMLP
from verl_mcore_utils.transformer_config import hf_get

__all__ = ["build_gpt_model", "local_layer_spec", "rope_theta", "rotary_percent"]


def local_layer_spec(tf_config: TransformerConfig, *, core_attention: type = SDPACoreAttention) -> ModuleSpec:
    """megatron-core's local GPT layer spec with ``core_attention`` swapped in (no Transformer Engine).

    The MLP is :class:`verl_mcore_utils.swiglu.FusedSwiGLUMLP`: megatron-core's MLP whose gated SiLU runs
    as one Triton kernel on CUDA (megatron-core's own forward everywhere else). A config with experts
    (``num_moe_experts``) gets megatron-core's MoE layer instead: router + sequential expert MLPs, or with
    ``moe_grouped_gemm`` :class:`verl_mcore_utils.grouped_experts.GroupedExperts` (torch's grouped GEMM).
    With ``sequence_parallel`` the norms are :class:`verl_mcore_utils.sp_norm.SequenceParallelNorm` (megatron-core's
    torch norm asserts SP off); :func:`build_gpt_model` gives the block's final norm the same.
    """
    experts = tf_config.num_moe_experts
    spec = get_gpt_layer_local_spec(
        num_experts=experts,
        moe_grouped_gemm=False,
        normalization=tf_config.normalization,
        qk_layernorm=tf_config.qk_layernorm,
    )
    spec.submodules.self_attention.submodules.core_attention = core_attention
    if not experts:
        spec.submodules.mlp = with_mlp_class(spec.submodules.mlp, base=MLP, cls=FusedSwiGLUMLP)
    elif tf_config.moe_grouped_gemm:
        use_grouped_experts(spec)
    if tf_config.sequence_parallel:
        with_sequence_parallel_norms(spec)
    return spec


def rope_theta(hf_config: Mapping[str, Any] | Any) -> float:
    """RoPE base of ``hf_config``; scaled RoPE variants are refused rather than silently built unscaled."""
    rope = hf_rope_parameters(hf_config)
    if rope["rope_type"] != "default":
        raise ValueError(
            f"rope_type {rope['rope_type']!r} (rope scaling) is not supported by build_gpt_model yet; only plain RoPE"
        )
    return float(rope["rope_theta"])


def rotary_percent(hf_config: Mapping[str, Any] | Any) -> float:
    """The rotated fraction of each head (``partial_rotary_factor``: inside ``rope_parameters`` in transformers 5,
    top level in older configs; 1.0 when absent)."""
    value = hf_rope_parameters(hf_config).get(
        "partial_rotary_factor", hf_get(hf_config, "partial_rotary_factor")
    )
    return float(value or 1.0)


def build_gpt_model(
    *,
    hf_config: Mapping[str, Any] | Any,
    tf_config: TransformerConfig,
    device: torch.device | str,
    pre_process: bool = True,
    post_process: bool = True,
    layer_spec: ModuleSpec | None = None,
    vocab_size: int | None = None,
    vp_stage: int | None = None,
    position_embedding_type: str = "rope",
) -> GPTModel:
    """Build a GPTModel (one pipeline stage) for ``hf_config`` and move it to ``device``.

    Model-parallel state must be initialised first (see verl_mcore_utils.parallel). Weights stay
    in ``tf_config.params_dtype``; wrapping (Float16Module / DDP) is the caller's choice.
    ``position_embedding_type="none"`` is for layer specs whose core attention applies RoPE itself
    (verl-dyncp); the RoPE settings of ``hf_config`` are checked either way.
    """
    rope_theta(hf_config)  # scaled RoPE is refused before anything is built
    spec = layer_spec if layer_spec is not None else local_layer_spec(tf_config)
    if isinstance(spec, ModuleSpec) and mixed_layers(tf_config) is not None:  # dense first layers (GLM-4.5)
        spec = mixed_block_spec(tf_config, spec, vp_stage=vp_stage)
    if tf_config.sequence_parallel:
        if torch.device(device).type == "cpu":
            install_portable_sequence_parallel()  # megatron-core's SP collectives allocate on CUDA
        # the block's final norm: megatron-core's module-level torch norm otherwise
        spec = block_spec_with_final_norm(tf_config, spec, vp_stage=vp_stage)
    with cpu_expert_bias(tf_config, device):
        model = _gpt_model(
            hf_config=hf_config,
            tf_config=tf_config,
            spec=spec,
            vocab_size=vocab_size,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            position_embedding_type=position_embedding_type,
        )
    add_expert_bias(model, tf_config)
    make_rope_portable(model, device)
    make_moe_portable(model, device)
    return model.to(device)


def _gpt_model(
    *,
    hf_config: Mapping[str, Any] | Any,
    tf_config: TransformerConfig,
    spec: Any,
    vocab_size: int | None,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None,
    position_embedding_type: str,
) -> GPTModel:
    theta = rope_theta(hf_config)
    return GPTModel(
        config=tf_config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size if vocab_size is not None else hf_get(hf_config, "vocab_size"),
        max_sequence_length=hf_get(hf_config, "max_position_embeddings", 4096),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf_get(hf_config, "tie_word_embeddings", False)),
        position_embedding_type=position_embedding_type,
        rotary_base=theta,
        rotary_percent=rotary_percent(hf_config),
        vp_stage=vp_stage,
    )
