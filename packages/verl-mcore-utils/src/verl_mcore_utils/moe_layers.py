"""MoE models with dense layers (``moe_layer_freq``) on our local spec, and the router's expert bias on the CPU.

megatron-core turns ``moe_layer_freq`` into per-layer specs only in ``get_gpt_decoder_block_spec``, which builds
its own local spec (not ours: our core attention, fused SwiGLU MLP, grouped experts). :func:`mixed_block_spec`
does the same from the caller's MoE layer spec: a dense layer is that spec with a dense MLP, and the list is cut to
this pipeline stage's layers as megatron-core cuts it (offset and count of ``get_transformer_layer_offset`` /
``get_num_layers_to_build``).

megatron-core 0.19's ``TopKRouter.__init__`` allocates ``expert_bias`` and ``local_tokens_per_expert`` with
``device=torch.cuda.current_device()`` (0.14 allocates them on the default device): a CPU-only host cannot build
an expert-bias router. :func:`cpu_expert_bias` builds the model with the flag off and gives every router the two
buffers afterwards, on the CPU, as megatron-core's ``__init__`` would (float32 zeros; the bias persistent, the
token counts not).

megatron-core 0.19.2's ``TopKRouter._apply_expert_bias`` masks padding with ``routing_map & ~padding_mask``:
``[tokens, experts]`` against the flattened ``[tokens]`` mask, which fails to broadcast (and would mask the wrong
axis where the counts happen to agree). :func:`add_expert_bias` gives every expert-bias router the same count
with the mask on the token axis (CPU and CUDA models; 0.14 counts inline, without a mask, and never calls it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["add_expert_bias", "cpu_expert_bias", "mixed_block_spec", "mixed_layers"]


def mixed_layers(tf_config: TransformerConfig) -> list[int] | None:
    """The 0 (dense) / 1 (MoE) list of a config with dense layers among MoE layers; None otherwise."""
    freq = tf_config.moe_layer_freq
    if not tf_config.num_moe_experts:
        return None
    if isinstance(freq, int) and freq != 1:
        raise ValueError(f"moe_layer_freq={freq} is not supported; give a 0/1 list per layer")
    if not isinstance(freq, list) or 0 not in freq:
        return None
    if len(freq) != tf_config.num_layers:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries for {tf_config.num_layers} layers")
    return list(freq)


def mixed_block_spec(tf_config: TransformerConfig, moe_spec: ModuleSpec, *, vp_stage: int | None) -> object:
    """This stage's TransformerBlockSubmodules: ``moe_spec`` for MoE layers, with a dense MLP for dense ones."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from verl_mcore_utils.compat import with_mlp_class
    from verl_mcore_utils.swiglu import FusedSwiGLUMLP

    pattern = mixed_layers(tf_config)
    if pattern is None:
        raise ValueError("mixed_block_spec needs moe_layer_freq with dense (0) layers")
    if tf_config.pipeline_model_parallel_layout is not None:
        raise ValueError("pipeline_model_parallel_layout with dense and MoE layers is not supported")
    dense_mlp = get_gpt_layer_local_spec(
        num_experts=None, normalization=tf_config.normalization
    ).submodules.mlp
    dense_mlp = with_mlp_class(dense_mlp, base=MLP, cls=FusedSwiGLUMLP)
    dense = dataclasses.replace(moe_spec, submodules=dataclasses.replace(moe_spec.submodules, mlp=dense_mlp))
    specs = [moe_spec if moe else dense for moe in pattern]
    offset = get_transformer_layer_offset(tf_config, vp_stage=vp_stage)
    count = get_num_layers_to_build(tf_config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=LayerNormImpl)


@contextlib.contextmanager
def cpu_expert_bias(tf_config: TransformerConfig, device: torch.device | str) -> Iterator[None]:
    """Build inside this on ``device``: on the CPU the routers' expert-bias buffers are made here, not on CUDA."""
    if torch.device(device).type != "cpu" or not tf_config.moe_router_enable_expert_bias:
        yield
        return
    tf_config.moe_router_enable_expert_bias = False
    try:
        yield
    finally:
        tf_config.moe_router_enable_expert_bias = True


def _count_routed_tokens(
    router: torch.nn.Module, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> None:
    """megatron-core's expert-bias token count (training forwards only) with padding (True) masked per token."""
    if router.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            router.local_tokens_per_expert += routing_map.sum(dim=0)  # type: ignore[operator]  # a buffer (Tensor)


def add_expert_bias(model: torch.nn.Module, tf_config: TransformerConfig) -> int:
    """Give every router of ``model`` built under :func:`cpu_expert_bias` its expert-bias buffers (CPU), and
    every expert-bias router the padding-correct token count. Returns the number of routers."""
    import functools

    from megatron.core.transformer.moe.router import TopKRouter

    if not tf_config.moe_router_enable_expert_bias:
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, TopKRouter):
            continue
        module._apply_expert_bias = functools.partial(_count_routed_tokens, module)
        count += 1
        if getattr(module, "expert_bias", None) is None:
            experts = tf_config.num_moe_experts
            for name in ("local_tokens_per_expert", "expert_bias"):  # plain ``None`` attributes until now
                if name in vars(module):
                    delattr(module, name)
            module.register_buffer("local_tokens_per_expert", torch.zeros(experts), persistent=False)
            module.register_buffer("expert_bias", torch.zeros(experts))
            module.enable_expert_bias = True
    return count
