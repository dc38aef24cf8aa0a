"""Packed (THD) sequences split over a context-parallel group with zigzag load balancing, and back.

Everything is computed from the sequence lengths alone (:func:`build_thd_meta`), so every rank can compute
every other rank's layout without communication. Only ``torch`` (and verl-mcore-utils' pinned copy) is
imported. The layout is described in the package README.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verl_mcore_utils.transfer import to_device_async

__all__ = [
    "THDBatch",
    "THDPackedMeta",
    "build_thd_meta",
    "gather_slots",
    "postprocess_thd_engine",
    "preprocess_thd_engine",
    "thd_alignment",
]


def thd_alignment(*, cp_size: int, tp_size: int = 1) -> int:
    """The multiple every sequence is padded to: ``tp * cp * 2``, or ``tp`` without CP."""
    _check_positive("cp_size", cp_size)
    _check_positive("tp_size", tp_size)
    return tp_size if cp_size == 1 else tp_size * cp_size * 2


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _as_lens(seq_lens: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    lens = tuple(int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens))
    if not lens:
        raise ValueError("seq_lens is empty: a packed micro-batch needs at least one sequence")
    bad = [(i, n) for i, n in enumerate(lens) if n < 1]
    if bad:
        raise ValueError(
            f"every sequence needs at least one token; (index, length) of the bad ones: {bad[:8]}"
        )
    return lens


def _segments(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(starts[i], starts[i] + lens[i])`` for every i (int64)."""
    total = int(lens.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(lens)), lens)
    first = torch.cumsum(lens, 0) - lens
    return starts[seg] + (torch.arange(total) - first[seg])


def _cu(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])


def _rank_positions(
    padded: torch.Tensor, chunk: torch.Tensor, local_lens: torch.Tensor, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence id, position within the padded sequence, offset within the local sequence) per local token."""
    seq = torch.repeat_interleave(torch.arange(len(padded)), local_lens)
    j = torch.arange(int(local_lens.sum())) - (_cu(local_lens)[:-1])[seq]
    h = chunk[seq]
    pos = torch.where(j < h, cp_rank * h + j, padded[seq] - (cp_rank + 1) * h + (j - h))
    return seq, pos, j


@dataclass(frozen=True, eq=False)
class THDPackedMeta:
    """Where every local token of one CP rank comes from, and what its attention must see.

    Per local token (length ``local_tokens = sum(padded_lens) / cp_size``, local order: per
    sequence, its first chunk then its second chunk):

    * ``position_ids`` (int64): the token's position in its sequence in the no-CP run (padding
      continues the count); ``is_padding`` (bool) flags the padding.
    * ``source_index`` (int64): index into the packed unpadded input, -1 for padding;
      ``label_index``: index of the next token of the same sequence, -1 where there is none.
    * ``global_index`` (int64): index into the full padded packed buffer (``sum(padded_lens)`` tokens).

    Per sequence (int32 ``cu_seqlens*`` of length ``B + 1``, int64 offsets):

    * ``cu_seqlens`` (true lengths) and ``cu_seqlens_padded`` (padded lengths), both global;
      ``local_cu_seqlens`` (``padded_len / cp`` per sequence) over the local buffer.
    * ``chunk_lens`` (``h``, or ``padded_len`` when cp == 1), ``first_chunk_offsets`` /
      ``second_chunk_offsets``: where the two chunks start in the local buffer.

    For causal zigzag attention (queries of a chunk attend to a prefix of their sequence, mask
    aligned bottom-right: query ``i`` of a chunk of ``q`` tokens over ``kv`` keys sees keys
    ``<= kv - q + i``):

    * first chunks: ``q_index_first`` (local positions, packed by sequence), ``cu_seqlens_q_first``,
      keys ``[0, (r+1)*h)`` of each padded sequence: ``kv_index_first`` (into the full padded buffer),
      ``cu_seqlens_kv_first``;
    * second chunks: the same with ``_second`` and keys ``[0, padded_len - r*h)`` (empty when cp == 1).
    * ``padded_to_gathered`` (int64, ``sum(padded_lens)``): after all-gathering the local buffers of
      the CP ranks in rank order and concatenating them, ``gathered[padded_to_gathered]`` is the full
      padded buffer; compose it with ``kv_index_*`` to pick keys straight from the gathered buffer.
    * ``unpadded_to_gathered`` (int64, ``T``): the same for the packed unpadded tokens (postprocess).
    """

    seq_lens: tuple[int, ...]
    cp_size: int
    cp_rank: int
    tp_size: int
    alignment: int
    padded_lens: tuple[int, ...]
    position_ids: torch.Tensor
    is_padding: torch.Tensor
    source_index: torch.Tensor
    label_index: torch.Tensor
    global_index: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    local_cu_seqlens: torch.Tensor
    chunk_lens: torch.Tensor
    first_chunk_offsets: torch.Tensor
    second_chunk_offsets: torch.Tensor
    q_index_first: torch.Tensor
    q_index_second: torch.Tensor
    cu_seqlens_q_first: torch.Tensor
    cu_seqlens_q_second: torch.Tensor
    kv_index_first: torch.Tensor
    kv_index_second: torch.Tensor
    cu_seqlens_kv_first: torch.Tensor
    cu_seqlens_kv_second: torch.Tensor
    max_seqlen_padded: int
    max_seqlen_q: int
    max_seqlen_kv_first: int
    max_seqlen_kv_second: int
    padded_to_gathered: torch.Tensor
    unpadded_to_gathered: torch.Tensor
    local_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {self.cp_rank}")
        if len(self.padded_lens) != len(self.seq_lens):
            raise ValueError(f"{len(self.padded_lens)} padded lengths for {len(self.seq_lens)} sequences")
        for n, p in zip(self.seq_lens, self.padded_lens, strict=True):
            if p < n or p % self.alignment:
                raise ValueError(
                    f"padded length {p} of a sequence of {n} tokens is not a multiple of {self.alignment} >= {n}"
                )
        object.__setattr__(self, "local_tokens", sum(self.padded_lens) // self.cp_size)
        for name in ("position_ids", "is_padding", "source_index", "label_index", "global_index"):
            if getattr(self, name).shape != (self.local_tokens,):
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({self.local_tokens},)"
                )

    @property
    def total_tokens(self) -> int:
        """``T``: real tokens of the packed input."""
        return sum(self.seq_lens)

    def take(self, tensor: torch.Tensor, *, pad_value: float | bool = 0) -> torch.Tensor:
        """This rank's share of a per-token packed tensor (dim 0 = ``T``), padding filled with ``pad_value``."""
        return self._pick(tensor, self.source_index, pad_value)

    def take_next(self, tensor: torch.Tensor, *, fill: float | bool = 0) -> torch.Tensor:
        """The next token's value of a per-token tensor for every local token (``fill`` where none)."""
        return self._pick(tensor, self.label_index, fill)

    def take_ahead(self, tensor: torch.Tensor, *, shift: int, fill: float | bool = 0) -> torch.Tensor:
        """The value ``shift`` tokens ahead in the same sequence, for every local token (``fill`` where none).

        ``shift=1`` is :meth:`take_next`. Read from the full packed tensor, so it is right across CP
        chunk borders and never crosses into the next sequence (multi-token prediction's targets).
        """
        _check_positive("shift", shift)
        if shift == 1:
            return self.take_next(tensor, fill=fill)
        src = self.source_index
        lens = torch.tensor(self.seq_lens, dtype=torch.int64, device=src.device)
        seq_of = torch.repeat_interleave(torch.arange(len(lens), device=src.device), lens)
        ends = torch.cumsum(lens, 0)  # one past each sequence's last packed token
        ahead = src + shift
        valid = (src >= 0) & (ahead < ends[seq_of[src.clamp(min=0)]])
        return self._pick(tensor, torch.where(valid, ahead, torch.full_like(ahead, -1)), fill)

    def _pick(self, tensor: torch.Tensor, index: torch.Tensor, fill: float | bool) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != self.total_tokens:
            raise ValueError(
                f"expected a packed tensor with {self.total_tokens} tokens in dim 0, got shape {tuple(tensor.shape)}"
            )
        index = index.to(tensor.device)
        valid = index >= 0
        picked = tensor.index_select(0, index.clamp(min=0))
        mask = valid.view(-1, *([1] * (tensor.dim() - 1)))
        return torch.where(mask, picked, torch.full((), fill, dtype=tensor.dtype, device=tensor.device))


def _padded(
    lens: torch.Tensor, *, padded_lens: Sequence[int] | None, cp_size: int, align: int
) -> tuple[torch.Tensor, int]:
    """The padded lengths and the alignment they keep: ``lens`` rounded up to ``align``, or ``padded_lens``
    (multiples of ``2 * cp`` under CP)."""
    if padded_lens is None:
        return (lens + align - 1) // align * align, align
    padded = torch.tensor([int(p) for p in padded_lens], dtype=torch.int64)
    if padded.shape != lens.shape:
        raise ValueError(f"{len(padded)} padded lengths for {len(lens)} sequences")
    return padded, 1 if cp_size == 1 else 2 * cp_size


def _gather_maps(
    global_indices: list[torch.Tensor], *, lens: torch.Tensor, cu: torch.Tensor, cu_pad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row of every padded token, and of every real token, in the buffer of all ranks' local tokens
    (rank-major); ``global_indices[r]``: the padded position of each of rank ``r``'s local tokens."""
    n_local = global_indices[0].numel()
    padded_to_gathered = torch.empty(n_local * len(global_indices), dtype=torch.int64)
    for rank, g in enumerate(global_indices):
        padded_to_gathered[g] = torch.arange(rank * n_local, (rank + 1) * n_local)
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), lens)
    unpadded_pos = torch.arange(int(lens.sum())) - cu[:-1][seq_of_token]
    return padded_to_gathered, padded_to_gathered[cu_pad[:-1][seq_of_token] + unpadded_pos]


def _gathered_index(*, seq_lens: Sequence[int], cp_size: int, tp_size: int = 1) -> tuple[int, torch.Tensor]:
    """``(local_tokens, unpadded_to_gathered)`` of :func:`build_thd_meta` for the same lengths, in closed form.

    Why: merging a micro-batch's outputs needs only this map, for every CP block of its plan, once per
    micro-batch inside the step; building each block's whole layout for it (every rank's positions, twenty
    tensors) was host time the GPU waits for. Zigzag order: with ``h = padded / (2 * cp)``, position ``p`` of a
    sequence is in chunk ``c = p // h``; chunks ``c < cp`` are rank ``c``'s first, the others rank
    ``2 * cp - 1 - c``'s second (local offset ``h + p % h``); the gathered buffer is the ranks' local buffers
    in rank order. Equal to the layout's map token for token (tested).
    """
    lens = torch.tensor(_as_lens(seq_lens), dtype=torch.int64)
    padded, _ = _padded(
        lens, padded_lens=None, cp_size=cp_size, align=thd_alignment(cp_size=cp_size, tp_size=tp_size)
    )
    if cp_size == 1:  # one rank: each sequence's tokens at its padded offset
        return int(padded.sum()), _segments(_cu(padded)[:-1], lens)
    local_lens = padded // cp_size
    chunk = padded // (2 * cp_size)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pos = torch.arange(int(lens.sum())) - _cu(lens)[:-1][seq]
    h = chunk[seq]
    c = pos // h
    first = c < cp_size
    rank = torch.where(first, c, 2 * cp_size - 1 - c)
    offset = pos - c * h + torch.where(first, 0, h)  # the second chunk starts h into the local sequence
    local_tokens = int(local_lens.sum())
    return local_tokens, rank * local_tokens + _cu(local_lens)[:-1][seq] + offset


def _key_prefix_lens(
    padded: torch.Tensor, chunk: torch.Tensor, *, cp_size: int, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the keys the first and the second local chunk attend to (a prefix of the sequence)."""
    if cp_size == 1:
        return padded, torch.zeros_like(padded)
    return (cp_rank + 1) * chunk, padded - cp_rank * chunk


def _to(t: torch.Tensor, *, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """``t`` as ``dtype`` on ``device``, through pinned memory (no host wait: :func:`to_device_async`)."""
    t = t.to(dtype)
    return t if device is None else to_device_async(t, device)


def build_thd_meta(
    *,
    seq_lens: Sequence[int] | torch.Tensor,
    cp_size: int,
    cp_rank: int,
    tp_size: int = 1,
    device: torch.device | str | None = None,
    padded_lens: Sequence[int] | None = None,
) -> THDPackedMeta:
    """The zigzag layout of CP rank ``cp_rank`` for sequences of ``seq_lens`` tokens (lengths only).

    Sequences are padded to the alignment ``tp * cp * 2``, or to ``padded_lens`` when given (the lengths a
    batch was already padded to, e.g. ``cu_seqlens_q_padded`` of megatron's PackedSeqParams; multiples of
    ``2 * cp`` under CP): the attention builds its view of the same layout from those.
    """
    lens_t = _as_lens(seq_lens)
    align = thd_alignment(cp_size=cp_size, tp_size=tp_size)
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")
    lens = torch.tensor(lens_t, dtype=torch.int64)
    padded, align = _padded(lens, padded_lens=padded_lens, cp_size=cp_size, align=align)
    local_lens = padded // cp_size
    chunk = padded if cp_size == 1 else padded // (2 * cp_size)
    cu, cu_pad, cu_local = _cu(lens), _cu(padded), _cu(local_lens)

    def layout(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        seq, pos, j = _rank_positions(padded, chunk, local_lens, rank)
        return seq, pos, j, cu_pad[seq] + pos

    seq, pos, j, global_index = layout(cp_rank)
    length = lens[seq]
    source = torch.where(pos < length, cu[seq] + pos, -1)
    label = torch.where(pos + 1 < length, cu[seq] + pos + 1, -1)

    global_indices = [global_index if r == cp_rank else layout(r)[3] for r in range(cp_size)]
    padded_to_gathered, unpadded_to_gathered = _gather_maps(global_indices, lens=lens, cu=cu, cu_pad=cu_pad)
    first = j < chunk[seq]
    kv_first_lens, kv_second_lens = _key_prefix_lens(padded, chunk, cp_size=cp_size, cp_rank=cp_rank)
    q_second_lens = local_lens - chunk

    i32, i64 = (functools.partial(_to, dtype=dtype, device=device) for dtype in (torch.int32, torch.int64))
    return THDPackedMeta(
        seq_lens=lens_t,
        cp_size=cp_size,
        cp_rank=cp_rank,
        tp_size=tp_size,
        alignment=align,
        padded_lens=tuple(int(p) for p in padded),
        position_ids=i64(pos),
        is_padding=_to(pos >= length, dtype=torch.bool, device=device),
        source_index=i64(source),
        label_index=i64(label),
        global_index=i64(global_index),
        cu_seqlens=i32(cu),
        cu_seqlens_padded=i32(cu_pad),
        local_cu_seqlens=i32(cu_local),
        chunk_lens=i64(chunk),
        first_chunk_offsets=i64(cu_local[:-1]),
        second_chunk_offsets=i64(cu_local[:-1] + chunk),
        q_index_first=i64(torch.nonzero(first).flatten()),
        q_index_second=i64(torch.nonzero(~first).flatten()),
        cu_seqlens_q_first=i32(_cu(chunk)),
        cu_seqlens_q_second=i32(_cu(q_second_lens)),
        kv_index_first=i64(_segments(cu_pad[:-1], kv_first_lens)),
        kv_index_second=i64(_segments(cu_pad[:-1], kv_second_lens)),
        cu_seqlens_kv_first=i32(_cu(kv_first_lens)),
        cu_seqlens_kv_second=i32(_cu(kv_second_lens)),
        max_seqlen_padded=int(padded.max()),
        max_seqlen_q=int(chunk.max()),
        max_seqlen_kv_first=int(kv_first_lens.max()),
        max_seqlen_kv_second=int(kv_second_lens.max()),
        padded_to_gathered=i64(padded_to_gathered),
        unpadded_to_gathered=i64(unpadded_to_gathered),
    )


@dataclass(frozen=True, eq=False)
class THDBatch:
    """One CP rank's inputs: tokens, next-token labels, loss mask and true positions, plus the layout."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    meta: THDPackedMeta

    def __post_init__(self) -> None:
        n = self.meta.local_tokens
        for name in ("input_ids", "labels", "loss_mask", "position_ids"):
            t = getattr(self, name)
            if t.dim() == 0 or t.shape[0] != n:
                raise ValueError(
                    f"THDBatch.{name} has shape {tuple(t.shape)}; dim 0 must be {n} local tokens"
                )
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"THDBatch.loss_mask must be bool, got {self.loss_mask.dtype}")


def preprocess_thd_engine(
    input_ids: torch.Tensor,
    *,
    seq_lens: Sequence[int] | torch.Tensor,
    cp_size: int,
    cp_rank: int,
    tp_size: int = 1,
    pad_value: int = 0,
    ignore_index: int = -100,
    label_mask: torch.Tensor | None = None,
) -> THDBatch:
    """Pad, zigzag-split and label a packed batch for CP rank ``cp_rank`` of a group of ``cp_size``.

    ``input_ids`` is packed (dim 0 = ``sum(seq_lens)``); any dtype and trailing dims are kept.
    ``labels`` are the next token of the same sequence (``ignore_index`` for the last token of each
    sequence and for padding), read from the full input so chunk borders are right. ``loss_mask``
    is True where the label is a real token and, if ``label_mask`` (per packed token, "this token is
    a training target", e.g. the response mask) is given, where that target is selected.
    """
    meta = build_thd_meta(
        seq_lens=seq_lens, cp_size=cp_size, cp_rank=cp_rank, tp_size=tp_size, device=input_ids.device
    )
    has_label = meta.label_index >= 0
    if label_mask is not None:
        if label_mask.shape != (meta.total_tokens,):
            raise ValueError(
                f"label_mask must have shape ({meta.total_tokens},), got {tuple(label_mask.shape)}"
            )
        has_label = has_label & meta.take_next(label_mask.to(torch.bool), fill=False)
    return THDBatch(
        input_ids=meta.take(input_ids, pad_value=pad_value),
        labels=meta.take_next(input_ids, fill=ignore_index),
        loss_mask=has_label,
        position_ids=meta.position_ids,
        meta=meta,
    )


def gather_slots(
    local: torch.Tensor, *, group: dist.ProcessGroup | None, rank: int, lens: Sequence[int]
) -> torch.Tensor:
    """All-gather every rank's ``local`` (dim 0 = ``lens[rank]``) and concatenate them in rank order.

    The other ranks' slices arrive detached; this rank's slot is ``local`` itself, so autograd flows
    back only into this rank's own tensor (each rank owns the gradient of its own tokens and the
    DP x CP gradient reduction adds them up, nothing is counted twice). Bytes are transported, not
    values, so every dtype (bf16, bool, int64, ...) comes back bit-exact in its own dtype.
    """
    world = len(lens)
    if local.dim() == 0 or local.shape[0] != lens[rank]:
        raise ValueError(f"local tensor has shape {tuple(local.shape)}; dim 0 must be {lens[rank]}")
    if world == 1:
        return local
    if group is None:
        raise ValueError(f"a process group is needed to gather over {world} ranks")
    if dist.get_world_size(group) != world:
        raise ValueError(f"the process group has {dist.get_world_size(group)} ranks, expected {world}")
    longest = max(lens)
    src = local.detach().contiguous()
    send = src.new_zeros((longest, *src.shape[1:]))
    send[: src.shape[0]] = src
    if send.numel() == 0:  # nothing to move (a zero-sized trailing dim): the same on every rank
        return torch.cat([local if r == rank else send[: lens[r]] for r in range(world)], dim=0)
    send_bytes = send.view(torch.uint8)
    bufs = [torch.empty_like(send_bytes) for _ in range(world)]
    dist.all_gather(bufs, send_bytes, group=group)
    parts = [
        local if r == rank else buf.view(local.dtype).view(send.shape)[: lens[r]]
        for r, buf in enumerate(bufs)
    ]
    return torch.cat(parts, dim=0)


def postprocess_thd_engine(
    local_output: torch.Tensor, *, meta: THDPackedMeta, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Gather a per-token output over the CP group and return it packed, unpadded, in input order.

    ``local_output`` has ``meta.local_tokens`` in dim 0 (any trailing dims, any dtype; the dtype is
    kept). Gradients reach only this rank's ``local_output`` (see :func:`gather_slots`).
    ``cp_group`` may be None when ``cp_size == 1``.
    """
    gathered = gather_slots(
        local_output, group=cp_group, rank=meta.cp_rank, lens=[meta.local_tokens] * meta.cp_size
    )
    return gathered.index_select(0, meta.unpadded_to_gathered.to(gathered.device))
