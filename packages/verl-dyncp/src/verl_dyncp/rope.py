"""Rotary position embedding from explicit per-token positions (for packed, context-parallel batches).

Why not megatron-core's RoPE: in every release (0.14 to 0.19) GPTModel builds one frequency table for
positions ``0..max_len`` and ``Attention`` slices it per sequence with ``cu_seqlens`` and the *static*
``pg_collection.cp`` group (the zigzag slice of ``get_pos_emb_on_this_cp_rank``). With a CP size that
changes per micro-batch, or groups other than megatron's static one, those slices are the wrong
positions. Here every local token carries its true position (the position the same token has in the
run without CP) and the rotation is computed from it, so the CP layout cannot leak into RoPE.

The maths is megatron-core's (``inv_freq = 1 / base^(2i/d)`` in fp32, ``cos``/``sin`` cast to the
tensor dtype, rotate-half or interleaved pairs, only the first ``rotary_percent`` of the head dim
rotated), so a model using this matches a megatron-core model using its own RoPE bit for bit up to the
order of fp32 operations.
"""

from __future__ import annotations

import torch

from verl_dyncp.fused_rope import fused_rope, fused_rope_applies
from verl_mcore_utils.transfer import to_device_async

__all__ = ["apply_rope", "apply_rope_tables", "rope_inv_freq", "rope_tables"]


def rope_inv_freq(
    *, head_dim: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0
) -> torch.Tensor:
    """Inverse frequencies ``[rot_dim / 2]`` (fp32, CPU), computed as megatron-core's RotaryEmbedding does."""
    rot_dim = int(head_dim * rotary_percent)
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(
            f"rotary dimension {rot_dim} (head_dim={head_dim} x rotary_percent={rotary_percent})"
            " must be even and > 0"
        )
    return 1.0 / (rotary_base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))


def _rotate_half(x: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        first, second = torch.chunk(x, 2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def rope_tables(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the angles ``position * inv_freq``, ``[T, 1, rot_dim]`` in ``dtype`` on ``device``.

    Angles in float32 (as megatron-core), then cast: one table per micro-batch serves every layer
    (:func:`verl_dyncp.thd_attention.local_rope_qk` caches it on the batch's layout).
    """
    if position_ids.dim() != 1:
        raise ValueError(
            f"position_ids must be 1-D with one entry per token: got {tuple(position_ids.shape)}"
        )
    inv = _on_device(inv_freq, torch.device(device))
    freqs = torch.outer(position_ids.to(device=device, dtype=torch.float32), inv)  # [T, rot/2]
    emb = (
        torch.stack((freqs, freqs), dim=-1).flatten(-2) if interleaved else torch.cat((freqs, freqs), dim=-1)
    )
    emb = emb.unsqueeze(1)  # broadcast over heads
    return torch.cos(emb).to(dtype), torch.sin(emb).to(dtype)


def _on_device(inv_freq: torch.Tensor, device: torch.device) -> torch.Tensor:
    """float32 ``inv_freq`` on ``device``, copied without waiting for the GPU's queue (a plain host copy to the
    GPU would). Copied per call, once per micro-batch (the tables are cached on the layout), and owned by
    nobody else: a process-wide cache of it outlived every engine (512 bytes per device)."""
    inv = inv_freq.to(torch.float32)
    return inv if inv.device == device else to_device_async(inv, device)


def apply_rope_tables(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False, fused: bool = False
) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, dim]`` with precomputed :func:`rope_tables` (first ``rot_dim`` channels).

    ``fused``: one Triton kernel where it applies (verl_dyncp.fused_rope), else the torch ops.
    """
    if cos.shape[0] != x.shape[0]:
        raise ValueError(f"rope tables hold {cos.shape[0]} positions for {x.shape[0]} tokens")
    if fused and fused_rope_applies(x, cos, interleaved=interleaved):
        return fused_rope(x, cos, sin)  # one Triton kernel instead of five elementwise passes
    rot_dim = cos.shape[-1]
    rotated, passed = x[..., :rot_dim], x[..., rot_dim:]
    rotated = rotated * cos + _rotate_half(rotated, interleaved=interleaved) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


def apply_rope(
    x: torch.Tensor,
    *,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, dim]`` by the angles of ``position_ids`` ``[T]``.

    Only the first ``2 * len(inv_freq)`` channels are rotated (``rotary_percent < 1`` leaves the rest).
    """
    if position_ids.dim() != 1 or position_ids.numel() != x.shape[0]:
        raise ValueError(
            "position_ids must be 1-D with one entry per token:"
            f" got {tuple(position_ids.shape)} for x {tuple(x.shape)}"
        )
    cos, sin = rope_tables(position_ids, inv_freq, dtype=x.dtype, device=x.device, interleaved=interleaved)
    return apply_rope_tables(x, cos, sin, interleaved=interleaved)
