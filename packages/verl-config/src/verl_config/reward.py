"""The ``reward`` section (verl 0.9) and the legacy reward sections it replaced.

``reward`` holds everything about scoring responses: the rule-based function
(``custom_reward_function``), the reward manager that turns scores into token rewards
(``reward_manager``), an optional model-based reward served by a rollout engine (``reward_model``)
and remote code execution (``sandbox_fusion``). verl 0.9 moved these out of the top-level
``reward_model`` / ``custom_reward_function`` / ``sandbox_fusion`` sections. Those stay accepted as legacy
keys (null = "not given"), as verl 0.9.1's own config keeps them (``legacy_reward_impl.yaml``), but verl's
``main_ppo`` no longer reads them: the move to ``reward`` (``migrate_legacy_reward_impl``) runs only in verl's
fully-async entry point since verl 0.9.0. So a given legacy value is kept where it was written, as in verl,
and a note (:func:`verl_config.config_notes`) names the key under ``reward`` that takes effect.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import MISSING

from verl_config.errors import ConfigValueError
from verl_config.notes import adjusting, note
from verl_config.rollout import DisaggregationConfig
from verl_config.validation import check_choice, check_positive, check_positive_keys, check_unit_interval

__all__ = [
    "CustomRewardFunctionConfig",
    "LegacyCustomRewardFunctionConfig",
    "LegacyRewardModelConfig",
    "LegacySandboxFusionConfig",
    "RewardConfig",
    "RewardManagerConfig",
    "RewardModelConfig",
    "RewardModuleConfig",
    "RewardRolloutConfig",
    "SandboxFusionConfig",
]


@dataclass
class CustomRewardFunctionConfig:
    """A rule-based reward function: ``name`` in the Python file ``path`` (null path = verl's built-ins)."""

    path: str | None = None
    name: str | None = "compute_score"


@dataclass
class RewardModuleConfig:
    """A class to import: ``name`` in the Python file ``path``."""

    path: str | None = None
    name: str | None = "custom_reward_manager"


@dataclass
class RewardManagerConfig:
    """``reward.reward_manager``: a registered manager (``source=register``) or one imported from a file."""

    source: str = "register"
    name: str = "naive"
    module: RewardModuleConfig | None = field(default_factory=RewardModuleConfig)

    def __post_init__(self) -> None:
        check_choice("source", self.source, ("register", "importlib"))
        if self.source == "importlib" and not (self.module and self.module.path):
            raise ConfigValueError(
                "module.path",
                "is null but source is 'importlib'; give the file that defines the reward manager",
            )


@dataclass
class SandboxFusionConfig:
    """Remote code execution for code rewards (``reward.sandbox_fusion``)."""

    url: str | None = None
    max_concurrent: int = 64
    memory_limit_mb: int = 1024

    def __post_init__(self) -> None:
        check_positive("max_concurrent", self.max_concurrent)
        check_positive("memory_limit_mb", self.memory_limit_mb)


@dataclass
class RewardRolloutConfig:
    """The rollout engine that serves a reward model (``reward.reward_model.rollout``); verl's defaults."""

    name: str | None = MISSING  # verl's ??? (mandatory): built as null; required once the reward model is on
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    cudagraph_capture_sizes: list[int] | None = None
    free_cache_engine: bool = True
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    tensor_model_parallel_size: int = 2
    pipeline_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    max_num_seqs: int = 1024
    load_format: str = "auto"
    layered_summon: bool = False
    scheduling_policy: str | None = "fcfs"
    full_determinism: bool = False
    seed: int = 42
    multi_stage_wake_up: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    limit_images: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = False
    ignore_eos: bool = False
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    n: int = 1
    prompt_length: int = 2048
    response_length: int = 2048
    quantization: str | None = None
    quantization_config_file: str | None = None
    mtp: Any = None
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)

    def __post_init__(self) -> None:
        check_unit_interval("gpu_memory_utilization", self.gpu_memory_utilization, open_low=True)
        check_positive_keys(
            self,
            "data_parallel_size",
            "expert_parallel_size",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "n",
        )


@dataclass
class RewardModelConfig:
    """A model-based reward (``reward.reward_model``, off by default), served by ``rollout``.

    With ``enable_resource_pool`` it gets its own ``nnodes`` x ``n_gpus_per_node`` GPUs; otherwise it
    shares the trainer's.
    """

    enable: bool = False
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 8
    nnodes: int = 0
    model_path: str | None = None
    rollout: RewardRolloutConfig = field(default_factory=RewardRolloutConfig)

    def __post_init__(self) -> None:
        check_positive("nnodes", self.nnodes, allow_zero=True)
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        if self.enable_resource_pool and self.nnodes == 0:
            raise ConfigValueError(
                "nnodes",
                "is 0 but enable_resource_pool is true; give the reward model's own nodes (nnodes x n_gpus_per_node)",
            )
        if self.enable and not self.model_path:
            raise ConfigValueError(
                "model_path", "is null but enable is true; give the reward model (a local path or a hub name)"
            )
        if self.enable and self.rollout.name in (None, MISSING):
            raise ConfigValueError(
                "rollout.name",
                "is not set (verl's default is ??? = mandatory) but enable is true: the reward model is served by"
                " a rollout engine; set reward.reward_model.rollout.name=vllm|sglang|trtllm",
            )


@dataclass
class RewardConfig:
    """``reward``: how responses are scored. ``reward_kwargs`` are extra keyword arguments of the reward
    manager (DAPO's overlong buffer lives there)."""

    num_workers: int = 8
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_positive("num_workers", self.num_workers)


# ---------------------------------------------------------------------------------------------
# Legacy spellings (null = not given): kept as written, noted with the key that takes effect
# ---------------------------------------------------------------------------------------------


def _note_unread(section: object, canonical: dict[str, str | None]) -> None:
    """Note each given key of a legacy section: verl 0.9's main_ppo keeps it but reads ``canonical[key]``
    (None: nothing replaces it)."""
    if not adjusting():
        return
    for key, new in canonical.items():
        if getattr(section, key) is None:
            continue
        instead = f"set {new}" if new else "verl 0.9 has no replacement"
        note(
            key,
            f"is a pre-0.9 reward key that verl 0.9's main_ppo does not read (it has no effect); {instead}",
        )


@dataclass
class LegacyCustomRewardFunctionConfig:
    """Top-level ``custom_reward_function`` (legacy): now ``reward.custom_reward_function``."""

    path: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        _note_unread(self, {k: f"reward.custom_reward_function.{k}" for k in ("path", "name")})


@dataclass
class LegacySandboxFusionConfig:
    """Top-level ``sandbox_fusion`` (legacy): now ``reward.sandbox_fusion``."""

    url: str | None = None
    max_concurrent: int | None = None
    memory_limit_mb: int | None = None

    def __post_init__(self) -> None:
        _note_unread(
            self, {k: f"reward.sandbox_fusion.{k}" for k in ("url", "max_concurrent", "memory_limit_mb")}
        )


@dataclass
class LegacyRewardModelModelConfig:
    """``reward_model.model`` (legacy): ``path`` is now ``reward.reward_model.model_path``; verl 0.9 reads
    neither ``external_lib`` nor ``trust_remote_code`` of the reward model any more."""

    path: str | None = None
    external_lib: str | None = None
    trust_remote_code: bool | None = None

    def __post_init__(self) -> None:
        _note_unread(
            self,
            {"path": "reward.reward_model.model_path", "external_lib": None, "trust_remote_code": None},
        )


@dataclass
class LegacyRewardRolloutConfig:
    """``reward_model.rollout`` (legacy): each key is now one of ``reward.reward_model.rollout``."""

    name: str | None = None
    dtype: str | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    cudagraph_capture_sizes: list[int] | None = None
    free_cache_engine: bool | None = None
    data_parallel_size: int | None = None
    expert_parallel_size: int | None = None
    tensor_model_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    load_format: str | None = None
    engine_kwargs: dict[str, Any] | None = None
    limit_images: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    disable_log_stats: bool | None = None
    skip_tokenizer_init: bool | None = None
    prompt_length: int | None = None
    response_length: int | None = None

    def __post_init__(self) -> None:
        _note_unread(self, {f.name: f"reward.reward_model.rollout.{f.name}" for f in fields(self)})


@dataclass
class LegacyRewardModelConfig:
    """Top-level ``reward_model`` (legacy, verl < 0.9): every key defaults to null ("not given").

    verl 0.9's main_ppo reads, instead of each: ``num_workers`` -> ``reward.num_workers``; ``reward_manager``
    -> ``reward.reward_manager.name``; ``reward_loop_source`` / ``reward_loop_module_path`` /
    ``reward_loop_class_name`` -> ``reward.reward_manager.source`` / ``module.path`` / ``module.name``;
    ``enable``, ``enable_resource_pool``, ``n_gpus_per_node``, ``nnodes`` -> the same keys of
    ``reward.reward_model``; ``model.path`` -> ``reward.reward_model.model_path``; ``rollout.*`` ->
    ``reward.reward_model.rollout.*``; ``reward_kwargs`` -> ``reward.reward_kwargs``. A given key is kept
    (as verl keeps it) and noted.
    """

    num_workers: int | None = None
    reward_manager: str | None = None
    enable: bool | None = None
    enable_resource_pool: bool | None = None
    n_gpus_per_node: int | None = None
    nnodes: int | None = None
    reward_loop_source: str | None = None
    reward_loop_module_path: str | None = None
    reward_loop_class_name: str | None = None
    model: LegacyRewardModelModelConfig = field(default_factory=LegacyRewardModelModelConfig)
    rollout: LegacyRewardRolloutConfig = field(default_factory=LegacyRewardRolloutConfig)
    reward_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _note_unread(
            self,
            {
                "num_workers": "reward.num_workers",
                "reward_manager": "reward.reward_manager.name",
                **{
                    k: f"reward.reward_model.{k}"
                    for k in ("enable", "enable_resource_pool", "n_gpus_per_node", "nnodes")
                },
                "reward_loop_source": "reward.reward_manager.source",
                "reward_loop_module_path": "reward.reward_manager.module.path",
                "reward_loop_class_name": "reward.reward_manager.module.name",
                "reward_kwargs": "reward.reward_kwargs",
            },
        )
