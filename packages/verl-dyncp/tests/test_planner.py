"""Dynamic/static CP planning (pure) and split / merge / loss parity on gloo with 2 and 4 ranks."""

from __future__ import annotations

import random

import pytest
import torch
from dyncp_workers import results

from verl_dyncp.planner import (
    GEMM_ROOFLINE_TOKENS,
    CPBlock,
    DynamicCPPlan,
    WorkloadModel,
    dynamic_cp_size,
    plan_dynamic_cp,
)


@pytest.mark.parametrize(("longest", "k"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_k_rule_table(longest: int, k: int) -> None:
    assert dynamic_cp_size(longest, max_seqlen_per_dp_cp_rank=1, dp_cp_size=8) == k
    # the same rule in tokens: ceil(longest / max) rounded up to a power of two
    assert dynamic_cp_size(longest * 1000 - 1, max_seqlen_per_dp_cp_rank=1000, dp_cp_size=8) == k


def test_errors_name_lengths_and_limits() -> None:
    with pytest.raises(
        ValueError,
        match=r"sequence of 4097 tokens .* max_seqlen_per_dp_cp_rank \(1024\) x DP x CP ranks \(4\) = 4096",
    ):
        plan_dynamic_cp([10, 4097], dp_cp_size=4, max_seqlen_per_dp_cp_rank=1024)
    with pytest.raises(ValueError, match="empty micro-batch"):
        plan_dynamic_cp([], dp_cp_size=4, max_seqlen_per_dp_cp_rank=1024)
    with pytest.raises(ValueError, match="dynamic CP needs max_seqlen_per_dp_cp_rank"):
        plan_dynamic_cp([3], dp_cp_size=4)
    with pytest.raises(
        ValueError, match="static_cp_size must be a power of two dividing dp_cp_size 4, got 3"
    ):
        plan_dynamic_cp([3], dp_cp_size=4, static_cp_size=3)
    with pytest.raises(
        ValueError, match=r"sequence of 9 tokens does not fit static CP 2 x max_seqlen_per_dp_cp_rank 4 = 8"
    ):
        plan_dynamic_cp([9], dp_cp_size=4, static_cp_size=2, max_seqlen_per_dp_cp_rank=4)
    with pytest.raises(ValueError, match=r"needs a CP group of 8 ranks .* groups of at most 2"):
        plan_dynamic_cp([5], dp_cp_size=6, max_seqlen_per_dp_cp_rank=1)
    with pytest.raises(ValueError, match="WorkloadModel.linear must be an int >= 0, got -1"):
        WorkloadModel(linear=-1)
    with pytest.raises(ValueError, match="every sequence index exactly once"):
        DynamicCPPlan(seq_lens=(3, 4), dp_cp_size=2, cp_size=1, assignments=((0,), (0,)), loads=(9, 9))
    with pytest.raises(ValueError, match="not aligned to its size 2"):
        CPBlock(offset=1, size=2, sequences=(), load=0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("workload", [WorkloadModel(), WorkloadModel.for_transformer(hidden_size=64)])
def test_balance_and_no_duplication(seed: int, workload: WorkloadModel) -> None:
    rng = random.Random(seed)
    lens = [min(int(rng.lognormvariate(6.0, 1.0)), 4096) + 1 for _ in range(rng.randint(9, 60))]
    plan = plan_dynamic_cp(lens, dp_cp_size=16, max_seqlen_per_dp_cp_rank=1024, workload=workload)
    need = dynamic_cp_size(max(lens), max_seqlen_per_dp_cp_rank=1024, dp_cp_size=16)
    smallest = plan_dynamic_cp(
        lens, dp_cp_size=16, max_seqlen_per_dp_cp_rank=1024, workload=workload, larger_cp_min_gain=None
    )
    assert smallest.cp_size == need
    # a larger group only where it lowers the busiest rank's load by >= 10%
    assert plan.cp_size >= need
    if plan.cp_size > need:
        assert max(plan.loads) / plan.cp_size <= 0.9 * max(smallest.loads) / need
    assert sorted(i for a in plan.assignments for i in a) == list(range(len(lens)))
    costs = [workload.cost(n) for n in lens]
    share = sum(costs) / plan.num_groups
    assert max(plan.loads) <= share + max(costs)  # the LPT bound
    assert all(load == sum(costs[i] for i in a) for load, a in zip(plan.loads, plan.assignments, strict=True))
    if len(lens) >= plan.num_groups:
        assert not plan.idle_groups
    # deterministic: the same lengths give the same plan (every rank plans alone)
    assert plan_dynamic_cp(lens, dp_cp_size=16, max_seqlen_per_dp_cp_rank=1024, workload=workload) == plan


def test_fewer_sequences_than_groups_and_static() -> None:
    plan = plan_dynamic_cp([5, 2], dp_cp_size=8, max_seqlen_per_dp_cp_rank=4, larger_cp_min_gain=None)
    assert plan.cp_size == 2 and plan.assignments == ((0,), (1,), (), ())
    assert plan.idle_groups == (2, 3)
    static = plan_dynamic_cp([5, 2, 7], dp_cp_size=8, static_cp_size=4)
    assert static.cp_size == 4 and static.num_groups == 2 and static.assignments == ((2,), (0, 1))


def _check_world(world: int) -> None:
    per_rank = results(world)
    names = ["dynamic_k1", "dynamic_k2", "dynamic_tp2", "few_seqs", "equal_lens", "static"]
    for rank, res in enumerate(per_rank):
        pl = res["planner"]
        for name in names:
            case = pl[name]
            # every rank planned the same thing on its own
            assert case["assignments"] == per_rank[0]["planner"][name]["assignments"], (rank, name)
            assert case["loss_rel"] <= 1e-5, (rank, name, case)
            assert case["grad_rel"] <= 1e-5, (rank, name, case)
            assert case["merge_grad_rel"] <= 1e-5, (rank, name, case)
            assert case["merge_max_err"] <= 1e-6, (rank, name, case)
            assert case["merge_dtype"] == "torch.float32"
        assert pl["static"]["k"] == world
        assert pl["merge_exact"] == (True, True)
        assert pl["take_roundtrip"], "dynamic_cp_take then merge gives back another per-token tensor (bf16)"
        # several outputs in one gather per dtype: the same bytes, order and gradients as one gather each
        assert pl["joint_merge"] == {"order": True, "values": True, "grads": True, "roundtrip": True}, rank
        few = pl["few_seqs"]
        assert few["assignments"] == ((0,),) + ((),) * (world - 1)
        assert few["is_dummy"] == (rank != 0)
        if few["is_dummy"]:
            assert few["dummy_grad_zero"] and few["local_loss"] == 0.0
    assert [r["planner"]["dynamic_k2"]["k"] for r in per_rank] == [2] * world


def test_gloo_two_ranks_match_no_cp() -> None:
    """Split + local loss normalised by the global token count: loss value and dW equal the single-process
    mean (rel <= 1e-5); the merged outputs come back in the original order, and a loss on them gives the
    same gradients; dummy ranks give zero loss and zero gradients."""
    _check_world(2)


def test_gloo_four_ranks_match_no_cp() -> None:
    _check_world(4)
    per_rank = results(4)
    assert per_rank[0]["planner"]["dynamic_k1"]["assignments"] == ((0,), (5,), (2, 4, 7), (1, 3, 6))


def test_refinement_fixes_the_lpt_counter_example() -> None:
    """Costs 3, 3, 2, 2, 2 on two ranks: LPT gives 7 / 5 (3+2+2 | 3+2); one swap gives the optimum 6 / 6."""
    linear = WorkloadModel(quadratic=0, linear=1)
    lens = [3, 3, 2, 2, 2]
    kw = {"dp_cp_size": 2, "max_seqlen_per_dp_cp_rank": 8, "workload": linear, "larger_cp_min_gain": None}
    lpt = plan_dynamic_cp(lens, refine=False, **kw)
    assert sorted(lpt.loads) == [5, 7]
    plan = plan_dynamic_cp(lens, **kw)
    assert plan.loads == (6, 6)
    assert sorted(plan.assignments) == [(0, 1), (2, 3, 4)]


@pytest.mark.parametrize("seed", range(20))
def test_refinement_never_worse_than_lpt_and_keeps_the_invariants(seed: int) -> None:
    """Random long-tail micro-batches: the refined busiest rank is never above LPT's, the LPT bound still
    holds, no sequence is lost or duplicated, no group is emptied, every sequence sits on a group at least
    as large as it needs, and the plan is deterministic."""
    rng = random.Random(seed)
    workload = WorkloadModel.for_transformer(hidden_size=1536)
    n = rng.choice([2, 4, 8, 16])
    lens = [min(int(rng.lognormvariate(7.6, 1.2)) + 1, 4096 * n) for _ in range(rng.randint(n, 4 * n))]
    kw = {"dp_cp_size": n, "max_seqlen_per_dp_cp_rank": 4096, "workload": workload}
    costs = [workload.cost(x) for x in lens]
    lpt, refined = plan_dynamic_cp(lens, refine=False, **kw), plan_dynamic_cp(lens, **kw)
    assert max(refined.loads) / refined.cp_size <= max(lpt.loads) / lpt.cp_size
    assert sorted(i for b in refined.blocks for i in b.sequences) == list(range(len(lens)))
    for b in refined.blocks:
        assert b.load == sum(costs[i] for i in b.sequences)
    need = max(dynamic_cp_size(x, max_seqlen_per_dp_cp_rank=4096, dp_cp_size=n) for x in lens)
    assert refined.cp_size >= need
    assert max(refined.loads) <= sum(costs) / refined.num_groups + max(costs)
    if len(lens) >= refined.num_groups:
        assert not refined.idle_groups
    assert plan_dynamic_cp(lens, **kw) == refined


def test_refinement_lowers_the_busiest_rank_on_long_tails() -> None:
    """Over many random micro-batches the search finds a lower busiest rank than LPT in some of them."""
    rng = random.Random(7)
    workload = WorkloadModel.for_transformer(hidden_size=1536)
    better = 0
    for _ in range(100):
        lens = [min(int(rng.lognormvariate(7.6, 1.2)) + 1, 8192) for _ in range(rng.randint(6, 30))]
        lpt = plan_dynamic_cp(
            lens, dp_cp_size=4, max_seqlen_per_dp_cp_rank=8192, workload=workload, refine=False
        )
        refined = plan_dynamic_cp(lens, dp_cp_size=4, max_seqlen_per_dp_cp_rank=8192, workload=workload)
        assert max(refined.loads) <= max(lpt.loads)
        better += max(refined.loads) < max(lpt.loads)
    assert better >= 10, better


def test_workload_model_for_transformer_counts_the_model_shape() -> None:
    # hidden size only: f = 4h, no GQA, no LM head -> 24 h^2 dense per token vs 2 h L attention: 12 h
    expected = WorkloadModel(quadratic=1, linear=12 * 1536, min_rank_tokens=GEMM_ROOFLINE_TOKENS)
    assert WorkloadModel.for_transformer(hidden_size=1536) == expected
    assert expected.rank_floor == 12 * 1536 * GEMM_ROOFLINE_TOKENS
    assert WorkloadModel.for_transformer(hidden_size=1536, min_rank_tokens=0).rank_floor == 0
    # Qwen2.5-1.5B: h 1536, 12 heads x 128, 2 KV groups, gated MLP 8960, 28 layers, vocab 151936
    h, a, kv, f = 1536, 12 * 128, 2 * 128, 8960
    dense = 2 * h * (a + 2 * kv) + 2 * a * h + 2 * h * f * 2 + 2 * f * h
    shape = {"ffn_hidden_size": f, "gated_linear_unit": True, "num_attention_heads": 12}
    shape |= {"num_query_groups": 2, "kv_channels": 128}
    assert WorkloadModel.for_transformer(hidden_size=h, **shape).linear == round(dense / (2 * a))
    with_head = WorkloadModel.for_transformer(hidden_size=h, num_layers=28, vocab_size=151936, **shape)
    assert with_head.linear == round((dense + 2 * h * 151936 / 28) / (2 * a))
    slower = WorkloadModel.for_transformer(hidden_size=h, attention_cost_factor=2.0, **shape)
    assert slower.linear == round(dense / (4 * a))
    with pytest.raises(ValueError, match="attention_cost_factor must be > 0"):
        WorkloadModel.for_transformer(hidden_size=h, attention_cost_factor=0.0)


def test_a_larger_cp_group_when_one_sequence_outweighs_a_rank_share() -> None:
    """The smallest group that holds the longest sequence is kept unless doubling lowers the busiest rank's
    modelled load by >= 10%: one long sequence among short ones is split further; many similar ones are not."""
    # 5 and 2 tokens on 8 ranks (need 2): groups of 2 leave the 5-token rank at 25/2 while others idle;
    # each doubling halves the busiest rank's load, up to one group of 8 (no idle ranks)
    assert plan_dynamic_cp([5, 2], dp_cp_size=8, max_seqlen_per_dp_cp_rank=4).cp_size == 8
    # Qwen2.5-1.5B's workload, 5 sequences on 4 ranks (need 1): 5227 tokens cost 1.6x a rank's share at CP 1;
    # CP 2 balances within 3% of the mean, CP 4 would gain only 2% more: CP 2 (the simulator's optimum)
    shape = WorkloadModel.for_transformer(
        hidden_size=1536, ffn_hidden_size=8960, gated_linear_unit=True, num_attention_heads=12,
        num_query_groups=2, kv_channels=128, num_layers=28, vocab_size=151936,
    )  # fmt: skip
    lens = [510, 2899, 5227, 3933, 646]
    plan = plan_dynamic_cp(lens, dp_cp_size=4, max_seqlen_per_dp_cp_rank=8192, workload=shape)
    assert plan.cp_size == 2
    # many sequences of similar cost balance at CP 1
    many = [3000 + 37 * i for i in range(16)]
    assert plan_dynamic_cp(many, dp_cp_size=4, max_seqlen_per_dp_cp_rank=8192, workload=shape).cp_size == 1
    # the gain threshold: 0 takes any improvement, None the smallest size, outside [0, 1) is an error
    assert plan_dynamic_cp(lens, dp_cp_size=4, max_seqlen_per_dp_cp_rank=8192, workload=shape,
                           larger_cp_min_gain=None).cp_size == 1  # fmt: skip
    assert plan_dynamic_cp(lens, dp_cp_size=4, max_seqlen_per_dp_cp_rank=8192, workload=shape,
                           larger_cp_min_gain=0.0).cp_size == 4  # fmt: skip
    with pytest.raises(ValueError, match=r"larger_cp_min_gain must be in \[0, 1\) or None, got 1.5"):
        plan_dynamic_cp(lens, dp_cp_size=4, max_seqlen_per_dp_cp_rank=8192, larger_cp_min_gain=1.5)


def test_workload_model_from_a_megatron_transformer_config() -> None:
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12, num_query_groups=2,
        kv_channels=128, gated_linear_unit=True, use_cpu_initialization=True,
    )  # fmt: skip
    shape = {"ffn_hidden_size": 8960, "gated_linear_unit": True, "num_attention_heads": 12}
    shape |= {"num_query_groups": 2, "kv_channels": 128, "num_layers": 28}
    assert WorkloadModel.from_transformer_config(config, vocab_size=151936) == WorkloadModel.for_transformer(
        hidden_size=1536, vocab_size=151936, **shape
    )


def test_token_cap_keeps_ranks_within_the_micro_batch_budget() -> None:
    """Micro-batches cut at 16K tokens per rank (long tail 256-32K): balancing cost alone gives some rank more
    than 16K tokens in most of them (short sequences are cheap per token); with ``max_tokens_per_rank``
    almost none overshoot, and those by little (bin packing can be infeasible, so the cap is a preference)."""
    workload = WorkloadModel.for_transformer(
        hidden_size=1536, ffn_hidden_size=8960, gated_linear_unit=True, num_attention_heads=12,
        num_query_groups=2, kv_channels=128, num_layers=28, vocab_size=151936,
    )  # fmt: skip
    rng = random.Random(0)
    cap = 16384
    over = {None: 0, cap: 0}
    worst = {None: 0.0, cap: 0.0}
    for _ in range(120):
        n = rng.choice([4, 8])
        lens: list[int] = []
        while sum(lens) < cap * n:
            lens.append(min(max(int(rng.lognormvariate(7.6, 1.2)), 256), 32768))
        lens.pop()
        for c in (None, cap):
            plan = plan_dynamic_cp(
                lens, dp_cp_size=n, max_seqlen_per_dp_cp_rank=cap, workload=workload, max_tokens_per_rank=c
            )
            assert sorted(i for b in plan.blocks for i in b.sequences) == list(range(len(lens)))
            tokens = max(-(-sum(lens[i] for i in b.sequences) // b.size) for b in plan.blocks)
            over[c] += tokens > cap
            worst[c] = max(worst[c], tokens / cap)
    assert over[None] >= 60, over  # without the cap: most micro-batches overshoot
    assert over[cap] <= 0.1 * 120 and worst[cap] <= 1.1, (over, worst)
    assert worst[cap] < worst[None], worst
    with pytest.raises(ValueError, match="max_tokens_per_rank must be a positive int, got 0"):
        plan_dynamic_cp([5], dp_cp_size=2, max_seqlen_per_dp_cp_rank=8, max_tokens_per_rank=0)


QWEN15B = {
    "hidden_size": 1536, "ffn_hidden_size": 8960, "gated_linear_unit": True, "num_attention_heads": 12,
    "num_query_groups": 2, "kv_channels": 128, "num_layers": 28, "vocab_size": 151936,
}  # fmt: skip


def test_a_short_micro_batch_runs_without_cp_and_leaves_ranks_idle() -> None:
    """Two sequences of 96 tokens on 4 ranks: CP 2 would halve each rank's tokens (48 instead of 96) but
    both are under the matmuls' roofline floor (GEMM_ROOFLINE_TOKENS), so it would gain nothing and add CP's
    collectives; CP 1 with two idle ranks is the plan. Without the floor the cost model alone picks CP 2."""
    shape = WorkloadModel.for_transformer(**QWEN15B)
    kw = {"dp_cp_size": 4, "max_seqlen_per_dp_cp_rank": 256, "max_tokens_per_rank": 256}
    plan = plan_dynamic_cp([96, 96], workload=shape, **kw)
    assert (plan.cp_size, plan.idle_groups) == (1, (2, 3))
    no_floor = WorkloadModel.for_transformer(**QWEN15B, min_rank_tokens=0)
    assert plan_dynamic_cp([96, 96], workload=no_floor, **kw).cp_size == 2
    # once a rank's share is well above the floor, splitting pays again: two of 2000 tokens on 4 ranks
    wide = {**kw, "max_seqlen_per_dp_cp_rank": 2048, "max_tokens_per_rank": 2048}
    assert plan_dynamic_cp([2000, 2000], workload=shape, **wide).cp_size == 2


def test_a_larger_cp_group_when_the_sequences_do_not_pack_into_the_memory_budget() -> None:
    """Ten sequences of 96 tokens, 256 tokens per rank on 4 ranks (the micro-batch was cut at 4 x 256): at
    CP 1 only two fit a rank (a third would make 288 > 256), at CP 2 five fit a group of two (480 <= 512).
    The budget is a hard limit, so CP 2, whatever the balance says; a static size never grows."""
    shape = WorkloadModel.for_transformer(**QWEN15B)
    lens = [96] * 10
    plan = plan_dynamic_cp(
        lens, dp_cp_size=4, max_seqlen_per_dp_cp_rank=256, max_tokens_per_rank=256, workload=shape
    )
    assert plan.cp_size == 2
    assert all(sum(lens[i] for i in a) <= 256 * 2 for a in plan.assignments)
    # eight of them fit two per rank: CP 1 (192 tokens per rank, under the floor: CP 2 gains nothing)
    kw = {"dp_cp_size": 4, "max_seqlen_per_dp_cp_rank": 256, "max_tokens_per_rank": 256, "workload": shape}
    assert plan_dynamic_cp([96] * 8, **kw).cp_size == 1
    static = plan_dynamic_cp(lens, dp_cp_size=4, static_cp_size=1, max_tokens_per_rank=256, workload=shape)
    assert static.cp_size == 1


def test_workload_model_rejects_a_negative_floor() -> None:
    with pytest.raises(ValueError, match="WorkloadModel.min_rank_tokens must be an int >= 0, got -1"):
        WorkloadModel(min_rank_tokens=-1)


def test_joint_merge_refuses_outputs_of_different_token_counts() -> None:
    """Outputs merged together must be per-token tensors of this rank's tokens; the message names each shape."""
    from verl_dyncp.planner import dynamic_cp_merge_outputs

    with pytest.raises(ValueError, match=r"share dim 0.*'log_probs': \(3,\).*'entropy': \(4,\)"):
        dynamic_cp_merge_outputs(
            {"log_probs": torch.zeros(3), "entropy": torch.zeros(4)}, micro_batch=None, groups=None
        )
    assert dynamic_cp_merge_outputs({}, micro_batch=None, groups=None) == {}
