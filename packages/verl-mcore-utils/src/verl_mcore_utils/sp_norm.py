"""Layer norms for sequence parallelism without Transformer Engine.

megatron-core needs sequence parallelism (SP) for a mixture-of-experts model at TP > 1, and its only norm
without Transformer Engine (``WrappedTorchNorm``, ``megatron/core/transformer/torch_norm.py``) asserts SP off.
A norm is per token, so on a sequence shard it computes what it computes on the whole sequence: torch's
``LayerNorm`` / ``RMSNorm`` serve unchanged. What SP changes is the gradient: each TP rank's norm weight sees
its own shard of the tokens, so the weight gradients must be summed over the TP group. megatron-core's
``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) sums every parameter marked
``sequence_parallel = True`` when the config has SP on, as Transformer Engine's norm marks its own; the norm
here marks its weight (and bias) the same way, with the config's SP setting.

q / k layernorms act on attention heads, which TP splits (every rank sees the whole sequence there): their
weights are shared by every head, and megatron-core sums their gradients over TP by name (``q_layernorm`` /
``k_layernorm``) whether SP is on or not. They get this norm too (WrappedTorchNorm would refuse the SP config),
marked like Transformer Engine's, which changes nothing: megatron-core sums a parameter once either way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

__all__ = [
    "SequenceParallelNorm",
    "block_spec_with_final_norm",
    "mtp_spec_with_sequence_parallel_norms",
    "with_sequence_parallel_norms",
]


class SequenceParallelNorm:
    """torch's LayerNorm / RMSNorm (``config.normalization``), weight and bias marked ``sequence_parallel``.

    The builder signature is megatron-core's ``WrappedTorchNorm``'s; the same settings are refused, except SP.
    """

    def __new__(  # type: ignore[misc]  # a factory: returns a torch norm module, not an instance
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        for key in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, key, False):
                raise ValueError(f"{key}=True is not supported by the torch norm (no Transformer Engine)")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(
                f"normalization={config.normalization!r}: only LayerNorm and RMSNorm are supported"
            )
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _norm_fields(submodules: Any) -> list[str]:
    names = ("input_layernorm", "pre_mlp_layernorm", "pre_cross_attn_layernorm", "q_layernorm", "k_layernorm")
    return [n for n in names if _is_torch_norm(getattr(submodules, n, None))]


def _is_torch_norm(builder: Any) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return builder is WrappedTorchNorm


def with_sequence_parallel_norms(spec: Any) -> Any:
    """``spec`` (a local GPT layer spec) with every megatron-core torch norm replaced by
    :class:`SequenceParallelNorm` (the layer's norms and the attention's q / k norms), in place."""
    layer = spec.submodules
    for name in _norm_fields(layer):
        setattr(layer, name, SequenceParallelNorm)
    attention = getattr(getattr(layer, "self_attention", None), "submodules", None)
    for name in _norm_fields(attention) if attention is not None else ():
        setattr(attention, name, SequenceParallelNorm)
    return spec


def block_spec_with_final_norm(tf_config: Any, layer_spec: Any, *, vp_stage: int | None) -> Any:
    """megatron-core's block of ``layer_spec`` layers whose final norm is :class:`SequenceParallelNorm`
    (megatron-core picks its module-level norm, the torch one without Transformer Engine). A block spec
    (``TransformerBlockSubmodules``, e.g. GLM-4.5's dense and MoE layers) gets its final norm replaced."""
    from megatron.core.transformer.transformer_block import _get_block_submodules

    if hasattr(layer_spec, "layer_specs"):
        block = layer_spec
    else:
        block = _get_block_submodules(tf_config, layer_spec, vp_stage=vp_stage)
    if _is_torch_norm(block.layer_norm):
        block = replace(block, layer_norm=SequenceParallelNorm)
    return block


def mtp_spec_with_sequence_parallel_norms(block: Any) -> Any:
    """megatron-core's MTP block spec with each layer's own torch norms (``enorm``, ``hnorm`` and the final
    ``layer_norm``) replaced by :class:`SequenceParallelNorm`; megatron-core gives them its module-level norm,
    which asserts SP off. Under SP they see a sequence shard, like the decoder's norms (the MTP layer scatters
    its projection's output to the sequence shards before its decoder layer, whose spec the caller already
    gave SP norms). A new spec: megatron-core's repeats one layer spec object for every MTP layer."""
    layers = []
    for spec in block.layer_specs:
        sub = spec.submodules
        norms = {
            n: SequenceParallelNorm
            for n in ("enorm", "hnorm", "layer_norm")
            if _is_torch_norm(getattr(sub, n))
        }
        layers.append(replace(spec, submodules=replace(sub, **norms)))
    return replace(block, layer_specs=layers)
