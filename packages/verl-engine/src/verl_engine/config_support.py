"""Which keys of verl 0.9.1's engine sections the engine honours, which it refuses at build time, and which are
not an engine's (the trainer, the worker or the rollout reads them).

Why a table: verl-config accepts every setting verl accepts, so a setting the engine ignored would silently train
something else than the user asked for. Every key under ``actor_rollout_ref.{actor,ref,model}`` and
``critic`` (with ``critic.model``) matches exactly one :class:`Rule`; a test walks the loaded schema and checks
that no key is unclassified, that every honoured rule names the tests showing its effect, and that every
refused rule is refused by :func:`verl_engine.refusals.check_supported` before any model is built.
``docs/refused-keys.md`` is generated from this table (``scripts/refused_keys_doc.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from verl_engine.config_rule import (
    ACTOR,
    CRITIC,
    CRITIC_MODEL,
    MODEL,
    REF,
    ROLE_SECTIONS,
    SECTIONS,
    Kind,
    Rule,
    flatten_section,
    is_empty,
    one_of,
    plain,
)

__all__ = [
    "ACTOR",
    "CRITIC",
    "CRITIC_MODEL",
    "EVIDENCE_TODO",
    "MODEL",
    "REF",
    "ROLE_SECTIONS",
    "RULES",
    "SECTIONS",
    "Kind",
    "Rule",
    "flatten_section",
    "refusal_problems",
    "rule_for",
]

_ROLES3 = (ACTOR, REF, CRITIC)
_ROUTER_REPLAY = (
    *(
        f"tests/test_rl_engine_router_replay_cpu.py::{name}"
        for name in (
            "test_replaying_the_routes_just_recorded_changes_nothing",
            "test_replay_forces_the_recorded_experts_after_the_routers_change",
            "test_r2_records_in_the_old_log_prob_pass_and_the_update_replays_them",
            "test_r3_replays_the_routes_given_in_the_batch",
        )
    ),
    "tests/test_rl_engine_moe_pp_cpu.py::test_router_replay_at_pp2_ep2_and_ep2_pp2_equals_one_rank",
)
_TRAINS = (ACTOR, CRITIC)
_MODELS = (MODEL, CRITIC_MODEL)


def _torch_fused_kernels(value: Any, cfg: Any, section: str) -> bool:
    return (value or {}).get("impl_backend", "torch") == "torch"


def _describe_fused_kernels(value: Any) -> str:
    impl = (value or {}).get("impl_backend")
    return (
        f"(impl_backend={impl!r}): verl-engine's fused LM head is the chunked torch implementation"
        " (verl_engine.fused_head); supported: impl_backend=torch (or use_fused_kernels=false)"
    )


def _follows_model_fused_kernels(value: Any, cfg: Any, section: str) -> bool:
    return bool(value) == bool(cfg.actor_rollout_ref.model.use_fused_kernels)


def _padded_if_engine_padded(value: Any, cfg: Any, section: str) -> bool:
    engine = cfg.critic.megatron if section == CRITIC_MODEL else cfg.actor_rollout_ref.actor.megatron
    return bool(value) or not engine.use_remove_padding


def _forward_tokens_follow_ppo(value: Any, cfg: Any, section: str) -> bool:
    return value is None or value == cfg.critic.ppo_max_token_len_per_gpu


def _dense_override_config(value: Any, cfg: Any, section: str) -> bool:
    value = plain(value) or {}
    return set(value) <= {"model_config", "moe_config"} and not any((value.get("moe_config") or {}).values())


# evidence node ids, shared by several rules
_PPO_STEP = "tests/test_rl_engine_cpu.py::test_one_ppo_step_is_independent_of_micro_batching_dp_and_cp"
_CRITIC = "tests/test_rl_engine_cpu.py::test_critic_values_are_the_backbone_through_a_value_head"
_LOGPROBS = "tests/test_rl_engine_cpu.py::test_log_probs_and_entropy_match_transformers_on_one_rank"
_LOSS_PARITY = (
    "packages/verl-engine/tests/test_verl_loss_parity.py::test_policy_loss_matches_verl_in_every_layout"
)
_COV_SELECTION = "packages/verl-engine/tests/test_verl_loss_parity.py::test_the_covariance_losses_select_some_tokens_not_all"
_COV_MICRO = "packages/verl-engine/tests/test_verl_loss_parity.py::test_the_covariance_losses_are_verls_function_per_micro_batch"
_UNREGISTERED_LOSS = (
    "packages/verl-engine/tests/test_refusals.py::test_a_policy_loss_the_engine_lacks_is_refused_at_build"
)
_PPO_LOSS = "packages/verl-engine/tests/test_losses.py::test_ppo_loss_matches_reference"
_PPO_LOSS_CFG = "packages/verl-engine/tests/test_losses.py::test_ppo_loss_with_verl_config_and_tensordict"
_PIPELINE = "tests/test_rl_engine_pipeline_cpu.py::test_pipeline_stages_equal_one_stage"
_TP_CP = "tests/test_rl_engine_pipeline_cpu.py::test_pipeline_with_tensor_and_context_parallelism"
_LR = "packages/verl-engine/tests/test_lr_schedule.py::test_megatron_hand_values"
_LR_TOTAL = "packages/verl-engine/tests/test_lr_schedule.py::test_warmup_and_total_resolution"
_OPTIM_GROUPS = "tests/test_engine_optimizer.py::test_cpu_optimizer_groups_follow_megatron"
_LORA = "tests/test_rl_engine_lora_cpu.py::test_lora_engine_surface"
_SETTINGS = "tests/test_rl_engine_settings_cpu.py::"
_MTP = "tests/test_rl_engine_mtp_cpu.py::test_mtp_loss_matches_reference_and_is_independent_of_dp_and_cp"
_NO_MOE = (
    "moe_config.freeze_moe_router=true (frozen routers) is not implemented for mixture-of-experts models yet"
)
_EP = (
    "tests/test_rl_engine_moe_ep_cpu.py::test_expert_parallel_step_equals_one_rank",
    "tests/test_rl_engine_moe_ep_cpu.py::test_expert_parallel_refusals_name_the_key",
    "tests/test_rl_engine_moe_ep_cpu.py::test_export_at_ep2_is_the_checkpoint_bitwise",
    "tests/test_rl_engine_moe_pp_cpu.py::test_moe_at_pp2_dp2_and_ep2_pp2_equals_one_rank",
)
_ETP = (
    "tests/test_rl_engine_moe_ep_cpu.py::test_expert_tensor_parallel_step_equals_one_rank",
    "tests/test_rl_engine_moe_ep_cpu.py::test_expert_parallel_refusals_name_the_key",
)
_NO_QAT = "verl-engine has no quantisation-aware training; leave the qat sections at verl's defaults"
_ENTROPY_CHUNKING = (
    "the engine computes the entropy with its own vocab-parallel kernels (no chunking option); use"
    " actor_rollout_ref.model.use_fused_kernels=true for a memory-light LM head"
)
_LORA_KEYS = (
    "lora.merge", "lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules", "lora.exclude_modules",
    "lora.dropout_position", "lora.lora_A_init_method", "lora.lora_B_init_method", "lora.dtype", "lora.adapter_path",
)  # fmt: skip

_H, _R, _N = Kind.HONOURED, Kind.REFUSED, Kind.NOT_ENGINE

RULES: tuple[Rule, ...] = (
    # ---- role sections: keys of verl's trainer and worker ----
    Rule(keys=("strategy",), sections=_ROLES3, kind=_N,
         reason="selects which of verl's engines the worker builds; model_engine=megatron selects this one"
         " (rl_engine_from_config checks model_engine)"),
    Rule(keys=("rollout_n",), sections=_ROLES3, kind=_N,
         reason="the rollout's samples per prompt (verl's trainer uses it for batch sizes)"),
    Rule(keys=("ppo_mini_batch_size", "ppo_epochs", "shuffle", "data_loader_seed"), sections=_TRAINS, kind=_N,
         reason="verl's trainer / worker splits the batch into shuffled mini-batches and epochs; each engine"
         " train call gets one mini-batch"),
    Rule(keys=("enable",), sections=(CRITIC,), kind=_N,
         reason="verl's trainer decides whether a critic exists"),
    Rule(keys=("nccl_timeout",), sections=(CRITIC,), kind=_N,
         reason="verl's worker creates the process group with it; the engine joins the group it is given"),
    Rule(keys=("calculate_entropy",), sections=(ACTOR,), kind=_N,
         reason="verl's worker reads it and sets data['calculate_entropy'] on each forward; the engine honours"
         " that field (" + _LOGPROBS + ")"),
    Rule(keys=("use_torch_compile",), sections=(ACTOR, REF), kind=_N,
         reason="verl's FSDP actor compiles its log-prob / entropy helpers with it; the Megatron path has no"
         " torch.compile and no result depends on it"),
    Rule(keys=("profiler.enable",), sections=_ROLES3, kind=_R, allowed=one_of(False), supported="false",
         reason="verl-engine has no profiler hooks; profile with nsys / torch.profiler around the engine calls",
         example=("profiler.enable=true",)),
    Rule(keys=("profiler.tool", "profiler.all_ranks", "profiler.ranks", "profiler.save_path",
               "profiler.relocate_results", "profiler.finish_hook_*", "profiler.tool_config"),
         sections=_ROLES3, kind=_N,
         reason="settings of verl's worker profiler (read only when profiler.enable=true, which is refused);"
         " profiler.tool follows global_profiler.tool"),
    # ---- micro-batching (the engine section's use_dynamic_bsz / max_token_len / micro_batch follow these) ----
    Rule(keys=("ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
         sections=_TRAINS, kind=_H, evidence=(_PPO_STEP, _CRITIC),
         reason="through megatron.use_dynamic_bsz / max_token_len_per_gpu / micro_batch_size_per_gpu"),
    Rule(keys=("ppo_micro_batch_size",), sections=_TRAINS, kind=_H,
         evidence=("packages/verl-config/tests/test_ppo_config.py::test_deprecated_global_micro_batch_is_converted_with_a_note",),
         reason="verl-config turns the deprecated global size into ppo_micro_batch_size_per_gpu when loading"),
    Rule(keys=("log_prob_micro_batch_size",), sections=(REF,), kind=_H,
         evidence=("packages/verl-config/tests/test_ppo_config.py::test_deprecated_global_micro_batch_is_converted_with_a_note",),
         reason="verl-config turns the deprecated global size into log_prob_micro_batch_size_per_gpu when loading"),
    Rule(keys=("log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
         sections=(REF,), kind=_H,
         evidence=(_SETTINGS + "test_ref_log_prob_micro_batching_splits_the_reference_call",),
         reason="through the ref's megatron.use_dynamic_bsz / max_token_len_per_gpu / micro_batch_size_per_gpu"),
    Rule(keys=("forward_max_token_len_per_gpu",), sections=(CRITIC,), kind=_R,
         allowed=_forward_tokens_follow_ppo, supported="equal to critic.ppo_max_token_len_per_gpu",
         reason="the engine cuts every call (values and updates) by megatron.max_token_len_per_gpu, which"
         " follows ppo_max_token_len_per_gpu; set the two equal",
         example=("forward_max_token_len_per_gpu=1000",)),
    # ---- the actor's loss (verl_engine.losses.roles.ppo_loss reads the actor section) ----
    Rule(keys=("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg",
               "loss_agg_mode", "loss_scale_factor", "entropy_coeff", "use_kl_loss", "kl_loss_coef",
               "kl_loss_type", "policy_loss.dro_beta"),
         sections=(ACTOR,), kind=_H, evidence=(_LOSS_PARITY, _PPO_LOSS, _PPO_LOSS_CFG, _PPO_STEP),
         reason="read by verl_engine.losses.ppo_loss (the actor section is its config)"),
    Rule(keys=("policy_loss.loss_mode",), sections=(ACTOR,), kind=_H,
         evidence=(_LOSS_PARITY, _COV_SELECTION, _COV_MICRO, _UNREGISTERED_LOSS),
         reason="every policy loss of verl 0.9.1 is registered (verl_engine.losses.POLICY_LOSSES); a name nobody"
         " registered is refused at build (verl_engine.refusals); bypass_mode is selected by"
         " algorithm.rollout_correction.bypass_mode=true, as in verl"),
    Rule(keys=("policy_loss.clip_cov_*", "policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef"),
         sections=(ACTOR,), kind=_H, evidence=(_LOSS_PARITY, _COV_SELECTION, _COV_MICRO),
         reason="read by the clip_cov / kl_cov policy losses (verl_engine.losses.policy)"),
    Rule(keys=("cliprange_value", "loss_agg_mode", "loss_scale_factor"), sections=(CRITIC,), kind=_H,
         evidence=("packages/verl-engine/tests/test_losses.py::test_value_loss_matches_reference",),
         reason="read by verl_engine.losses.value_loss (the critic section is its config)"),
    Rule(keys=("calculate_sum_pi_squared",), sections=(ACTOR,), kind=_R, allowed=one_of(False),
         supported="false", reason="the engine's forward returns log-probs and entropy only (no sum of"
         " squared probabilities)", example=("calculate_sum_pi_squared=true",)),
    Rule(keys=("use_prefix_grouper",), sections=(ACTOR,), kind=_R, allowed=one_of(False), supported="false",
         reason="the engine packs every sequence whole (no shared-prefix grouping)",
         example=("use_prefix_grouper=true",)),
    Rule(keys=("freeze_vision_tower",), sections=(ACTOR,), kind=_R, allowed=one_of(False), supported="false",
         reason="verl-engine builds text-only models (no vision tower)", example=("freeze_vision_tower=true",)),
    Rule(keys=("use_fused_kernels",), sections=(ACTOR,), kind=_R, allowed=_follows_model_fused_kernels,
         supported="equal to actor_rollout_ref.model.use_fused_kernels",
         reason="the engine reads actor_rollout_ref.model.use_fused_kernels (which this key follows); set that"
         " one", example=("use_fused_kernels=true",)),
    *(
        Rule(keys=(f"{prefix}entropy_from_logits_with_chunking",), sections=sections, kind=_R,
             allowed=one_of(False), supported="false", reason=_ENTROPY_CHUNKING,
             example=(f"{prefix}entropy_from_logits_with_chunking=true",))
        for prefix, sections in (("", (ACTOR, REF)), ("megatron.", _ROLES3))
    ),
    *(
        Rule(keys=(f"{prefix}entropy_from_logits_chunk_size",), sections=sections, kind=_R,
             reason="only used with entropy_from_logits_with_chunking, which is refused",
             example=(f"{prefix}entropy_from_logits_chunk_size=1024",))
        for prefix, sections in (("", (ACTOR, REF)), ("megatron.", _ROLES3))
    ),
    *(
        Rule(keys=(f"{prefix}qat.*",), sections=sections, kind=_R, reason=_NO_QAT,
             example=(f"{prefix}qat.enable=true",))
        for prefix, sections in (("", (ACTOR,)), ("megatron.", _ROLES3))
    ),
    Rule(keys=("checkpoint.save_contents", "checkpoint.load_contents"), sections=_TRAINS, kind=_R,
         supported="['model', 'optimizer', 'extra']",
         reason="the engine's checkpoint always holds the model, optimizer and extra state; export Hugging"
         " Face weights with the engine's save_hf", example=("checkpoint.save_contents=[model]",)),
    Rule(keys=("checkpoint.async_save",), sections=_TRAINS, kind=_R, allowed=one_of(False), supported="false",
         reason="the engine saves synchronously", example=("checkpoint.async_save=true",)),
    Rule(keys=("checkpoint.strict",), sections=_TRAINS, kind=_R, allowed=one_of(True), supported="true",
         reason="the engine loads checkpoints strictly", example=("checkpoint.strict=false",)),
    Rule(keys=("checkpoint.mbridge_config",), sections=_TRAINS, kind=_R, allowed=is_empty, supported="{}",
         reason="the engine does not checkpoint through mbridge",
         example=("+checkpoint.mbridge_config.distributed_filesystem=true",)),
    # ---- the optimizer (verl_engine.optimizer, verl_engine.lr_schedule) ----
    Rule(keys=("optim.lr", "optim.betas", "optim.weight_decay", "optim.clip_grad", "optim.min_lr",
               "optim.lr_warmup_steps", "optim.lr_warmup_steps_ratio", "optim.lr_warmup_init",
               "optim.lr_decay_steps", "optim.total_training_steps", "optim.override_optimizer_config"),
         sections=_TRAINS, kind=_H, evidence=(_LR, _LR_TOTAL, _OPTIM_GROUPS, _PPO_STEP),
         reason="megatron-core's OptimizerConfig (override_optimizer_config last) and the engine's LR schedule"),
    Rule(keys=("optim.optimizer",), sections=_TRAINS, kind=_R, allowed=one_of("adam"), supported="adam",
         reason="the engine builds and tests Adam only (its muon_* / sgd settings are not passed on)",
         example=("optim.optimizer=sgd",)),
    Rule(keys=("optim.lr_decay_style",), sections=_TRAINS, kind=_R,
         allowed=one_of("constant", "linear", "cosine"), supported="constant, linear, cosine",
         reason="verl_engine.lr_schedule implements megatron-core's constant / linear / cosine schedules",
         evidence=(_LR,), example=("optim.lr_decay_style=WSD",)),
    Rule(keys=("optim.lr_wsd_decay_style", "optim.lr_wsd_decay_steps"), sections=_TRAINS, kind=_R,
         reason="only used by lr_decay_style=WSD, which is refused", example=("optim.lr_wsd_decay_steps=10",)),
    Rule(keys=("optim.weight_decay_incr_style",), sections=_TRAINS, kind=_R, allowed=one_of("constant"),
         supported="constant", reason="the engine keeps weight_decay constant",
         example=("optim.weight_decay_incr_style=linear",)),
    Rule(keys=("optim.use_checkpoint_opt_param_scheduler",), sections=_TRAINS, kind=_R, allowed=one_of(False),
         supported="false", reason="a resumed LR schedule takes this config's settings (megatron's override mode)",
         example=("optim.use_checkpoint_opt_param_scheduler=true",)),
    Rule(keys=("optim.use_precision_aware_optimizer", "optim.main_grads_dtype", "optim.exp_avg_dtype",
               "optim.exp_avg_sq_dtype"), sections=_TRAINS, kind=_R,
         reason="the engine does not pass the precision-aware optimizer settings to megatron-core; set them"
         " through optim.override_optimizer_config if you need them",
         example=("optim.use_precision_aware_optimizer=true",)),
    Rule(keys=("optim.use_layer_wise_distributed_optimizer", "optim.use_layer_wise_param_layout", "optim.muon_*"),
         sections=_TRAINS, kind=_R, reason="Muon settings; the engine builds Adam only",
         example=("optim.muon_momentum=0.9",)),
    # ---- the megatron engine section ----
    Rule(keys=("megatron.param_offload", "megatron.grad_offload", "megatron.optimizer_offload"),
         sections=_ROLES3, kind=_H,
         evidence=("tests/test_grpo_run_cpu.py::test_grpo_loop_invariants_exact_resume_and_offload",
                   "tests/test_rl_engine_offload_cpu.py::test_offload_round_trip_is_bitwise"),
         reason="the worker offloads between calls with the engine's offload methods"),
    Rule(keys=("megatron.tensor_model_parallel_size", "megatron.pipeline_model_parallel_size",
               "megatron.virtual_pipeline_model_parallel_size", "megatron.context_parallel_size"),
         sections=_ROLES3, kind=_H, evidence=(_PIPELINE, _TP_CP, _PPO_STEP)),
    Rule(keys=("megatron.sequence_parallel",), sections=_ROLES3, kind=_H,
         evidence=("tests/test_rl_engine_sequence_parallel_cpu.py::test_tp2_with_and_without_sp_equals_one_rank",),
         reason="without Transformer Engine too (verl_mcore_utils.sp_norm); off at TP 1, as verl sets it"),
    Rule(keys=("megatron.expert_model_parallel_size",), sections=_ROLES3, kind=_H, evidence=_EP),
    Rule(keys=("megatron.expert_tensor_parallel_size",), sections=_ROLES3, kind=_H, evidence=_ETP),
    Rule(keys=("megatron.use_distributed_optimizer",), sections=_ROLES3, kind=_H,
         evidence=("tests/test_gpu_construction.py::test_gradient_reduction_matches_the_setting",
                   "tests/test_config_to_mcore.py::test_engine_section_to_wrap_and_ddp_config")),
    Rule(keys=("megatron.use_dist_checkpointing",), sections=_ROLES3, kind=_R, allowed=one_of(False),
         supported="false", reason="the engine loads Hugging Face weights from model.path and saves its own"
         " checkpoints, not megatron dist checkpoints",
         example=("megatron.use_dist_checkpointing=true", "megatron.dist_checkpointing_path=/ckpt")),
    Rule(keys=("megatron.dist_checkpointing_path", "megatron.dist_checkpointing_prefix",
               "megatron.dist_ckpt_optim_fully_reshardable", "megatron.distrib_optim_fully_reshardable_mem_efficient"),
         sections=_ROLES3, kind=_R, reason="megatron dist-checkpoint settings; the engine does not use dist"
         " checkpoints", example=("megatron.dist_ckpt_optim_fully_reshardable=true",)),
    Rule(keys=("megatron.dynamic_context_parallel", "megatron.max_seqlen_per_dp_cp_rank"), sections=_ROLES3,
         kind=_H, evidence=("tests/test_engine_packed_cpu.py::test_cp_layouts_match_no_cp", _PPO_STEP)),
    Rule(keys=("megatron.packed_attention_backend",), sections=_ROLES3, kind=_H,
         evidence=("tests/test_gpu_engine_packed.py::test_transformer_engine_without_cp_is_as_accurate_as_bf16",)),
    Rule(keys=("megatron.pad_bshd_to_minibatch_max",), sections=_ROLES3, kind=_H, evidence=(_LOGPROBS,),
         reason="padded (use_remove_padding=false) micro-batches are padded to their own longest sequence; with"
         " causal attention and right padding the outputs are those of verl's padding either way, only memory"
         " differs"),
    Rule(keys=("megatron.pad_to_length", "megatron.pad_to_length_bucket"), sections=_ROLES3, kind=_R,
         reason="the engine pads padded micro-batches to their longest sequence (no fixed-length buckets)",
         example=("megatron.pad_to_length=true",)),
    Rule(keys=("megatron.seed",), sections=(ACTOR, REF), kind=_H,
         evidence=(_SETTINGS + "test_megatron_seed_initialises_a_model_built_without_weights",),
         reason="torch.manual_seed before the model (and LoRA adapters) are initialised: it sets what model.path"
         " does not load (every weight of a model built from hf_config alone, the adapters)"),
    Rule(keys=("megatron.seed",), sections=(CRITIC,), kind=_H,
         evidence=(_SETTINGS + "test_megatron_seed_initialises_the_critic_value_head",),
         reason="torch.manual_seed before the model (and LoRA adapters) are initialised: the value head (not in"
         " model.path's weights) comes from it"),
    Rule(keys=("megatron.override_ddp_config",), sections=_ROLES3, kind=_H,
         evidence=("tests/test_config_to_mcore.py::test_engine_section_to_wrap_and_ddp_config",
                   "tests/test_gpu_construction.py::test_gradient_reduction_matches_the_setting",
                   _SETTINGS + "test_gradients_are_reduced_in_fp32_unless_override_ddp_config_says_otherwise"),
         reason="over verl's DDP defaults (fp32 gradient reduction; megatron-core's own default is bf16)"),
    Rule(keys=("megatron.override_transformer_config",), sections=_ROLES3, kind=_H,
         evidence=(_PIPELINE, "tests/test_config_to_mcore.py::test_engine_section_to_transformer_config")),
    Rule(keys=("megatron.override_mcore_model_config",), sections=_ROLES3, kind=_R, allowed=is_empty,
         supported="{}", reason="the engine builds its model from config.json (+ model.override_config.model_config"
         " and megatron.override_transformer_config); use those",
         example=("+megatron.override_mcore_model_config.share_embeddings_and_output_weights=true",)),
    Rule(keys=("megatron.use_mbridge", "megatron.vanilla_mbridge"), sections=_ROLES3, kind=_N,
         reason="choose among verl's model-construction codes; verl-engine has one (its provider from config.json,"
         " weights from model.path's safetensors) and the model is the same"),
    Rule(keys=("megatron.use_remove_padding",), sections=_ROLES3, kind=_H, evidence=(_LOGPROBS,)),
    Rule(keys=("megatron.forward_only",), sections=_TRAINS, kind=_H,
         evidence=(_SETTINGS + "test_megatron_forward_only_builds_no_optimizer",),
         reason="forward_only=true builds no optimizer or LR schedule, freezes the parameters and refuses"
         " train_batch (as verl's engine and worker)"),
    Rule(keys=("megatron.forward_only",), sections=(REF,), kind=_R, allowed=one_of(True), supported="true",
         reason="the reference policy has no optim section: its engine is always forward only (verl's"
         " megatron_ref.yaml sets true)", example=("megatron.forward_only=false",)),
    Rule(keys=("megatron.dtype",), sections=_ROLES3, kind=_H,
         evidence=("tests/test_gpu_engine.py::test_bf16_training_on_gpu_reduces_loss",),
         reason="the CPU debug backend always runs float32"),
    Rule(keys=("megatron.use_megatron_fsdp",), sections=_ROLES3, kind=_H,
         evidence=("tests/test_gpu_mfsdp.py::test_megatron_fsdp_matches_ddp_distributed_optimizer",)),
    Rule(keys=("megatron.router_replay.mode",), sections=(ACTOR, REF), kind=_H, evidence=_ROUTER_REPLAY,
         reason="verl_engine.router_replay: R2 records the routes in the old-log-prob pass and replays them in the"
         " update, R3 replays the batch's routed_experts (also at PP and EP); a dense model, sequence parallelism,"
         " padded rows and unreplayable routers are refused by name at build; the reference policy never replays (as verl's)"),
    Rule(keys=("megatron.router_replay.mode",), sections=(CRITIC,), kind=_R, allowed=one_of("disabled"),
         supported="disabled", reason="verl 0.9.1 replays the actor's routes only (its critic has no replay)",
         example=("megatron.router_replay.mode=R2",)),
    Rule(keys=("megatron.router_replay.record_file", "megatron.router_replay.replay_file"), sections=_ROLES3,
         kind=_R, allowed=one_of(None), supported="null", reason="verl 0.9.1 declares these keys but never reads"
         " them: routes travel in the batch as routed_experts", example=("megatron.router_replay.record_file=r.pt",)),
    Rule(keys=("megatron.use_dynamic_bsz", "megatron.max_token_len_per_gpu", "megatron.micro_batch_size_per_gpu"),
         sections=_ROLES3, kind=_H, evidence=(_PPO_STEP,),
         reason="verl_engine.micro_batching.MicroBatching; they follow the role's own keys"),
    # ---- the model sections ----
    Rule(keys=("path",), sections=_MODELS, kind=_H, evidence=(_LOGPROBS,),
         reason="config.json and the safetensors weights are read from it"),
    Rule(keys=("tokenizer_path", "custom_chat_template", "use_shm", "trust_remote_code"), sections=_MODELS,
         kind=_N, reason="read by verl's tokenizer and model-download helpers; the engine reads config.json and the"
         " safetensors of model.path itself and builds only its supported architectures"),
    Rule(keys=("lora.fully_sharded_loras",), sections=_MODELS, kind=_N,
         reason="read by verl's vLLM rollout server (how vLLM shards LoRA weights), not by a training engine"),
    Rule(keys=("external_lib",), sections=_MODELS, kind=_R, allowed=one_of(None), supported="null",
         reason="the engine builds its own supported architectures (qwen2, qwen3, llama) and imports no model code",
         example=("external_lib=my_models",)),
    Rule(keys=("hf_config_path",), sections=_MODELS, kind=_R, allowed=one_of(None), supported="null",
         reason="the engine reads config.json from model.path (or the hf_config= argument of"
         " rl_engine_from_config)", example=("hf_config_path=/models/config",)),
    Rule(keys=("override_config",), sections=_MODELS, kind=_R, allowed=_dense_override_config,
         supported="model_config overrides; moe_config.freeze_moe_router=false",
         reason="model_config entries override config.json; " + _NO_MOE,
         evidence=(_PIPELINE,), example=("override_config.moe_config.freeze_moe_router=true",)),
    Rule(keys=("use_remove_padding",), sections=_MODELS, kind=_R, allowed=_padded_if_engine_padded,
         supported="true, or false together with the role's megatron.use_remove_padding=false",
         reason="the Megatron engine follows megatron.use_remove_padding; set that one to false",
         example=("use_remove_padding=false",)),
    Rule(keys=("enable_gradient_checkpointing", "enable_activation_offload", "use_liger", "tiled_mlp.*"),
         sections=_MODELS, kind=_N,
         reason="keys of verl's FSDP engine, which verl's Megatron engine ignores too (recomputation is"
         " megatron.override_transformer_config.recompute_*)"),
    Rule(keys=("lora_rank", "lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path"),
         sections=_MODELS, kind=_H,
         evidence=("packages/verl-config/tests/test_lora.py::test_flat_only_is_moved_into_the_block_with_warnings",),
         reason="verl-config moves these legacy spellings into model.lora when loading"),
    Rule(keys=("use_fused_kernels",), sections=(MODEL,), kind=_H,
         evidence=("tests/test_rl_engine_cpu.py::test_the_fused_lm_head_gives_the_same_ppo_step",)),
    Rule(keys=("use_fused_kernels",), sections=(CRITIC_MODEL,), kind=_R, allowed=one_of(False),
         supported="false", reason="the critic is a value model: it has no LM head to fuse",
         example=("use_fused_kernels=true",)),
    Rule(keys=("fused_kernel_options",), sections=_MODELS, kind=_R, allowed=_torch_fused_kernels,
         supported="impl_backend=torch", reason="verl-engine's fused LM head is the chunked torch implementation",
         describe=_describe_fused_kernels,
         evidence=("tests/test_rl_engine_cpu.py::test_fused_kernels_with_an_unknown_backend_is_refused",),
         example=("fused_kernel_options.impl_backend=triton",)),
    Rule(keys=_LORA_KEYS,
         sections=(MODEL,), kind=_H,
         evidence=(_LORA, "packages/verl-mcore-utils/tests/test_lora.py::test_adapter_matches_peft_on_transformers",
                   "packages/verl-mcore-utils/tests/test_lora.py::test_dropout_after_the_adapter",
                   "packages/verl-mcore-utils/tests/test_lora.py::test_merged_export_matches_peft_merge_and_unload",
                   "packages/verl-mcore-utils/tests/test_lora.py::test_save_load_round_trip_is_exact"),
         reason="verl_mcore_utils.lora inserts the adapters before wrapping (the reference policy is the base"
         " model)"),
    Rule(keys=_LORA_KEYS,
         sections=(CRITIC_MODEL,), kind=_H,
         evidence=(_SETTINGS + "test_critic_model_lora_builds_a_lora_critic",
                   "packages/verl-mcore-utils/tests/test_lora.py::test_adapter_matches_peft_on_transformers",
                   "packages/verl-mcore-utils/tests/test_lora.py::test_dropout_after_the_adapter",
                   "packages/verl-mcore-utils/tests/test_lora.py::test_save_load_round_trip_is_exact"),
         reason="the critic's engine gets the same LoRA hook as the actor's, from critic.model.lora"),
    Rule(keys=("lora.type",), sections=_MODELS, kind=_R, allowed=one_of("lora"), supported="lora",
         reason="verl_mcore_utils.lora implements plain LoRA (one adapter per linear)", example=("lora.type=dora",)),
    Rule(keys=("lora.a2a_experimental",), sections=_MODELS, kind=_R, allowed=one_of(False), supported="false",
         reason="LoRA adapters on the experts' all-to-all are not implemented (LoRA targets no expert in verl-engine)", example=("lora.a2a_experimental=true",)),
    Rule(keys=("lora.freeze_vision_model", "lora.freeze_vision_projection", "lora.freeze_language_model"),
         sections=_MODELS, kind=_R, allowed=one_of(True), supported="true",
         reason="verl-engine builds text-only models and LoRA always freezes the base model",
         example=("lora.freeze_language_model=false",)),
    Rule(keys=("mtp.enable", "mtp.enable_train", "mtp.detach_encoder", "mtp.mtp_loss_scaling_factor"),
         sections=(MODEL,), kind=_H,
         evidence=(_MTP, "tests/test_rl_engine_mtp_cpu.py::test_mtp_on_a_model_without_mtp_layers_is_named")),
    Rule(keys=("mtp.enable", "mtp.enable_train", "mtp.detach_encoder", "mtp.mtp_loss_scaling_factor"),
         sections=(CRITIC_MODEL,), kind=_R,
         reason="the critic is a value model: multi-token prediction trains LM heads it does not have",
         example=("mtp.enable=true",)),
    Rule(keys=("mtp.enable_rollout", "mtp.speculative_*", "mtp.method", "mtp.num_speculative_tokens"),
         sections=_MODELS, kind=_N, reason="the rollout's speculative decoding with the MTP layers"),
)  # fmt: skip

EVIDENCE_TODO: frozenset[tuple[str, str]] = frozenset()
"""(section, key pattern of an honoured rule) whose effect no test shows yet: the engine reads them (see the
rule's reason) but the evidence is missing; the walk test reports them."""


def rule_for(key: str, section: str) -> Rule:
    """The one rule of ``section``'s ``key``; KeyError when none or several match."""
    found = [r for r in RULES if r.matches(key, section)]
    if len(found) != 1:
        raise KeyError(
            f"{section}.{key} matches {len(found)} rules of verl_engine.config_support.RULES; give it one"
        )
    return found[0]


def refusal_problems(
    cfg: Any, *, role: str, describe: Mapping[str, Callable[[Any], str]] | None = None
) -> list[str]:
    """One line per key of ``role``'s sections that is valid verl but not supported here (empty: buildable).

    ``describe``: full key -> the message after ``key=value`` for keys whose refusal says more than the table.
    """
    problems = []
    for section in ROLE_SECTIONS[role]:
        for key, value in flatten_section(cfg, section):
            rule = rule_for(key, section)
            if rule.kind is Kind.REFUSED and not rule.is_supported(value, cfg=cfg, section=section, key=key):
                full = f"{section}.{key}"
                custom = (describe or {}).get(full)
                problems.append(
                    f"{full}={plain(value)!r} {custom(value)}" if custom else rule.problem(full, value)
                )
    return problems
