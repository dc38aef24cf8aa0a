"""The CP size of a micro-batch and which sequences each CP group runs, from the sequence lengths alone.

The size starts at the smallest power-of-two group that holds the longest sequence, doubles while a group
overflows the micro-batch's memory budget, then doubles while that balances the busiest rank enough better; the sequences are spread over the groups by :mod:`verl_dyncp.balance`.
The package README gives the rules (determinism, idle groups, loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from verl_dyncp.balance import balance_groups
from verl_dyncp.workload import WorkloadModel, check_pos_int

__all__ = [
    "DEFAULT_LARGER_CP_MIN_GAIN",
    "CPBlock",
    "DynamicCPPlan",
    "dynamic_cp_size",
    "plan_dynamic_cp",
]

# A larger CP group must lower the busiest rank's modelled load by at least this fraction: what the
# workload model does not price (K/V all-gather, the varlen kernel under CP instead of CP 1's dense
# calls, more padding) costs a few percent per doubling (benchmarks/dyncp_plan_sim_gpu.py, docs/benchmarks.md).
DEFAULT_LARGER_CP_MIN_GAIN = 0.1


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


def dynamic_cp_size(longest: int, *, max_seqlen_per_dp_cp_rank: int, dp_cp_size: int) -> int:
    """Smallest power of two ``k >= ceil(longest / max_seqlen_per_dp_cp_rank)``; error if no group is that big."""
    check_pos_int("longest", longest)
    check_pos_int("max_seqlen_per_dp_cp_rank", max_seqlen_per_dp_cp_rank)
    check_pos_int("dp_cp_size", dp_cp_size)
    if longest > max_seqlen_per_dp_cp_rank * dp_cp_size:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit: at most max_seqlen_per_dp_cp_rank ({max_seqlen_per_dp_cp_rank})"
            f" x DP x CP ranks ({dp_cp_size}) = {max_seqlen_per_dp_cp_rank * dp_cp_size} tokens per sequence;"
            " raise max_seqlen_per_dp_cp_rank or the DP x CP size, or drop/truncate the sequence"
        )
    need = -(-longest // max_seqlen_per_dp_cp_rank)
    k = 1 << (need - 1).bit_length()
    if k > _largest_pow2_divisor(dp_cp_size):
        raise ValueError(
            f"a sequence of {longest} tokens needs a CP group of {k} ranks (max_seqlen_per_dp_cp_rank"
            f" {max_seqlen_per_dp_cp_rank}) but the {dp_cp_size} DP x CP ranks form power-of-two groups of at most"
            f" {_largest_pow2_divisor(dp_cp_size)}"
        )
    return k


@dataclass(frozen=True)
class CPBlock:
    """An aligned block of ``size`` DP x CP ranks (positions ``offset .. offset+size-1``) running ``sequences``
    with local CP size ``size``; no sequences means dummy work. ``load`` is its workload."""

    offset: int
    size: int
    sequences: tuple[int, ...]
    load: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.size & (self.size - 1):
            raise ValueError(f"CPBlock.size must be a power of two >= 1, got {self.size}")
        if self.offset < 0 or self.offset % self.size:
            raise ValueError(f"CPBlock.offset {self.offset} is not aligned to its size {self.size}")
        if list(self.sequences) != sorted(set(self.sequences)):
            raise ValueError(f"CPBlock.sequences must be ascending and distinct, got {self.sequences}")


@dataclass(frozen=True)
class DynamicCPPlan:
    """Which sequences each of the ``dp_cp_size / cp_size`` groups runs, from the lengths alone.

    ``assignments[g]`` are the original indices (ascending) of the sequences group ``g`` (ranks
    ``g*k .. g*k+k-1`` of the DP x CP list) runs; an empty tuple marks an idle group (dummy work).
    ``loads[g]`` is the group's total :class:`WorkloadModel` cost.
    """

    seq_lens: tuple[int, ...]
    dp_cp_size: int
    cp_size: int
    assignments: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.seq_lens:
            raise ValueError("DynamicCPPlan.seq_lens is empty")
        if self.cp_size < 1 or self.cp_size & (self.cp_size - 1) or self.dp_cp_size % self.cp_size:
            raise ValueError(
                f"DynamicCPPlan.cp_size must be a power of two dividing dp_cp_size {self.dp_cp_size}, got {self.cp_size}"
            )
        if len(self.assignments) != self.num_groups or len(self.loads) != self.num_groups:
            raise ValueError(
                f"DynamicCPPlan needs {self.num_groups} assignments and loads, got {len(self.assignments)} and {len(self.loads)}"
            )
        flat = sorted(i for a in self.assignments for i in a)
        if flat != list(range(len(self.seq_lens))):
            raise ValueError("DynamicCPPlan.assignments must hold every sequence index exactly once")
        if any(list(a) != sorted(a) for a in self.assignments):
            raise ValueError("DynamicCPPlan.assignments must be ascending within each group")

    @property
    def num_groups(self) -> int:
        return self.dp_cp_size // self.cp_size

    @property
    def idle_groups(self) -> tuple[int, ...]:
        """Groups that run only a dummy sequence."""
        return tuple(g for g, a in enumerate(self.assignments) if not a)

    @property
    def blocks(self) -> tuple[CPBlock, ...]:
        """The plan as blocks (all of size ``cp_size``), the form split and merge work on."""
        k = self.cp_size
        return tuple(
            CPBlock(offset=g * k, size=k, sequences=a, load=load)
            for g, (a, load) in enumerate(zip(self.assignments, self.loads, strict=True))
        )


def plan_dynamic_cp(
    seq_lens: Sequence[int] | torch.Tensor,
    *,
    dp_cp_size: int,
    max_seqlen_per_dp_cp_rank: int | None = None,
    static_cp_size: int | None = None,
    workload: WorkloadModel | None = None,
    refine: bool = True,
    larger_cp_min_gain: float | None = DEFAULT_LARGER_CP_MIN_GAIN,
    max_tokens_per_rank: int | None = None,
) -> DynamicCPPlan:
    """The plan for one micro-batch: dynamic ``k``, or ``static_cp_size``.

    Dynamic ``k`` starts at the smallest group that holds the longest sequence (:func:`dynamic_cp_size`),
    doubles while a group holds more than ``max_tokens_per_rank`` per rank, then while that lowers the
    busiest rank's modelled load (never below ``workload.rank_floor``) by at least ``larger_cp_min_gain``
    (a fraction; None keeps the smallest ``k``), see :func:`_balanced_cp_size`. ``refine=False`` keeps
    plain LPT (no move / swap search). Both switches exist for comparison (``benchmarks/dyncp_plan_sim_gpu.py``).
    ``max_tokens_per_rank``: the memory budget the micro-batch was cut for (tokens per rank); balancing
    by cost alone can give a rank of short sequences more tokens than that, so with it set sequences go
    only where they fit, while any group can take them (see :func:`verl_dyncp.balance.balance_groups`).
    """
    lens = _checked_lens(seq_lens)
    check_pos_int("dp_cp_size", dp_cp_size)
    if static_cp_size is not None:
        k = _static_cp_size(
            static_cp_size, longest=max(lens), dp_cp_size=dp_cp_size, max_seqlen=max_seqlen_per_dp_cp_rank
        )
    elif max_seqlen_per_dp_cp_rank is None:
        raise ValueError("dynamic CP needs max_seqlen_per_dp_cp_rank (or give static_cp_size)")
    else:
        k = dynamic_cp_size(
            max(lens), max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank, dp_cp_size=dp_cp_size
        )
    model = workload or WorkloadModel()
    cap = None if max_tokens_per_rank is None else check_pos_int("max_tokens_per_rank", max_tokens_per_rank)
    # static CP keeps its size (min_gain None)
    k, (members, loads) = _balanced_cp_size(
        [model.cost(n) for n in lens],
        smallest=k,
        dp_cp_size=dp_cp_size,
        min_gain=larger_cp_min_gain if static_cp_size is None else None,
        refine=refine,
        tokens=lens,
        cap=cap,
        floor=model.rank_floor,
    )
    return DynamicCPPlan(
        seq_lens=lens,
        dp_cp_size=dp_cp_size,
        cp_size=k,
        assignments=tuple(tuple(sorted(m)) for m in members),
        loads=tuple(loads),
    )


def _checked_lens(seq_lens: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    lens = tuple(int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens))
    if not lens:
        raise ValueError(
            "empty micro-batch: no sequences to plan; every DP x CP rank needs at least one sequence in the"
            " micro-batch (drop empty micro-batches before splitting)"
        )
    bad = [(i, n) for i, n in enumerate(lens) if n < 1]
    if bad:
        raise ValueError(
            f"every sequence needs at least one token; (index, length) of the bad ones: {bad[:8]}"
        )
    return lens


def _static_cp_size(static_cp_size: int, *, longest: int, dp_cp_size: int, max_seqlen: int | None) -> int:
    k = check_pos_int("static_cp_size", static_cp_size)
    if k & (k - 1) or dp_cp_size % k:
        raise ValueError(f"static_cp_size must be a power of two dividing dp_cp_size {dp_cp_size}, got {k}")
    if max_seqlen is not None and longest > k * max_seqlen:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit static CP {k} x max_seqlen_per_dp_cp_rank"
            f" {max_seqlen} = {k * max_seqlen} tokens"
        )
    return k


def _balanced_cp_size(
    costs: Sequence[int],
    *,
    smallest: int,
    dp_cp_size: int,
    min_gain: float | None,
    refine: bool,
    tokens: Sequence[int],
    cap: int | None,
    floor: int = 0,
) -> tuple[int, tuple[list[list[int]], list[int]]]:
    """The CP size for a micro-batch and its groups' assignment (returned so the caller does not compute it
    again). Three rules, in this order:

    1. Need: ``smallest``, the smallest size that holds the longest sequence.
    2. Memory (dynamic sizes only, ``min_gain`` not None, ``cap`` set): doubled while some group holds more
       than ``cap`` tokens per rank and a larger size exists. ``cap`` is the memory budget the micro-batch
       was cut for; sequences of up to a rank's budget do not always pack into budget-sized bins (three of
       96 tokens in 256), while twice the ranks pool their room.
    3. Balance: doubled while the busiest rank's modelled load ``max(max(group load) / k, floor)`` drops by
       at least ``min_gain`` of the current choice's.

    Why balance: the smallest size that holds the longest sequence is not always the fastest. When one
    sequence costs more than a rank's fair share (few sequences, or one long one among short ones), groups
    of that size cannot balance: the rank holding it runs while the others wait. A group twice as large
    splits it (zigzag, evenly). Why the floor (:attr:`WorkloadModel.rank_floor`): a rank holding few tokens
    takes as long as one at the floor, so a short micro-batch (every rank under the floor) keeps its small
    size and leaves ranks idle rather than pay CP's collectives for nothing. Comparing exact fractions of
    integer loads keeps every rank's choice identical. No size can put the busiest rank below
    ``max(sum(costs) / dp_cp_size, floor)``, so the search stops as soon as the current choice is within
    the gain of it (the common case: one size tried).
    """

    def assign(k: int) -> tuple[list[list[int]], list[int]]:
        limit = None if cap is None else cap * k
        return balance_groups(costs, num_groups=dp_cp_size // k, tokens=tokens, limit=limit, refine=refine)

    def over_budget(k: int, members: list[list[int]]) -> bool:
        return cap is not None and any(sum(tokens[i] for i in m) > cap * k for m in members)

    if min_gain is not None and not 0 <= min_gain < 1:
        raise ValueError(f"larger_cp_min_gain must be in [0, 1) or None, got {min_gain!r}")
    largest = _largest_pow2_divisor(dp_cp_size)
    best_k, best_assigned = smallest, assign(smallest)
    if min_gain is None:
        return best_k, best_assigned
    while best_k < largest and over_budget(best_k, best_assigned[0]):
        best_k *= 2
        best_assigned = assign(best_k)
    keep = 1 - Fraction(str(min_gain))
    bound = max(Fraction(sum(costs), dp_cp_size), Fraction(floor))
    best = max(Fraction(max(best_assigned[1]), best_k), Fraction(floor))
    k = best_k * 2
    while k <= largest:
        if best * keep < bound:
            break  # no larger size can gain min_gain: every busiest rank carries at least the bound
        assigned = assign(k)
        peak = max(Fraction(max(assigned[1]), k), Fraction(floor))
        if peak <= best * keep and not over_budget(k, assigned[0]):
            best_k, best_assigned, best = k, assigned, peak
        k *= 2
    return best_k, best_assigned
