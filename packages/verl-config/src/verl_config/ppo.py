"""Typed schema of the PPO trainer config (``ppo_trainer``): every section, both engines.

The tree and key names are verl's (``actor_rollout_ref.actor.megatron.override_ddp_config...``),
so existing command lines keep working. Role sections that differ per engine come in two
classes (``FSDPActorConfig`` / ``McoreActorConfig`` ...); :mod:`verl_config.compose` picks them from
``model_engine``. Rules that involve several sections live in :meth:`TrainerConfig.__post_init__`
and name every key involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.engines import FSDPEngineConfig, FSDPOptimConfig, McoreEngineConfig, McoreOptimConfig
from verl_config.errors import ConfigValueError, ErrorCollector
from verl_config.model import CriticModelConfig, FSDPCriticModelConfig, ModelConfig
from verl_config.notes import adjusting, note
from verl_config.profiler import GlobalProfilerConfig, ProfilerConfig
from verl_config.reward import (
    CustomRewardFunctionConfig,
    FSDPRewardModelConfig,
    RewardManagerConfig,
    RewardModelConfig,
)
from verl_config.rollout import FSDPRolloutConfig, RolloutConfig
from verl_config.validation import check_choice, check_parallel_layout, check_positive

__all__ = [
    "ADV_ESTIMATORS",
    "ENGINE_STRATEGIES",
    "MODEL_ENGINES",
    "POLICY_LOSS_MODES",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "DataConfig",
    "FSDPActorConfig",
    "FSDPCriticConfig",
    "FSDPRefConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "McoreActorConfig",
    "McoreCriticConfig",
    "McoreRefConfig",
    "PolicyLossConfig",
    "RayKwargsConfig",
    "RefConfig",
    "RolloutCorrectionConfig",
    "RouterReplayConfig",
    "RunConfig",
    "TrainerConfig",
    "TransferQueueConfig",
    "check_kl_type",
]

MODEL_ENGINES = ("fsdp", "megatron")
# The actor/ref/critic strategies each engine accepts (verl's FSDP roles take fsdp or fsdp2).
ENGINE_STRATEGIES = {"fsdp": ("fsdp", "fsdp2"), "megatron": ("megatron",)}
# verl's built-in advantage estimators (verl/trainer/ppo/core_algos.py AdvantageEstimator). verl
# looks names up in a registry that user code can extend, so an unknown name is a note, not an error.
ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "opo",
    "grpo_passk",
    "gpg",
    "rloo_vectorized",
    "grpo_vectorized",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
)
# verl's registered policy losses (register_policy_loss); extendable like the estimators.
POLICY_LOSS_MODES = (
    "vanilla",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "cispo",
    "bypass_mode",
)
# Estimators that compare several responses to the same prompt: meaningless with rollout.n == 1.
_GROUP_ESTIMATORS = (
    "grpo",
    "rloo",
    "opo",
    "gpg",
    "grpo_passk",
    "reinforce_plus_plus_baseline",
    "rloo_vectorized",
    "grpo_vectorized",
)
_LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# KL estimators of verl's kl_penalty; a trailing '+' selects the straight-through k2 gradient.
_KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def check_kl_type(key: str, value: str) -> None:
    """A KL estimator name as verl's kl_penalty takes it (``low_var_kl``, ``k3+`` ...)."""
    check_choice(key, value[:-1] if isinstance(value, str) and value.endswith("+") else value, _KL_TYPES)


def _registry_note(key: str, value: str, known: tuple[str, ...]) -> None:
    """An unknown name of an extensible verl registry: accepted (user code may register it), noted."""
    if isinstance(value, str) and "${" not in value and value not in known and adjusting():
        note(
            key,
            f"{value!r} is not one of verl's built-ins ({', '.join(known)}); it must be registered by your code",
        )


# --------------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """Prompt dataset and batch size (``train_batch_size`` prompts per step, before rollout.n)."""

    tokenizer: str | None = None
    use_shm: bool = False
    train_files: Any = "~/data/rlhf/gsm8k/train.parquet"
    val_files: Any = "~/data/rlhf/gsm8k/test.parquet"
    train_max_samples: int = -1
    val_max_samples: int = -1
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    gen_batch_size: int | None = None
    val_batch_size: int | None = None
    tool_config_path: str | None = "${actor_rollout_ref.rollout.multi_turn.tool_config_path}"
    return_raw_input_ids: bool = False
    return_raw_chat: bool = True
    return_full_prompt: bool = False
    shuffle: bool = True
    seed: int | None = None
    dataloader_num_workers: int = 8
    image_patch_size: int = 14
    validation_shuffle: bool = False
    filter_overlong_prompts: bool = False
    filter_overlong_prompts_workers: int = 1
    truncation: str = "error"
    image_key: str = "images"
    video_key: str = "videos"
    trust_remote_code: bool = False
    custom_cls: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})
    return_multi_modal_inputs: bool = True
    sampler: dict[str, Any] = field(default_factory=lambda: {"class_path": None, "class_name": None})
    datagen: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in (
            "max_prompt_length",
            "max_response_length",
            "train_batch_size",
            "filter_overlong_prompts_workers",
            "image_patch_size",
        ):
            check_positive(key, getattr(self, key))
        check_positive("dataloader_num_workers", self.dataloader_num_workers, allow_zero=True)
        if self.gen_batch_size is not None:
            check_positive("gen_batch_size", self.gen_batch_size)
        if self.val_batch_size is not None:
            check_positive("val_batch_size", self.val_batch_size)
            if adjusting():
                note(
                    "val_batch_size",
                    "is deprecated in verl (validation sets go to the rollout engine as one batch)",
                )
        check_choice("truncation", self.truncation, ("error", "left", "right", "middle"))


# ------------------------------------------------------------------------------------------- actor
@dataclass
class CheckpointConfig:
    """What a checkpoint holds (``model``, ``optimizer``, ``extra``, ``hf_model``); load follows save."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: list[str] = "${.save_contents}"  # type: ignore[assignment]
    async_save: bool = False

    def __post_init__(self) -> None:
        for key in ("save_contents", "load_contents"):
            value = getattr(self, key)
            if isinstance(value, list):
                for item in value:
                    check_choice(key, item, ("model", "optimizer", "extra", "hf_model"))


@dataclass
class PolicyLossConfig:
    """The policy loss (``actor.policy_loss``): ``loss_mode`` picks it (GSPO: ``gspo``; DAPO: ``vanilla``)."""

    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    def __post_init__(self) -> None:
        _registry_note("loss_mode", self.loss_mode, POLICY_LOSS_MODES)
        if self.clip_cov_lb > self.clip_cov_ub:
            raise ConfigValueError(
                "clip_cov_lb", f"({self.clip_cov_lb}) is above clip_cov_ub ({self.clip_cov_ub}); swap them"
            )


@dataclass
class RouterReplayConfig:
    """MoE router replay (``actor.router_replay``): record / replay expert routing for determinism."""

    mode: str = "disabled"
    record_file: str | None = None
    replay_file: str | None = None

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ("disabled", "R2", "R3"))


@dataclass
class ActorConfig:
    """Keys of ``actor_rollout_ref.actor`` common to both engines."""

    strategy: str = "fsdp"
    rollout_n: int = "${actor_rollout_ref.rollout.n}"  # type: ignore[assignment]
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int | None = 16384
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    freeze_vision_tower: bool = False
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int | None = None
    entropy_coeff: float = 0.0
    calculate_entropy: bool = False
    use_kl_loss: bool = False
    use_prefix_grouper: bool = False
    use_torch_compile: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    shuffle: bool = False
    data_loader_seed: int | None = 42
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    use_fused_kernels: bool = "${actor_rollout_ref.model.use_fused_kernels}"  # type: ignore[assignment]
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, ("fsdp", "fsdp2", "megatron"))
        for key in ("ppo_mini_batch_size", "ppo_epochs"):
            check_positive(key, getattr(self, key))
        for key in (
            "ppo_micro_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ppo_max_token_len_per_gpu",
            "loss_scale_factor",
        ):
            if getattr(self, key) is not None:
                check_positive(key, getattr(self, key))
        if self.use_dynamic_bsz is True and self.ppo_max_token_len_per_gpu is None:
            raise ConfigValueError(
                "ppo_max_token_len_per_gpu",
                "is null but use_dynamic_bsz is true; dynamic batching packs micro-batches up to this many tokens"
                " per GPU: set ppo_max_token_len_per_gpu (e.g. 16384) or use_dynamic_bsz=false",
            )
        check_choice("loss_agg_mode", self.loss_agg_mode, _LOSS_AGG_MODES)
        check_kl_type("kl_loss_type", self.kl_loss_type)
        if not isinstance(self.clip_ratio_c, str) and self.clip_ratio_c <= 1.0:
            raise ConfigValueError(
                "clip_ratio_c",
                f"must be > 1 (dual-clip lower bound; verl's policy loss asserts it); got {self.clip_ratio_c}",
            )


@dataclass
class FSDPActorConfig(ActorConfig):
    """FSDP actor: ``fsdp_config`` section, Ulysses sequence parallel, torch.compile.

    ``grad_clip`` is verl's legacy spelling of ``optim.clip_grad``: given explicitly, it is moved
    there with a warning.
    """

    strategy: str = "fsdp"
    optim: FSDPOptimConfig = field(default_factory=FSDPOptimConfig)
    fsdp_config: FSDPEngineConfig = field(default_factory=FSDPEngineConfig)
    grad_clip: float | None = 1.0
    ulysses_sequence_parallel_size: int = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False
    use_remove_padding: bool = "${actor_rollout_ref.model.use_remove_padding}"  # type: ignore[assignment]
    calculate_sum_pi_squared: bool = False
    sum_pi_squared_checkpointing: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)


@dataclass
class McoreActorConfig(ActorConfig):
    """Megatron actor: ``megatron`` section and megatron-core optimizer."""

    strategy: str = "megatron"
    optim: McoreOptimConfig = field(default_factory=McoreOptimConfig)
    megatron: McoreEngineConfig = field(default_factory=McoreEngineConfig)
    load_weight: bool = True


# --------------------------------------------------------------------------------------------- ref
@dataclass
class RefConfig:
    """Reference policy (log-probs only); used when a KL term needs it (use_kl_loss / use_kl_in_reward)."""

    strategy: str = "fsdp"
    rollout_n: int = "${actor_rollout_ref.rollout.n}"  # type: ignore[assignment]
    use_torch_compile: bool = "${actor_rollout_ref.actor.use_torch_compile}"  # type: ignore[assignment]
    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int | None = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, ("fsdp", "fsdp2", "megatron"))


@dataclass
class FSDPRefConfig(RefConfig):
    strategy: str = "${actor_rollout_ref.actor.strategy}"
    fsdp_config: FSDPEngineConfig = field(default_factory=lambda: FSDPEngineConfig(forward_only=True))
    ulysses_sequence_parallel_size: int = "${actor_rollout_ref.actor.ulysses_sequence_parallel_size}"  # type: ignore[assignment]
    entropy_from_logits_with_chunking: bool = False
    entropy_checkpointing: bool = False


@dataclass
class McoreRefConfig(RefConfig):
    strategy: str = "megatron"
    megatron: McoreEngineConfig = field(default_factory=McoreEngineConfig)
    load_weight: bool = True


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref``: the shared model plus the actor, rollout and reference sections."""

    hybrid_engine: bool = True
    nccl_timeout: int = 600
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=FSDPActorConfig)
    ref: RefConfig = field(default_factory=FSDPRefConfig)
    rollout: RolloutConfig = field(default_factory=FSDPRolloutConfig)

    def __post_init__(self) -> None:
        check_positive("nccl_timeout", self.nccl_timeout)


# -------------------------------------------------------------------------------------------- critic
@dataclass
class CriticConfig:
    """Value model (GAE). Used when ``enable`` is true, or when it is null and adv_estimator is gae."""

    strategy: str = "fsdp"
    rollout_n: int = "${actor_rollout_ref.rollout.n}"  # type: ignore[assignment]
    enable: bool | None = None
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"  # type: ignore[assignment]
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    ppo_max_token_len_per_gpu: int | None = 32768
    forward_max_token_len_per_gpu: int | None = "${.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"  # type: ignore[assignment]
    shuffle: bool = "${actor_rollout_ref.actor.shuffle}"  # type: ignore[assignment]
    data_loader_seed: int | None = 42
    cliprange_value: float = 0.5
    loss_agg_mode: str = "${actor_rollout_ref.actor.loss_agg_mode}"
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, ("fsdp", "fsdp2", "megatron"))
        check_positive("ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_positive("cliprange_value", self.cliprange_value)
        check_choice("loss_agg_mode", self.loss_agg_mode, _LOSS_AGG_MODES)
        if self.use_dynamic_bsz is True and self.ppo_max_token_len_per_gpu is None:
            raise ConfigValueError(
                "ppo_max_token_len_per_gpu",
                "is null but use_dynamic_bsz is true; set ppo_max_token_len_per_gpu (e.g. 32768) or use_dynamic_bsz=false",
            )


@dataclass
class FSDPCriticConfig(CriticConfig):
    strategy: str = "fsdp"
    optim: FSDPOptimConfig = field(default_factory=lambda: FSDPOptimConfig(lr=1e-5))
    model: FSDPCriticModelConfig = field(default_factory=FSDPCriticModelConfig)
    forward_micro_batch_size: int | None = "${.ppo_micro_batch_size}"  # type: ignore[assignment]
    forward_micro_batch_size_per_gpu: int | None = "${.ppo_micro_batch_size_per_gpu}"  # type: ignore[assignment]
    ulysses_sequence_parallel_size: int = 1
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)


@dataclass
class McoreCriticConfig(CriticConfig):
    strategy: str = "megatron"
    optim: McoreOptimConfig = field(default_factory=lambda: McoreOptimConfig(lr=1e-5))
    megatron: McoreEngineConfig = field(default_factory=McoreEngineConfig)
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    data_loader_seed: int | None = "${actor_rollout_ref.actor.data_loader_seed}"  # type: ignore[assignment]
    nccl_timeout: int = 600
    load_weight: bool = True


# ----------------------------------------------------------------------------------------- algorithm
@dataclass
class KLControlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1

    def __post_init__(self) -> None:
        check_choice("type", self.type, ("fixed", "adaptive"))


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (``algorithm.filter_groups``): drop groups whose ``metric`` does not vary."""

    enable: bool = False
    metric: str | None = None
    max_num_gen_batches: int = 0

    def __post_init__(self) -> None:
        if self.enable and self.metric is None:
            raise ConfigValueError(
                "metric", "is null but enable is true; name the metric groups are filtered on (e.g. acc)"
            )


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between rollout and training log-probs (``algorithm.rollout_correction``)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    rollout_is_batch_normalize: bool = False

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, ("ppo_clip", "reinforce"))
        check_positive("rollout_is_threshold", self.rollout_is_threshold)


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    use_pf_ppo: bool = False
    pf_ppo: dict[str, Any] = field(default_factory=lambda: {"reweight_method": "pow", "weight_pow": 2.0})
    filter_groups: FilterGroupsConfig | None = None
    rollout_correction: RolloutCorrectionConfig | None = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        _registry_note("adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        check_kl_type("kl_penalty", self.kl_penalty)
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigValueError(key, f"must be in [0, 1]; got {getattr(self, key)}")
        method = (self.pf_ppo or {}).get("reweight_method")
        if method is not None:
            check_choice("pf_ppo.reweight_method", method, ("pow", "max_min", "max_random"))


# ------------------------------------------------------------------------------------------- trainer
@dataclass
class RunConfig:
    """The ``trainer`` section: run control, logging, checkpoints, cluster size.

    ``logger`` takes a list or one name (``trainer.logger=console`` means ``[console]``, as in verl).
    """

    balance_batch: bool = True
    total_epochs: int = 30
    total_training_steps: int | None = None
    project_name: str = "verl_examples"
    experiment_name: str = "gsm8k"
    logger: Any = field(default_factory=lambda: ["console", "wandb"])
    log_val_generations: int = 0
    rollout_data_dir: str | None = None
    validation_data_dir: str | None = None
    nnodes: int = 1
    n_gpus_per_node: int = 8
    save_freq: int = -1
    esi_redundant_time: int = 0
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    val_before_train: bool = True
    val_only: bool = False
    test_freq: int = -1
    critic_warmup: int = 0
    default_hdfs_dir: str | None = None
    del_local_ckpt_after_load: bool = False
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_actor_ckpt_to_keep: int | None = None
    max_critic_ckpt_to_keep: int | None = None
    remove_previous_ckpt_in_save: bool | None = None
    ray_wait_register_center_timeout: int = 300
    device: str = "cuda"
    use_legacy_worker_impl: str = "auto"

    def __post_init__(self) -> None:
        check_positive("nnodes", self.nnodes)
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        check_positive("total_epochs", self.total_epochs)
        if self.total_training_steps is not None:
            check_positive("total_training_steps", self.total_training_steps)
        check_choice("resume_mode", self.resume_mode, ("auto", "disable", "resume_path"))
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ConfigValueError(
                "resume_from_path", "is null but resume_mode is 'resume_path'; give the checkpoint folder"
            )
        check_choice("device", self.device, ("cuda", "npu", "cpu"))
        check_choice("use_legacy_worker_impl", self.use_legacy_worker_impl, ("auto", "enable", "disable"))
        if isinstance(self.logger, str) and "${" not in self.logger:
            self.logger = [self.logger]
        if not isinstance(self.logger, list | tuple):
            raise ConfigValueError("logger", f"must be a logger name or a list of them; got {self.logger!r}")
        for item in self.logger:
            check_choice(
                "logger",
                item,
                (
                    "console",
                    "wandb",
                    "tensorboard",
                    "mlflow",
                    "swanlab",
                    "vemlp_wandb",
                    "clearml",
                    "trackio",
                    "file",
                ),
            )

    @property
    def world_size(self) -> int:
        """Training processes: nnodes x n_gpus_per_node."""
        return self.nnodes * self.n_gpus_per_node


@dataclass
class TransferQueueConfig:
    """``transfer_queue``: verl's experimental data plane between roles."""

    enable: bool = False


@dataclass
class RayKwargsConfig:
    """``ray_kwargs``: arguments of ``ray.init`` and the timeline dump."""

    ray_init: dict[str, Any] = field(default_factory=lambda: {"num_cpus": None})
    timeline_json_file: str | None = None


# ----------------------------------------------------------------------------------------- root
@dataclass
class TrainerConfig:
    """The whole PPO trainer config (entry ``ppo_trainer``); ``model_engine`` picks the engine sections.

    Cross-section rules follow verl's ``validate_config`` and apply only where verl applies them:
    reference micro-batches only when a reference policy is used (a KL term), critic rules only
    when the critic is (``critic.enable``, or GAE when it is null), micro-batch rules only without
    dynamic batch sizes. A few rules of ours add safety where verl would fail later on a cluster;
    where verl accepts a value we would reject, the rule is a note instead.
    """

    model_engine: str = "fsdp"
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=FSDPCriticConfig)
    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    reward_model: RewardModelConfig = field(default_factory=FSDPRewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: RunConfig = field(default_factory=RunConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    transfer_queue: TransferQueueConfig = field(default_factory=TransferQueueConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)

    @property
    def uses_reference_policy(self) -> bool:
        """verl builds the reference policy only for a KL term (in the reward or in the loss)."""
        return bool(self.algorithm.use_kl_in_reward or self.actor_rollout_ref.actor.use_kl_loss)

    @property
    def uses_critic(self) -> bool:
        """``critic.enable`` when set, else whether the estimator is GAE (verl's need_critic)."""
        if self.critic.enable is not None:
            return bool(self.critic.enable)
        return self.algorithm.adv_estimator == "gae"

    def __post_init__(self) -> None:
        check_choice("model_engine", self.model_engine, MODEL_ENGINES)
        if not adjusting():  # a default tree being built: cross-section rules apply to loaded configs only
            return
        arr = self.actor_rollout_ref
        errors = ErrorCollector()  # independent rules: every broken one is reported, not just the first
        allowed = ENGINE_STRATEGIES[self.model_engine]
        for path, role in (
            ("actor_rollout_ref.actor", arr.actor),
            ("actor_rollout_ref.ref", arr.ref),
            ("critic", self.critic),
        ):
            if role.strategy not in allowed:
                errors.add(
                    ConfigValueError(
                        f"{path}.strategy",
                        f"is {role.strategy!r} but model_engine is {self.model_engine!r} (strategies"
                        f" {', '.join(allowed)}); the engine is chosen once with model_engine=fsdp|megatron (the"
                        " role sections follow it)",
                    )
                )
        world = self.trainer.world_size
        actor_dp = critic_dp = None
        with errors:
            actor_dp = self._check_layout("actor_rollout_ref.actor", arr.actor, world)
        with errors:
            if self.uses_reference_policy:
                self._check_layout("actor_rollout_ref.ref", arr.ref, world)
        with errors:
            critic_dp = self._check_layout("critic", self.critic, world) if self.uses_critic else actor_dp
        if world % arr.rollout.tensor_model_parallel_size:
            errors.add(
                ConfigValueError(
                    "actor_rollout_ref.rollout.tensor_model_parallel_size",
                    f"({arr.rollout.tensor_model_parallel_size}) does not divide the world size {world}"
                    " (trainer.nnodes x trainer.n_gpus_per_node)",
                )
            )
        if actor_dp is not None and critic_dp is not None:  # the batch rules need the DP sizes
            self._check_batches(actor_dp=actor_dp, critic_dp=critic_dp, errors=errors)
        with errors:
            self._check_engine_ties()
        with errors:
            self._check_remove_padding()
        if arr.rollout.val_kwargs.do_sample and arr.rollout.temperature <= 0:
            errors.add(
                ConfigValueError(
                    "actor_rollout_ref.rollout.temperature",
                    f"is {arr.rollout.temperature} but actor_rollout_ref.rollout.val_kwargs.do_sample is true;"
                    " sampling needs a temperature > 0",
                )
            )
        errors.raise_if_any()
        if self.algorithm.adv_estimator in _GROUP_ESTIMATORS and arr.rollout.n < 2:
            note(
                "actor_rollout_ref.rollout.n",
                f"is {arr.rollout.n} but algorithm.adv_estimator={self.algorithm.adv_estimator} compares several"
                " responses per prompt: every advantage will be 0 (set actor_rollout_ref.rollout.n >= 2)",
            )
        if self.algorithm.use_kl_in_reward and arr.actor.use_kl_loss:
            note(
                "algorithm.use_kl_in_reward",
                "and actor_rollout_ref.actor.use_kl_loss are both on: KL is applied twice",
            )

    # ---------------------------------------------------------------- helpers of __post_init__
    def _check_layout(self, path: str, role: Any, world: int) -> int:
        """Validate a role's parallel layout against the world size and return its data-parallel size."""
        engine = getattr(role, "megatron", None)
        if engine is not None:
            try:
                dp = check_parallel_layout(
                    world_size=world,
                    tensor_model_parallel_size=engine.tensor_model_parallel_size,
                    pipeline_model_parallel_size=engine.pipeline_model_parallel_size,
                    context_parallel_size=engine.context_parallel_size,
                )
            except ConfigValueError as err:
                raise ConfigValueError(
                    f"{path}.megatron",
                    f"{err.message} (world size = trainer.nnodes x trainer.n_gpus_per_node)",
                ) from None
            etp = engine.expert_tensor_parallel_size or engine.tensor_model_parallel_size
            expert_mp = etp * engine.expert_model_parallel_size * engine.pipeline_model_parallel_size
            if world % expert_mp:
                raise ConfigValueError(
                    f"{path}.megatron.expert_model_parallel_size",
                    f"world size {world} is not divisible by expert_tensor_parallel_size ({etp}) x"
                    f" expert_model_parallel_size ({engine.expert_model_parallel_size}) x pipeline_model_parallel_size"
                    f" ({engine.pipeline_model_parallel_size}) = {expert_mp}",
                )
            return dp
        sp = getattr(role, "ulysses_sequence_parallel_size", 1)
        if world % sp:
            raise ConfigValueError(
                f"{path}.ulysses_sequence_parallel_size", f"({sp}) does not divide the world size {world}"
            )
        fsdp_path, fsdp = f"{path}.fsdp_config", getattr(role, "fsdp_config", None)
        if fsdp is None and hasattr(role, "model"):  # the FSDP critic keeps it under model
            fsdp_path, fsdp = f"{path}.model.fsdp_config", getattr(role.model, "fsdp_config", None)
        if fsdp is not None and fsdp.fsdp_size != -1 and world % fsdp.fsdp_size:
            raise ConfigValueError(
                f"{fsdp_path}.fsdp_size", f"({fsdp.fsdp_size}) does not divide the world size {world}"
            )
        return world // sp

    def _check_batches(self, *, actor_dp: int, critic_dp: int, errors: ErrorCollector) -> None:
        """The batch rules of each role, checked independently (each error goes to ``errors``)."""
        arr = self.actor_rollout_ref
        n = arr.rollout.n
        actor = arr.actor
        if self.data.train_batch_size < actor.ppo_mini_batch_size:
            message = (
                f"({actor.ppo_mini_batch_size}) is larger than data.train_batch_size ({self.data.train_batch_size});"
                " a mini-batch is a part of the step's batch"
            )
            if not actor.use_dynamic_bsz:
                errors.add(ConfigValueError("actor_rollout_ref.actor.ppo_mini_batch_size", message))
            else:
                note("actor_rollout_ref.actor.ppo_mini_batch_size", message)
        found = len(errors.errors)
        with errors:
            _check_micro(
                role="actor_rollout_ref.actor",
                mini=actor.ppo_mini_batch_size * n,
                dp=actor_dp,
                global_key="ppo_micro_batch_size",
                per_gpu_key="ppo_micro_batch_size_per_gpu",
                section=actor,
                dynamic=actor.use_dynamic_bsz,
                dynamic_key="use_dynamic_bsz",
            )
        if not actor.use_dynamic_bsz and len(errors.errors) == found:  # needs a valid micro-batch size
            with errors:
                self._check_step_batch(actor_dp=actor_dp)
        log_prob_roles = [("actor_rollout_ref.rollout", arr.rollout)]
        if self.uses_reference_policy:
            log_prob_roles.insert(0, ("actor_rollout_ref.ref", arr.ref))
        for role, section in log_prob_roles:
            with errors:
                _check_micro(
                    role=role,
                    mini=None,
                    dp=actor_dp,
                    global_key="log_prob_micro_batch_size",
                    per_gpu_key="log_prob_micro_batch_size_per_gpu",
                    section=section,
                    dynamic=section.log_prob_use_dynamic_bsz,
                    dynamic_key="log_prob_use_dynamic_bsz",
                )
        if self.uses_critic:
            critic = self.critic
            if not critic.use_dynamic_bsz and self.data.train_batch_size < critic.ppo_mini_batch_size:
                errors.add(
                    ConfigValueError(
                        "critic.ppo_mini_batch_size",
                        f"({critic.ppo_mini_batch_size}) is larger than data.train_batch_size"
                        f" ({self.data.train_batch_size})",
                    )
                )
            with errors:
                _check_micro(
                    role="critic",
                    mini=critic.ppo_mini_batch_size * n,
                    dp=critic_dp,
                    global_key="ppo_micro_batch_size",
                    per_gpu_key="ppo_micro_batch_size_per_gpu",
                    section=critic,
                    dynamic=critic.use_dynamic_bsz,
                    dynamic_key="use_dynamic_bsz",
                )
        longest = self.data.max_prompt_length + self.data.max_response_length
        if actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu < longest:
            errors.add(
                ConfigValueError(
                    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                    f"({actor.ppo_max_token_len_per_gpu}) is smaller than one sequence of data.max_prompt_length +"
                    f" data.max_response_length = {longest}; with use_dynamic_bsz a micro-batch must hold at least"
                    " one",
                )
            )

    def _check_step_batch(self, *, actor_dp: int) -> None:
        """verl's first check: the step's sequences split evenly over the smallest possible batch."""
        arr = self.actor_rollout_ref
        world = self.trainer.world_size
        sequences = self.data.train_batch_size * arr.rollout.n
        engine = getattr(arr.actor, "megatron", None)
        if engine is not None:
            minimal, how = (
                actor_dp * arr.actor.ppo_micro_batch_size_per_gpu,
                f"megatron DP {actor_dp} x actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
                f" {arr.actor.ppo_micro_batch_size_per_gpu}",
            )
        else:
            minimal, how = world, f"the world size {world}"
        if sequences % minimal:
            raise ConfigValueError(
                "data.train_batch_size",
                f"x actor_rollout_ref.rollout.n = {sequences} sequences is not divisible by {how} = {minimal}",
            )
        global_micro = arr.actor.ppo_micro_batch_size
        sp = getattr(arr.actor, "ulysses_sequence_parallel_size", 1)
        if engine is None and global_micro is not None and global_micro * sp < world:
            raise ConfigValueError(
                "actor_rollout_ref.actor.ppo_micro_batch_size",
                f"({global_micro}) x ulysses_sequence_parallel_size ({sp}) is smaller than the world size {world}",
            )

    def _check_engine_ties(self) -> None:
        """The megatron section's batch keys follow the role's; a different value is a contradiction."""
        arr = self.actor_rollout_ref
        ties = {
            "actor_rollout_ref.actor": (
                arr.actor,
                (
                    ("use_dynamic_bsz", "use_dynamic_bsz"),
                    ("max_token_len_per_gpu", "ppo_max_token_len_per_gpu"),
                    ("micro_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu"),
                ),
            ),
            "actor_rollout_ref.ref": (
                arr.ref,
                (
                    ("use_dynamic_bsz", "log_prob_use_dynamic_bsz"),
                    ("max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"),
                    ("micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu"),
                ),
            ),
            "critic": (
                self.critic,
                (
                    ("use_dynamic_bsz", "use_dynamic_bsz"),
                    ("max_token_len_per_gpu", "ppo_max_token_len_per_gpu"),
                    ("micro_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu"),
                ),
            ),
        }
        for path, (role, pairs) in ties.items():
            engine = getattr(role, "megatron", None)
            if engine is None:
                continue
            for engine_key, role_key in pairs:
                if getattr(engine, engine_key) != getattr(role, role_key):
                    raise ConfigValueError(
                        f"{path}.megatron.{engine_key}",
                        f"is {getattr(engine, engine_key)!r} but {path}.{role_key} is {getattr(role, role_key)!r};"
                        f" they are one setting: set {path}.{role_key} only",
                    )

    def _check_remove_padding(self) -> None:
        for path, role, model_path, model in (
            (
                "actor_rollout_ref.actor",
                self.actor_rollout_ref.actor,
                "actor_rollout_ref.model",
                self.actor_rollout_ref.model,
            ),
            ("critic", self.critic, "critic.model", self.critic.model),
        ):
            if role is self.critic and not self.uses_critic:
                continue
            padded = getattr(model, "use_remove_padding", True) is False  # megatron critic: the engine's key
            sp = getattr(role, "ulysses_sequence_parallel_size", 1)
            if sp > 1 and padded:
                raise ConfigValueError(
                    f"{model_path}.use_remove_padding",
                    f"is false but {path}.ulysses_sequence_parallel_size is {sp}; Ulysses sequence parallel splits"
                    f" packed sequences: set {model_path}.use_remove_padding=true",
                )
            engine = getattr(role, "megatron", None)
            if engine is not None and engine.dynamic_context_parallel and padded:
                raise ConfigValueError(
                    f"{model_path}.use_remove_padding",
                    f"is false but {path}.megatron.dynamic_context_parallel is true; dynamic context parallelism"
                    f" runs on packed (THD) sequences: set {model_path}.use_remove_padding=true",
                )


def _check_micro(
    *,
    role: str,
    mini: int | None,
    dp: int,
    global_key: str,
    per_gpu_key: str,
    section: Any,
    dynamic: bool,
    dynamic_key: str,
) -> None:
    """verl's micro-batch rules: one spelling at a time, set unless dynamic, and dividing the mini-batch.

    ``mini`` is the role's mini-batch in sequences (prompts x rollout.n) over all DP ranks; the
    deprecated global micro-batch size is converted to the per-GPU one (must divide by DP).
    """
    global_value = getattr(section, global_key)
    per_gpu = getattr(section, per_gpu_key)
    if global_value is not None and per_gpu is not None:
        raise ConfigValueError(
            f"{role}.{global_key}",
            f"and {role}.{per_gpu_key} are both set ({global_value}, {per_gpu}); {global_key} is the deprecated"
            f" global spelling, keep {per_gpu_key} only",
        )
    if global_value is not None:
        if global_value % dp:
            raise ConfigValueError(
                f"{role}.{global_key}",
                f"({global_value}) is not divisible by the data-parallel size {dp}; set {role}.{per_gpu_key} instead",
            )
        per_gpu = global_value // dp
        setattr(section, per_gpu_key, per_gpu)
        setattr(section, global_key, None)
        engine = getattr(section, "megatron", None)
        if engine is not None and engine.micro_batch_size_per_gpu is None:  # it follows the role's key
            engine.micro_batch_size_per_gpu = per_gpu
        note(
            f"{role}.{per_gpu_key}",
            f"set to {per_gpu} from the deprecated {role}.{global_key}={global_value} / DP {dp}",
        )
    if per_gpu is None:
        if not dynamic:
            raise ConfigValueError(
                f"{role}.{per_gpu_key}",
                f"is null and {role}.{dynamic_key} is false; set {role}.{per_gpu_key} (sequences per GPU per forward)"
                f" or {role}.{dynamic_key}=true",
            )
        return
    if mini is None or dynamic:
        return
    if mini % dp:
        raise ConfigValueError(
            f"{role}.ppo_mini_batch_size",
            f"x actor_rollout_ref.rollout.n = {mini} sequences is not divisible by the data-parallel size {dp}",
        )
    per_rank = mini // dp
    if per_rank % per_gpu:
        raise ConfigValueError(
            f"{role}.{per_gpu_key}",
            f"({per_gpu}) does not divide the mini-batch per data-parallel rank: ppo_mini_batch_size x rollout.n /"
            f" DP = {mini} / {dp} = {per_rank}; choose a divisor of {per_rank}",
        )
