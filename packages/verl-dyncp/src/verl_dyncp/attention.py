"""megatron-core ``core_attention`` for packed (THD) batches under a per-batch (dynamic) CP group.

The work is done by :func:`verl_dyncp.thd_attention.thd_attention` (layout contract, CP algorithm and
kernels: the package README); this module adapts megatron-core's core-attention contract to it: the
constructor takes megatron's keyword arguments, ``forward`` gets ``[T, heads, dim]`` tensors and
``packed_seq_params`` (the CP group travels on it, see :func:`attach_cp_context`), and RoPE settings
come from :func:`dyncp_core_attention` since megatron-core 0.19 instantiates the spec's class itself.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType

from verl_dyncp.cp_context import CPContext, attach_cp_context, get_cp_context
from verl_dyncp.layout import thd_layout
from verl_dyncp.rope import apply_rope, rope_inv_freq
from verl_dyncp.thd_attention import thd_attention
from verl_mcore_utils.attention import AttentionCall, CoreAttentionBase

__all__ = ["CPContext", "DynCPCoreAttention", "attach_cp_context", "dyncp_core_attention"]


class DynCPCoreAttention(CoreAttentionBase):
    """``core_attention`` for megatron-core layer specs: THD + (dynamic) CP, causal, GQA, optional RoPE.

    Class attributes (set by :func:`dyncp_core_attention`, since megatron-core 0.19 instantiates the
    spec's class directly and cannot pass extra constructor arguments): ``rotary_base`` (None: no RoPE
    here), ``rotary_percent`` and ``kernel`` ("auto", "varlen", "cudnn" or "sdpa"). The constructor takes
    megatron-core's core-attention arguments (:class:`verl_mcore_utils.attention.CoreAttentionBase`).
    """

    rotary_base: float | None = None
    rotary_percent: float = 1.0
    kernel: str = "auto"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.attention_type != "self":
            raise ValueError(f"DynCPCoreAttention supports self attention only, got {self.attention_type!r}")
        config = self.config
        self._static_cp_group = getattr(self.pg_collection, "cp", None)
        self.rotary_interleaved = bool(getattr(config, "rotary_interleaved", False))
        self._inv_freq = (
            rope_inv_freq(
                head_dim=config.kv_channels, rotary_percent=self.rotary_percent, rotary_base=self.rotary_base
            )
            if self.rotary_base is not None
            else None
        )

    def _static_group(self) -> dist.ProcessGroup | None:
        if self.config.context_parallel_size <= 1:
            return None
        if self._static_cp_group is not None:
            return self._static_cp_group
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._inv_freq is None:
            return x
        return apply_rope(
            x, position_ids=positions, inv_freq=self._inv_freq, interleaved=self.rotary_interleaved
        )

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: AttentionCall
    ) -> torch.Tensor:
        """THD: [T, np, hn] x [T, ng, hn] x [T, ng, hn] -> [T, np * hn].

        BSHD without CP (no packed_seq_params): [s, b, np, hn] -> [s, b, np * hn].
        """
        if call.mask_type != AttnMaskType.causal:
            raise ValueError(f"DynCPCoreAttention implements causal attention only, got {call.mask_type}")
        packed_seq_params = call.packed_seq_params
        dropout = self.dropout_p if self.training else 0.0
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", "thd") != "thd":
            return self._forward_bshd(query, key, value, dropout=dropout)
        context = get_cp_context(packed_seq_params, static_cp_group=self._static_group())
        layout = thd_layout(
            packed_seq_params, cp_size=context.size, cp_rank=context.rank, device=query.device
        )
        return thd_attention(
            query,
            key,
            value,
            layout=layout,
            cp_group=context.cp_group,
            position_ids=context.position_ids,
            inv_freq=self._inv_freq,
            rotary_interleaved=self.rotary_interleaved,
            softmax_scale=self.softmax_scale,
            dropout_p=dropout,
            kernel=self.kernel,
        )

    def _forward_bshd(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dropout: float
    ) -> torch.Tensor:
        """Unpacked batches without CP (e.g. a quick generation check): positions 0..s-1 in every row."""
        if self._static_group() is not None:
            raise ValueError(
                "context parallelism needs THD batches (packed_seq_params) in DynCPCoreAttention"
            )
        s, b, n_heads, _ = query.shape
        positions = torch.arange(s, device=query.device).repeat_interleave(b)
        q = self._rope(query.reshape(s * b, n_heads, -1), positions).reshape(query.shape)
        k = self._rope(key.reshape(s * b, key.shape[2], -1), positions).reshape(key.shape)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, value))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=dropout,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


@functools.cache
def dyncp_core_attention(
    *, rotary_base: float | None, rotary_percent: float = 1.0, kernel: str = "auto"
) -> type[DynCPCoreAttention]:
    """A DynCPCoreAttention subclass with these settings (cached: the same settings give the same class).

    ``rotary_base`` None: RoPE is left to the model (only correct without CP); otherwise RoPE is applied
    here from the true token positions and the model must be built with ``position_embedding_type="none"``.
    """
    if kernel not in ("auto", "varlen", "cudnn", "sdpa"):
        hint = " ('te' is built by thd_layer_spec / te_core_attention)" if kernel == "te" else ""
        raise ValueError(f"kernel must be 'auto', 'varlen', 'cudnn' or 'sdpa', got {kernel!r}{hint}")
    name = "DynCPCoreAttention" if rotary_base is None else "DynCPCoreAttentionRoPE"
    return type(
        name,
        (DynCPCoreAttention,),
        {
            "rotary_base": None if rotary_base is None else float(rotary_base),
            "rotary_percent": float(rotary_percent),
            "kernel": kernel,
            "__module__": __name__,
        },
    )
