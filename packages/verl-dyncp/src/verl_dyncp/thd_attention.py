"""Core attention for packed (THD) batches with a context-parallel group that may change every call.

Batches come in verl-dyncp's zigzag THD layout; the CP group travels with the batch (a :class:`CPContext`
from :func:`attach_cp_context`, then ``PackedSeqParams.cp_group``, then megatron-core's static CP group).
Every rank all-gathers K and V over the group (reduce-scatter in backward) and attends its local chunks
with causal masks from the true positions; RoPE is applied here from those positions. The README's design
notes give the layout contract, the algorithm, its cost and the kernels (``kernel="cudnn"``: dense
cuDNN attention per long sequence at CP 1 and the Triton RoPE kernel, the default on CUDA; ``"varlen"`` is
the plain varlen path).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_dyncp.rope import apply_rope_tables, rope_tables
from verl_dyncp.thd import build_thd_meta

__all__ = [
    "CPContext",
    "ThdLayout",
    "attach_cp_context",
    "build_thd_layout",
    "get_cp_context",
    "local_rope_qk",
    "pick_kernel",
    "thd_attention",
    "thd_layout",
    "thd_packed_seq_params",
    "varlen_kernel_available",
]

logger = logging.getLogger(__name__)

_CONTEXT_ATTR = "verl_cp_context"
_LAYOUT_CACHE_ATTR = "_verl_thd_layout_cache"


@dataclasses.dataclass(frozen=True)
class CPContext:
    """How one packed micro-batch is split over context-parallel ranks.

    ``cp_group`` None means CP size 1. ``position_ids`` (``[local tokens]``) overrides the RoPE positions
    derived from the zigzag layout; leave it None unless positions are not ``0..len-1`` per sequence.
    """

    cp_group: dist.ProcessGroup | None = None
    position_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return 1 if self.cp_group is None else dist.get_world_size(group=self.cp_group)

    @property
    def rank(self) -> int:
        return 0 if self.cp_group is None else dist.get_rank(group=self.cp_group)


def attach_cp_context(
    packed_seq_params: Any, *, cp_group: dist.ProcessGroup | None, position_ids: torch.Tensor | None = None
) -> Any:
    """Attach the CP group (and optional RoPE positions) of this micro-batch to ``packed_seq_params``.

    Returns the same object. Where PackedSeqParams has ``local_cp_size`` / ``cp_group`` (megatron-core
    >= 0.16) they are filled too, so megatron's Transformer Engine attention sees the same group; for CP
    size 1 that is ``cp_group=None, local_cp_size=1``, which switches TE's CP off (with
    ``local_cp_size=None`` TE would keep the previous micro-batch's group).
    """
    context = CPContext(cp_group=cp_group, position_ids=position_ids)
    object.__setattr__(packed_seq_params, _CONTEXT_ATTR, context)
    object.__setattr__(packed_seq_params, _LAYOUT_CACHE_ATTR, {})
    from verl_mcore_utils.compat import packed_seq_params_fields  # megatron-core only when used

    if "cp_group" in packed_seq_params_fields():
        packed_seq_params.cp_group = cp_group
        packed_seq_params.local_cp_size = context.size
    return packed_seq_params


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
    getattr(params, _LAYOUT_CACHE_ATTR)[(context.size, context.rank, str(device))] = layout


def get_cp_context(packed_seq_params: Any, *, static_cp_group: dist.ProcessGroup | None = None) -> CPContext:
    """The CPContext of a batch: attached one, else PackedSeqParams.cp_group, else ``static_cp_group``."""
    context = getattr(packed_seq_params, _CONTEXT_ATTR, None)
    if context is not None:
        return context
    group = getattr(packed_seq_params, "cp_group", None)
    if group is not None:
        return CPContext(cp_group=group)
    return CPContext(cp_group=static_cp_group)


@dataclasses.dataclass(frozen=True)
class ThdLayout:
    """Index tensors describing one rank's share of a zigzag-split packed batch (see module docstring).

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
    cache: dict[Any, ThdLayout] | None = getattr(packed_seq_params, _LAYOUT_CACHE_ATTR, None)
    key = (cp_size, cp_rank, str(device))
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
    if cache is None:
        cache = {}
        object.__setattr__(packed_seq_params, _LAYOUT_CACHE_ATTR, cache)
    cache[key] = layout
    return layout


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


@functools.cache
def _varlen_fn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_kernel_available() -> bool:
    """True when the installed torch has ``torch.nn.attention.varlen.varlen_attn``."""
    return _varlen_fn() is not None


_warned: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _varlen_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None,
) -> torch.Tensor:
    """torch's varlen kernel, causal and bottom-right aligned, with the arguments this torch release takes."""
    fn = _varlen_fn()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # k/v may be views of the gathered kv buffer
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:  # older releases spelled causality as a flag
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            reps = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: ThdLayout,
    scale: float | None,
) -> torch.Tensor:
    """Causal varlen flash attention, bottom-right aligned (each chunk sees its key prefix)."""
    cu_k = layout.cu_seqlens_q if layout.cp_size == 1 else layout.cu_seqlens_k
    return _varlen_call(
        q, k, v, layout.cu_seqlens_q, cu_k, layout.max_seqlen_q, layout.max_seqlen_k, scale=scale
    )


# Sequences at least this long take one dense SDPA call each (cuDNN's fused attention on Hopper), the rest
# of a row one varlen call per run of shorter sequences. Measured on one H100 (torch 2.11, 12 query / 2 KV
# heads of 128, bf16; benchmarks/results/attention_kernels_h100.json), forward + backward of a 4096-token
# sequence: dense cuDNN 0.89 ms, varlen (FlashAttention-2, K/V repeated for GQA) 1.85 ms; at 16384 tokens
# 5.8 vs 10.0 ms. Short sequences are cheaper together in one varlen call than one call each.
DENSE_MIN_TOKENS = 2048
# Dense windows are rounded up to this many tokens where the row allows, so that cuDNN, which builds one
# execution plan per shape, sees few distinct shapes when lengths vary from batch to batch.
DENSE_WINDOW_MULTIPLE = 256


@dataclasses.dataclass(frozen=True)
class _DenseSegment:
    start: int
    length: int  # the sequence's (padded) tokens
    window: int  # tokens given to the kernel: length, rounded up within the row


@dataclasses.dataclass(frozen=True)
class _VarlenSegment:
    start: int
    end: int
    cu_seqlens: torch.Tensor
    max_seqlen: int


def _segment_plan(layout: ThdLayout) -> tuple[Any, ...]:
    """Split a CP-1 row into dense segments (long sequences) and varlen runs (the rest), once per micro-batch.

    A dense window may reach past its sequence into the next tokens of the row: under causal masking a
    query never sees later keys, and the extra query rows are cut from the output, so their gradient is
    zero and gives the keys they saw nothing. No sequence's result depends on the rounding.
    """
    if layout.segment_plan is not None:
        return layout.segment_plan
    total = layout.num_local_tokens
    plan: list[Any] = []
    run: list[tuple[int, int]] = []

    def close_run() -> None:
        if run:
            start = run[0][0]
            offsets = [0, *itertools.accumulate(n for _, n in run)]
            cu = torch.tensor(offsets, dtype=torch.int32, device=layout.cu_seqlens_q.device)
            plan.append(_VarlenSegment(start, start + offsets[-1], cu, max(n for _, n in run)))
            run.clear()

    for start, length in zip(layout.local_starts, layout.padded_lens, strict=True):
        if length >= DENSE_MIN_TOKENS:
            close_run()
            rounded = -(-length // DENSE_WINDOW_MULTIPLE) * DENSE_WINDOW_MULTIPLE
            plan.append(_DenseSegment(start, length, min(rounded, total - start)))
        else:
            run.append((start, length))
    close_run()
    object.__setattr__(layout, "segment_plan", tuple(plan))  # a cache on the frozen layout, like rope_cache
    return layout.segment_plan


@functools.cache
def _dense_backends() -> list[Any]:
    """The fused SDPA kernels a dense call may use, cuDNN first (built once: this runs per layer and call)."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _segmented_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: ThdLayout,
    scale: float | None,
) -> torch.Tensor:
    """CP size 1: dense fused SDPA per long sequence, varlen per run of short ones, outputs in row order."""
    from torch.nn.attention import sdpa_kernel

    gqa = k.shape[1] != q.shape[1]
    outputs = []
    for seg in _segment_plan(layout):
        if isinstance(seg, _DenseSegment):
            window = slice(seg.start, seg.start + seg.window)
            qi, ki, vi = (t[window].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, s, d] views
            with sdpa_kernel(_dense_backends()):
                out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
            outputs.append(out.squeeze(0).transpose(0, 1)[: seg.length])
        else:
            part = slice(seg.start, seg.end)
            outputs.append(
                _varlen_call(
                    q[part],
                    k[part],
                    v[part],
                    seg.cu_seqlens,
                    seg.cu_seqlens,
                    seg.max_seqlen,
                    seg.max_seqlen,
                    scale=scale,
                )
            )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _sdpa_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    *,
    layout: ThdLayout,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """Reference path: one SDPA call per sequence with an explicit position mask (any device, any dtype)."""
    outputs = []
    gqa = k_full.shape[1] != q.shape[1]
    for p, ls, fs in zip(layout.padded_lens, layout.local_starts, layout.full_starts, strict=True):
        n_local = p // layout.cp_size
        q_i = q[ls : ls + n_local].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if layout.cp_size == 1:
            k_i, v_i = (t[fs : fs + p].transpose(0, 1).unsqueeze(0) for t in (k_full, v_full))
            out = F.scaled_dot_product_attention(
                q_i, k_i, v_i, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            h = p // (2 * layout.cp_size)
            k_end = p - layout.cp_rank * h  # the last key any local query of this sequence sees
            k_i, v_i = (t[fs : fs + k_end].transpose(0, 1).unsqueeze(0) for t in (k_full, v_full))
            q_pos = layout.position_ids[ls : ls + n_local]
            mask = torch.arange(k_end, device=q.device)[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(
                q_i, k_i, v_i, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
            )
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)


def pick_kernel(q: torch.Tensor, *, kernel: str = "auto", dropout_p: float = 0.0) -> str:
    """ "varlen" (torch's varlen flash kernel) where it applies, else "sdpa" (logged once on CUDA).

    varlen_attn needs CUDA, fp16/bf16 and no dropout; ``kernel`` "sdpa" or "varlen" forces a path
    ("varlen" raises when it cannot run).
    """
    if kernel == "sdpa":
        return "sdpa"
    fast_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0
    if kernel in ("varlen", "cudnn"):
        if not (fast_ok and varlen_kernel_available()):
            raise RuntimeError(
                f"kernel={kernel!r} needs torch.nn.attention.varlen, a CUDA tensor in fp16/bf16 and no dropout"
            )
        return "varlen"
    if fast_ok and varlen_kernel_available():
        return "varlen"
    if q.is_cuda:
        _log_once(
            "verl_dyncp attention: using the per-sequence SDPA path on CUDA (varlen_attn available="
            f"{varlen_kernel_available()}, dtype={q.dtype}, dropout={dropout_p}); expect lower throughput"
        )
    return "sdpa"


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
    if layout.cp_size > 1:
        kv = _AllGatherRows.apply(torch.cat((k, v), dim=-1), cp_group)
        kv = kv.index_select(0, layout.stream_index if chosen == "varlen" else layout.full_index)
        k, v = kv.split((k.shape[-1], v.shape[-1]), dim=-1)
    if chosen == "varlen" and layout.cp_size == 1 and kernel in ("auto", "cudnn"):
        out = _segmented_attention(q, k, v, layout=layout, scale=softmax_scale)
    elif chosen == "varlen":
        out = _varlen_attention(q, k, v, layout=layout, scale=softmax_scale)
    else:
        out = _sdpa_attention(q, k, v, layout=layout, scale=softmax_scale, dropout_p=dropout_p)
    if layout.has_padding:
        out = out * layout.valid[:, None, None].to(out.dtype)  # padding rows: zero output, no gradient
    return out.reshape(out.shape[0], -1)
