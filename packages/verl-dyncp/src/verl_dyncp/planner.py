"""Dynamic (and static) context-parallel planning for one packed micro-batch.

Per micro-batch the local CP size starts at ``k = smallest power of two >= ceil(longest /
max_seqlen_per_dp_cp_rank)`` (1, 2, 3, 4, 5 -> 1, 2, 4, 4, 8 when ``max_seqlen_per_dp_cp_rank`` is 1 token):
the smallest group that can hold the longest sequence; it doubles while that lowers the busiest rank's
modelled load by at least ``larger_cp_min_gain`` (10% by default; None keeps the smallest), which happens
when one sequence costs more than a rank's fair share. The ``n`` DP x CP ranks form ``n / k`` aligned
groups (:class:`CPGroups`) and the sequences are spread over them by greedy longest-processing-time (LPT) scheduling on the
attention workload ``quadratic * L**2 + linear * L`` (:class:`WorkloadModel`): sequences sorted by
cost, longest first (ties: lower index first), each placed on the group with the least load so far
(ties: lower group index). LPT guarantees every group's load is at most the average load plus the
largest single cost, every sequence runs on exactly one group (no duplicated work), and with at least
as many sequences as groups no group is left empty. A local search then moves or swaps sequences out of
the busiest group while that lowers it (``refine``, on by default): with a few dozen sequences per
micro-batch LPT alone can leave the busiest rank most of one long sequence above the mean.

Static CP is the same machinery with ``static_cp_size`` fixed. :func:`plan_mixed_cp` (``mixed=True`` in
:func:`dynamic_cp_split_batch`) goes further: several CP sizes in one micro-batch, each sequence on a block
of the size it needs (:class:`MixedCPPlan`); split and merge handle both kinds of plan as a list of
:class:`CPBlock`. Opt-in; its measurements are in docs/benchmarks.md.

Determinism: the plan depends only on the sequence lengths (integers, integer arithmetic, stable
tie-breaking), so every rank computes the same plan without communication; every DP x CP rank must
therefore be given the lengths of the whole micro-batch (not only of its own share).

Idle groups: with fewer sequences than groups, the groups without a sequence get a dummy sequence of
``alignment`` pad tokens whose labels are all ignored and whose loss mask is all False. The engine must
run them exactly like real work (forward, loss, backward): the dummy forward takes part in the same TP
and CP collectives as its peers, the backward produces (zero) parameter gradients so the DP x CP gradient
reduction is entered by every rank, and its loss (token sum 0) adds nothing to the global loss.

Loss: use :func:`global_loss_token_count` over the LOCAL loss masks (they partition the real tokens,
dummy ones count 0) and divide each rank's token-sum loss by it (:func:`normalize_token_loss`). The sum
over ranks of the gradients is then the no-CP gradient of the mean token loss. Megatron's DDP averages
gradients over the DP x CP ranks by default: multiply the loss by ``n`` in that case (or let megatron-core
sum, e.g. ``calculate_per_token_loss``), or the gradients come out ``n`` times too small.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from verl_dyncp.groups import CPGroup, CPGroups
from verl_dyncp.thd import THDBatch, build_thd_meta, gather_slots, preprocess_thd_engine, thd_alignment
from verl_mcore_utils.transfer import to_device_async

__all__ = [
    "DEFAULT_LARGER_CP_MIN_GAIN",
    "MEASURED_ATTENTION_COST_FACTOR",
    "CPBlock",
    "DynamicCPMicroBatch",
    "DynamicCPPlan",
    "MixedCPPlan",
    "WorkloadModel",
    "all_reduce_loss",
    "dynamic_cp_merge_output",
    "dynamic_cp_size",
    "dynamic_cp_split_batch",
    "dynamic_cp_take",
    "dynamic_cp_take_ahead",
    "global_loss_token_count",
    "normalize_token_loss",
    "plan_dynamic_cp",
    "plan_mixed_cp",
]


# How much slower a FLOP of causal attention runs than a FLOP of the dense layers, forward + backward, for
# single sequences of 2K-16K tokens at the Qwen2.5-1.5B shape with verl-dyncp's CP-1 kernels (cuDNN SDPA),
# bf16, one H200: 2.0-3.2 over nine runs of benchmarks/dyncp_plan_sim_gpu.py (per length: ~12 at 2K,
# where each call's fixed cost dominates, 4 at 4K, 1.6 at 8K, 1.15 at 16K). The engine's planner uses it;
# with it the planner's plans were within 10% of the simulator's optimum in 39 of 40 cases (docs/benchmarks.md).
MEASURED_ATTENTION_COST_FACTOR = 3.0


@dataclass(frozen=True)
class WorkloadModel:
    """Cost of one sequence of ``L`` tokens: ``quadratic * L**2 + linear * L`` (integers, so plans are exact).

    The quadratic term is attention; the linear term is everything per token (projections, MLP). For a
    dense transformer of hidden size ``h`` the ratio is about ``12 * h`` (:meth:`for_transformer`).
    """

    quadratic: int = 1
    linear: int = 0

    def __post_init__(self) -> None:
        for name in ("quadratic", "linear"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"WorkloadModel.{name} must be an int >= 0, got {v!r}")
        if self.quadratic == 0 and self.linear == 0:
            raise ValueError("WorkloadModel needs a non-zero quadratic or linear coefficient")

    @classmethod
    def for_transformer(
        cls,
        *,
        hidden_size: int,
        ffn_hidden_size: int | None = None,
        gated_linear_unit: bool = False,
        num_attention_heads: int | None = None,
        num_query_groups: int | None = None,
        kv_channels: int | None = None,
        num_layers: int | None = None,
        vocab_size: int | None = None,
        attention_cost_factor: float = 1.0,
    ) -> WorkloadModel:
        """The workload model from the FLOPs of one layer: dense work per token vs causal attention per token.

        Forward FLOPs per token of one layer: QKV ``2 h (a + 2 g d)``, output projection ``2 a h``, MLP
        ``2 h f (2 if gated else 1) + 2 f h`` (``a = heads x d``, ``g`` query groups, ``d`` = kv_channels,
        ``f`` = ffn_hidden_size), plus the LM head ``2 h V`` spread over ``num_layers`` when both are given;
        causal attention over a sequence of ``L`` tokens: ``2 L a`` per token (scores and values over ``L/2``
        keys on average). So ``cost(L) ~ quadratic * L^2 + linear * L`` with ``linear / quadratic = dense /
        (2 a x attention_cost_factor)``; ``attention_cost_factor`` is how much slower a FLOP of the attention
        kernel runs than a FLOP of the matmuls (measured by ``benchmarks/dyncp_plan_sim_gpu.py``). With only
        ``hidden_size`` (``f = 4 h``, no GQA, no head) the ratio is ``12 h``, the classic estimate.
        """
        h = _check_pos_int("hidden_size", hidden_size)
        heads = num_attention_heads
        d = kv_channels if kv_channels is not None else (h // heads if heads else None)
        a = heads * d if heads and d else h
        groups = num_query_groups if num_query_groups is not None else (heads or 1)
        kv = groups * d if d else h
        f = ffn_hidden_size if ffn_hidden_size is not None else 4 * h
        if not attention_cost_factor > 0:
            raise ValueError(f"attention_cost_factor must be > 0, got {attention_cost_factor!r}")
        dense = 2 * h * (a + 2 * kv) + 2 * a * h + 2 * h * f * (2 if gated_linear_unit else 1) + 2 * f * h
        if num_layers and vocab_size:
            dense += 2 * h * vocab_size / num_layers
        return cls(quadratic=1, linear=max(1, round(dense / (2 * a * attention_cost_factor))))

    @classmethod
    def from_transformer_config(
        cls, config: Any, *, vocab_size: int | None = None, attention_cost_factor: float = 1.0
    ) -> WorkloadModel:
        """:meth:`for_transformer` with the shape of a megatron-core ``TransformerConfig`` (hidden and FFN
        sizes, gated MLP, heads, query groups, kv_channels, layers) and the LM head's ``vocab_size``."""
        return cls.for_transformer(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.ffn_hidden_size,
            gated_linear_unit=bool(config.gated_linear_unit),
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups,
            kv_channels=config.kv_channels,
            num_layers=config.num_layers,
            vocab_size=vocab_size,
            attention_cost_factor=attention_cost_factor,
        )

    def cost(self, length: int) -> int:
        return self.quadratic * length * length + self.linear * length


def _check_pos_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


def dynamic_cp_size(longest: int, *, max_seqlen_per_dp_cp_rank: int, dp_cp_size: int) -> int:
    """Smallest power of two ``k >= ceil(longest / max_seqlen_per_dp_cp_rank)``; error if no group is that big."""
    _check_pos_int("longest", longest)
    _check_pos_int("max_seqlen_per_dp_cp_rank", max_seqlen_per_dp_cp_rank)
    _check_pos_int("dp_cp_size", dp_cp_size)
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


def _check_blocks(
    seq_lens: tuple[int, ...], dp_cp_size: int, blocks: tuple[CPBlock, ...], owner: str
) -> None:
    if not seq_lens:
        raise ValueError(f"{owner}.seq_lens is empty")
    position = 0
    for b in blocks:
        if b.offset != position:
            raise ValueError(
                f"{owner}: block at offset {b.offset} where position {position} was expected (gap or overlap)"
            )
        position += b.size
    if position != dp_cp_size:
        raise ValueError(f"{owner}: the blocks cover {position} DP x CP ranks, expected {dp_cp_size}")
    flat = sorted(i for b in blocks for i in b.sequences)
    if flat != list(range(len(seq_lens))):
        raise ValueError(f"{owner}: the blocks must hold every sequence index exactly once")


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


@dataclass(frozen=True)
class MixedCPPlan:
    """A plan with a CP size per block: long sequences on large blocks, short ones on small blocks.

    ``blocks`` cover the DP x CP positions ``0 .. dp_cp_size-1`` in order, each aligned to its size
    (sizes descending, so each is one of :class:`CPGroups`' groups).
    """

    seq_lens: tuple[int, ...]
    dp_cp_size: int
    blocks: tuple[CPBlock, ...]

    def __post_init__(self) -> None:
        _check_blocks(self.seq_lens, self.dp_cp_size, self.blocks, "MixedCPPlan")

    @property
    def cp_sizes(self) -> tuple[int, ...]:
        """The distinct block sizes, descending."""
        return tuple(sorted({b.size for b in self.blocks}, reverse=True))


def _assign_to_blocks(
    sizes: Sequence[int],
    need: Sequence[int],
    costs: Sequence[int],
    *,
    refine: bool = True,
    tokens: Sequence[int] | None = None,
    cap: int | None = None,
) -> tuple[list[list[int]], list[int]] | None:
    """LPT over blocks of ``sizes``, then (``refine``) local search: each sequence (largest cost first) onto
    the block, among those at least as large as it needs, whose per-rank load ``(load + cost) / size`` is
    then smallest (ties: fewer sequences, so zero-cost ties still spread; then lower block index); then
    :func:`_refine`. None when a sequence fits no block. Sizes are powers of two, so ``(load + cost) *
    (largest / size)`` compares per-rank loads exactly in integers.

    Memory: with ``cap`` (tokens per rank) and ``tokens`` (per sequence), a sequence goes only to blocks it
    leaves within ``cap * size`` tokens; if none has room (bin packing can be infeasible), to the block with
    the fewest tokens per rank after it, so the overshoot is as small as this greedy order allows."""
    loads = [0] * len(sizes)
    held = [0] * len(sizes)
    members: list[list[int]] = [[] for _ in sizes]
    scale = [max(sizes) // k for k in sizes]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        fits = [j for j, k in enumerate(sizes) if k >= need[i]]
        if not fits:
            return None
        if cap is not None and tokens is not None:
            room = [j for j in fits if held[j] + tokens[i] <= cap * sizes[j]]
            if not room:
                j = min(fits, key=lambda j: ((held[j] + tokens[i]) * scale[j], j))
                fits = [j]
            else:
                fits = room
        j = min(fits, key=lambda j: ((loads[j] + costs[i]) * scale[j], len(members[j]), j))
        members[j].append(i)
        loads[j] += costs[i]
        held[j] += tokens[i] if tokens is not None else 0
    if refine:
        _refine(sizes, need, costs, members, loads, scale, tokens=tokens, cap=cap)
    return members, loads


# how many of the least loaded blocks the local search tries as partners of the busiest one per step
_REFINE_TARGETS = 8


def _refine(
    sizes: Sequence[int],
    need: Sequence[int],
    costs: Sequence[int],
    members: list[list[int]],
    loads: list[int],
    scale: Sequence[int],
    *,
    tokens: Sequence[int] | None = None,
    cap: int | None = None,
) -> None:
    """Lower the busiest block's per-rank load by moving one of its sequences to another block or swapping
    it for a cheaper one there, best improvement first, until no move or swap helps (in place).

    Why: LPT places each sequence once and never revisits it; with few sequences per rank (a long tail in
    a micro-batch of a few dozen sequences) its busiest rank can sit a large fraction of one sequence's
    cost above the mean, and that rank sets the micro-batch's time. A move or swap is taken only if both
    blocks end strictly below the current peak, so the sorted vector of per-rank loads decreases
    lexicographically and the search ends; the LPT bound (peak <= mean + largest cost) still holds. A
    block is never emptied (with at least as many sequences as blocks, none runs dummy work), every
    sequence stays on a block at least as large as it needs, and with a token ``cap`` no block ends above
    ``cap`` tokens per rank unless it already was, and then it does not grow. Swap partners are found by
    bisection on each block's sorted costs among the ``_REFINE_TARGETS`` least loaded blocks, so a step
    costs O(blocks + members x log members): cheap next to the micro-batch it plans, also on hundreds of
    ranks. Deterministic (integer arithmetic, fixed tie-breaking).
    """
    nblocks = len(sizes)
    if nblocks < 2:
        return
    held = [sum(tokens[i] for i in members[j]) if tokens is not None else 0 for j in range(nblocks)]

    def room(j: int, extra: int) -> bool:
        """Block ``j`` may take ``extra`` more tokens (negative: fewer) under the cap."""
        if cap is None or tokens is None or extra <= 0:
            return True
        return held[j] + extra <= max(cap * sizes[j], held[j])

    ordered = [sorted((costs[i], i) for i in members[j]) for j in range(nblocks)]
    for _ in range(4 * len(costs) + 4):  # bound; every step strictly lowers the sorted load vector
        per_rank = [loads[j] * scale[j] for j in range(nblocks)]
        p = max(range(nblocks), key=lambda j: (per_rank[j], -j))
        peak = per_rank[p]
        # partners among the least loaded blocks only: a move or swap lands a block at or above its current
        # load, so these hold the best improvements; it keeps a step cheap with hundreds of ranks
        targets = heapq.nsmallest(
            _REFINE_TARGETS, (j for j in range(nblocks) if j != p), key=lambda j: (per_rank[j], j)
        )
        best: tuple | None = None
        for i in members[p]:
            if len(members[p]) == 1:
                break  # moving or swapping the only sequence just moves the peak (or empties the block)
            for j in targets:
                if sizes[j] < need[i]:
                    continue
                # ideal transfer d* = (peak - per_rank[j]) / (scale[p] + scale[j]) of cost from p to j
                target = costs[i] - (peak - per_rank[j]) // (scale[p] + scale[j])
                candidates: list[tuple[int, int | None]] = [(0, None)]  # (partner cost, partner) None: move
                at = bisect_left(ordered[j], (target, -1))
                for k in (at - 1, at):
                    if 0 <= k < len(ordered[j]):
                        candidates.append(ordered[j][k])
                for c2, i2 in candidates:
                    if i2 is not None and sizes[p] < need[i2]:
                        continue
                    d = costs[i] - c2
                    if d <= 0:
                        continue
                    if tokens is not None:
                        moved = tokens[i] - (0 if i2 is None else tokens[i2])
                        if not (room(j, moved) and room(p, -moved)):
                            continue
                    a, b = (loads[p] - d) * scale[p], (loads[j] + d) * scale[j]
                    if max(a, b) >= peak:
                        continue
                    key = (max(a, b), i, j, -1 if i2 is None else i2)
                    if best is None or key < best[0]:
                        best = (key, i, j, i2, d)
        if best is None:
            return
        _, i, j, i2, d = best
        members[p].remove(i)
        members[j].append(i)
        ordered[p].remove((costs[i], i))
        insort(ordered[j], (costs[i], i))
        if i2 is not None:
            members[j].remove(i2)
            members[p].append(i2)
            ordered[j].remove((costs[i2], i2))
            insort(ordered[p], (costs[i2], i2))
        loads[p] -= d
        loads[j] += d
        if tokens is not None:
            moved = tokens[i] - (0 if i2 is None else tokens[i2])
            held[p] -= moved
            held[j] += moved


# A larger CP group must lower the busiest rank's modelled load by at least this fraction: what the
# workload model does not price (K/V all-gather, the varlen kernel under CP instead of CP 1's dense
# cuDNN calls, more padding) costs a few percent per doubling on one NVLink node
# (benchmarks/dyncp_plan_sim_gpu.py, docs/benchmarks.md).
DEFAULT_LARGER_CP_MIN_GAIN = 0.1


def _balanced_cp_size(
    costs: Sequence[int],
    *,
    smallest: int,
    dp_cp_size: int,
    min_gain: float | None,
    refine: bool,
    tokens: Sequence[int] | None = None,
    cap: int | None = None,
) -> tuple[int, tuple[list[list[int]], list[int]]]:
    """The CP size for a micro-batch and its groups' assignment (:func:`_assign_to_blocks` over equal groups
    of that size, returned so the caller does not compute it again): ``smallest`` (the longest sequence's
    need), doubled while the busiest rank's modelled load ``max(group load) / k`` drops by at least
    ``min_gain`` of the current choice's.

    Why: the smallest size that holds the longest sequence is not always the fastest. When one sequence
    costs more than a rank's fair share (few sequences, or one long one among short ones), groups of that
    size cannot balance: the rank holding it runs while the others wait. A group twice as large splits it
    (zigzag, evenly). Comparing exact fractions of integer loads keeps every rank's choice identical.
    No size can put the busiest rank below the mean ``sum(costs) / dp_cp_size``, so the search stops as
    soon as the current choice is within the gain of it (the common case: one size tried).
    """

    def assign(k: int) -> tuple[list[list[int]], list[int]]:
        assigned = _assign_to_blocks(
            [k] * (dp_cp_size // k), [1] * len(costs), costs, refine=refine, tokens=tokens, cap=cap
        )
        assert assigned is not None  # equal groups: every sequence fits any of them
        return assigned

    if min_gain is not None and not 0 <= min_gain < 1:
        raise ValueError(f"larger_cp_min_gain must be in [0, 1) or None, got {min_gain!r}")
    best_k, best_assigned = smallest, assign(smallest)
    if min_gain is None:
        return best_k, best_assigned
    keep = 1 - Fraction(str(min_gain))
    mean = Fraction(sum(costs), dp_cp_size)
    best = Fraction(max(best_assigned[1]), smallest)
    k = smallest * 2
    while k <= _largest_pow2_divisor(dp_cp_size):
        if best * keep < mean:
            break  # no larger size can gain min_gain: every busiest rank carries at least the mean
        assigned = assign(k)
        peak = Fraction(max(assigned[1]), k)
        if peak <= best * keep:
            best_k, best_assigned, best = k, assigned, peak
        k *= 2
    return best_k, best_assigned


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

    Dynamic ``k`` starts at the smallest group that holds the longest sequence (:func:`dynamic_cp_size`)
    and doubles while that lowers the busiest rank's modelled load by at least ``larger_cp_min_gain``
    (a fraction; None keeps the smallest ``k``), see :func:`_balanced_cp_size`. ``refine=False`` keeps
    plain LPT (no move / swap search). Both switches exist for comparison (``benchmarks/dyncp_plan_sim_gpu.py``).
    ``max_tokens_per_rank``: the memory budget the micro-batch was cut for (tokens per rank); balancing
    by cost alone can give a rank of short sequences more tokens than that, so with it set sequences go
    only where they fit, while any group can take them (see :func:`_assign_to_blocks`).
    """
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
    _check_pos_int("dp_cp_size", dp_cp_size)
    longest = max(lens)
    if static_cp_size is not None:
        k = _check_pos_int("static_cp_size", static_cp_size)
        if k & (k - 1) or dp_cp_size % k:
            raise ValueError(
                f"static_cp_size must be a power of two dividing dp_cp_size {dp_cp_size}, got {k}"
            )
        if max_seqlen_per_dp_cp_rank is not None and longest > k * max_seqlen_per_dp_cp_rank:
            raise ValueError(
                f"a sequence of {longest} tokens does not fit static CP {k} x max_seqlen_per_dp_cp_rank"
                f" {max_seqlen_per_dp_cp_rank} = {k * max_seqlen_per_dp_cp_rank} tokens"
            )
    else:
        if max_seqlen_per_dp_cp_rank is None:
            raise ValueError("dynamic CP needs max_seqlen_per_dp_cp_rank (or give static_cp_size)")
        k = dynamic_cp_size(
            longest, max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank, dp_cp_size=dp_cp_size
        )
    model = workload or WorkloadModel()
    costs = [model.cost(n) for n in lens]
    cap = None if max_tokens_per_rank is None else _check_pos_int("max_tokens_per_rank", max_tokens_per_rank)
    # every group has size k >= every sequence's need: LPT (+ local search) over equal groups; static CP
    # keeps its size (min_gain None)
    k, (members, loads) = _balanced_cp_size(
        costs,
        smallest=k,
        dp_cp_size=dp_cp_size,
        min_gain=larger_cp_min_gain if static_cp_size is None else None,
        refine=refine,
        tokens=lens,
        cap=cap,
    )
    return DynamicCPPlan(
        seq_lens=lens,
        dp_cp_size=dp_cp_size,
        cp_size=k,
        assignments=tuple(tuple(sorted(m)) for m in members),
        loads=tuple(loads),
    )


def plan_mixed_cp(
    seq_lens: Sequence[int] | torch.Tensor,
    *,
    dp_cp_size: int,
    max_seqlen_per_dp_cp_rank: int,
    workload: WorkloadModel | None = None,
    refine: bool = True,
    larger_cp_min_gain: float | None = DEFAULT_LARGER_CP_MIN_GAIN,
    max_tokens_per_rank: int | None = None,
) -> MixedCPPlan:
    """Several CP sizes in one micro-batch: long sequences on large blocks, short ones on small blocks.

    Every sequence needs ``k_i = dynamic_cp_size(L_i)`` ranks. The search starts from the one-k layout
    (``dp_cp_size / K`` blocks of the size :func:`plan_dynamic_cp` picks, ``K >= max k_i``) and splits one block into two
    halves at a time, taking the split whose LPT assignment (:func:`_assign_to_blocks`: each sequence
    onto a block at least as large as it needs) has the smallest peak per-rank load ``load / size``, as
    long as that peak is not above the current one. So the plan's modelled busiest rank is never worse
    than the one-k plan's, and equal-cost layouts are broken towards smaller blocks (less CP
    communication, which the workload model does not price). Keeping the peak per-rank load (tokens
    included, through the linear term) also keeps the per-rank memory of the one-k plan: a layout that
    puts the short sequences on a few small blocks while the long ones share a big one is refused.
    Blocks are laid out by size, descending, so each block is aligned. Deterministic, from the lengths
    only (exact rational comparisons).
    """
    lens = tuple(int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens))
    if not lens:
        raise ValueError("empty micro-batch: no sequences to plan")
    _check_pos_int("dp_cp_size", dp_cp_size)
    model = workload or WorkloadModel()
    need = [
        dynamic_cp_size(n, max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank, dp_cp_size=dp_cp_size)
        for n in lens
    ]
    costs = [model.cost(n) for n in lens]

    def peak(sizes: Sequence[int], loads: Sequence[int]) -> Fraction:
        return max(Fraction(load, k) for load, k in zip(loads, sizes, strict=True))

    cap = None if max_tokens_per_rank is None else _check_pos_int("max_tokens_per_rank", max_tokens_per_rank)
    fit = {"refine": refine, "tokens": lens, "cap": cap}
    # blocks of the one-k plan's size: each at least every sequence's need, so its assignment is the one-k one
    largest, assigned = _balanced_cp_size(
        costs, smallest=max(need), dp_cp_size=dp_cp_size, min_gain=larger_cp_min_gain, **fit
    )
    sizes = [largest] * (dp_cp_size // largest)
    best = peak(sizes, assigned[1])
    while True:
        trials = []
        for k in sorted(set(sizes), reverse=True):
            if k == 1:
                continue
            trial = list(sizes)
            trial.remove(k)
            trial = sorted([*trial, k // 2, k // 2], reverse=True)
            result = _assign_to_blocks(trial, need, costs, **fit)
            if result is not None:
                trials.append((peak(trial, result[1]), -k, trial, result))
        if not trials:
            break
        value, _, trial, result = min(trials, key=lambda t: (t[0], t[1]))
        if value > best:
            break
        best, sizes, assigned = value, trial, result
    members, loads = assigned
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    blocks = tuple(
        CPBlock(offset=o, size=k, sequences=tuple(sorted(m)), load=load_j)
        for o, k, m, load_j in zip(offsets, sizes, members, loads, strict=True)
    )
    return MixedCPPlan(seq_lens=lens, dp_cp_size=dp_cp_size, blocks=blocks)


def _block_of(plan: DynamicCPPlan | MixedCPPlan, position: int) -> CPBlock:
    for b in plan.blocks:
        if b.offset <= position < b.offset + b.size:
            return b
    raise ValueError(f"DP x CP position {position} is outside the plan's {plan.dp_cp_size} ranks")


@dataclass(frozen=True, eq=False)
class DynamicCPMicroBatch:
    """This rank's part of a planned micro-batch: its CP group, its sequences and its local THD inputs.

    ``batch`` is the :class:`THDBatch` of the group's sequences (in ascending original order) for this
    rank's CP rank; for an idle group it is the dummy sequence (``is_dummy``, loss mask all False).
    """

    plan: DynamicCPPlan | MixedCPPlan
    block: CPBlock
    group: CPGroup
    sequence_indices: tuple[int, ...]
    is_dummy: bool
    batch: THDBatch

    def __post_init__(self) -> None:
        if self.group.size != self.block.size or self.group.index * self.group.size != self.block.offset:
            raise ValueError(
                f"CP group {self.group.index} of size {self.group.size} is not the plan's block at offset"
                f" {self.block.offset} of size {self.block.size}"
            )
        if self.block not in self.plan.blocks:
            raise ValueError("the block is not one of the plan's blocks")
        if self.sequence_indices != self.block.sequences:
            raise ValueError("sequence_indices differ from the plan's assignment for this block")
        if self.is_dummy != (not self.sequence_indices):
            raise ValueError("is_dummy must be True exactly when the group has no sequence")


def _packed_index(seq_lens: Sequence[int], indices: Sequence[int]) -> torch.Tensor:
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    if not indices:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(cu[i], cu[i + 1]) for i in indices])


def dynamic_cp_split_batch(
    input_ids: torch.Tensor,
    *,
    seq_lens: Sequence[int] | torch.Tensor,
    groups: CPGroups,
    max_seqlen_per_dp_cp_rank: int | None = None,
    static_cp_size: int | None = None,
    tp_size: int = 1,
    pad_value: int = 0,
    ignore_index: int = -100,
    label_mask: torch.Tensor | None = None,
    workload: WorkloadModel | None = None,
    mixed: bool = False,
    larger_cp_min_gain: float | None = DEFAULT_LARGER_CP_MIN_GAIN,
    max_tokens_per_rank: int | None = None,
) -> DynamicCPMicroBatch:
    """Plan the packed micro-batch and return this rank's local THD inputs.

    ``input_ids`` (and ``label_mask``, if given) hold the whole micro-batch packed (dim 0 =
    ``sum(seq_lens)``) on every DP x CP rank; split other per-token tensors of the micro-batch (advantages,
    old log-probs, ...) with :func:`dynamic_cp_take`.
    """
    plan: DynamicCPPlan | MixedCPPlan
    if mixed:
        if static_cp_size is not None or max_seqlen_per_dp_cp_rank is None:
            raise ValueError(
                "mixed=True plans dynamic CP: give max_seqlen_per_dp_cp_rank and no static_cp_size"
            )
        plan = plan_mixed_cp(
            seq_lens,
            dp_cp_size=groups.world_size,
            max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank,
            workload=workload,
            larger_cp_min_gain=larger_cp_min_gain,
            max_tokens_per_rank=max_tokens_per_rank,
        )
    else:
        plan = plan_dynamic_cp(
            seq_lens,
            dp_cp_size=groups.world_size,
            max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank,
            static_cp_size=static_cp_size,
            workload=workload,
            larger_cp_min_gain=larger_cp_min_gain,
            max_tokens_per_rank=max_tokens_per_rank,
        )
    if input_ids.dim() == 0 or input_ids.shape[0] != sum(plan.seq_lens):
        raise ValueError(
            f"input_ids must be packed with {sum(plan.seq_lens)} tokens in dim 0, got shape {tuple(input_ids.shape)}"
        )
    block = _block_of(plan, groups.position)
    k = block.size
    group = groups.group(k)
    mine = block.sequences
    if mine:
        index = _packed_index(plan.seq_lens, mine).to(input_ids.device)
        batch = preprocess_thd_engine(
            input_ids.index_select(0, index),
            seq_lens=[plan.seq_lens[i] for i in mine],
            cp_size=k,
            cp_rank=group.rank,
            tp_size=tp_size,
            pad_value=pad_value,
            ignore_index=ignore_index,
            label_mask=None
            if label_mask is None
            else label_mask.index_select(0, index.to(label_mask.device)),
        )
    else:
        n = thd_alignment(cp_size=k, tp_size=tp_size)
        dummy = torch.full(
            (n, *input_ids.shape[1:]), pad_value, dtype=input_ids.dtype, device=input_ids.device
        )
        batch = preprocess_thd_engine(
            dummy,
            seq_lens=[n],
            cp_size=k,
            cp_rank=group.rank,
            tp_size=tp_size,
            pad_value=pad_value,
            ignore_index=ignore_index,
            label_mask=torch.zeros(n, dtype=torch.bool, device=input_ids.device),
        )
        batch = replace(batch, labels=torch.full_like(batch.labels, ignore_index))
    return DynamicCPMicroBatch(
        plan=plan, block=block, group=group, sequence_indices=mine, is_dummy=not mine, batch=batch
    )


def dynamic_cp_take(
    tensor: torch.Tensor, *, micro_batch: DynamicCPMicroBatch, pad_value: float | bool = 0
) -> torch.Tensor:
    """This rank's local share of another packed per-token tensor of the whole micro-batch (e.g. advantages)."""
    if micro_batch.is_dummy:
        n = micro_batch.batch.meta.local_tokens
        return torch.full((n, *tensor.shape[1:]), pad_value, dtype=tensor.dtype, device=tensor.device)
    index = _packed_index(micro_batch.plan.seq_lens, micro_batch.sequence_indices).to(tensor.device)
    return micro_batch.batch.meta.take(tensor.index_select(0, index), pad_value=pad_value)


def dynamic_cp_take_ahead(
    tensor: torch.Tensor, *, micro_batch: DynamicCPMicroBatch, shift: int, fill: float | bool = 0
) -> torch.Tensor:
    """This rank's local share of the value ``shift`` tokens ahead in the same sequence (``fill`` where none).

    ``tensor`` is packed over the whole micro-batch, like :func:`dynamic_cp_take`'s; ``shift=1`` gives
    the next-token labels. Multi-token prediction takes its inputs and targets this way.
    """
    if micro_batch.is_dummy:
        n = micro_batch.batch.meta.local_tokens
        return torch.full((n, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)
    index = _packed_index(micro_batch.plan.seq_lens, micro_batch.sequence_indices).to(tensor.device)
    return micro_batch.batch.meta.take_ahead(tensor.index_select(0, index), shift=shift, fill=fill)


def _merge_index(plan: DynamicCPPlan | MixedCPPlan, *, tp_size: int) -> tuple[list[int], torch.Tensor]:
    """Local length of every DP x CP rank and, per original packed token, its index in the gathered buffer."""
    lens: list[int] = []
    index = torch.empty(sum(plan.seq_lens), dtype=torch.int64)
    offset = 0
    for block in plan.blocks:
        k = block.size
        if not block.sequences:
            local = thd_alignment(cp_size=k, tp_size=tp_size) // k
        else:
            meta = build_thd_meta(
                seq_lens=[plan.seq_lens[i] for i in block.sequences], cp_size=k, cp_rank=0, tp_size=tp_size
            )
            local = meta.local_tokens
            index[_packed_index(plan.seq_lens, block.sequences)] = offset + meta.unpadded_to_gathered
        lens.extend([local] * k)
        offset += local * k
    return lens, index


def dynamic_cp_merge_output(
    local_output: torch.Tensor, *, micro_batch: DynamicCPMicroBatch, groups: CPGroups
) -> torch.Tensor:
    """Gather every rank's local per-token output and return the whole micro-batch packed, in original order.

    One all-gather over the DP x CP ranks (buffers padded to the longest local length). Every rank gets
    the full result; this rank's slot is ``local_output`` itself, so a loss on the merged output sends
    gradients only into this rank's own tokens (sum of the ranks' gradients = the no-CP gradient).
    Dtype and trailing dims are kept. Dummy ranks' outputs are dropped.
    """
    lens, index = _merge_index_on(micro_batch, local_output.device)
    gathered = gather_slots(local_output, group=groups.full_group, rank=groups.position, lens=lens)
    return gathered.index_select(0, index)


_MERGE_CACHE_ATTR = "_verl_merge_index"


def _merge_index_on(micro_batch: DynamicCPMicroBatch, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """:func:`_merge_index` of the micro-batch on ``device``, computed once per micro-batch (an engine merges
    several outputs of each), copied without a host-device synchronisation."""
    cache: dict[str, tuple[list[int], torch.Tensor]] | None = getattr(micro_batch, _MERGE_CACHE_ATTR, None)
    if cache is None:
        cache = {}
        object.__setattr__(micro_batch, _MERGE_CACHE_ATTR, cache)
    key = str(device)
    if key not in cache:
        lens, index = _merge_index(micro_batch.plan, tp_size=micro_batch.batch.meta.tp_size)
        cache[key] = (lens, to_device_async(index, device))
    return cache[key]


def global_loss_token_count(
    local_loss_mask: torch.Tensor, *, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Number of loss tokens of the whole micro-batch: the LOCAL masks summed over the DP x CP ranks.

    The local masks (from the split) partition the real tokens and dummy ranks contribute 0, so no token
    is counted twice. Returns an int64 scalar on the mask's device (``group`` None: no reduction).
    """
    count = local_loss_mask.to(torch.int64).sum()
    if group is not None:
        dist.all_reduce(count, group=group)
    return count


def normalize_token_loss(
    per_token_loss: torch.Tensor, *, loss_mask: torch.Tensor, global_token_count: torch.Tensor | int
) -> torch.Tensor:
    """``sum(per_token_loss[loss_mask]) / global_token_count`` (0 when there is no loss token anywhere).

    With this on every rank (local tokens, or a group's merged tokens of which each rank back-propagates
    only its own slot), the sum of the ranks' gradients is the no-CP gradient of the mean token loss.
    """
    if per_token_loss.shape != loss_mask.shape:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape"
        )
    total = torch.where(loss_mask, per_token_loss, torch.zeros((), dtype=per_token_loss.dtype)).sum()
    if isinstance(global_token_count, int):
        return total / max(global_token_count, 1)
    # stays on the device: no host synchronisation per micro-batch
    return total / global_token_count.to(device=total.device, dtype=total.dtype).clamp(min=1)


def all_reduce_loss(
    loss: torch.Tensor, *, group: dist.ProcessGroup | None, duplication: int = 1
) -> torch.Tensor:
    """The global loss value for logging: sum of the ranks' normalised losses (detached).

    ``duplication``: how many ranks computed each token's loss (1 for local per-token losses, the CP size
    ``k`` when every rank of a group computed the loss on the group's merged outputs).
    """
    _check_pos_int("duplication", duplication)
    value = loss.detach().clone() / duplication
    if group is not None:
        dist.all_reduce(value, group=group)
    return value
