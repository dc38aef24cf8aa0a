"""Reward sections: ``reward_model`` (per engine), ``reward_manager`` and ``custom_reward_function``.

Rule-based rewards (``custom_reward_function``, ``reward_manager``) need no model; ``reward_model``
describes a model-based reward served either by a training engine or by a rollout engine
(``use_reward_loop``). verl's keys and defaults; the engine-specific parts follow ``model_engine``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.engines import DTYPES, McoreLayoutConfig
from verl_config.errors import ConfigValueError
from verl_config.profiler import ProfilerConfig
from verl_config.validation import check_choice, check_positive, check_positive_keys, check_unit_interval

__all__ = [
    "CustomRewardFunctionConfig",
    "FSDPRewardModelConfig",
    "FSDPRewardModelModelConfig",
    "McoreRewardEngineConfig",
    "McoreRewardModelConfig",
    "RewardFSDPConfig",
    "RewardManagerConfig",
    "RewardModelConfig",
    "RewardModelModelConfig",
    "RewardRolloutConfig",
    "SandboxFusionConfig",
]


@dataclass
class CustomRewardFunctionConfig:
    """A rule-based reward function: ``name`` in the Python file ``path`` (null path = verl's built-ins)."""

    path: str | None = None
    name: str | None = "compute_score"


@dataclass
class RewardManagerConfig:
    """``reward_manager``: which reward manager turns scores into token rewards."""

    source: str = "register"
    name: str = "${reward_model.reward_manager}"
    module: dict[str, Any] | None = field(
        default_factory=lambda: {"path": None, "name": "custom_reward_manager"}
    )

    def __post_init__(self) -> None:
        check_choice("source", self.source, ("register", "importlib"))
        if self.source == "importlib" and not (self.module or {}).get("path"):
            raise ConfigValueError(
                "module.path",
                "is null but source is 'importlib'; give the file that defines the reward manager",
            )


@dataclass
class SandboxFusionConfig:
    """Remote code execution for code rewards (``reward_model.sandbox_fusion``)."""

    url: str | None = None
    max_concurrent: int = 64
    memory_limit_mb: int = 1024

    def __post_init__(self) -> None:
        check_positive("max_concurrent", self.max_concurrent)
        check_positive("memory_limit_mb", self.memory_limit_mb)


@dataclass
class RewardRolloutConfig:
    """The rollout engine that serves a reward model with ``use_reward_loop`` (``reward_model.rollout``)."""

    name: str | None = "vllm"
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    cudagraph_capture_sizes: list[int] | None = None
    free_cache_engine: bool = True
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    tensor_model_parallel_size: int = 2
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    max_num_seqs: int = 1024
    load_format: str = "auto"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    limit_images: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = False
    prompt_length: int = 2048
    response_length: int = 2048

    def __post_init__(self) -> None:
        check_unit_interval("gpu_memory_utilization", self.gpu_memory_utilization, open_low=True)
        check_positive_keys(self, "data_parallel_size", "expert_parallel_size", "tensor_model_parallel_size")


@dataclass
class RewardModelModelConfig:
    """The reward model itself (``reward_model.model``)."""

    input_tokenizer: str | None = "${actor_rollout_ref.model.path}"
    path: str = "~/models/FsfairX-LLaMA3-RM-v0.1"
    external_lib: str | None = "${actor_rollout_ref.model.external_lib}"
    trust_remote_code: bool = False
    override_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardFSDPConfig:
    """FSDP wrapping of a reward model (``reward_model.model.fsdp_config``; forward only, no optimizer)."""

    wrap_policy: dict[str, Any] = field(default_factory=lambda: {"min_num_params": 0})
    param_offload: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    forward_prefetch: bool = False

    def __post_init__(self) -> None:
        if self.fsdp_size != -1:
            check_positive("fsdp_size", self.fsdp_size)


@dataclass
class FSDPRewardModelModelConfig(RewardModelModelConfig):
    use_shm: bool = False
    use_remove_padding: bool = False
    use_fused_kernels: bool = "${actor_rollout_ref.model.use_fused_kernels}"  # type: ignore[assignment]
    fsdp_config: RewardFSDPConfig = field(default_factory=RewardFSDPConfig)


_ACTOR_MCORE = "actor_rollout_ref.actor.megatron"


@dataclass
class McoreRewardEngineConfig(McoreLayoutConfig):
    """Megatron layout of a reward model (``reward_model.megatron``; forward only, no optimizer state)."""

    use_distributed_optimizer: bool = False
    seed: int = f"${{{_ACTOR_MCORE}.seed}}"  # type: ignore[assignment]
    override_transformer_config: dict[str, Any] = f"${{{_ACTOR_MCORE}.override_transformer_config}}"  # type: ignore[assignment]
    use_mbridge: bool = f"${{{_ACTOR_MCORE}.use_mbridge}}"  # type: ignore[assignment]
    vanilla_mbridge: bool = f"${{{_ACTOR_MCORE}.vanilla_mbridge}}"  # type: ignore[assignment]
    use_remove_padding: bool = f"${{{_ACTOR_MCORE}.use_remove_padding}}"  # type: ignore[assignment]
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("dtype", self.dtype, DTYPES)


def _reward_profiler() -> ProfilerConfig:
    return ProfilerConfig(tool_config="${actor_rollout_ref.actor.profiler.tool_config}")  # type: ignore[arg-type]


@dataclass
class RewardModelConfig:
    """Model-based reward (off by default)."""

    enable: bool = False
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 8
    nnodes: int = 0
    strategy: str = "fsdp"
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size: int | None = None
    micro_batch_size_per_gpu: int | None = None
    max_length: int | None = None
    use_dynamic_bsz: bool = "${critic.use_dynamic_bsz}"  # type: ignore[assignment]
    forward_max_token_len_per_gpu: int | None = "${critic.forward_max_token_len_per_gpu}"  # type: ignore[assignment]
    reward_manager: str = "naive"
    reward_loop_source: str = "register"
    reward_loop_module_path: str | None = None
    reward_loop_class_name: str | None = None
    launch_reward_fn_async: bool = False
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    profiler: ProfilerConfig = field(default_factory=_reward_profiler)
    use_reward_loop: bool = True
    num_workers: int = 1
    rollout: RewardRolloutConfig = field(default_factory=RewardRolloutConfig)

    def __post_init__(self) -> None:
        check_choice("reward_loop_source", self.reward_loop_source, ("register", "importlib"))
        check_positive("nnodes", self.nnodes, allow_zero=True)
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        check_positive("num_workers", self.num_workers)
        if self.enable_resource_pool and self.nnodes == 0:
            raise ConfigValueError(
                "nnodes",
                "is 0 but enable_resource_pool is true; give the reward model's own nodes (nnodes x n_gpus_per_node)",
            )
        if self.micro_batch_size is not None and self.micro_batch_size_per_gpu is not None:
            raise ConfigValueError(
                "micro_batch_size",
                f"and micro_batch_size_per_gpu are both set ({self.micro_batch_size}, {self.micro_batch_size_per_gpu});"
                " micro_batch_size is the deprecated global spelling, keep micro_batch_size_per_gpu only",
            )
        if self.enable and not self.use_dynamic_bsz and not self.use_reward_loop:
            if self.micro_batch_size is None and self.micro_batch_size_per_gpu is None:
                raise ConfigValueError(
                    "micro_batch_size_per_gpu",
                    "is null while enable is true, use_dynamic_bsz is false and use_reward_loop is false; set"
                    " reward_model.micro_batch_size_per_gpu (or use_dynamic_bsz=true)",
                )


@dataclass
class FSDPRewardModelConfig(RewardModelConfig):
    """A reward model on the FSDP engine."""

    strategy: str = "fsdp"
    model: FSDPRewardModelModelConfig = field(default_factory=FSDPRewardModelModelConfig)
    ulysses_sequence_parallel_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("strategy", self.strategy, ("fsdp", "fsdp2"))
        check_positive("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size)


@dataclass
class McoreRewardModelConfig(RewardModelConfig):
    """A reward model on the Megatron engine (its parallel layout in ``megatron``)."""

    strategy: str = "megatron"
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    nccl_timeout: int = 600
    megatron: McoreRewardEngineConfig = field(default_factory=McoreRewardEngineConfig)
    load_weight: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("strategy", self.strategy, ("megatron",))
