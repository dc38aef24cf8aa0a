"""Core attention for packed (THD) batches with a context-parallel group that may change every call.

Every rank all-gathers K and V over the group (reduce-scatter in backward) and attends its local zigzag
chunks with causal masks from the true positions; RoPE is applied here from those positions. The README's
design notes give the layout contract, the algorithm, its cost and the kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from verl_dyncp.kernels import attend, pick_kernel
from verl_dyncp.layout import ThdLayout, thd_packed_seq_params
from verl_dyncp.rope import apply_rope_tables, rope_tables

# thd_packed_seq_params is re-exported: verl-engine imports it from here
__all__ = ["local_rope_qk", "thd_attention", "thd_packed_seq_params"]


class _AllGatherRows(torch.autograd.Function):
    """Concatenate every rank's ``x`` along dim 0; backward sums the gradients and keeps this rank's rows.

    On NCCL the backward is a reduce-scatter; on gloo (no reduce-scatter) an all-reduce and a slice.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        size = dist.get_world_size(group=group)
        if dist.get_backend(group) == dist.Backend.NCCL:  # one buffer, no extra copy
            out = x.new_empty((size * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x, group=group)
            return out
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        group = ctx.group
        size, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        grad = grad.contiguous()
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        total = grad.clone()
        dist.all_reduce(total, group=group)
        return total.chunk(size, dim=0)[rank].contiguous(), None


def local_rope_qk(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    layout: ThdLayout,
    position_ids: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
    rotary_interleaved: bool,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check that ``query`` holds this rank's tokens of ``layout``; rotate q and k from the true positions.

    Shared by every THD attention kernel (ours and Transformer Engine's): megatron's own RoPE would slice
    frequencies by the static CP rank, wrong once the CP group changes per micro-batch. ``inv_freq`` None:
    q and k unchanged. ``position_ids`` None: the layout's positions.
    """
    if query.shape[0] != layout.num_local_tokens:
        raise ValueError(
            f"query has {query.shape[0]} tokens but cu_seqlens_padded / cp_size={layout.cp_size} describe"
            f" {layout.num_local_tokens}"
        )
    if inv_freq is None:
        return query, key
    positions = position_ids if position_ids is not None else layout.position_ids
    key_ = (id(positions), tuple(inv_freq.tolist()), query.dtype, query.device, rotary_interleaved)
    entry = layout.rope_cache.get(key_)
    if entry is None or entry[0] is not positions:  # the entry keeps its positions alive: ids stay unique
        cos, sin = rope_tables(
            positions, inv_freq, dtype=query.dtype, device=query.device, interleaved=rotary_interleaved
        )
        layout.rope_cache[key_] = (positions, cos, sin)
    else:
        _, cos, sin = entry
    return (
        apply_rope_tables(query, cos, sin, interleaved=rotary_interleaved, fused=fused),
        apply_rope_tables(key, cos, sin, interleaved=rotary_interleaved, fused=fused),
    )


def thd_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layout: ThdLayout,
    cp_group: dist.ProcessGroup | None,
    position_ids: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
    rotary_interleaved: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    kernel: str = "auto",
) -> torch.Tensor:
    """Causal attention of this rank's zigzag tokens: [T, np, hn] x [T, ng, hn] x [T, ng, hn] -> [T, np*hn].

    ``inv_freq`` set: q and k are rotated first with ``position_ids`` (default: the layout's true
    positions). With ``layout.cp_size > 1`` every rank of ``cp_group`` must call this together.
    """
    q, k = local_rope_qk(
        query,
        key,
        layout=layout,
        position_ids=position_ids,
        inv_freq=inv_freq,
        rotary_interleaved=rotary_interleaved,
        fused=kernel in ("auto", "cudnn"),
    )
    v = value
    group_size = 1 if cp_group is None else dist.get_world_size(group=cp_group)
    if group_size != layout.cp_size:
        raise ValueError(f"layout is for CP size {layout.cp_size} but the CP group has {group_size} ranks")
    chosen = pick_kernel(q, kernel=kernel, dropout_p=dropout_p)
    if layout.graph_safe and chosen != "varlen":
        raise ValueError(
            f"a graph layout (verl_dyncp.graph_layout) needs the varlen kernel, but kernel={kernel!r} chose"
            f" {chosen!r} here (varlen needs CUDA, fp16/bf16, no dropout and torch.nn.attention.varlen)"
        )
    if layout.cp_size > 1:
        kv = _AllGatherRows.apply(torch.cat((k, v), dim=-1), cp_group)
        kv = kv.index_select(0, layout.stream_index if chosen == "varlen" else layout.full_index)
        k, v = kv.split((k.shape[-1], v.shape[-1]), dim=-1)
    dense = (
        chosen == "varlen" and layout.cp_size == 1 and kernel in ("auto", "cudnn") and not layout.graph_safe
    )
    path = "dense" if dense else chosen
    out = attend(q, k, v, layout=layout, path=path, scale=softmax_scale, dropout_p=dropout_p)
    if layout.has_padding:
        out = out * layout.valid[:, None, None].to(out.dtype)  # padding rows: zero output, no gradient
    return out.reshape(out.shape[0], -1)
