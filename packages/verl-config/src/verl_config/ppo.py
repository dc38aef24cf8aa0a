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
from verl_config.errors import ConfigValueError
from verl_config.lora import LoraConfig
from verl_config.notes import adjusting, note
from verl_config.validation import check_choice, check_parallel_layout, check_positive

__all__ = [
    "ADV_ESTIMATORS",
    "MODEL_ENGINES",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "CriticModelConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "FSDPActorConfig",
    "FSDPCriticConfig",
    "FSDPRefConfig",
    "KLControlConfig",
    "McoreActorConfig",
    "McoreCriticConfig",
    "McoreRefConfig",
    "ModelConfig",
    "RefConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "TrainerConfig",
]

MODEL_ENGINES = ("fsdp", "megatron")
ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "opo",
    "gpg",
    "grpo_passk",
)
# Estimators that compare several responses to the same prompt: meaningless with rollout.n == 1.
_GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline")
_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """Prompt dataset and batch size (``train_batch_size`` prompts per step, before rollout.n)."""

    tokenizer: str | None = None
    train_files: Any = "~/data/rlhf/gsm8k/train.parquet"
    val_files: Any = "~/data/rlhf/gsm8k/test.parquet"
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    val_batch_size: int | None = None
    return_raw_input_ids: bool = False
    return_raw_chat: bool = False
    return_full_prompt: bool = False
    shuffle: bool = True
    filter_overlong_prompts: bool = False
    filter_overlong_prompts_workers: int = 1
    truncation: str = "error"
    trust_remote_code: bool = False
    custom_cls: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})

    def __post_init__(self) -> None:
        for key in (
            "max_prompt_length",
            "max_response_length",
            "train_batch_size",
            "filter_overlong_prompts_workers",
        ):
            check_positive(key, getattr(self, key))
        if self.val_batch_size is not None:
            check_positive("val_batch_size", self.val_batch_size)
        check_choice("truncation", self.truncation, ("error", "left", "right", "middle"))


# -------------------------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """The Hugging Face model of actor / rollout / ref (``actor_rollout_ref.model``).

    ``lora`` is the canonical LoRA spelling; ``lora_rank`` / ``lora_alpha`` / ``target_modules`` /
    ``exclude_modules`` are the deprecated flat keys: null means "not given", a given value is moved
    into ``lora`` with a warning when the config is loaded (see :mod:`verl_config.lora`).
    """

    path: str = "~/models/deepseek-llm-7b-chat"
    tokenizer_path: str | None = None
    custom_chat_template: str | None = None
    external_lib: str | None = None
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = True
    enable_activation_offload: bool = False
    use_remove_padding: bool = True
    use_fused_kernels: bool = False
    use_liger: bool = False
    trust_remote_code: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    lora_rank: int | None = None
    lora_alpha: float | None = None
    target_modules: Any = None
    exclude_modules: Any = None


@dataclass
class CriticModelConfig(ModelConfig):
    """The critic's model (``critic.model``); path and tokenizer follow the actor's by default."""

    path: str = "${actor_rollout_ref.model.path}"
    tokenizer_path: str | None = "${actor_rollout_ref.model.path}"


# ------------------------------------------------------------------------------------------- actor
@dataclass
class CheckpointConfig:
    """What a checkpoint holds (``model``, ``optimizer``, ``extra``, ``hf_model``)."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])

    def __post_init__(self) -> None:
        for key in ("save_contents", "load_contents"):
            for item in getattr(self, key):
                check_choice(key, item, ("model", "optimizer", "extra", "hf_model"))


@dataclass
class ActorConfig:
    """Keys of ``actor_rollout_ref.actor`` common to both engines."""

    strategy: str = "fsdp"
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    shuffle: bool = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, MODEL_ENGINES)
        for key in ("ppo_mini_batch_size", "ppo_max_token_len_per_gpu", "ppo_epochs"):
            check_positive(key, getattr(self, key))
        for key in ("ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu"):
            if getattr(self, key) is not None:
                check_positive(key, getattr(self, key))
        check_choice("loss_agg_mode", self.loss_agg_mode, _LOSS_AGG_MODES)
        check_choice(
            "kl_loss_type", self.kl_loss_type, ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
        )
        if self.clip_ratio_c <= 1.0:
            raise ConfigValueError(
                "clip_ratio_c", f"must be > 1 (dual-clip lower bound); got {self.clip_ratio_c}"
            )


@dataclass
class FSDPActorConfig(ActorConfig):
    """FSDP actor: ``fsdp_config`` section, Ulysses sequence parallel, torch.compile.

    ``grad_clip`` is verl's legacy spelling of ``optim.clip_grad`` (null = not given; moved there
    with a warning).
    """

    strategy: str = "fsdp"
    optim: FSDPOptimConfig = field(default_factory=FSDPOptimConfig)
    fsdp_config: FSDPEngineConfig = field(default_factory=FSDPEngineConfig)
    ulysses_sequence_parallel_size: int = 1
    use_torch_compile: bool = True
    grad_clip: float | None = None

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
    data_loader_seed: int | None = None


# --------------------------------------------------------------------------------------------- ref
@dataclass
class RefConfig:
    """Reference policy (log-probs only)."""

    strategy: str = "fsdp"
    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, MODEL_ENGINES)


@dataclass
class FSDPRefConfig(RefConfig):
    strategy: str = "fsdp"
    fsdp_config: FSDPEngineConfig = field(default_factory=lambda: FSDPEngineConfig(param_offload=False))
    ulysses_sequence_parallel_size: int = "${actor_rollout_ref.actor.ulysses_sequence_parallel_size}"  # type: ignore[assignment]


@dataclass
class McoreRefConfig(RefConfig):
    strategy: str = "megatron"
    megatron: McoreEngineConfig = field(default_factory=McoreEngineConfig)
    load_weight: bool = True


# ------------------------------------------------------------------------------------------ rollout
@dataclass
class SamplingConfig:
    """Sampling parameters for validation generations (``rollout.val_kwargs``)."""

    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0
    n: int = 1
    do_sample: bool = False


@dataclass
class RolloutConfig:
    """Generation engine (vLLM / SGLang) settings.

    ``layer_name_map`` tells the Megatron weight sync how fused layers are named on the rollout
    side (qkv, gate_up); it is null on FSDP, which syncs Hugging Face names.
    """

    name: str = "vllm"
    mode: str = "async"
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    prompt_length: int = "${data.max_prompt_length}"  # type: ignore[assignment]
    response_length: int = "${data.max_response_length}"  # type: ignore[assignment]
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    ignore_eos: bool = False
    enforce_eager: bool = True
    free_cache_engine: bool = True
    load_format: str = "dummy_dtensor"
    layered_summon: bool = False
    tensor_model_parallel_size: int = 2
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    max_num_seqs: int = 1024
    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    disable_log_stats: bool = True
    enable_chunked_prefill: bool = True
    do_sample: bool = True
    n: int = 1
    layer_name_map: dict[str, Any] | None = None
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        check_choice("name", self.name, ("vllm", "sglang", "hf"))
        check_choice("mode", self.mode, ("sync", "async"))
        check_positive("n", self.n)
        check_positive("tensor_model_parallel_size", self.tensor_model_parallel_size)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigValueError(
                "gpu_memory_utilization", f"must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
        check_choice("dtype", self.dtype, ("float32", "bfloat16", "float16"))


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref``: the shared model plus the actor, rollout and reference sections."""

    hybrid_engine: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=FSDPActorConfig)
    ref: RefConfig = field(default_factory=FSDPRefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


# -------------------------------------------------------------------------------------------- critic
@dataclass
class CriticConfig:
    """Value model (used by GAE)."""

    strategy: str = "fsdp"
    rollout_n: int = "${actor_rollout_ref.rollout.n}"  # type: ignore[assignment]
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"  # type: ignore[assignment]
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    forward_micro_batch_size: int | None = "${.ppo_micro_batch_size}"  # type: ignore[assignment]
    forward_micro_batch_size_per_gpu: int | None = "${.ppo_micro_batch_size_per_gpu}"  # type: ignore[assignment]
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = "${.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"  # type: ignore[assignment]
    shuffle: bool = "${actor_rollout_ref.actor.shuffle}"  # type: ignore[assignment]
    cliprange_value: float = 0.5
    loss_agg_mode: str = "${actor_rollout_ref.actor.loss_agg_mode}"  # type: ignore[assignment]
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, MODEL_ENGINES)
        check_positive("ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_positive("cliprange_value", self.cliprange_value)
        check_choice("loss_agg_mode", self.loss_agg_mode, _LOSS_AGG_MODES)


@dataclass
class FSDPCriticConfig(CriticConfig):
    strategy: str = "fsdp"
    optim: FSDPOptimConfig = field(default_factory=lambda: FSDPOptimConfig(lr=1e-5))
    fsdp_config: FSDPEngineConfig = field(default_factory=FSDPEngineConfig)
    ulysses_sequence_parallel_size: int = 1
    grad_clip: float | None = None


@dataclass
class McoreCriticConfig(CriticConfig):
    strategy: str = "megatron"
    optim: McoreOptimConfig = field(default_factory=lambda: McoreOptimConfig(lr=1e-5))
    megatron: McoreEngineConfig = field(default_factory=McoreEngineConfig)
    load_weight: bool = True
    data_loader_seed: int | None = None


# ----------------------------------------------------------------------------------- reward, algo
@dataclass
class RewardModelConfig:
    """Model-based reward (off by default; rule-based rewards use custom_reward_function)."""

    enable: bool = False
    strategy: str = "${model_engine}"
    model: dict[str, Any] = field(
        default_factory=lambda: {"input_tokenizer": "${actor_rollout_ref.model.path}", "path": None}
    )
    micro_batch_size_per_gpu: int | None = None
    max_length: int | None = None
    reward_manager: str = "naive"


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = None
    name: str = "compute_score"


@dataclass
class KLControlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1

    def __post_init__(self) -> None:
        check_choice("type", self.type, ("fixed", "adaptive"))


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

    def __post_init__(self) -> None:
        check_choice("adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        check_choice("kl_penalty", self.kl_penalty, ("kl", "abs", "mse", "low_var_kl", "full"))
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigValueError(key, f"must be in [0, 1]; got {getattr(self, key)}")


@dataclass
class RunConfig:
    """The ``trainer`` section: run control, logging, checkpoints, cluster size."""

    balance_batch: bool = True
    total_epochs: int = 30
    total_training_steps: int | None = None
    project_name: str = "verl_examples"
    experiment_name: str = "gsm8k"
    logger: list[str] = field(default_factory=lambda: ["console", "wandb"])
    log_val_generations: int = 0
    nnodes: int = 1
    n_gpus_per_node: int = 8
    save_freq: int = -1
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    val_before_train: bool = True
    test_freq: int = -1
    critic_warmup: int = 0
    default_hdfs_dir: str | None = None
    del_local_ckpt_after_load: bool = False
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_actor_ckpt_to_keep: int | None = None
    max_critic_ckpt_to_keep: int | None = None
    device: str = "cuda"

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
        for item in self.logger:
            check_choice(
                "logger",
                item,
                ("console", "wandb", "tensorboard", "mlflow", "swanlab", "vemlp_wandb", "clearml", "file"),
            )

    @property
    def world_size(self) -> int:
        """Training processes: nnodes x n_gpus_per_node."""
        return self.nnodes * self.n_gpus_per_node


# ----------------------------------------------------------------------------------------- root
@dataclass
class TrainerConfig:
    """The whole PPO trainer config (entry ``ppo_trainer``); ``model_engine`` picks the engine sections."""

    model_engine: str = "fsdp"
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=FSDPCriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        check_choice("model_engine", self.model_engine, MODEL_ENGINES)
        if not adjusting():  # a default tree being built: cross-section rules apply to loaded configs only
            return
        arr = self.actor_rollout_ref
        for path, role in (
            ("actor_rollout_ref.actor", arr.actor),
            ("actor_rollout_ref.ref", arr.ref),
            ("critic", self.critic),
        ):
            if role.strategy != self.model_engine:
                raise ConfigValueError(
                    f"{path}.strategy",
                    f"is {role.strategy!r} but model_engine is {self.model_engine!r}; the engine is chosen once with"
                    f" model_engine={role.strategy} (the role sections follow it)",
                )
        world = self.trainer.world_size
        actor_dp = self._check_layout("actor_rollout_ref.actor", arr.actor, world)
        self._check_layout("actor_rollout_ref.ref", arr.ref, world)
        critic_dp = self._check_layout("critic", self.critic, world)
        if world % arr.rollout.tensor_model_parallel_size:
            raise ConfigValueError(
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                f"({arr.rollout.tensor_model_parallel_size}) does not divide the world size {world}"
                " (trainer.nnodes x trainer.n_gpus_per_node)",
            )
        self._check_batches(actor_dp=actor_dp, critic_dp=critic_dp)
        self._check_engine_ties()
        self._check_remove_padding()
        if self.algorithm.adv_estimator in _GROUP_ESTIMATORS and arr.rollout.n < 2:
            raise ConfigValueError(
                "actor_rollout_ref.rollout.n",
                f"is {arr.rollout.n} but algorithm.adv_estimator={self.algorithm.adv_estimator} compares several"
                " responses per prompt; set actor_rollout_ref.rollout.n >= 2",
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
        fsdp = getattr(role, "fsdp_config", None)
        if fsdp is not None and fsdp.fsdp_size != -1 and world % fsdp.fsdp_size:
            raise ConfigValueError(
                f"{path}.fsdp_config.fsdp_size", f"({fsdp.fsdp_size}) does not divide the world size {world}"
            )
        return world // sp

    def _check_batches(self, *, actor_dp: int, critic_dp: int) -> None:
        arr = self.actor_rollout_ref
        n = arr.rollout.n
        if self.data.train_batch_size < arr.actor.ppo_mini_batch_size:
            raise ConfigValueError(
                "actor_rollout_ref.actor.ppo_mini_batch_size",
                f"({arr.actor.ppo_mini_batch_size}) is larger than data.train_batch_size ({self.data.train_batch_size});"
                " a mini-batch is a part of the step's batch",
            )
        _check_micro(
            role="actor_rollout_ref.actor",
            mini=arr.actor.ppo_mini_batch_size * n,
            dp=actor_dp,
            global_key="ppo_micro_batch_size",
            per_gpu_key="ppo_micro_batch_size_per_gpu",
            section=arr.actor,
            dynamic=arr.actor.use_dynamic_bsz,
            dynamic_key="use_dynamic_bsz",
        )
        for role, section in (("actor_rollout_ref.ref", arr.ref), ("actor_rollout_ref.rollout", arr.rollout)):
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
        if self.algorithm.adv_estimator == "gae":
            _check_micro(
                role="critic",
                mini=self.critic.ppo_mini_batch_size * n,
                dp=critic_dp,
                global_key="ppo_micro_batch_size",
                per_gpu_key="ppo_micro_batch_size_per_gpu",
                section=self.critic,
                dynamic=self.critic.use_dynamic_bsz,
                dynamic_key="use_dynamic_bsz",
            )
        longest = self.data.max_prompt_length + self.data.max_response_length
        if arr.actor.use_dynamic_bsz and arr.actor.ppo_max_token_len_per_gpu < longest:
            raise ConfigValueError(
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                f"({arr.actor.ppo_max_token_len_per_gpu}) is smaller than one sequence of data.max_prompt_length +"
                f" data.max_response_length = {longest}; with use_dynamic_bsz a micro-batch must hold at least one",
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
            engine = getattr(role, "megatron", None)
            if engine is not None and engine.dynamic_context_parallel and not model.use_remove_padding:
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
