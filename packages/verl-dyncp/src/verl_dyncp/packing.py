"""Cut a call's sequences into micro-batches that dynamic CP can run at the CP size they need.

Why this exists: cutting micro-batches by total tokens (``budget x ranks``, first-fit decreasing) and then
planning each one packs the micro-batch to the brim. A micro-batch of exactly ``ranks x budget`` tokens
rarely splits into CP groups without one of them going over budget, so the planner's memory rule doubles
its CP size, often up to the whole pool: on Megatron-LM's dynamic-CP workload (lognormal lengths, mean 1024,
2048 tokens per rank, 4 ranks) 6 of 9 micro-batches ran at CP 4 although their longest sequence needed at
most CP 2, and dynamic CP came out slower than static CP 4 (docs/benchmarks.md, issue 36 part 4). CP costs
collectives and per-group fixed work that the planner's workload model does not price, so a size larger
than the sequences need should come from the balance rule only, never from packing.

:func:`pack_micro_batches` fills micro-batches the way Megatron-LM's dynamic CP fills ranks: longest
sequence first, each micro-batch at the CP size of its longest sequence (:func:`dynamic_cp_size`), a
sequence joining the first open micro-batch of at least its size where the planner's own assignment at that
size keeps every group within budget. The check runs :func:`plan_dynamic_cp` itself (with the balance rule
off), so a micro-batch accepted here is planned at that size when it runs. Depends on lengths only: every
rank computes the same micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from verl_dyncp.plan import dynamic_cp_size, plan_dynamic_cp
from verl_dyncp.workload import WorkloadModel, check_pos_int

__all__ = ["pack_micro_batches"]


@dataclass
class _Frame:
    """An open micro-batch: its CP size (its longest sequence's), members and free tokens."""

    cp_size: int
    room: int
    members: list[int] = field(default_factory=list)


def pack_micro_batches(
    seq_lens: Sequence[int],
    *,
    dp_cp_size: int,
    max_tokens_per_rank: int,
    max_seqlen_per_dp_cp_rank: int,
    workload: WorkloadModel | None = None,
) -> list[tuple[int, ...]]:
    """Sequence indices of every micro-batch (ascending inside one; micro-batches longest-first).

    Every micro-batch holds at most ``max_tokens_per_rank x dp_cp_size`` tokens, and the planner's
    assignment at the CP size of its longest sequence puts at most ``max_tokens_per_rank x k`` tokens in
    each CP group of ``k`` ranks. A sequence longer than the pool can hold is an error naming its length
    (from :func:`dynamic_cp_size`), raised before any work.
    """
    check_pos_int("dp_cp_size", dp_cp_size)
    cap = check_pos_int("max_tokens_per_rank", max_tokens_per_rank)
    check_pos_int("max_seqlen_per_dp_cp_rank", max_seqlen_per_dp_cp_rank)
    lens = [int(n) for n in seq_lens]
    needs = [dynamic_cp_size(n, max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank, dp_cp_size=dp_cp_size)
             for n in lens]  # fmt: skip
    frames: list[_Frame] = []
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        for frame in frames:
            if frame.cp_size >= needs[i] and lens[i] <= frame.room and _fits(
                [*frame.members, i], lens, frame.cp_size, dp_cp_size=dp_cp_size, cap=cap,
                max_seqlen=max_seqlen_per_dp_cp_rank, workload=workload,
            ):  # fmt: skip
                frame.members.append(i)
                frame.room -= lens[i]
                break
        else:
            frames.append(_Frame(cp_size=needs[i], room=cap * dp_cp_size - lens[i], members=[i]))
    return [tuple(sorted(f.members)) for f in frames]


def _fits(
    members: list[int],
    lens: list[int],
    cp_size: int,
    *,
    dp_cp_size: int,
    cap: int,
    max_seqlen: int,
    workload: WorkloadModel | None,
) -> bool:
    """Whether the planner, at the size the longest member needs, keeps every group within budget."""
    sub = [lens[i] for i in members]
    # larger_cp_min_gain None: the size the longest sequence needs, and the assignment the planner's memory
    # rule checks first, exactly as the run computes it
    plan = plan_dynamic_cp(
        sub,
        dp_cp_size=dp_cp_size,
        max_seqlen_per_dp_cp_rank=max_seqlen,
        workload=workload,
        larger_cp_min_gain=None,
        max_tokens_per_rank=cap,
    )
    assert plan.cp_size == cp_size, (plan.cp_size, cp_size)  # members never need more than the frame's size
    return all(sum(sub[j] for j in group) <= cap * cp_size for group in plan.assignments)
