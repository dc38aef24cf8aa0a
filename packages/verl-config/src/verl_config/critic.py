"""The ``critic`` section (the value model of GAE) of both engines."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_config.actor import CheckpointConfig, McoreCheckpointConfig
from verl_config.algorithm import LOSS_AGG_MODES
from verl_config.engines import FSDPEngineConfig, FSDPOptimConfig, McoreEngineConfig, McoreOptimConfig
from verl_config.errors import ConfigValueError
from verl_config.model import CriticModelConfig
from verl_config.profiler import ProfilerConfig
from verl_config.validation import check_choice, check_positive

__all__ = ["CriticConfig", "FSDPCriticConfig", "McoreCriticConfig"]


@dataclass
class CriticConfig:
    """Value model (GAE). Used when ``enable`` is true, or when it is null and adv_estimator is gae."""

    strategy: str = "fsdp"
    rollout_n: int = "${actor_rollout_ref.rollout.n}"  # type: ignore[assignment]
    enable: bool | None = None
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"  # type: ignore[assignment]
    ppo_micro_batch_size: int | None = None
    # verl's default: follows the deprecated global key, so giving that one sets both (refused, as in verl)
    ppo_micro_batch_size_per_gpu: int | None = "${oc.select:.ppo_micro_batch_size,null}"  # type: ignore[assignment]
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    ppo_max_token_len_per_gpu: int | None = 32768
    forward_max_token_len_per_gpu: int | None = "${.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"  # type: ignore[assignment]
    shuffle: bool = "${actor_rollout_ref.actor.shuffle}"  # type: ignore[assignment]
    data_loader_seed: int | None = 42
    cliprange_value: float = 0.5
    loss_agg_mode: str = "${actor_rollout_ref.actor.loss_agg_mode}"
    loss_scale_factor: int | None = "${actor_rollout_ref.actor.loss_scale_factor}"  # type: ignore[assignment]
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    model: CriticModelConfig = field(default_factory=CriticModelConfig)

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, ("fsdp", "fsdp2", "megatron"))
        check_positive("ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_positive("cliprange_value", self.cliprange_value)
        check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.use_dynamic_bsz is True and self.ppo_max_token_len_per_gpu is None:
            raise ConfigValueError(
                "ppo_max_token_len_per_gpu",
                "is null but use_dynamic_bsz is true; set ppo_max_token_len_per_gpu (e.g. 32768) or use_dynamic_bsz=false",
            )


@dataclass
class FSDPCriticConfig(CriticConfig):
    strategy: str = "fsdp"
    optim: FSDPOptimConfig = field(default_factory=lambda: FSDPOptimConfig(lr=1e-5))
    fsdp: FSDPEngineConfig = field(default_factory=FSDPEngineConfig)
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
    checkpoint: CheckpointConfig = field(default_factory=McoreCheckpointConfig)
    data_loader_seed: int | None = "${actor_rollout_ref.actor.data_loader_seed}"  # type: ignore[assignment]
    nccl_timeout: int = 600
