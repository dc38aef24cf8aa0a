"""The unified ppo_trainer config: defaults, engine composition, pinned engine differences, validation rules."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
from omegaconf import OmegaConf

from conftest import MICRO_BATCHES
from verl_config import (
    ConfigError,
    ConfigKeyError,
    ConfigTypeError,
    ConfigValueError,
    FSDPActorConfig,
    FSDPCriticConfig,
    FSDPRefConfig,
    McoreActorConfig,
    McoreCriticConfig,
    McoreEngineConfig,
    McoreRefConfig,
    TrainerConfig,
    config_notes,
    default_tree,
    load_config,
)

MEGATRON = ["model_engine=megatron", *MICRO_BATCHES]
A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"


def _load(*overrides: str, engine: str = "megatron", **kwargs: Any) -> TrainerConfig:
    return load_config(overrides=[f"model_engine={engine}", *MICRO_BATCHES, *overrides], **kwargs)


# ------------------------------------------------------------------------------------ defaults
def test_engine_selects_typed_role_sections() -> None:
    fsdp = _load(engine="fsdp")
    assert isinstance(fsdp, TrainerConfig) and fsdp.model_engine == "fsdp"
    assert isinstance(fsdp.actor_rollout_ref.actor, FSDPActorConfig)
    assert isinstance(fsdp.actor_rollout_ref.ref, FSDPRefConfig)
    assert isinstance(fsdp.critic, FSDPCriticConfig)
    meg = _load()
    assert isinstance(meg.actor_rollout_ref.actor, McoreActorConfig)
    assert isinstance(meg.actor_rollout_ref.ref, McoreRefConfig)
    assert isinstance(meg.critic, McoreCriticConfig)
    assert isinstance(meg.actor_rollout_ref.actor.megatron, McoreEngineConfig)


def test_megatron_engine_section_has_verls_keys_and_defaults() -> None:
    """verl 0.9.1's McoreEngineConfig, key for key (sequence_parallel: default true, forced off at TP 1).

    grad_offload (dropped by verl 0.9.1) and packed_attention_backend are this package's own keys.
    """
    expected = {
        "param_offload": False,
        "grad_offload": False,
        "optimizer_offload": False,
        "tensor_model_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": None,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": 1,
        "sequence_parallel": True,
        "use_distributed_optimizer": True,
        "use_dist_checkpointing": False,
        "dist_checkpointing_path": None,
        "dist_checkpointing_prefix": "",
        "dynamic_context_parallel": False,
        "max_seqlen_per_dp_cp_rank": None,
        "packed_attention_backend": "auto",
        "entropy_from_logits_with_chunking": "${actor_rollout_ref.actor.entropy_from_logits_with_chunking}",
        "entropy_from_logits_chunk_size": "${actor_rollout_ref.actor.entropy_from_logits_chunk_size}",
        "pad_bshd_to_minibatch_max": True,
        "pad_to_length": False,
        "pad_to_length_bucket": 512,
        "dist_ckpt_optim_fully_reshardable": False,
        "distrib_optim_fully_reshardable_mem_efficient": False,
        "seed": 42,
        "override_ddp_config": {},
        "override_transformer_config": {
            "recompute_granularity": None,
            "recompute_modules": ["core_attn"],
            "recompute_method": None,
            "recompute_num_layers": None,
            "attention_backend": "flash",
        },
        "override_mcore_model_config": {},
        "use_mbridge": True,
        "vanilla_mbridge": False,
        "use_remove_padding": True,
        "forward_only": False,
        "dtype": "bfloat16",
        "use_megatron_fsdp": False,
        "router_replay": {"mode": "disabled", "record_file": None, "replay_file": None},
        "qat": {
            "enable": False,
            "mode": "w4a16",
            "group_size": 16,
            "ignore_patterns": ["lm_head", "*mlp.gate"],
            "activation_observer": None,
            "quantization_config_path": None,
        },
        # in the PPO tree these three follow the role's keys (interpolations, see below)
        "use_dynamic_bsz": "${..use_dynamic_bsz}",
        "max_token_len_per_gpu": "${..ppo_max_token_len_per_gpu}",
        "micro_batch_size_per_gpu": "${..ppo_micro_batch_size_per_gpu}",
    }
    tree = OmegaConf.to_container(default_tree("megatron"), resolve=False)
    assert tree["actor_rollout_ref"]["actor"]["megatron"] == expected
    # the critic has no actor entropy keys to follow: verl 0.9.1 gives it the fallback values
    assert tree["critic"]["megatron"] == {
        **expected,
        "entropy_from_logits_with_chunking": False,
        "entropy_from_logits_chunk_size": 2048,
    }
    standalone = McoreEngineConfig()
    assert (
        standalone.use_dynamic_bsz,
        standalone.max_token_len_per_gpu,
        standalone.micro_batch_size_per_gpu,
    ) == (
        True,
        None,
        None,
    )
    # resolved: the tie gives the role's value; sequence_parallel forced off with a note
    cfg = _load()
    eng = cfg.actor_rollout_ref.actor.megatron
    assert (
        eng.micro_batch_size_per_gpu == 4
        and eng.use_dynamic_bsz is False
        and eng.max_token_len_per_gpu == 16384
    )
    assert eng.sequence_parallel is False
    assert f"{AM}.sequence_parallel: forced to false because tensor_model_parallel_size is 1" in " ".join(
        config_notes(cfg)
    )
    assert (
        _load(f"{AM}.tensor_model_parallel_size=2").actor_rollout_ref.actor.megatron.sequence_parallel is True
    )


def test_reference_section_follows_the_actor_layout_and_never_trains() -> None:
    cfg = _load(f"{AM}.tensor_model_parallel_size=2", f"{AM}.pipeline_model_parallel_size=2", f"{AM}.seed=7")
    ref = cfg.actor_rollout_ref.ref.megatron
    assert (ref.tensor_model_parallel_size, ref.pipeline_model_parallel_size, ref.seed) == (2, 2, 7)
    assert ref.forward_only is True
    assert ref.wrap_config_kwargs()["wrap_with_ddp"] is False
    assert cfg.actor_rollout_ref.actor.megatron.wrap_config_kwargs()["wrap_with_ddp"] is True


def test_reward_model_has_no_training_engine_section() -> None:
    """verl 0.9.1 serves the reward model through a rollout engine: no strategy / megatron / fsdp section
    (b178a3cd had reward_model.strategy and reward_model.megatron); verl refuses those keys, so do we."""
    from verl_config.reward import LegacyRewardModelConfig, RewardModelConfig

    for cls in (RewardModelConfig, LegacyRewardModelConfig):
        names = {f.name for f in dataclasses.fields(cls)}
        assert not names & {"strategy", "megatron", "fsdp_config"}, cls.__name__
    for override in (
        "reward_model.strategy=megatron",
        "reward_model.megatron.tensor_model_parallel_size=2",
        "reward.reward_model.megatron.tensor_model_parallel_size=2",
    ):
        with pytest.raises(ConfigKeyError, match="unknown config key"):
            _load(override)


def test_other_section_defaults() -> None:
    cfg = _load(engine="fsdp")
    assert cfg.data.train_batch_size == 1024 and cfg.data.max_prompt_length == 512
    assert cfg.actor_rollout_ref.rollout.prompt_length == 512  # interpolated from data
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5
    assert cfg.critic.model.path == cfg.actor_rollout_ref.model.path
    assert cfg.critic.ppo_mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.trainer.world_size == 8
    assert cfg.actor_rollout_ref.model.lora.rank == 0 and cfg.actor_rollout_ref.model.lora.alpha == 32
    # verl 0.9.1: scoring lives under `reward`; the legacy top-level reward_model keys are all "not given"
    assert cfg.reward.num_workers == 8 and cfg.reward.reward_manager.name == "naive"
    assert cfg.reward.reward_manager.source == "register"
    assert cfg.reward.custom_reward_function.name == "compute_score"
    assert cfg.reward.reward_model.enable is False and cfg.reward.reward_model.model_path is None
    assert cfg.reward.reward_model.rollout.tensor_model_parallel_size == 2
    assert cfg.reward_model.reward_manager is None and cfg.reward_model.enable is None


def test_legacy_reward_keys_are_kept_and_noted() -> None:
    """verl 0.9.1's main_ppo keeps the pre-0.9 reward keys but reads only ``reward`` (its
    migrate_legacy_reward_impl runs in the fully-async entry only): they stay where written, with a note."""
    cfg = _load(
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.max_resp_len=512",
        "custom_reward_function.path=/tmp/my_reward.py",
        "reward_model.rollout.tensor_model_parallel_size=4",
        engine="fsdp",
    )
    assert cfg.reward_model.reward_manager == "dapo" and cfg.reward.reward_manager.name == "naive"
    assert cfg.reward_model.reward_kwargs == {"max_resp_len": 512} and cfg.reward.reward_kwargs == {}
    assert (
        cfg.custom_reward_function.path == "/tmp/my_reward.py"
        and cfg.reward.custom_reward_function.path is None
    )
    assert cfg.reward.reward_model.rollout.tensor_model_parallel_size == 2
    notes = "\n".join(config_notes(cfg))
    for legacy, instead in (
        ("reward_model.reward_manager", "reward.reward_manager.name"),
        ("reward_model.reward_kwargs", "reward.reward_kwargs"),
        ("custom_reward_function.path", "reward.custom_reward_function.path"),
        (
            "reward_model.rollout.tensor_model_parallel_size",
            "reward.reward_model.rollout.tensor_model_parallel_size",
        ),
    ):
        assert f"{legacy}: is a pre-0.9 reward key that verl 0.9's main_ppo does not read" in notes
        assert f"set {instead}" in notes
    assert "reward_model" not in "".join(config_notes(_load(engine="fsdp")))


def test_each_teacher_is_built_as_a_section() -> None:
    """distillation.teacher_models is a dict of sections: each teacher is a TeacherModelConfig with its checks."""
    from verl_config.distillation import TeacherModelConfig

    cfg = _load(engine="fsdp")
    assert isinstance(cfg.distillation.teacher_models["teacher_model"], TeacherModelConfig)
    with pytest.raises(
        ConfigValueError, match=r"distillation.teacher_models.teacher_model.model_path: is null"
    ):
        _load("distillation.enabled=true", engine="fsdp")


# ------------------------------------------------------------------------- engine differences
# Every default that differs between the engines is checked key by key against verl's own two generated
# configs in test_verl_parity.py (each engine's tree against verl's for that engine).


def test_nothing_lost_when_selecting_megatron() -> None:
    cfg = _load("+actor_rollout_ref.model.override_config.model_config.max_position_embeddings=8192")
    arr = cfg.actor_rollout_ref
    assert arr.rollout.layer_name_map == {"qkv_layer_name": "qkv", "gate_proj_layer_name": "gate_up"}
    assert arr.model.override_config["moe_config"] == {"freeze_moe_router": False}
    assert arr.model.override_config["model_config"] == {"max_position_embeddings": 8192}
    assert arr.model.use_remove_padding is True  # verl 0.9.1's Megatron default (false before)


# ------------------------------------------------------------------------------- entry / alias
def test_deprecated_alias_means_megatron_and_warns_once() -> None:
    with pytest.warns(FutureWarning, match="'ppo_megatron_trainer' is deprecated"):
        cfg = load_config("ppo_megatron_trainer", overrides=MICRO_BATCHES)
    assert cfg.model_engine == "megatron"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config("ppo_megatron_trainer", overrides=MICRO_BATCHES)
    assert not [w for w in caught if "ppo_megatron_trainer" in str(w.message)]
    reference = OmegaConf.to_container(OmegaConf.structured(_load()))
    assert OmegaConf.to_container(OmegaConf.structured(cfg)) == reference
    with pytest.raises(ConfigValueError, match="entry 'ppo_megatron_trainer' means model_engine=megatron"):
        load_config("ppo_megatron_trainer", overrides=["model_engine=fsdp"])
    with pytest.raises(ConfigKeyError, match="unknown entry config 'ppo_trainerr'"):
        load_config("ppo_trainerr")


def test_yaml_selects_engine_and_layers_under_overrides(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "model_engine: megatron\nactor_rollout_ref:\n  actor:\n    megatron:\n      tensor_model_parallel_size: 2\n"
        "    optim:\n      lr: 3.0e-6\n"
    )
    cfg = load_config(yaml_path=path, overrides=[*MICRO_BATCHES, f"{A}.optim.lr=5e-6"])
    assert cfg.model_engine == "megatron"
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.actor.optim.lr == 5e-6
    path.write_text("actor_rollout_ref:\n  actor:\n    megatron:\n      tensor_model_parallel_sise: 2\n")
    with pytest.raises(ConfigKeyError, match="exists only with model_engine=megatron"):
        load_config(yaml_path=path, overrides=MICRO_BATCHES)
    with pytest.raises(ConfigKeyError, match=f"did you mean '{AM}.tensor_model_parallel_size'"):
        load_config(yaml_path=path, overrides=["model_engine=megatron", *MICRO_BATCHES])


def test_unknown_and_mistyped_keys() -> None:
    with pytest.raises(
        ConfigKeyError, match=r"'actor_rollout_ref.actor.megatron' exists only with model_engine=megatron"
    ):
        _load(f"{AM}.tensor_model_parallel_size=2", engine="fsdp")
    with pytest.raises(ConfigKeyError, match=r"did you mean 'actor_rollout_ref.rollout'"):
        _load("actor_rollout_ref.rollot.n=2")
    with pytest.raises(ConfigTypeError, match=r"actor_rollout_ref.rollout.n.*'many'"):
        _load("actor_rollout_ref.rollout.n=many")


# ----------------------------------------------------------------------------- validation rules
@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            [f"{AM}.dynamic_context_parallel=true"],
            rf"{AM}.max_seqlen_per_dp_cp_rank: is null but dynamic_context_parallel is true",
        ),
        (
            [
                f"{AM}.dynamic_context_parallel=true",
                f"{AM}.max_seqlen_per_dp_cp_rank=4096",
                f"{AM}.use_remove_padding=false",
            ],
            rf"{AM}.use_remove_padding: is false but dynamic_context_parallel is true",
        ),
        (
            [
                f"{AM}.dynamic_context_parallel=true",
                f"{AM}.max_seqlen_per_dp_cp_rank=4096",
                "actor_rollout_ref.model.use_remove_padding=false",
            ],
            r"actor_rollout_ref.model.use_remove_padding: is false but .*dynamic_context_parallel is true",
        ),
        (
            [f"{AM}.use_megatron_fsdp=true", f"{AM}.use_distributed_optimizer=false"],
            rf"{AM}.use_distributed_optimizer: is false but use_megatron_fsdp is true",
        ),
        (
            [f"{AM}.use_megatron_fsdp=true", f"{AM}.override_ddp_config.use_distributed_optimizer=false"],
            rf"{AM}.override_ddp_config.use_distributed_optimizer: is false but use_distributed_optimizer is true",
        ),
        (
            [f"{AM}.use_megatron_fsdp=true", f"{AM}.pipeline_model_parallel_size=2"],
            rf"{AM}.pipeline_model_parallel_size: is 2 but use_megatron_fsdp is true",
        ),
        (
            [f"{AM}.override_ddp_config.data_parallel_sharding_strategy=zero3"],
            r"data_parallel_sharding_strategy: must be one of 'no_shard', 'optim', 'optim_grads', 'optim_grads_params'",
        ),
        (
            [f"{AM}.tensor_model_parallel_size=3"],
            rf"{AM}: world size 8 is not divisible by tensor_model_parallel_size \(3\)",
        ),
        (
            [f"{AM}.expert_model_parallel_size=16"],
            rf"{AM}.expert_model_parallel_size: world size 8 is not divisible by",
        ),
        (
            [f"{AM}.virtual_pipeline_model_parallel_size=2"],
            r"virtual .*need pipeline_model_parallel_size > 1",
        ),
        (
            [f"{AM}.override_transformer_config.recompute_granularity=full"],
            rf"{AM}.override_transformer_config.recompute_method: is null but .*recompute_granularity is 'full'",
        ),
        (
            [
                f"{AM}.override_transformer_config.recompute_granularity=selective",
                f"{AM}.override_transformer_config.recompute_num_layers=2",
            ],
            r"recompute_num_layers: is 2 but recompute_granularity is 'selective'",
        ),
        ([f"{AM}.use_dist_checkpointing=true"], rf"{AM}.dist_checkpointing_path: is null"),
        (
            [f"{A}.ppo_mini_batch_size=64", f"{A}.ppo_micro_batch_size_per_gpu=3"],
            rf"{A}.ppo_micro_batch_size_per_gpu: \(3\) does not divide the mini-batch per data-parallel rank: .* = 64 / 8 = 8",
        ),
        ([f"{A}.ppo_mini_batch_size=4"], r"= 4 sequences is not divisible by the data-parallel size 8"),
        (
            [f"{A}.ppo_micro_batch_size=32"],
            rf"{A}.ppo_micro_batch_size: and {A}.ppo_micro_batch_size_per_gpu are both set",
        ),
        (
            [f"{A}.ppo_micro_batch_size_per_gpu=null"],
            rf"{A}.ppo_micro_batch_size_per_gpu: is null and {A}.use_dynamic_bsz is false",
        ),
        ([f"{A}.ppo_mini_batch_size=2048"], r"larger than data.train_batch_size \(1024\)"),
        ([f"{A}.strategy=fsdp"], rf"{A}.strategy: is 'fsdp' but model_engine is 'megatron'"),
        (
            ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
            r"rollout.tensor_model_parallel_size: \(3\) does not divide",
        ),
        (
            [f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=512"],
            r"ppo_max_token_len_per_gpu: \(512\) is smaller than one sequence .* = 1024",
        ),
        (
            [f"{AM}.use_dynamic_bsz=true"],
            rf"{AM}.use_dynamic_bsz: is True but {A}.use_dynamic_bsz is False; .*set {A}.use_dynamic_bsz only",
        ),
        ([f"{AM}.tensor_model_parallel_size=0"], rf"{AM}.tensor_model_parallel_size: must be > 0, got 0"),
        (["trainer.resume_mode=resume_path"], r"trainer.resume_from_path: is null but resume_mode"),
    ],
)
def test_validation_rules_name_the_keys(overrides: list[str], pattern: str) -> None:
    # ConfigError: a mistake that breaks two rules (dynamic CP on padded sequences) is reported by both
    with pytest.raises(ConfigError, match=pattern):
        _load(*overrides)


def test_deprecated_global_micro_batch_is_converted_with_a_note() -> None:
    cfg = _load(f"{A}.ppo_micro_batch_size_per_gpu=null", f"{A}.ppo_micro_batch_size=32")
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.actor.megatron.micro_batch_size_per_gpu == 4
    assert any("set to 4 from the deprecated" in n for n in config_notes(cfg))


def test_valid_layouts() -> None:
    cfg = _load(
        f"{AM}.tensor_model_parallel_size=2",
        f"{AM}.pipeline_model_parallel_size=2",
        f"{AM}.context_parallel_size=2",
        "trainer.nnodes=2",
        f"{A}.ppo_mini_batch_size=64",
        f"{A}.ppo_micro_batch_size_per_gpu=2",
    )
    assert (
        cfg.actor_rollout_ref.actor.megatron.model_parallel_size() == 8
    )  # DP = 16 / 8 = 2, 64/2=32 per rank
    cfg = _load(
        f"{AM}.use_megatron_fsdp=true",
        f"{AM}.override_ddp_config.data_parallel_sharding_strategy=optim_grads",
    )
    assert cfg.actor_rollout_ref.actor.megatron.use_megatron_fsdp is True


# ---------------------------------------------------------------------------- conversions
def test_conversions_to_lower_layer_kwargs() -> None:
    cfg = _load(
        f"{AM}.use_distributed_optimizer=false",
        f"{AM}.tensor_model_parallel_size=2",
        f"{AM}.override_ddp_config.bucket_size=1000",
        f"{A}.optim.lr=2e-6",
    )
    eng = cfg.actor_rollout_ref.actor.megatron
    assert eng.wrap_config_kwargs(is_value_model=False) == {
        "is_value_model": False,
        "share_embeddings_and_output_weights": False,
        "wrap_with_ddp": True,
        "use_distributed_optimizer": False,
        "use_megatron_fsdp": False,
    }
    assert eng.ddp_config_overrides() == {"bucket_size": 1000}
    tf = eng.transformer_config_overrides()
    assert (
        tf["tensor_model_parallel_size"] == 2
        and tf["sequence_parallel"] is True
        and tf["recompute_modules"] == ["core_attn"]
    )
    assert eng.parallel_kwargs()["tensor_model_parallel_size"] == 2
    assert eng.construction_path == "provider"  # verl 0.9.1: vanilla_mbridge defaults to false
    assert _load(f"{AM}.vanilla_mbridge=true").actor_rollout_ref.actor.megatron.construction_path == "mbridge"
    assert _load(f"{AM}.use_mbridge=false").actor_rollout_ref.actor.megatron.construction_path == "plain"
    opt = cfg.actor_rollout_ref.actor.optim.optimizer_config_kwargs(
        dtype=eng.dtype, use_distributed_optimizer=False
    )
    assert opt["lr"] == 2e-6 and opt["bf16"] is True and opt["use_distributed_optimizer"] is False
    assert (opt["adam_beta1"], opt["adam_beta2"]) == (0.9, 0.999)
