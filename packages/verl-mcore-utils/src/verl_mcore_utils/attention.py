"""A core-attention module for megatron-core layer specs that needs no Transformer Engine.

megatron-core's own DotProductAttention uses a CUDA-only global memory buffer and the CUDA RNG
tracker, so it cannot run on a CPU-only machine; TE's attention is not always installable. This
module runs PyTorch's scaled_dot_product_attention (flash / memory-efficient kernels on CUDA, the
math kernel on CPU) on the same [s, b, heads, dim] tensors megatron-core's Attention hands over.
Packed (THD) batches and context parallelism come with verl-dyncp; here they are refused loudly.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["AttentionCall", "CoreAttentionBase", "SDPACoreAttention"]


class AttentionCall(NamedTuple):
    """What megatron-core's call passes beside query, key and value, with the mask type in force."""

    attention_mask: torch.Tensor | None
    mask_type: AttnMaskType
    packed_seq_params: Any | None


class CoreAttentionBase(MegatronModule):
    """megatron-core's ``core_attention`` contract, for our core-attention modules to subclass.

    The constructor takes megatron-core's keyword arguments and stores them; the process-group arguments
    (named differently across megatron-core releases) are accepted, and ``pg_collection`` kept where given.
    ``forward`` takes megatron-core's call, refuses an attention bias and hands the mask type in force
    (the call's, else the constructor's) to :meth:`attend`, which a subclass implements.
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
        **process_groups: Any,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.pg_collection = process_groups.get("pg_collection")

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
        if attention_bias is not None:
            raise ValueError(f"{type(self).__name__} does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        return self.attend(query, key, value, AttentionCall(attention_mask, mask_type, packed_seq_params))

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: AttentionCall
    ) -> torch.Tensor:
        """The attention itself: ``[..., np, hn]`` queries and ``[..., ng, hn]`` keys and values in."""
        raise NotImplementedError


class SDPACoreAttention(CoreAttentionBase):
    """Drop-in ``core_attention`` for ``SelfAttentionSubmodules`` (BSHD batches, CP size 1).

    Takes :class:`CoreAttentionBase`'s constructor arguments; the process groups go unused, since
    attention itself needs no communication without context parallelism.
    """

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        if config.context_parallel_size > 1:
            raise ValueError(
                f"SDPACoreAttention does not implement context parallelism (context_parallel_size="
                f"{config.context_parallel_size}); use verl_dyncp's core attention for CP > 1"
            )
        super().__init__(config, *args, **kwargs)

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: AttentionCall
    ) -> torch.Tensor:
        """[sq, b, np, hn] x [sk, b, ng, hn] x [sk, b, ng, hn] -> [sq, b, np * hn]."""
        if call.packed_seq_params is not None:
            raise ValueError(
                "packed (THD) sequences need verl_dyncp's core attention; SDPACoreAttention takes BSHD only"
            )
        attention_mask, mask_type = call.attention_mask, call.mask_type
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
