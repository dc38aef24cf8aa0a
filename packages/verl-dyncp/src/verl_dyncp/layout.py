"""One rank's share of a zigzag-split packed batch, as the index tensors the attention kernels need.

Built once per micro-batch (ideally while the batch is prepared, :func:`thd_packed_seq_params`) and cached
on its ``packed_seq_params``; the layout contract is in the README's design notes.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import torch.distributed as dist

from verl_dyncp.cp_context import LAYOUT_CACHE_ATTR, attach_cp_context, get_cp_context
from verl_dyncp.thd import build_thd_meta

__all__ = ["ThdLayout", "build_thd_layout", "cache_layout", "thd_layout", "thd_packed_seq_params"]


@dataclasses.dataclass(frozen=True)
class ThdLayout:
    """Index tensors describing one rank's share of a zigzag-split packed batch (see the README's design notes).

    ``full_index`` maps the whole padded batch in sequence order to rows of the all-gathered K/V
    buffer (rank-major); ``stream_index`` lists, for each local query chunk, the rows of its key prefix
    (the key stream of the varlen kernel). Both are None for CP size 1 (local order is global order).
    """

    cp_size: int
    cp_rank: int
    num_local_tokens: int
    padded_lens: tuple[int, ...]
    local_starts: tuple[int, ...]
    full_starts: tuple[int, ...]
    position_ids: torch.Tensor
    valid: torch.Tensor
    full_index: torch.Tensor | None
    stream_index: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    # any token past its sequence's true length (False: the output mask is skipped)
    has_padding: bool = True
    # a fixed-shape layout over a CUDA graph's inputs (verl_dyncp.graph_layout): no per-sequence host
    # lengths, so the attention must take the varlen path
    graph_safe: bool = False
    # RoPE cos / sin tables of this micro-batch by (positions, frequencies, dtype, interleaved): computed by
    # the first layer, reused by the others (one table build per micro-batch, not two per layer)
    rope_cache: dict[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )
    # the CP-1 kernel plan of this micro-batch (see _segment_plan), built by the first layer
    segment_plan: tuple[Any, ...] | None = dataclasses.field(default=None, compare=False, repr=False)


def thd_layout(
    packed_seq_params: Any, *, cp_size: int, cp_rank: int, device: torch.device | str
) -> ThdLayout:
    """The layout of this rank's tokens for a batch, built once and cached on ``packed_seq_params``."""
    cache: dict[Any, ThdLayout] | None = getattr(packed_seq_params, LAYOUT_CACHE_ATTR, None)
    key = _cache_key(cp_size=cp_size, cp_rank=cp_rank, device=device)
    if cache is not None and key in cache:
        return cache[key]
    if packed_seq_params.cu_seqlens_q is None:
        raise ValueError(
            "THD attention needs packed_seq_params.cu_seqlens_q (and cu_seqlens_q_padded under CP)"
        )
    layout = build_thd_layout(
        cu_seqlens=packed_seq_params.cu_seqlens_q,
        cu_seqlens_padded=packed_seq_params.cu_seqlens_q_padded,
        cp_size=cp_size,
        cp_rank=cp_rank,
        device=device,
    )
    cache_layout(packed_seq_params, layout)
    return layout


def cache_layout(packed_seq_params: Any, layout: ThdLayout) -> None:
    """Cache ``layout`` on ``packed_seq_params`` where :func:`thd_layout` looks it up: under its own CP size,
    CP rank and device (the one key, so that a writer ahead of the attention and its reader cannot drift)."""
    cache: dict[Any, ThdLayout] | None = getattr(packed_seq_params, LAYOUT_CACHE_ATTR, None)
    if cache is None:
        cache = {}
        object.__setattr__(packed_seq_params, LAYOUT_CACHE_ATTR, cache)
    cache[_cache_key(cp_size=layout.cp_size, cp_rank=layout.cp_rank, device=layout.valid.device)] = layout


def _cache_key(*, cp_size: int, cp_rank: int, device: torch.device | str) -> tuple[int, int, str]:
    """``"cuda"`` and ``"cuda:<current>"`` name one device: the key carries the index either way."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return cp_size, cp_rank, str(resolved)


def build_thd_layout(
    *,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    cp_size: int,
    cp_rank: int,
    device: torch.device | str,
) -> ThdLayout:
    """Index tensors of CP rank ``cp_rank`` of ``cp_size`` for whole-sequence offsets (true and padded).

    One host sync (``tolist``); call once per micro-batch (:func:`thd_layout` caches it).
    """
    cu_padded = [
        int(x) for x in (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens).tolist()
    ]
    cu_true = [int(x) for x in cu_seqlens.tolist()]
    if len(cu_padded) != len(cu_true) or len(cu_padded) < 2:
        raise ValueError(
            f"cu_seqlens ({len(cu_true)} entries) and cu_seqlens_padded ({len(cu_padded)}) must describe the"
            " same sequences, at least one"
        )
    padded = [b - a for a, b in itertools.pairwise(cu_padded)]
    true = [b - a for a, b in itertools.pairwise(cu_true)]
    for i, (p, t) in enumerate(zip(padded, true, strict=True)):
        if t > p or p <= 0:
            raise ValueError(f"sequence {i}: true length {t} and padded length {p} are inconsistent")
        if cp_size > 1 and p % (2 * cp_size):
            raise ValueError(
                f"sequence {i}: padded length {p} is not a multiple of 2 x cp_size = {2 * cp_size}; pad with"
                " preprocess_thd_engine (alignment tp * cp * 2)"
            )
    # One computation of the zigzag layout (verl-dyncp's THDPackedMeta, the planner's own); this is the
    # attention's view of it: rank-major rows of the gathered K/V buffer and the key stream per query chunk.
    meta = build_thd_meta(seq_lens=true, cp_size=cp_size, cp_rank=cp_rank, padded_lens=padded)
    chunk = [int(c) for c in meta.chunk_lens.tolist()]
    if cp_size == 1:
        q_lens, k_lens = list(padded), list(padded)
        full_index = stream_index = None
    else:
        kv_first = (meta.cu_seqlens_kv_first[1:] - meta.cu_seqlens_kv_first[:-1]).tolist()
        kv_second = (meta.cu_seqlens_kv_second[1:] - meta.cu_seqlens_kv_second[:-1]).tolist()
        q_lens = [h for c in chunk for h in (c, c)]
        k_lens = [k for pair in zip(kv_first, kv_second, strict=True) for k in pair]
        rows = meta.padded_to_gathered
        firsts = rows[meta.kv_index_first].split(kv_first)
        seconds = rows[meta.kv_index_second].split(kv_second)
        full_index = rows.to(device)
        stream_index = torch.cat([t for pair in zip(firsts, seconds, strict=True) for t in pair]).to(device)

    def cumsum(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)

    return ThdLayout(
        cp_size=cp_size,
        cp_rank=cp_rank,
        num_local_tokens=meta.local_tokens,
        padded_lens=tuple(padded),
        local_starts=tuple(int(x) for x in meta.local_cu_seqlens[:-1].tolist()),
        full_starts=tuple(int(x) for x in meta.cu_seqlens_padded[:-1].tolist()),
        position_ids=meta.position_ids.to(device),
        valid=(~meta.is_padding).to(device),
        full_index=full_index,
        stream_index=stream_index,
        cu_seqlens_q=cumsum(q_lens),
        cu_seqlens_k=cumsum(k_lens),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
        has_padding=padded != true,
    )


def thd_packed_seq_params(meta: Any, *, cp_group: dist.ProcessGroup | None) -> Any:
    """megatron-core PackedSeqParams for one rank's THD share (``meta``: its THDPackedMeta), CP group attached.

    The one place that turns the layout of :func:`verl_dyncp.thd.preprocess_thd_engine` into what
    GPTModel.forward takes (``qkv_format="thd"``, true and padded cu_seqlens, padded max length), so an
    engine and the tests build the same thing. ``cp_group`` None means CP size 1.
    """
    from verl_mcore_utils.compat import make_packed_seq_params  # megatron-core only when used

    params = make_packed_seq_params(
        qkv_format="thd",
        cu_seqlens_q=meta.cu_seqlens,
        cu_seqlens_kv=meta.cu_seqlens,
        cu_seqlens_q_padded=meta.cu_seqlens_padded,
        cu_seqlens_kv_padded=meta.cu_seqlens_padded,
        max_seqlen_q=meta.max_seqlen_padded,
        max_seqlen_kv=meta.max_seqlen_padded,
    )
    params = attach_cp_context(params, cp_group=cp_group)
    _prebuild_layout(params, meta)
    return params


def _prebuild_layout(params: Any, meta: Any) -> None:
    """Build the attention's layout now, while the batch is prepared, and cache it for the forward.

    Built in the first layer's attention instead, it would read cu_seqlens back from the GPU (a sync in
    the middle of the forward) and run its index arithmetic on the host while the GPU waits. At CP size 1
    it is a view of ``meta`` (no copy, no sync).
    """
    context = get_cp_context(params)
    if (context.size, context.rank) != (meta.cp_size, meta.cp_rank):
        return  # an unusual pairing: leave it to the forward
    device = meta.position_ids.device
    if context.size == 1:
        padded = list(meta.padded_lens)
        starts = tuple(itertools.accumulate(padded[:-1], initial=0))
        layout = ThdLayout(
            cp_size=1,
            cp_rank=0,
            num_local_tokens=sum(padded),
            padded_lens=tuple(padded),
            local_starts=starts,
            full_starts=starts,
            position_ids=meta.position_ids,
            valid=~meta.is_padding,
            full_index=None,
            stream_index=None,
            cu_seqlens_q=meta.cu_seqlens_padded,
            cu_seqlens_k=meta.cu_seqlens_padded,
            max_seqlen_q=max(padded),
            max_seqlen_k=max(padded),
            has_padding=padded != list(meta.seq_lens),
        )
    else:
        layout = build_thd_layout(
            cu_seqlens=meta.cu_seqlens,
            cu_seqlens_padded=meta.cu_seqlens_padded,
            cp_size=context.size,
            cp_rank=context.rank,
            device=device,
        )
    cache_layout(params, layout)
