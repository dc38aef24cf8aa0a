"""GLM-4.5 (``glm4_moe``): DeepSeek-V3's router and shared experts on ordinary GQA attention.

transformers' ``Glm4MoeTopkRouter`` is DeepSeek-V3's: sigmoid scores, an expert bias
(``e_score_correction_bias``) added for the choice only, group-limited top-k (``n_group`` groups, the
``topk_group`` best by the sum of their two best biased scores), the chosen unbiased scores renormalised
(``norm_topk_prob``) and multiplied by ``routed_scaling_factor``. megatron-core's sigmoid routing
(``topk_routing_with_score_function``) does the same with ``moe_router_enable_expert_bias``,
``moe_router_num_groups`` / ``moe_router_group_topk`` and ``moe_router_topk_scaling_factor``, with two
differences refused here by name: it always renormalises a top-k > 1 (and never a top-1), and it ranks a group
by its best ``topk / group_topk`` scores where transformers takes the best 2. The shared experts
(``n_shared_experts`` x ``moe_intermediate_size`` wide, no gate) are megatron-core's ``SharedExpertMLP``; the
first ``first_k_dense_replace`` layers are dense (``moe_layer_freq``). Partial RoPE (``partial_rotary_factor``)
is the model's ``rotary_percent`` (:func:`verl_mcore_utils.model.rotary_percent`).

The expert bias is not trained by gradients: megatron-core moves it after each optimizer step by
``moe_router_bias_update_rate`` x sign(mean load - load) (``get_updated_expert_bias``). verl 0.9.1's DeepSeek-V3
converter sets that rate to 0.001 (megatron-core's default too) and has no GLM converter of its own. The
load-balancing loss is the Switch aux loss over the whole sequence batch (the type verl-engine balances over the
DP x CP pool), its coefficient from the config (``aux_loss_alpha`` / ``router_aux_loss_coef``, 0 when absent,
as in GLM-4.5's config: no aux loss in transformers' model either).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["glm4_moe_fields", "moe_layer_pattern"]


def moe_layer_pattern(hf_config: Mapping[str, Any] | Any) -> list[int]:
    """megatron-core's ``moe_layer_freq`` list: 0 for the first ``first_k_dense_replace`` (dense) layers, then 1."""
    layers = int(hf_get(hf_config, "num_hidden_layers"))
    dense = min(int(hf_get(hf_config, "first_k_dense_replace", 0) or 0), layers)
    return [0] * dense + [1] * (layers - dense)


def hf_get(hf_config: Mapping[str, Any] | Any, key: str, default: Any = None) -> Any:
    """``key`` of a config.json mapping or a PretrainedConfig (as ``transformer_config.hf_get``, which imports
    this module)."""
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def glm4_moe_fields(hf_config: Mapping[str, Any] | Any, *, experts: int) -> dict[str, Any]:
    """The TransformerConfig MoE fields of a ``glm4_moe`` config; what megatron-core computes otherwise is refused."""
    topk = int(hf_get(hf_config, "num_experts_per_tok"))
    norm = bool(hf_get(hf_config, "norm_topk_prob", True))
    if norm != (topk > 1):
        raise ValueError(
            f"glm4_moe with norm_topk_prob={norm} and num_experts_per_tok={topk} is not supported: megatron-core's"
            " sigmoid router renormalises the chosen scores exactly when top-k > 1"
        )
    groups = int(hf_get(hf_config, "n_group", 1) or 1)
    group_topk = int(hf_get(hf_config, "topk_group", 1) or 1)
    if experts % groups:
        raise ValueError(f"glm4_moe: n_group={groups} does not divide the {experts} routed experts")
    limited = group_topk < groups
    if limited and topk // group_topk != 2:
        raise ValueError(
            f"glm4_moe with n_group={groups}, topk_group={group_topk}, num_experts_per_tok={topk} is not supported:"
            " transformers ranks a group by the sum of its 2 best scores, megatron-core by its best"
            f" num_experts_per_tok // topk_group = {topk // group_topk}"
        )
    if hf_get(hf_config, "topk_method", "noaux_tc") not in (None, "noaux_tc"):
        raise ValueError(
            f"glm4_moe topk_method={hf_get(hf_config, 'topk_method')!r} is not supported (noaux_tc)"
        )
    shared = int(hf_get(hf_config, "n_shared_experts", 0) or 0)
    width = int(hf_get(hf_config, "moe_intermediate_size"))
    pattern = moe_layer_pattern(hf_config)
    coeff = (
        hf_get(hf_config, "aux_loss_alpha", None) or hf_get(hf_config, "router_aux_loss_coef", None) or 0.0
    )
    return {
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": width,
        "moe_router_topk": topk,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 1e-3,
        "moe_router_num_groups": groups if limited else None,
        "moe_router_group_topk": group_topk if limited else None,
        "moe_router_topk_scaling_factor": float(hf_get(hf_config, "routed_scaling_factor", 1.0) or 1.0),
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(coeff),
        "moe_shared_expert_intermediate_size": shared * width if shared else None,
        "moe_layer_freq": pattern if 0 in pattern else 1,
        "moe_grouped_gemm": True,
    }
