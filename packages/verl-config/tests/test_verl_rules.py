"""verl's validation rules with verl's conditions; our stricter rules as notes; errors name every key involved."""

from __future__ import annotations

import warnings

import pytest

from verl_config import ConfigKeyError, ConfigValueError, config_notes, load_config

A = "actor_rollout_ref.actor"
# The actor's micro-batch only: the minimum verl asks for without a reference policy or a critic.
ACTOR_ONLY = [
    f"{A}.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
]


def _load(*overrides: str, engine: str = "megatron"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(overrides=[f"model_engine={engine}", *overrides])


def test_reference_micro_batch_is_required_only_with_a_kl_term() -> None:
    _load(*ACTOR_ONLY, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4")  # no ref, no critic
    with pytest.raises(
        ConfigValueError, match=r"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu: is null"
    ):
        _load(
            *ACTOR_ONLY,
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4",
            f"{A}.use_kl_loss=true",
        )
    with pytest.raises(
        ConfigValueError, match=r"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu: is null"
    ):
        _load(
            *ACTOR_ONLY,
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4",
            "algorithm.use_kl_in_reward=true",
        )


def test_critic_rules_apply_only_when_the_critic_runs() -> None:
    with pytest.raises(ConfigValueError, match=r"critic.ppo_micro_batch_size_per_gpu: is null"):
        _load(*ACTOR_ONLY)  # gae: the critic runs
    _load(*ACTOR_ONLY, "critic.enable=false")
    with pytest.raises(ConfigValueError, match=r"critic.ppo_micro_batch_size_per_gpu: is null"):
        _load(
            *ACTOR_ONLY, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "critic.enable=true"
        )
    # a critic layout that would not fit is not checked when the critic does not run
    _load(*ACTOR_ONLY, "critic.enable=false", "critic.megatron.tensor_model_parallel_size=3")


def test_dependency_errors_name_both_keys() -> None:
    with pytest.raises(ConfigValueError) as err:
        _load(
            *ACTOR_ONLY,
            "critic.enable=false",
            f"{A}.use_dynamic_bsz=true",
            f"{A}.ppo_max_token_len_per_gpu=null",
        )
    assert f"{A}.ppo_max_token_len_per_gpu: is null but use_dynamic_bsz is true" in str(err.value)
    with pytest.raises(
        ConfigValueError, match=r"actor_rollout_ref.rollout.temperature: is 0.0 but .*val_kwargs.do_sample"
    ):
        _load(
            *ACTOR_ONLY,
            "critic.enable=false",
            "actor_rollout_ref.rollout.temperature=0",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        )


def test_step_batch_must_split_over_the_megatron_minimum() -> None:
    # 1024 prompts x n=1 over DP 8 x micro 3 = 24: not divisible (verl's validate_config check)
    with pytest.raises(
        ConfigValueError, match=r"data.train_batch_size: x actor_rollout_ref.rollout.n = 1024 .* = 24"
    ):
        _load(
            f"{A}.ppo_micro_batch_size_per_gpu=3",
            "critic.enable=false",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            f"{A}.ppo_mini_batch_size=24",
            "data.train_batch_size=1024",
        )
    _load(
        f"{A}.ppo_micro_batch_size_per_gpu=3",
        "critic.enable=false",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        f"{A}.ppo_mini_batch_size=24",
        "data.train_batch_size=960",
    )


@pytest.mark.parametrize(
    ("overrides", "note_pattern"),
    [
        (["algorithm.adv_estimator=grpo"], "every advantage will be 0"),
        (["algorithm.adv_estimator=my_estimator", "critic.enable=false"], "not one of verl's built-ins"),
        ([f"{A}.policy_loss.loss_mode=my_loss", "critic.enable=false"], "must be registered by your code"),
        ([f"{A}.policy_loss.loss_mode=vanila", "critic.enable=false"], "did you mean 'vanilla'?"),
        ([f"{A}.optim.lr=0", "critic.enable=false"], "will not change the weights"),
        (
            [f"{A}.megatron.override_transformer_config.recompute_method=uniform", "critic.enable=false"],
            "has no effect",
        ),
    ],
)
def test_rules_stricter_than_verl_are_notes(overrides: list[str], note_pattern: str) -> None:
    cfg = _load(*ACTOR_ONLY, *overrides)
    assert any(note_pattern in n for n in config_notes(cfg)), config_notes(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.logger=console"],
        [f"{A}.optim.lr_warmup_steps=null", "critic.optim.lr_warmup_steps=null"],
        ["++actor_rollout_ref.actor.optim.lr_warmup_steps=null"],
        ["custom_reward_function.name=null"],
        ["actor_rollout_ref.model.lora.alpha=0"],  # LoRA off: alpha is irrelevant
        ["actor_rollout_ref.rollout.name=trtllm", "actor_rollout_ref.rollout.name=sglang"],
        [f"{A}.kl_loss_type=k3+", "algorithm.kl_penalty=low_var_kl+"],
        [f"{A}.use_torch_compile=false", "actor_rollout_ref.actor.megatron.dist_checkpointing_prefix=model."],
        [  # '+' on a key verl's yaml holds as null is Hydra's "add"; filter_groups holds values: no '+'
            "+data.gen_batch_size=512",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=acc",
        ],
        ["algorithm.filter_groups.enable=true"],  # verl 0.9.1: metric defaults to "reward"
        [
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
            "+reward_model.reward_kwargs.max_resp_len=4096",
        ],
        [
            "actor_rollout_ref.rollout.expert_parallel_size=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.data_parallel_size=2",
        ],
        ["actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true"],
        # verl reads lora.fully_sharded_loras with .get() (vllm_async_server); its yaml lacks it, scripts add it
        ["actor_rollout_ref.model.lora.rank=8", "+actor_rollout_ref.model.lora.fully_sharded_loras=True"],
        # trtllm: verl's TP x DP rule for the rollout's expert parallel size does not apply; null leaves it to
        # TensorRT-LLM, moe_tensor_parallel_size x expert_parallel_size tiles the tensor parallel ranks
        [
            "actor_rollout_ref.rollout.name=trtllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "+actor_rollout_ref.rollout.moe_tensor_parallel_size=2",
            "actor_rollout_ref.rollout.expert_parallel_size=2",
        ],
        [
            "actor_rollout_ref.rollout.name=trtllm",
            "+actor_rollout_ref.rollout.moe_tensor_parallel_size=null",
            "actor_rollout_ref.rollout.expert_parallel_size=null",
        ],
    ],
)
def test_configurations_verl_accepts_load(overrides: list[str]) -> None:
    cfg = _load(*ACTOR_ONLY, "critic.enable=false", *overrides)
    if "trainer.logger=console" in overrides:
        assert cfg.trainer.logger == ["console"]
    if "+data.gen_batch_size=512" in overrides:
        assert (
            cfg.algorithm.filter_groups.enable,
            cfg.algorithm.filter_groups.metric,
            cfg.data.gen_batch_size,
        ) == (True, "acc", 512)
    if overrides == ["algorithm.filter_groups.enable=true"]:
        assert (cfg.algorithm.filter_groups.enable, cfg.algorithm.filter_groups.metric) == (True, "reward")
    if "+actor_rollout_ref.model.lora.fully_sharded_loras=True" in overrides:
        assert cfg.actor_rollout_ref.model.lora.fully_sharded_loras is True
    if "+actor_rollout_ref.rollout.moe_tensor_parallel_size=2" in overrides:
        assert (
            cfg.actor_rollout_ref.rollout.moe_tensor_parallel_size,
            cfg.actor_rollout_ref.rollout.expert_parallel_size,
        ) == (2, 2)
    if "actor_rollout_ref.rollout.expert_parallel_size=null" in overrides:
        assert cfg.actor_rollout_ref.rollout.expert_parallel_size is None
    if "+reward_model.reward_kwargs.max_resp_len=4096" in overrides:
        assert cfg.reward_model.reward_kwargs == {
            "overlong_buffer_cfg": {"enable": True},
            "max_resp_len": 4096,
        }


def test_fsdp2_strategy_and_ulysses_rules() -> None:
    fsdp = [*ACTOR_ONLY, "critic.enable=false"]
    cfg = _load(*fsdp, f"{A}.strategy=fsdp2", engine="fsdp")
    assert cfg.actor_rollout_ref.ref.strategy == "fsdp2"  # the reference follows the actor
    with pytest.raises(
        ConfigValueError, match=r"actor_rollout_ref.actor.strategy: is 'megatron' but model_engine is 'fsdp'"
    ):
        _load(*fsdp, f"{A}.strategy=megatron", engine="fsdp")
    with pytest.raises(
        ConfigValueError,
        match=r"actor_rollout_ref.model.use_remove_padding: is false but .*ulysses_sequence_parallel_size is 2",
    ):
        _load(
            *fsdp,
            f"{A}.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.model.use_remove_padding=false",
            engine="fsdp",
        )


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        (
            ["actor_rollout_ref.rollout.mode=sync"],
            ConfigValueError,
            r"rollout.mode: 'sync' was removed from verl",
        ),
        (
            ["actor_rollout_ref.rollout.name=hf"],
            ConfigValueError,
            r"rollout.name: must be one of 'vllm', 'sglang', 'trtllm'",
        ),
        (
            ["actor_rollout_ref.rollout.expert_parallel_size=3"],
            ConfigValueError,
            r"expert_parallel_size: \(3\) must equal",
        ),
        (
            # verl's RolloutConfig compares None > 1 and fails; only trtllm leaves the size unspecified
            ["actor_rollout_ref.rollout.expert_parallel_size=null"],
            ConfigValueError,
            r"rollout.expert_parallel_size: is null, which only trtllm accepts",
        ),
        (
            ["+actor_rollout_ref.rollout.moe_tensor_parallel_size=2"],
            ConfigValueError,
            r"rollout.moe_tensor_parallel_size: is 2 but only trtllm",
        ),
        (
            [
                "actor_rollout_ref.rollout.name=trtllm",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                "+actor_rollout_ref.rollout.moe_tensor_parallel_size=4",
                "actor_rollout_ref.rollout.expert_parallel_size=2",
            ],
            ConfigValueError,
            r"rollout.moe_tensor_parallel_size: \(4\) x expert_parallel_size \(2\) must equal",
        ),
        (
            ["actor_rollout_ref.rollout.pipeline_model_parallel_size=2"],
            ConfigValueError,
            r"has no pipeline parallel",
        ),
        (
            ["actor_rollout_ref.model.mtp.enable_train=true"],
            ConfigValueError,
            r"model.mtp.enable_train: is true but enable is false",
        ),
        (
            [f"{A}.policy_loss.loss_mod=gspo"],
            ConfigKeyError,
            r"did you mean 'actor_rollout_ref.actor.policy_loss.loss_mode'",
        ),
        (["+actor_rollout_ref.actor.made_up=1"], ConfigKeyError, r"cannot add a key to the typed section"),
        ([f"{A}.clip_ratio_low=0.25", f"+{A}.clip_ratio_low=0.3"], ConfigKeyError, r"already exists"),
        # verl 0.9.1's yaml holds filter_groups.enable=false: Hydra refuses '+' there ("Could not append")
        (["+algorithm.filter_groups.enable=true"], ConfigKeyError, r"already exists.*Hydra refuses"),
        (
            # verl 0.9.1 moved router replay from the actor into its engine section (megatron.router_replay)
            [f"{A}.megatron.router_replay.mode=R9"],
            ConfigValueError,
            r"actor_rollout_ref.actor.megatron.router_replay.mode: must be one of 'disabled', 'R2', 'R3'",
        ),
        (
            [f"{A}.router_replay.mode=R3"],
            ConfigKeyError,
            r"unknown config key 'actor_rollout_ref.actor.router_replay.mode'",
        ),
        (
            # verl 0.9.1's _validate_router_replay_config: bypass mode skips the pass R2 records in
            [f"{A}.megatron.router_replay.mode=R2", "algorithm.rollout_correction.bypass_mode=true"],
            ConfigValueError,
            r"router_replay.mode: is R2 but algorithm.rollout_correction.bypass_mode is true",
        ),
        (
            # verl 0.9.1's default metric is "reward"; an explicit null with filtering on is still refused
            ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=null"],
            ConfigValueError,
            r"algorithm.filter_groups.metric: is null but enable is true",
        ),
    ],
)
def test_bad_values_fail_with_the_key(overrides: list[str], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        _load(*ACTOR_ONLY, "critic.enable=false", *overrides)
