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
from typing import Any

import torch

from verl_dyncp.cp_context import LAYOUT_CACHE_ATTR, attach_cp_context
from verl_dyncp.layout import ThdLayout

__all__ = ["GraphSlots", "graph_packed_seq_params", "graph_thd_layout", "pad_layout_to_slots"]


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

    def fit(self, *, tokens: int, sequences: int) -> bool:
        """Whether a micro-batch of ``tokens`` rows in ``sequences`` sequences fits (with its padding slot)."""
        return tokens <= self.tokens and sequences + (tokens < self.tokens) <= self.sequences


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
    if not slots.fit(tokens=used, sequences=count):
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
    return ThdLayout(
        cp_size=1,
        cp_rank=0,
        num_local_tokens=slots.tokens,
        padded_lens=(),  # per-sequence host lengths are what a graph cannot have; the varlen path needs none
        local_starts=(),
        full_starts=(),
        position_ids=position_ids,
        valid=valid,
        full_index=None,
        stream_index=None,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=slots.tokens,
        max_seqlen_k=slots.tokens,
        has_padding=True,
        graph_safe=True,
    )


def graph_packed_seq_params(
    *, cu_seqlens: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor, slots: GraphSlots
) -> Any:
    """megatron-core PackedSeqParams (CP size 1) carrying :func:`graph_thd_layout` for verl-dyncp's attention.

    What a graphed decoder's forward passes to megatron-core's TransformerBlock, built from its input tensors
    on every call (warm-up, capture); replays then read whatever layout was copied into those tensors.
    """
    from verl_mcore_utils.compat import make_packed_seq_params  # megatron-core only when used

    layout = graph_thd_layout(cu_seqlens=cu_seqlens, position_ids=position_ids, valid=valid, slots=slots)
    params = make_packed_seq_params(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=slots.tokens,
        max_seqlen_kv=slots.tokens,
    )
    params = attach_cp_context(params, cp_group=None)
    getattr(params, LAYOUT_CACHE_ATTR)[(1, 0, str(cu_seqlens.device))] = layout
    return params
