"""verl_config: the unified, typed and validated trainer config (no torch dependency).

Public API: :func:`load_config` (entry ``ppo_trainer`` with ``model_engine=fsdp|megatron``, or any
config dataclass such as :class:`SFTConfig`), the schema dataclasses, the engine sections with
their conversions to the keyword arguments of the lower layers, the LoRA block and module-name
translation, the override parser, the generated reference configs, the error types and checks.
"""

from importlib import metadata as _metadata

from verl_config.actor import (
    ActorConfig,
    ActorRolloutRefConfig,
    FSDPActorConfig,
    FSDPRefConfig,
    McoreActorConfig,
    McoreRefConfig,
    RefConfig,
)
from verl_config.algorithm import AlgorithmConfig
from verl_config.compose import ENTRIES, compose_config, default_tree, load_config
from verl_config.critic import CriticConfig, FSDPCriticConfig, McoreCriticConfig
from verl_config.data import DataConfig
from verl_config.engines import (
    DTYPES,
    MEGATRON_FSDP_SHARDING_STRATEGIES,
    FSDPEngineConfig,
    FSDPOptimConfig,
    McoreEngineConfig,
    McoreOptimConfig,
)
from verl_config.errors import (
    ConfigError,
    ConfigErrors,
    ConfigKeyError,
    ConfigTypeError,
    ConfigValueError,
    errors_of,
)
from verl_config.generate import (
    GENERATED_DIR,
    check_generated,
    engine_differences,
    generated_yaml,
    write_generated,
)
from verl_config.loader import apply_override, explicit_keys_of, to_yaml
from verl_config.lora import (
    DEFAULT_LORA_ALPHA,
    HF_TO_MCORE,
    MCORE_LINEAR_MODULES,
    LoraConfig,
    translate_target_modules,
)
from verl_config.model import ModelConfig
from verl_config.notes import ConfigNote, config_notes
from verl_config.overrides import Override, format_value, parse_override, parse_value
from verl_config.ppo import MODEL_ENGINES, TrainerConfig
from verl_config.rollout import RolloutConfig
from verl_config.run import RunConfig
from verl_config.sft import (
    MODEL_PRESETS,
    SFTConfig,
    SFTDataConfig,
    SFTModelConfig,
    SFTOptimConfig,
    SFTTrainerConfig,
)
from verl_config.validation import check_choice, check_parallel_layout, check_positive

__version__ = _metadata.version("verl-config")  # single source: pyproject.toml

__all__ = [
    "DEFAULT_LORA_ALPHA",
    "DTYPES",
    "ENTRIES",
    "GENERATED_DIR",
    "HF_TO_MCORE",
    "MCORE_LINEAR_MODULES",
    "MEGATRON_FSDP_SHARDING_STRATEGIES",
    "MODEL_ENGINES",
    "MODEL_PRESETS",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "ConfigError",
    "ConfigErrors",
    "ConfigKeyError",
    "ConfigNote",
    "ConfigTypeError",
    "ConfigValueError",
    "CriticConfig",
    "DataConfig",
    "FSDPActorConfig",
    "FSDPCriticConfig",
    "FSDPEngineConfig",
    "FSDPOptimConfig",
    "FSDPRefConfig",
    "LoraConfig",
    "McoreActorConfig",
    "McoreCriticConfig",
    "McoreEngineConfig",
    "McoreOptimConfig",
    "McoreRefConfig",
    "ModelConfig",
    "Override",
    "RefConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTModelConfig",
    "SFTOptimConfig",
    "SFTTrainerConfig",
    "TrainerConfig",
    "apply_override",
    "check_choice",
    "check_generated",
    "check_parallel_layout",
    "check_positive",
    "compose_config",
    "config_notes",
    "default_tree",
    "engine_differences",
    "errors_of",
    "explicit_keys_of",
    "format_value",
    "generated_yaml",
    "load_config",
    "parse_override",
    "parse_value",
    "to_yaml",
    "translate_target_modules",
    "write_generated",
]
