"""The ``distillation`` section (verl 0.9): on-policy distillation from one or more teacher models (off by default).

Each teacher under ``teacher_models`` is served by its own rollout engine (``inference``, which follows
the actor's rollout for the engine, dtype, lengths and temperature); ``teacher_key`` names the data
field that picks a sample's teacher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_config.errors import ConfigValueError
from verl_config.validation import check_positive, check_positive_keys, check_unit_interval

__all__ = [
    "DistillationConfig",
    "DistillationLossConfig",
    "TeacherInferenceConfig",
    "TeacherModelConfig",
]

_ROLLOUT = "actor_rollout_ref.rollout"


@dataclass
class DistillationLossConfig:
    """The distillation loss (``distillation.distillation_loss``); ``loss_mode`` names a registered loss.

    ``use_policy_gradient`` adds the task's policy-gradient loss (verl implements only the ``vanilla``
    one); the clip ratios are that loss's.
    """

    loss_mode: str = "k3"
    topk: int | None = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self) -> None:
        check_positive_keys(self, "topk", optional=True)
        check_positive("distillation_loss_coef", self.distillation_loss_coef, allow_zero=True)
        if self.policy_loss_mode != "vanilla":
            raise ConfigValueError(
                "policy_loss_mode",
                f"is {self.policy_loss_mode!r} but verl's distillation implements only 'vanilla'; set"
                " policy_loss_mode=vanilla",
            )


@dataclass
class TeacherInferenceConfig:
    """The rollout engine serving a teacher (``teacher_models.<name>.inference``); verl's defaults."""

    name: str | None = f"${{{_ROLLOUT}.name}}"
    dtype: str = f"${{{_ROLLOUT}.dtype}}"
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
    skip_tokenizer_init: bool = True
    prompt_length: int = f"${{{_ROLLOUT}.prompt_length}}"  # type: ignore[assignment]
    response_length: int = f"${{{_ROLLOUT}.response_length}}"  # type: ignore[assignment]
    temperature: float = f"${{{_ROLLOUT}.temperature}}"  # type: ignore[assignment]

    def __post_init__(self) -> None:
        check_unit_interval("gpu_memory_utilization", self.gpu_memory_utilization, open_low=True)
        check_positive_keys(self, "data_parallel_size", "expert_parallel_size", "tensor_model_parallel_size")


@dataclass
class TeacherModelConfig:
    """One teacher: the samples whose ``teacher_key`` field equals ``key`` are scored by ``model_path``."""

    key: str | None = None
    model_path: str | None = None
    num_replicas: int | None = 0
    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)

    def __post_init__(self) -> None:
        if self.num_replicas is not None:
            check_positive("num_replicas", self.num_replicas, allow_zero=True)


@dataclass
class DistillationConfig:
    """``distillation``: off unless ``enabled``; teachers get ``nnodes`` x ``n_gpus_per_node`` GPUs of their own."""

    enabled: bool = False
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    n_gpus_per_node: int = 8
    nnodes: int = 0
    teacher_models: dict[str, TeacherModelConfig] = field(
        default_factory=lambda: {"teacher_model": TeacherModelConfig()}
    )
    teacher_key: str = "data_source"

    def __post_init__(self) -> None:
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        check_positive("nnodes", self.nnodes, allow_zero=True)
        if not self.enabled:
            return
        if not self.teacher_models:
            raise ConfigValueError(
                "teacher_models", "is empty but enabled is true; describe at least one teacher"
            )
        for name, teacher in self.teacher_models.items():
            for key in ("model_path", "key"):
                if getattr(teacher, key) is None:
                    raise ConfigValueError(
                        f"teacher_models.{name}.{key}",
                        f"is null but distillation is enabled; set distillation.teacher_models.{name}.{key}",
                    )
