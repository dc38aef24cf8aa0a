"""Transformer Engine's attention for packed (THD) batches under a CP group that may change every call.

Optional: imported only when a layer spec asks for ``kernel="te"``. A subclass of megatron-core's
``TEDotProductAttention`` that hands TE the micro-batch's CP group before every call, creates TE's CP side
stream, applies RoPE from the true positions and zeroes padding rows; the README says why each is needed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from verl_dyncp.cp_context import get_cp_context
from verl_dyncp.layout import thd_layout
from verl_dyncp.rope import rope_inv_freq
from verl_dyncp.thd_attention import local_rope_qk

__all__ = ["te_attention_available", "te_core_attention"]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def te_attention_available() -> bool:
    """True when Transformer Engine's PyTorch attention and megatron-core's wrapper of it import."""
    try:
        _te_base()
    except ImportError:
        return False
    return True


@functools.cache
def _te_base() -> tuple[type[Any], type[Any]]:
    """(transformer_engine.pytorch.DotProductAttention, megatron's TEDotProductAttention), or ImportError."""
    try:
        import transformer_engine.pytorch as te
        from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention
    except ImportError as err:
        raise ImportError(
            "the 'te' attention kernel needs Transformer Engine (pip install 'transformer-engine[pytorch]'"
            f" for your CUDA and torch): {err}. Without it use kernel 'auto' (torch's varlen flash kernel)"
        ) from err
    if not HAVE_TE:
        raise ImportError("megatron-core did not find Transformer Engine (HAVE_TE is False)")
    return te.DotProductAttention, TEDotProductAttention


@functools.cache
def te_core_attention(
    *, rotary_base: float | None, rotary_percent: float = 1.0, cp_comm_type: str = "p2p"
) -> type:
    """A megatron-core ``core_attention`` class running Transformer Engine on THD + (dynamic) CP batches.

    ``rotary_base`` None: no RoPE here (only right without CP). ``cp_comm_type``: TE's CP algorithm
    ("p2p" ring with overlap, "all_gather", "a2a"). Cached: the same settings give the same class.
    Raises ImportError (naming the fix) when Transformer Engine is not installed.
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, got {cp_comm_type!r}")
    _, megatron_te_dpa = _te_base()
    name = "TEDynCPCoreAttentionRoPE" if rotary_base is not None else "TEDynCPCoreAttention"
    settings = {
        "rotary_base": float(rotary_base) if rotary_base is not None else None,
        "rotary_percent": float(rotary_percent),
        "verl_cp_comm_type": cp_comm_type,
        "__module__": __name__,
        "__qualname__": name,
    }
    return type(name, (_DynCPGroupMixin, megatron_te_dpa), settings)


class _DynCPGroupMixin:
    """megatron's TEDotProductAttention + per-micro-batch CP group, true-position RoPE, zeroed padding.

    Placed before TEDotProductAttention in the bases by :func:`te_core_attention`, which sets the class
    attributes below.
    """

    rotary_base: float | None = None
    rotary_percent: float = 1.0
    verl_cp_comm_type: str = "p2p"
    config: Any  # megatron's TransformerConfig, set by TEDotProductAttention

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["cp_comm_type"] = self.verl_cp_comm_type
        super().__init__(*args, **kwargs)
        self._static_cp_group = getattr(self, "cp_group", None)
        self._inv_freq = (
            rope_inv_freq(
                head_dim=self.config.kv_channels,
                rotary_percent=self.rotary_percent,
                rotary_base=self.rotary_base,
            )
            if self.rotary_base is not None
            else None
        )
        self._interleaved = bool(getattr(self.config, "rotary_interleaved", False))
        self._active_group: Any = "unset"

    def _use_group(self, group: dist.ProcessGroup | None) -> None:
        if group is self._active_group:
            return
        te_dpa, megatron_te_dpa = _te_base()
        comm = self.verl_cp_comm_type
        if group is None:
            te_dpa.set_context_parallel_group(self, None, None, None, comm)
        else:
            if megatron_te_dpa.cp_stream is None:  # created on first use: construction needs no GPU
                megatron_te_dpa.cp_stream = torch.cuda.Stream()
            te_dpa.set_context_parallel_group(
                self, group, dist.get_process_group_ranks(group), megatron_te_dpa.cp_stream, comm
            )
        self._active_group = group

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
    ) -> torch.Tensor:
        """megatron-core's call, which passes the mask type, bias and packed_seq_params by keyword."""
        packed_seq_params = kwargs.get("packed_seq_params")
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
            raise ValueError(
                "the 'te' kernel of verl-dyncp takes packed THD batches only (packed_seq_params with"
                " qkv_format='thd'); build batches with preprocess_thd_engine"
            )
        static = self._static_cp_group if self.config.context_parallel_size > 1 else None
        context = get_cp_context(packed_seq_params, static_cp_group=static)
        layout = thd_layout(
            packed_seq_params, cp_size=context.size, cp_rank=context.rank, device=query.device
        )
        query, key = local_rope_qk(
            query,
            key,
            layout=layout,
            position_ids=context.position_ids,
            inv_freq=self._inv_freq,
            rotary_interleaved=self._interleaved,
        )
        self._use_group(context.cp_group)
        if kwargs.get("attn_mask_type") is None:
            from megatron.core.transformer.enums import AttnMaskType

            kwargs["attn_mask_type"] = AttnMaskType.causal
        out = super().forward(query, key, value, attention_mask, **kwargs)  # type: ignore[misc]
        # megatron >= 0.16 re-applies the group from PackedSeqParams (the same one); keep in step
        self._active_group = context.cp_group
        out = out.reshape(layout.num_local_tokens, -1)
        return torch.where(layout.valid[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
