"""verl-config's Megatron section feeds verl-mcore-utils' wrap config and DDP-config builder unchanged."""

from __future__ import annotations

import pytest

from verl_config import load_config

MICRO = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "critic.model.path=${actor_rollout_ref.model.path}",  # GAE: the critic needs its model
]


@pytest.mark.parametrize("use_distributed_optimizer", [True, False])
def test_engine_section_to_wrap_and_ddp_config(use_distributed_optimizer: bool) -> None:
    from verl_mcore_utils import WrapConfig, build_ddp_config

    am = "actor_rollout_ref.actor.megatron"
    cfg = load_config(
        overrides=[
            "model_engine=megatron",
            *MICRO,
            f"{am}.use_distributed_optimizer={str(use_distributed_optimizer).lower()}",
            f"{am}.override_ddp_config.bucket_size=1000",
            f"{am}.override_ddp_config.grad_reduce_in_fp32=true",
        ]
    )
    actor = cfg.actor_rollout_ref.actor.megatron
    ddp = build_ddp_config(
        wrap_config=WrapConfig(**actor.wrap_config_kwargs()), override_ddp_config=actor.ddp_config_overrides()
    )
    assert ddp is not None
    assert ddp.use_distributed_optimizer is use_distributed_optimizer
    assert (ddp.bucket_size, ddp.grad_reduce_in_fp32) == (1000, True)
    ref = cfg.actor_rollout_ref.ref.megatron  # forward only: no DDP config at all
    assert build_ddp_config(wrap_config=WrapConfig(**ref.wrap_config_kwargs())) is None


def test_engine_section_to_transformer_config() -> None:
    from megatron.core.transformer.enums import AttnBackend

    from verl_mcore_utils import hf_to_transformer_config, qwen2_preset

    cfg = load_config(overrides=["model_engine=megatron", *MICRO, "actor_rollout_ref.actor.megatron.seed=3"])
    tf = hf_to_transformer_config(
        qwen2_preset("tiny", vocab_size=64),
        dtype=cfg.actor_rollout_ref.actor.megatron.dtype,
        overrides=cfg.actor_rollout_ref.actor.megatron.transformer_config_overrides(),
    )
    assert tf.attention_backend == AttnBackend.flash and tf.recompute_modules == ["core_attn"]
    assert tf.bf16 and tf.tensor_model_parallel_size == 1 and tf.sequence_parallel is False
