"""Fixed-shape CP-1 layouts: what lets one CUDA graph of the decoder serve every micro-batch of a token budget.

Why: a CP-1 micro-batch of 2048 tokens runs the decoder launch-bound (docs/benchmarks.md, "CUDA graphs on a
dynamic-CP micro-batch": 51.6 ms eager, 15.2 ms replayed from one graph, 12 layers at hidden 2048). A graph
replays fixed shapes and fixed addresses, while micro-batches differ in token count, sequence count and
lengths. So every micro-batch is padded to ``GraphSlots`` (a token budget and a number of sequence slots) and
its layout is passed to the graph as three tensors of fixed shape, copied into the graph's inputs:

* ``cu_seqlens`` ``[sequences + 1]`` int32: the micro-batch's sequences, then one sequence holding the padding
  tokens, then empty sequences (repeated offsets) up to the slot count;
* ``position_ids`` ``[tokens]``: the micro-batch's RoPE positions, then ``0, 1, ...`` for the padding sequence;
* ``valid`` ``[tokens]`` bool: False for every padding token (its attention output is zeroed, no gradient).

Inside the graph :func:`graph_thd_layout` builds the attention's :class:`~verl_dyncp.layout.ThdLayout` from
those tensors only: no host reads, the varlen kernel's maximum length fixed to the budget, and
``graph_safe`` set so the attention takes the varlen path (its dense path plans kernels per micro-batch on
the host, which a replay would not redo).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from verl_dyncp.cp_context import attach_cp_context
from verl_dyncp.layout import ThdLayout, build_thd_layout, cache_layout
from verl_mcore_utils.transfer import to_device_async

__all__ = [
    "CpGraphInputs",
    "GraphSlots",
    "graph_cp_packed_seq_params",
    "graph_cp_thd_layout",
    "graph_packed_seq_params",
    "graph_thd_layout",
    "pad_cp_layout_to_slots",
    "pad_cp_micro_batch_to_slots",
    "pad_layout_to_slots",
]


@dataclasses.dataclass(frozen=True)
class GraphSlots:
    """The fixed shape of a graphed CP-1 micro-batch: ``tokens`` rows, at most ``sequences`` sequences.

    One slot is kept for the padding sequence whenever a micro-batch has fewer tokens than the budget, so a
    micro-batch fits when it has at most ``tokens`` tokens and fewer than ``sequences`` sequences (or exactly
    ``sequences`` sequences filling the budget).
    """

    tokens: int
    sequences: int

    def __post_init__(self) -> None:
        for name in ("tokens", "sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GraphSlots.{name} must be a positive int, got {value!r}")
        if self.sequences > self.tokens:
            raise ValueError(
                f"GraphSlots.sequences={self.sequences} exceeds tokens={self.tokens}: a sequence has at least"
                " one token, so the extra slots could never be used"
            )

    def fit(self, *, tokens: int, sequences: int, cp_size: int = 1) -> bool:
        """Whether a micro-batch of ``tokens`` rows in ``sequences`` sequences fits (with its padding slot).

        ``cp_size`` k > 1: ``tokens`` counts the whole micro-batch's padded tokens, split over k ranks of
        ``self.tokens`` rows each (and the slots must be even: a rank holds two chunks of every sequence).
        """
        if cp_size > 1 and self.tokens % 2:
            return False
        budget = cp_size * self.tokens
        return tokens <= budget and sequences + (tokens < budget) <= self.sequences

    def holds(self, layout: ThdLayout) -> bool:
        """Whether the micro-batch of ``layout`` (a micro-batch's own layout, its CP size's) fits: :meth:`fit`
        over its padded lengths, which every rank of a CP group shares, so the group agrees on the answer."""
        padded = layout.padded_lens
        return self.fit(tokens=sum(padded), sequences=len(padded), cp_size=layout.cp_size)


def pad_layout_to_slots(
    layout: ThdLayout, *, slots: GraphSlots
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, position_ids, valid)`` of a CP-1 micro-batch's layout padded to ``slots``.

    Device ops only (the layout's tensors stay on their device, nothing is read back): this runs per
    micro-batch on the host's critical path. Raises ValueError, naming the numbers, for a micro-batch that
    does not fit; the caller then runs it eagerly or plans smaller micro-batches.
    """
    if layout.cp_size != 1:
        raise ValueError(
            f"graph layouts are CP-1 only: this micro-batch's layout is for CP size {layout.cp_size}"
        )
    used, count = layout.num_local_tokens, len(layout.padded_lens)
    if not slots.holds(layout):
        raise ValueError(
            f"micro-batch of {used} tokens in {count} sequences does not fit GraphSlots(tokens={slots.tokens},"
            f" sequences={slots.sequences}) (one slot goes to the padding sequence when tokens are left"
            " over): raise the slots or cut smaller micro-batches"
        )
    device = layout.cu_seqlens_q.device
    cu = torch.full((slots.sequences + 1,), slots.tokens, dtype=torch.int32, device=device)
    cu[: count + 1] = layout.cu_seqlens_q
    positions = torch.arange(slots.tokens, dtype=layout.position_ids.dtype, device=device) - used
    positions[:used] = layout.position_ids
    valid = torch.zeros(slots.tokens, dtype=torch.bool, device=device)
    valid[:used] = layout.valid
    return cu, positions, valid


def graph_thd_layout(
    *, cu_seqlens: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor, slots: GraphSlots
) -> ThdLayout:
    """The attention layout over a graph's input tensors (from :func:`pad_layout_to_slots`), built per call.

    Build it inside the graphed forward, not once: a fresh layout has an empty RoPE-table cache, so the
    tables are computed in the captured work (from whatever positions a replay copies in), not reused from
    a warm-up call.
    """
    if tuple(cu_seqlens.shape) != (slots.sequences + 1,) or cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens must be int32 of shape ({slots.sequences + 1},) for {slots}, got"
            f" {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    for name, t in (("position_ids", position_ids), ("valid", valid)):
        if tuple(t.shape) != (slots.tokens,):
            raise ValueError(f"{name} must have shape ({slots.tokens},) for {slots}, got {tuple(t.shape)}")
    return _graph_safe_layout(
        slots=slots, cp_size=1, cp_rank=0, position_ids=position_ids, valid=valid, full_index=None,
        stream_index=None, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
    )  # fmt: skip


def _graph_safe_layout(
    *,
    slots: GraphSlots,
    cp_size: int,
    cp_rank: int,
    position_ids: torch.Tensor,
    valid: torch.Tensor,
    full_index: torch.Tensor | None,
    stream_index: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
) -> ThdLayout:
    """A layout over a graph's input tensors: ``slots.tokens`` local rows, the maximum lengths the fixed
    bounds of the slots (a query chunk at most ``T`` rows, a key stream at most ``k T``), no per-sequence host
    lengths (what a graph cannot have; the varlen path needs none) and ``graph_safe`` set."""
    return ThdLayout(
        cp_size=cp_size,
        cp_rank=cp_rank,
        num_local_tokens=slots.tokens,
        padded_lens=(),
        local_starts=(),
        full_starts=(),
        position_ids=position_ids,
        valid=valid,
        full_index=full_index,
        stream_index=stream_index,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=slots.tokens,
        max_seqlen_k=cp_size * slots.tokens,
        has_padding=True,
        graph_safe=True,
    )


def _params_carrying(layout: ThdLayout, *, cp_group: Any) -> Any:
    """megatron-core PackedSeqParams over a graph layout's tensors, with the CP context attached and the layout
    cached under the (CP size, CP rank, device) key the attention looks up (so it never builds its own)."""
    from verl_mcore_utils.compat import make_packed_seq_params  # megatron-core only when used

    params = make_packed_seq_params(
        qkv_format="thd",
        cu_seqlens_q=layout.cu_seqlens_q,
        cu_seqlens_kv=layout.cu_seqlens_k,
        cu_seqlens_q_padded=layout.cu_seqlens_q,
        cu_seqlens_kv_padded=layout.cu_seqlens_k,
        max_seqlen_q=layout.max_seqlen_q,
        max_seqlen_kv=layout.max_seqlen_k,
    )
    params = attach_cp_context(params, cp_group=cp_group)
    cache_layout(params, layout)
    return params


def graph_packed_seq_params(
    *, cu_seqlens: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor, slots: GraphSlots
) -> Any:
    """megatron-core PackedSeqParams (CP size 1) carrying :func:`graph_thd_layout` for verl-dyncp's attention.

    What a graphed decoder's forward passes to megatron-core's TransformerBlock, built from its input tensors
    on every call (warm-up, capture); replays then read whatever layout was copied into those tensors.
    """
    layout = graph_thd_layout(cu_seqlens=cu_seqlens, position_ids=position_ids, valid=valid, slots=slots)
    return _params_carrying(layout, cp_group=None)


@dataclasses.dataclass(frozen=True)
class CpGraphInputs:
    """One CP rank's share of a CP-k micro-batch as tensors whose shapes depend only on ``slots`` and ``k``.

    The step toward graphs of CP > 1 micro-batches: the CP attention's varlen path reads nothing but index
    tensors (the all-gathered K/V rows of each query chunk's key stream), and under the zigzag split a rank's
    key stream has ``(2k + 1) / 2`` rows per local row whatever the lengths (a sequence of ``2kc`` padded tokens
    gives a rank chunks ``r`` and ``2k-1-r`` of ``c`` rows, with ``(r + 1)c + (2k - r)c`` keys). So one padding
    sequence filling the batch to ``k x slots.tokens`` fixes every shape:

    * ``position_ids``, ``valid`` ``[T]`` (``T = slots.tokens`` local rows);
    * ``full_index`` ``[k T]``: the padded batch in sequence order -> rows of the gathered K/V (rank-major);
    * ``stream_index`` ``[(2k + 1) T / 2]``: the key rows of each query chunk, chunk after chunk;
    * ``cu_seqlens_q``, ``cu_seqlens_k`` ``[2 x sequences + 1]`` int32: two chunks per sequence slot.
    """

    position_ids: torch.Tensor
    valid: torch.Tensor
    full_index: torch.Tensor
    stream_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors in field order: the order a graph takes them in (and ``CpGraphInputs(*t)`` rebuilds)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def pad_cp_micro_batch_to_slots(
    *,
    seq_lens: list[int],
    padded_lens: list[int],
    cp_size: int,
    cp_rank: int,
    slots: GraphSlots,
    device: torch.device | str,
) -> CpGraphInputs:
    """:class:`CpGraphInputs` of rank ``cp_rank`` for a micro-batch of ``seq_lens`` (padded to ``padded_lens``).

    ``slots.tokens`` counts one rank's rows, so the whole micro-batch may hold ``cp_size x slots.tokens``
    padded tokens. Built on the host from the lengths (which the micro-batch's own layout read already).
    Raises ValueError naming the numbers for a micro-batch that does not fit, or odd slots.
    """
    if cp_size < 2:
        raise ValueError(
            f"pad_cp_micro_batch_to_slots is for CP size >= 2 (CP 1: pad_layout_to_slots), got {cp_size}"
        )
    if slots.tokens % 2:
        raise ValueError(
            f"GraphSlots.tokens={slots.tokens} must be even under CP: a rank holds two chunks a sequence"
        )
    total, budget = sum(padded_lens), cp_size * slots.tokens
    if not slots.fit(tokens=total, sequences=len(padded_lens), cp_size=cp_size):
        raise ValueError(
            f"CP-{cp_size} micro-batch of {total} padded tokens in {len(padded_lens)} sequences does not fit"
            f" GraphSlots(tokens={slots.tokens}, sequences={slots.sequences}) ({budget} tokens over the CP group,"
            " one slot for the padding sequence): raise the slots or cut smaller micro-batches"
        )
    lens, padded = list(seq_lens), list(padded_lens)
    if (
        total < budget
    ):  # the padding sequence (one "true" token for the layout's rules; all its rows masked below)
        lens.append(1)
        padded.append(budget - total)

    def cu(values: list[int]) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(values)], dtype=torch.int32)

    layout = build_thd_layout(  # on the host: no device work, no reads back
        cu_seqlens=cu(lens), cu_seqlens_padded=cu(padded), cp_size=cp_size, cp_rank=cp_rank, device="cpu"
    )
    assert layout.full_index is not None and layout.stream_index is not None  # CP > 1
    chunks = 2 * slots.sequences + 1

    def fill(cu_lens: torch.Tensor) -> torch.Tensor:
        out = torch.full((chunks,), int(cu_lens[-1]), dtype=torch.int32)
        out[: cu_lens.numel()] = cu_lens
        return out

    valid = layout.valid.clone()
    valid[total // cp_size :] = False  # a rank's rows are in sequence order: the padding sequence's come last
    host = CpGraphInputs(
        position_ids=layout.position_ids,
        valid=valid,
        full_index=layout.full_index,
        stream_index=layout.stream_index,
        cu_seqlens_q=fill(layout.cu_seqlens_q),
        cu_seqlens_k=fill(layout.cu_seqlens_k),
    )
    # pinned and non_blocking: a blocking copy from pageable memory would make the host wait for every kernel
    # queued before the replay (PyTorch synchronises the stream for it)
    return CpGraphInputs(*(to_device_async(t, device) for t in host.tensors()))


def graph_cp_thd_layout(inputs: CpGraphInputs, *, cp_size: int, cp_rank: int, slots: GraphSlots) -> ThdLayout:
    """The attention layout over a graph's CP-k input tensors (:class:`CpGraphInputs`), built per call.

    The maximum lengths are the fixed bounds of the slots (a query chunk has at most ``T`` rows, a key stream
    at most ``k T``), so no host read depends on the micro-batch.
    """
    shapes = {
        "position_ids": (slots.tokens,),
        "valid": (slots.tokens,),
        "full_index": (cp_size * slots.tokens,),
        "stream_index": ((2 * cp_size + 1) * slots.tokens // 2,),
        "cu_seqlens_q": (2 * slots.sequences + 1,),
        "cu_seqlens_k": (2 * slots.sequences + 1,),
    }
    for name, shape in shapes.items():
        got = tuple(getattr(inputs, name).shape)
        if got != shape:
            raise ValueError(f"{name} must have shape {shape} for CP {cp_size} and {slots}, got {got}")
    return _graph_safe_layout(
        slots=slots, cp_size=cp_size, cp_rank=cp_rank, position_ids=inputs.position_ids, valid=inputs.valid,
        full_index=inputs.full_index, stream_index=inputs.stream_index, cu_seqlens_q=inputs.cu_seqlens_q,
        cu_seqlens_k=inputs.cu_seqlens_k,
    )  # fmt: skip


def pad_cp_layout_to_slots(layout: ThdLayout, *, slots: GraphSlots) -> CpGraphInputs:
    """:class:`CpGraphInputs` of a CP-k micro-batch from its own (cached) layout: what a graphed decoder replays.

    The layout holds the padded lengths on the host and the valid rows on the device, not the true lengths;
    the valid rows are all the graph needs of them (positions past a true length only reach masked rows), so
    the inputs are built from the padded lengths and the layout's ``valid`` is copied in (a device copy).
    """
    if layout.cp_size < 2 or not layout.padded_lens:
        raise ValueError(
            f"pad_cp_layout_to_slots needs a CP >= 2 micro-batch's own layout, got CP {layout.cp_size} with"
            f" {len(layout.padded_lens)} host lengths (a graph layout has none)"
        )
    padded = list(layout.padded_lens)
    inputs = pad_cp_micro_batch_to_slots(
        seq_lens=padded,
        padded_lens=padded,
        cp_size=layout.cp_size,
        cp_rank=layout.cp_rank,
        slots=slots,
        device=layout.position_ids.device,
    )
    inputs.valid[: layout.num_local_tokens] = layout.valid
    return inputs


def graph_cp_packed_seq_params(
    inputs: CpGraphInputs, *, cp_group: Any, cp_size: int, cp_rank: int, slots: GraphSlots
) -> Any:
    """megatron-core PackedSeqParams carrying :func:`graph_cp_thd_layout` and the CP group, built per call.

    The CP-k counterpart of :func:`graph_packed_seq_params`: the attention finds the layout in the cache under
    its (CP size, CP rank, device) key and all-gathers K/V over ``cp_group`` inside the graph.
    """
    layout = graph_cp_thd_layout(inputs, cp_size=cp_size, cp_rank=cp_rank, slots=slots)
    return _params_carrying(layout, cp_group=cp_group)
