"""Packed-batch helpers of verl-engine: batch validation, micro-batch split, CP layout from verl configs."""

from __future__ import annotations

import pytest
import torch

from verl_config import SFTConfig, load_config
from verl_engine.packed import CPLayout, PackedBatch, cp_layout_from_config, split_packed_micro_batches


def test_packed_batch_validates_and_counts_targets() -> None:
    b = PackedBatch.from_sequences(
        [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])],
        label_masks=[torch.tensor([0, 1, 1]), torch.tensor([1]), torch.tensor([0, 0])],
    )
    assert b.seq_lens == (3, 1, 2) and b.cu_seqlens == [0, 3, 4, 6]
    # first token of a sequence is never a target; the mask removes the rest
    assert b.target_mask.tolist() == [False, True, True, False, False, False]
    assert b.num_loss_tokens == 2
    sub = b.select([2, 0])
    assert sub.input_ids.tolist() == [5, 6, 1, 2, 3] and sub.seq_lens == (2, 3)
    assert (
        b.fingerprint()
        == PackedBatch.from_sequences(
            [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])],
            label_masks=[torch.tensor([0, 1, 1]), torch.tensor([1]), torch.tensor([0, 0])],
        ).fingerprint()
    )
    assert b.fingerprint() != PackedBatch.from_sequences([torch.tensor([1, 2, 3])]).fingerprint()
    assert PackedBatch.from_sequences([]).seq_lens == ()  # allowed: the engine refuses it on every rank
    with pytest.raises(ValueError, match="seq_lens sum to 4 but input_ids has 3"):
        PackedBatch(input_ids=torch.tensor([1, 2, 3]), seq_lens=(2, 2))
    with pytest.raises(ValueError, match=r"\(index, length\): \[\(1, 0\)\]"):
        PackedBatch(input_ids=torch.tensor([1, 2]), seq_lens=(2, 0))
    with pytest.raises(ValueError, match="label_mask must be bool"):
        PackedBatch(input_ids=torch.tensor([1, 2]), seq_lens=(2,), label_mask=torch.ones(2))


def test_micro_batches_first_fit_decreasing() -> None:
    lens = [37, 1, 64, 5, 100, 16, 23]
    mbs = split_packed_micro_batches(lens, max_tokens=128)
    # 100 | 64 -> new | 37 -> second (27 left) | 23 -> first (5 left) | 16 -> second | 5 -> first | 1 -> second
    assert mbs == [(3, 4, 6), (0, 1, 2, 5)]
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lens)))  # every sequence once
    assert all(sum(lens[i] for i in mb) <= 128 for mb in mbs)
    assert max(lens[i] for i in mbs[0]) == 100  # longest first: long sequences share micro-batches
    assert split_packed_micro_batches([500, 3], max_tokens=100) == [(0,), (1,)]  # too long: alone
    with pytest.raises(ValueError, match="max_tokens"):
        split_packed_micro_batches([1], max_tokens=0)


def test_layout_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="max_seqlen_per_dp_cp_rank"):
        CPLayout(dynamic=True)
    with pytest.raises(ValueError, match="power of two"):
        CPLayout(static_cp_size=3, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        CPLayout(static_cp_size=2)
    assert CPLayout(dynamic=True, max_seqlen_per_dp_cp_rank=64).token_budget_per_rank == 64


# the micro-batch keys verl requires (null by default)
MICRO_BATCHES = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "critic.model.path=${actor_rollout_ref.model.path}",  # GAE: the critic needs its model
]


def test_layout_from_the_unified_trainer_config_and_sft_config() -> None:
    cfg = load_config(
        "ppo_trainer",
        overrides=[
            "model_engine=megatron",
            *MICRO_BATCHES,
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.megatron.dynamic_context_parallel=true",
            "actor_rollout_ref.actor.megatron.max_seqlen_per_dp_cp_rank=4096",
        ],
    )
    layout = cp_layout_from_config(cfg.actor_rollout_ref.actor.megatron)
    assert layout.dynamic and layout.plan_kwargs() == {"max_seqlen_per_dp_cp_rank": 4096}
    static = load_config(
        "ppo_trainer",
        overrides=[
            "model_engine=megatron",
            *MICRO_BATCHES,
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.megatron.context_parallel_size=4",
        ],
    )
    layout = cp_layout_from_config(static.actor_rollout_ref.actor.megatron, max_tokens_per_rank=8192)
    assert not layout.dynamic and layout.plan_kwargs() == {"static_cp_size": 4}
    assert layout.describe() == "static CP 4"
    sft = load_config(
        SFTConfig,
        overrides=["megatron.dynamic_context_parallel=true", "megatron.max_seqlen_per_dp_cp_rank=512"],
    )
    assert cp_layout_from_config(sft.megatron).max_seqlen_per_dp_cp_rank == 512
    from verl_config.errors import ConfigValueError

    with pytest.raises(ConfigValueError, match="max_seqlen_per_dp_cp_rank"):
        load_config(SFTConfig, overrides=["megatron.dynamic_context_parallel=true"])
