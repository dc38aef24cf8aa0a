"""Transformer Engine's attention for packed (THD) batches under a CP group that may change every call.

Optional: everything else in verl-dyncp works without Transformer Engine; this module is only imported
when a layer spec asks for ``kernel="te"``. It subclasses megatron-core's ``TEDotProductAttention`` (so the
parameter-free module, its ``_extra_state`` and the TE version checks are megatron's own) and adds what
the packed path needs on every megatron-core release:

* The CP group of the micro-batch: taken from the :class:`~verl_dyncp.thd_attention.CPContext` that
  :func:`~verl_dyncp.thd_attention.attach_cp_context` put on ``packed_seq_params`` and handed to TE with
  ``set_context_parallel_group`` before every call; ``None`` (CP size 1) switches TE's CP off, so a
  micro-batch without CP never reuses the previous one's group. megatron-core >= 0.16 does the same from
  ``PackedSeqParams.cp_group`` / ``local_cp_size`` (filled by attach_cp_context too); doing it here also
  covers 0.14 / 0.15, where those fields do not exist.
* TE's ring (P2P) CP overlaps attention steps on a side stream that megatron only creates when the static
  ``context_parallel_size`` is > 1; the packed path runs megatron with CP 1, so it is created here.
* RoPE from the true token positions (the model is built with ``position_embedding_type="none"``, as for
  verl-dyncp's own attention): megatron's RoPE would slice frequencies with the static CP rank.
* Padding rows (tokens past a sequence's true length) get zero output and therefore no gradient,
  whatever the kernel leaves there.

Layout contract: the zigzag THD layout of :func:`verl_dyncp.thd.preprocess_thd_engine`, which is
Transformer Engine's own (``cu_seqlens_q`` true whole-sequence offsets, ``cu_seqlens_q_padded`` padded
ones, padded lengths multiples of ``2 x cp_size``, CP rank ``r`` holding chunks ``r`` and ``2 cp - 1 - r``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from verl_dyncp.rope import rope_inv_freq
from verl_dyncp.thd_attention import get_cp_context, local_rope_qk, thd_layout

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
def _te_base() -> tuple[type, type]:
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
    te_dpa, megatron_te_dpa = _te_base()
    base = float(rotary_base) if rotary_base is not None else None
    percent = float(rotary_percent)
    comm = cp_comm_type

    class TEDynCPCoreAttention(megatron_te_dpa):  # type: ignore[misc, valid-type]
        """megatron's TEDotProductAttention + per-micro-batch CP group, true-position RoPE, zeroed padding."""

        rotary_base = base
        rotary_percent = percent

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["cp_comm_type"] = comm
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
            if group is None:
                te_dpa.set_context_parallel_group(self, None, None, None, comm)
            else:
                if megatron_te_dpa.cp_stream is None:  # created on first use: construction needs no GPU
                    megatron_te_dpa.cp_stream = torch.cuda.Stream()
                te_dpa.set_context_parallel_group(
                    self, group, dist.get_process_group_ranks(group), megatron_te_dpa.cp_stream, comm
                )
            self._active_group = group

        def forward(  # type: ignore[override]
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params: Any | None = None,
            **kwargs: Any,
        ) -> torch.Tensor:
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
            if attn_mask_type is None:
                from megatron.core.transformer.enums import AttnMaskType

                attn_mask_type = AttnMaskType.causal
            out = super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
                **kwargs,
            )
            # megatron >= 0.16 re-applies the group from PackedSeqParams (the same one); keep in step
            self._active_group = context.cp_group
            out = out.reshape(layout.num_local_tokens, -1)
            return torch.where(
                layout.valid[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device)
            )

    TEDynCPCoreAttention.__qualname__ = TEDynCPCoreAttention.__name__ = (
        "TEDynCPCoreAttentionRoPE" if base is not None else "TEDynCPCoreAttention"
    )
    return TEDynCPCoreAttention
