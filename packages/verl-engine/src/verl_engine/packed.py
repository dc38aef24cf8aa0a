"""Packed (THD) batches and how they are spread over the DP x CP ranks: static or dynamic CP.

The DP x CP ranks are one pool; each micro-batch (first-fit-decreasing by length, at most
``max_tokens_per_rank x n`` tokens) is split over it by verl-dyncp's planner with a CP size per micro-batch
(dynamic) or a fixed one (static). The README's "Packed batches" section says why it is done this way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from verl_mcore_utils.transfer import to_device_async

__all__ = [
    "CPLayout",
    "PackedBatch",
    "PlannedMicroBatch",
    "check_same_batch_on_every_rank",
    "cp_layout_from_config",
    "plan_micro_batches",
    "split_packed_micro_batches",
]


@dataclass(frozen=True)
class PackedBatch:
    """Sequences packed back to back: ``input_ids[cu[i]:cu[i+1]]`` is sequence ``i``.

    ``label_mask`` (bool, per token, optional) marks the tokens that are training targets (e.g. the
    response); without it every token after the first of each sequence is a target. An empty batch
    (no sequences) can be built so that every rank reaches the engine's consistency check, where it is
    refused with a clear error on every rank at once.
    """

    input_ids: torch.Tensor
    seq_lens: tuple[int, ...]
    label_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", tuple(int(n) for n in self.seq_lens))
        if self.input_ids.dim() != 1:
            raise ValueError(
                f"PackedBatch.input_ids must be 1-D (sequences back to back), got shape {tuple(self.input_ids.shape)}"
            )
        bad = [(i, n) for i, n in enumerate(self.seq_lens) if n < 1]
        if bad:
            raise ValueError(
                f"PackedBatch.seq_lens: every sequence needs >= 1 token; (index, length): {bad[:8]}"
            )
        if sum(self.seq_lens) != self.input_ids.shape[0]:
            raise ValueError(
                f"PackedBatch: seq_lens sum to {sum(self.seq_lens)} but input_ids has {self.input_ids.shape[0]} tokens"
            )
        if self.label_mask is not None and (
            self.label_mask.shape != self.input_ids.shape or self.label_mask.dtype != torch.bool
        ):
            raise ValueError(
                f"PackedBatch.label_mask must be bool of shape {tuple(self.input_ids.shape)},"
                f" got {self.label_mask.dtype} {tuple(self.label_mask.shape)}"
            )

    @classmethod
    def from_sequences(
        cls, sequences: Sequence[torch.Tensor], *, label_masks: Sequence[torch.Tensor] | None = None
    ) -> PackedBatch:
        """Pack a list of 1-D token tensors (and optional per-token target masks)."""
        lens = tuple(int(s.shape[0]) for s in sequences)
        ids = torch.cat(list(sequences)) if sequences else torch.zeros(0, dtype=torch.int64)
        mask = None
        if label_masks is not None:
            if len(label_masks) != len(sequences):
                raise ValueError(f"{len(label_masks)} label masks for {len(sequences)} sequences")
            mask = torch.cat([m.to(torch.bool) for m in label_masks]) if label_masks else None
        return cls(input_ids=ids, seq_lens=lens, label_mask=mask)

    @property
    def cu_seqlens(self) -> list[int]:
        cu = [0]
        for n in self.seq_lens:
            cu.append(cu[-1] + n)
        return cu

    @property
    def target_mask(self) -> torch.Tensor:
        """Per token: is it a training target (never the first token of a sequence)."""
        mask = torch.ones(self.input_ids.shape[0], dtype=torch.bool)
        if self.label_mask is not None:
            mask &= self.label_mask.cpu()
        starts = torch.tensor(self.cu_seqlens[:-1], dtype=torch.int64)
        mask[starts] = False
        return mask

    @property
    def num_loss_tokens(self) -> int:
        return int(self.target_mask.sum())

    def select(self, indices: Sequence[int]) -> PackedBatch:
        """The sub-batch of sequences ``indices`` (in that order)."""
        cu = self.cu_seqlens
        index = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in indices]).to(self.input_ids.device)
        return PackedBatch(
            input_ids=self.input_ids.index_select(0, index),
            seq_lens=tuple(self.seq_lens[i] for i in indices),
            label_mask=None if self.label_mask is None else self.label_mask.index_select(0, index),
        )

    def fingerprint(self) -> int:
        """A 62-bit digest of lengths, tokens and mask: ranks compare it to catch different batches."""
        h = hashlib.blake2b(digest_size=8)
        h.update(repr(self.seq_lens).encode())
        h.update(self.input_ids.detach().to("cpu", torch.int64).numpy().tobytes())
        if self.label_mask is not None:
            h.update(self.label_mask.detach().cpu().numpy().tobytes())
        return int.from_bytes(h.digest(), "little") >> 2


class _CPConfig(Protocol):
    """The verl keys read from a megatron engine section (verl-config's McoreEngineConfig or SFT's)."""

    context_parallel_size: int
    dynamic_context_parallel: bool
    max_seqlen_per_dp_cp_rank: int | None


@dataclass(frozen=True)
class CPLayout:
    """Static or dynamic CP for packed micro-batches.

    ``dynamic``: CP size per micro-batch from ``max_seqlen_per_dp_cp_rank``; else every micro-batch uses
    ``static_cp_size`` (1 = no CP, plain data parallelism over the pool). ``max_tokens_per_rank``: the
    micro-batch token budget per rank (a micro-batch holds at most that times the pool size); defaults to
    ``max_seqlen_per_dp_cp_rank`` under dynamic CP.
    """

    dynamic: bool = False
    static_cp_size: int = 1
    max_seqlen_per_dp_cp_rank: int | None = None
    max_tokens_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.dynamic:
            if self.max_seqlen_per_dp_cp_rank is None or self.max_seqlen_per_dp_cp_rank < 1:
                raise ValueError(
                    "dynamic_context_parallel needs max_seqlen_per_dp_cp_rank >= 1 (the most tokens one rank may hold),"
                    f" got {self.max_seqlen_per_dp_cp_rank}"
                )
            if self.static_cp_size != 1:
                raise ValueError(
                    f"static_cp_size={self.static_cp_size} with dynamic CP: the CP size is chosen per micro-batch;"
                    " leave static_cp_size at 1"
                )
        else:
            k = self.static_cp_size
            if k < 1 or k & (k - 1):
                raise ValueError(f"static context_parallel_size must be a power of two >= 1, got {k}")
        budget = self.token_budget_per_rank
        if budget is None or budget < 1:
            raise ValueError(
                "max_tokens_per_rank (the micro-batch token budget per rank) must be >= 1 for static CP,"
                f" got {self.max_tokens_per_rank}"
            )

    @property
    def token_budget_per_rank(self) -> int | None:
        if self.max_tokens_per_rank is not None:
            return self.max_tokens_per_rank
        return self.max_seqlen_per_dp_cp_rank if self.dynamic else None

    def plan_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of verl_dyncp.dynamic_cp_split_batch for this layout."""
        if self.dynamic:
            return {"max_seqlen_per_dp_cp_rank": self.max_seqlen_per_dp_cp_rank}
        return {"static_cp_size": self.static_cp_size}

    def describe(self) -> str:
        if self.dynamic:
            return f"dynamic CP (max_seqlen_per_dp_cp_rank={self.max_seqlen_per_dp_cp_rank})"
        return "no CP" if self.static_cp_size == 1 else f"static CP {self.static_cp_size}"


def cp_layout_from_config(megatron: _CPConfig, *, max_tokens_per_rank: int | None = None) -> CPLayout:
    """The layout verl's keys ask for: ``dynamic_context_parallel`` + ``max_seqlen_per_dp_cp_rank``, or
    static ``context_parallel_size``. Under dynamic CP, ``context_parallel_size`` only shapes the world
    (the pool is DP x CP either way) and the CP size comes from the sequence lengths."""
    if megatron.dynamic_context_parallel:
        return CPLayout(
            dynamic=True,
            max_seqlen_per_dp_cp_rank=megatron.max_seqlen_per_dp_cp_rank,
            max_tokens_per_rank=max_tokens_per_rank,
        )
    return CPLayout(
        static_cp_size=megatron.context_parallel_size,
        max_tokens_per_rank=max_tokens_per_rank,
    )


def split_packed_micro_batches(seq_lens: Sequence[int], *, max_tokens: int) -> list[tuple[int, ...]]:
    """Sequence indices of every micro-batch: first-fit decreasing into bins of ``max_tokens`` tokens.

    A sequence longer than ``max_tokens`` gets a micro-batch of its own (the planner then decides whether
    it fits the pool, with an error naming its length otherwise). Indices inside a micro-batch are
    ascending; micro-batches come longest-first.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(seq_lens)), key=lambda i: (-int(seq_lens[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(seq_lens[i])
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return [tuple(sorted(b)) for b in bins]


def check_same_batch_on_every_rank(batch: PackedBatch, *, device: torch.device, message: str) -> None:
    """Raise ``ValueError(message)`` on EVERY rank unless all ranks hold the same batch.

    One MAX all-reduce of (digest, -digest): both are maximal everywhere only when every digest is equal.
    Run before anything else can fail, so a rank given a different (or empty) batch makes every rank raise
    the same error instead of leaving the others waiting in a collective.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    fp = batch.fingerprint()
    t = torch.tensor([fp, -fp], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[0]) != fp or -int(t[1]) != fp:
        raise ValueError(message)


class PlannedMicroBatch(NamedTuple):
    """One micro-batch as this rank runs it: the batch's sequences in it, this rank's share, attention params."""

    indices: tuple[int, ...]
    split: Any  # verl_dyncp.DynamicCPMicroBatch
    packed_seq_params: Any


def plan_micro_batches(
    batch: PackedBatch,
    micro_batches: Sequence[tuple[int, ...]],
    *,
    layout: CPLayout,
    groups: Any,
    tp_size: int,
    workload: Any,
    device: torch.device,
    max_tokens_per_rank: int | None = None,
) -> list[PlannedMicroBatch]:
    """verl-dyncp's split of every micro-batch (sequence indices of ``batch``) over the DP x CP pool ``groups``.

    ``max_tokens_per_rank``: the per-rank token budget the micro-batches were cut for; the dynamic planner
    then keeps each rank's tokens within it where the sequences allow (memory), not only its cost balanced.
    """
    from verl_dyncp.planner import dynamic_cp_split_batch
    from verl_dyncp.thd_attention import thd_packed_seq_params

    planned = []
    for indices in micro_batches:
        sub = batch.select(indices)
        split = dynamic_cp_split_batch(
            to_device_async(sub.input_ids, device),
            seq_lens=sub.seq_lens,
            groups=groups,
            tp_size=tp_size,
            label_mask=None if sub.label_mask is None else to_device_async(sub.label_mask, device),
            workload=workload,
            max_tokens_per_rank=max_tokens_per_rank if layout.dynamic else None,
            **layout.plan_kwargs(),
        )
        group = split.group.process_group if split.group.size > 1 else None
        planned.append(
            PlannedMicroBatch(tuple(indices), split, thd_packed_seq_params(split.batch.meta, cp_group=group))
        )
    return planned
