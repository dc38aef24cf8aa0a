"""A core-attention module for megatron-core layer specs that needs no Transformer Engine.

megatron-core's own DotProductAttention uses a CUDA-only global memory buffer and the CUDA RNG
tracker, so it cannot run on a CPU-only machine; TE's attention is not always installable. This
module runs PyTorch's scaled_dot_product_attention (flash / memory-efficient kernels on CUDA, the
math kernel on CPU) on the same [s, b, heads, dim] tensors megatron-core's Attention hands over.
Packed (THD) batches and context parallelism come with verl-dyncp; here they are refused loudly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["SDPACoreAttention"]


class SDPACoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for ``SelfAttentionSubmodules`` (BSHD batches, CP size 1).

    The constructor takes megatron-core's keyword arguments; the process-group arguments (named
    differently across megatron-core releases) are accepted and unused, since attention itself
    needs no communication without context parallelism.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        **_process_groups: Any,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError(
                f"SDPACoreAttention does not implement context parallelism (context_parallel_size="
                f"{config.context_parallel_size}); use verl_dyncp's core attention for CP > 1"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any | None = None,
        **_unused: Any,
    ) -> torch.Tensor:
        """[sq, b, np, hn] x [sk, b, ng, hn] x [sk, b, ng, hn] -> [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise ValueError(
                "packed (THD) sequences need verl_dyncp's core attention; SDPACoreAttention takes BSHD only"
            )
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, n_heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.shape[1] != n_heads:  # grouped-query attention: repeat the key/value groups
            reps = n_heads // k.shape[1]
            k = k.repeat_interleave(reps, dim=1)
            v = v.repeat_interleave(reps, dim=1)
        sdpa_mask = None
        is_causal = mask_type == AttnMaskType.causal
        if attention_mask is not None and mask_type in (AttnMaskType.padding, AttnMaskType.arbitrary):
            sdpa_mask = ~attention_mask.bool()  # megatron: True = masked out; SDPA: True = attend
        elif mask_type == AttnMaskType.padding_causal and attention_mask is not None:
            causal = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril()
            sdpa_mask = ~attention_mask.bool() & causal
            is_causal = False
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=sdpa_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=is_causal and sdpa_mask is None,
            scale=self.softmax_scale,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * head_dim)
