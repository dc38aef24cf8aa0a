"""``actor_rollout_ref``: the actor and reference-policy sections of both engines, and the section holding them.

Role sections that differ per engine come in two classes (``FSDPActorConfig`` / ``McoreActorConfig`` ...);
:mod:`verl_config.compose` picks them from ``model_engine``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.algorithm import LOSS_AGG_MODES, POLICY_LOSS_MODES, check_kl_type, registry_note
from verl_config.engines import (
    FSDPEngineConfig,
    FSDPOptimConfig,
    McoreEngineConfig,
    McoreOptimConfig,
    QATEngineConfig,
    RouterReplayConfig,
)
from verl_config.errors import ConfigValueError
from verl_config.model import ModelConfig
from verl_config.profiler import ProfilerConfig
from verl_config.rollout import FSDPRolloutConfig, RolloutConfig
from verl_config.validation import check_choice, check_positive, check_positive_keys

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "CheckpointConfig",
    "FSDPActorConfig",
    "FSDPRefConfig",
    "McoreActorConfig",
    "McoreCheckpointConfig",
    "McoreRefConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RouterReplayConfig",
]


@dataclass
class CheckpointConfig:
    """What a checkpoint holds (``model``, ``optimizer``, ``extra``, ``hf_model``); load follows save."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: list[str] = "${.save_contents}"  # type: ignore[assignment]
    async_save: bool = False
    strict: bool = True

    def __post_init__(self) -> None:
        for key in ("save_contents", "load_contents"):
            value = getattr(self, key)
            if isinstance(value, list):
                for item in value:
                    check_choice(key, item, ("model", "optimizer", "extra", "hf_model"))


@dataclass
class McoreCheckpointConfig(CheckpointConfig):
    """A Megatron role's checkpoint: ``mbridge_config`` holds keyword arguments for the bridge's HF export."""

    mbridge_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class PolicyLossConfig:
    """The policy loss (``actor.policy_loss``): ``loss_mode`` picks it (GSPO: ``gspo``; DAPO: ``vanilla``)."""

    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None

    def __post_init__(self) -> None:
        registry_note("loss_mode", self.loss_mode, POLICY_LOSS_MODES)
        if self.dro_beta is not None and self.dro_beta <= 0:
            raise ConfigValueError(
                "dro_beta", f"must be > 0 (the weight of DRO's quadratic penalty); got {self.dro_beta}"
            )
        if self.loss_mode == "dro" and self.dro_beta is None:
            raise ConfigValueError(
                "dro_beta",
                "is null but loss_mode is 'dro'; set policy_loss.dro_beta to a value > 0 (e.g. 0.1)",
            )
        if self.clip_cov_lb > self.clip_cov_ub:
            raise ConfigValueError(
                "clip_cov_lb", f"({self.clip_cov_lb}) is above clip_cov_ub ({self.clip_cov_ub}); swap them"
            )


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
    calculate_sum_pi_squared: bool = False
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
    qat: QATEngineConfig = field(default_factory=QATEngineConfig)
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, ("fsdp", "fsdp2", "megatron"))
        check_positive_keys(self, "ppo_mini_batch_size", "ppo_epochs", "entropy_from_logits_chunk_size")
        check_positive_keys(
            self,
            "ppo_micro_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ppo_max_token_len_per_gpu",
            "loss_scale_factor",
            optional=True,
        )
        if self.use_dynamic_bsz is True and self.ppo_max_token_len_per_gpu is None:
            raise ConfigValueError(
                "ppo_max_token_len_per_gpu",
                "is null but use_dynamic_bsz is true; dynamic batching packs micro-batches up to this many tokens"
                " per GPU: set ppo_max_token_len_per_gpu (e.g. 16384) or use_dynamic_bsz=false",
            )
        check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_kl_type("kl_loss_type", self.kl_loss_type)
        if not isinstance(self.clip_ratio_c, str) and self.clip_ratio_c <= 1.0:
            raise ConfigValueError(
                "clip_ratio_c",
                f"must be > 1 (dual-clip lower bound; verl's policy loss asserts it); got {self.clip_ratio_c}",
            )


def _fsdp_engine_following(role: str, **kwargs: Any) -> FSDPEngineConfig:
    """A role's ``fsdp_config`` whose entropy and padding switches follow the role's own keys (as in verl)."""
    follow = ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size", "entropy_checkpointing")
    tied = {key: f"${{actor_rollout_ref.{role}.{key}}}" for key in (*follow, "pad_to_length")}
    return FSDPEngineConfig(**tied, **kwargs)  # type: ignore[arg-type]


@dataclass
class FSDPActorConfig(ActorConfig):
    """FSDP actor: ``fsdp_config`` section, Ulysses sequence parallel, torch.compile.

    ``grad_clip`` is verl's legacy spelling of ``optim.clip_grad``: given explicitly, it is moved
    there with a warning.
    """

    strategy: str = "fsdp"
    optim: FSDPOptimConfig = field(default_factory=FSDPOptimConfig)
    fsdp_config: FSDPEngineConfig = field(default_factory=lambda: _fsdp_engine_following("actor"))
    grad_clip: float | None = 1.0
    ulysses_sequence_parallel_size: int = 1
    entropy_checkpointing: bool = False
    pad_to_length: bool = False
    use_remove_padding: bool = "${actor_rollout_ref.model.use_remove_padding}"  # type: ignore[assignment]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)


@dataclass
class McoreActorConfig(ActorConfig):
    """Megatron actor: ``megatron`` section and megatron-core optimizer."""

    strategy: str = "megatron"
    optim: McoreOptimConfig = field(default_factory=McoreOptimConfig)
    megatron: McoreEngineConfig = field(default_factory=McoreEngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=McoreCheckpointConfig)


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
    entropy_from_logits_with_chunking: bool = "${actor_rollout_ref.actor.entropy_from_logits_with_chunking}"  # type: ignore[assignment]
    entropy_from_logits_chunk_size: int = "${actor_rollout_ref.actor.entropy_from_logits_chunk_size}"  # type: ignore[assignment]

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, ("fsdp", "fsdp2", "megatron"))


@dataclass
class FSDPRefConfig(RefConfig):
    strategy: str = "${actor_rollout_ref.actor.strategy}"
    fsdp_config: FSDPEngineConfig = field(
        default_factory=lambda: _fsdp_engine_following(
            "ref",
            forward_only=True,
            pad_to_length_bucket="${actor_rollout_ref.actor.fsdp_config.pad_to_length_bucket}",
        )
    )
    ulysses_sequence_parallel_size: int = "${actor_rollout_ref.actor.ulysses_sequence_parallel_size}"  # type: ignore[assignment]
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    entropy_checkpointing: bool = False
    pad_to_length: bool = "${actor_rollout_ref.actor.pad_to_length}"  # type: ignore[assignment]


@dataclass
class McoreRefConfig(RefConfig):
    strategy: str = "megatron"
    megatron: McoreEngineConfig = field(default_factory=McoreEngineConfig)


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
