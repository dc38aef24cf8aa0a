"""pack_micro_batches: micro-batches that the planner runs at the CP size their longest sequence needs.

The regression: cut by total tokens, a micro-batch of Megatron-LM's dynamic-CP workload (lognormal lengths,
mean 1024, 2048 tokens per rank, 4 ranks) was filled to ``4 x 2048`` tokens and could not be split into CP-1 or
CP-2 groups within budget, so the planner's memory rule raised it to CP 4 (7 of 9 micro-batches of a step).
"""

from __future__ import annotations

import math
import random

import pytest

from verl_dyncp import WorkloadModel, dynamic_cp_size, pack_micro_batches, plan_dynamic_cp

BUDGET, POOL = 2048, 4
WORKLOAD = WorkloadModel.for_transformer(
    hidden_size=2048, num_attention_heads=16, num_layers=12, vocab_size=32000
)


def megatron_workload(seed: int, total: int = 65536) -> list[int]:
    """Megatron-LM's dynamic-CP example lengths: lognormal (median 621, sigma 1) clipped to 128..8192."""
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(int(min(8192, max(128, math.exp(rng.gauss(math.log(621), 1.0))))))
    return lens


def _pack(lens: list[int]) -> list[tuple[int, ...]]:
    return pack_micro_batches(
        lens, dp_cp_size=POOL, max_tokens_per_rank=BUDGET, max_seqlen_per_dp_cp_rank=BUDGET, workload=WORKLOAD
    )


def _cut_by_tokens(lens: list[int], max_tokens: int) -> list[tuple[int, ...]]:
    """The cut without packing (verl-engine's split_packed_micro_batches): first-fit decreasing by tokens."""
    bins: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        for b in bins:
            if sum(lens[j] for j in b) + lens[i] <= max_tokens:
                b.append(i)
                break
        else:
            bins.append([i])
    return [tuple(sorted(b)) for b in bins]


def _need(sub: list[int]) -> int:
    return dynamic_cp_size(max(sub), max_seqlen_per_dp_cp_rank=BUDGET, dp_cp_size=POOL)


def _plan(sub: list[int], **kw):
    return plan_dynamic_cp(
        sub,
        dp_cp_size=POOL,
        max_seqlen_per_dp_cp_rank=BUDGET,
        workload=WORKLOAD,
        max_tokens_per_rank=BUDGET,
        **kw,
    )


@pytest.mark.parametrize("seed", range(5))
def test_every_micro_batch_is_planned_at_the_size_its_longest_sequence_needs(seed: int) -> None:
    lens = megatron_workload(seed)
    micro_batches = _pack(lens)
    assert sorted(i for mb in micro_batches for i in mb) == list(range(len(lens)))  # each sequence once
    for mb in micro_batches:
        assert list(mb) == sorted(mb)
        sub = [lens[i] for i in mb]
        assert sum(sub) <= BUDGET * POOL
        # the planner's first choice (the size the longest needs) keeps every group within budget ...
        first = _plan(sub, larger_cp_min_gain=None)
        assert first.cp_size == _need(sub)
        assert all(sum(sub[j] for j in g) <= BUDGET * first.cp_size for g in first.assignments)
        # ... so the run's plan never raises the size for memory; only the balance rule may (and stays in budget)
        run = _plan(sub)
        assert run.cp_size >= first.cp_size
        assert all(sum(sub[j] for j in g) <= BUDGET * run.cp_size for g in run.assignments)


def test_fewer_micro_batches_run_at_cp4_than_when_cut_by_total_tokens() -> None:
    def cp4_count(micro_batches: list[tuple[int, ...]], lens: list[int]) -> int:
        return sum(_plan([lens[i] for i in mb]).cp_size == POOL for mb in micro_batches)

    lens = megatron_workload(0)
    by_tokens = _cut_by_tokens(lens, BUDGET * POOL)
    packed = _pack(lens)
    needed = sum(_need([lens[i] for i in mb]) == POOL for mb in packed)
    # seed 0: 7 of 9 at CP 4 when cut by tokens; packed, only the micro-batches holding a sequence > 4096
    # tokens (3) and at most one balance upgrade of the short tail
    assert cp4_count(by_tokens, lens) == 7
    assert cp4_count(packed, lens) <= needed + 1 < 7
    assert len(packed) <= len(by_tokens) + 1


def test_the_same_lengths_give_the_same_micro_batches() -> None:
    lens = megatron_workload(3)
    assert _pack(lens) == _pack(list(lens))


def test_short_sequences_fill_the_room_a_long_one_leaves() -> None:
    # one sequence needs CP 2 (3000 tokens): its micro-batch is two groups of 4096; the short ones join it
    lens = [3000, 900, 900, 900, 900, 900]
    (only,) = _pack(lens)
    assert only == tuple(range(len(lens)))
    assert _plan(lens).cp_size == 2


def test_a_sequence_longer_than_the_pool_holds_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="a sequence of 9000 tokens does not fit"):
        _pack([100, 9000])


def test_bad_budgets_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        pack_micro_batches([10], dp_cp_size=2, max_tokens_per_rank=0, max_seqlen_per_dp_cp_rank=8)
