"""verl_config: typed, validated trainer configuration (no torch dependency).

Public API: the schema dataclasses, :func:`load_config` (defaults <- YAML <- ``a.b=c`` overrides),
the error types and the layout checks.
"""

from verl_config.errors import ConfigError, ConfigKeyError, ConfigTypeError, ConfigValueError
from verl_config.loader import load_config, parse_overrides, to_yaml
from verl_config.schema import (
    DTYPES,
    MODEL_PRESETS,
    DataConfig,
    MegatronEngineConfig,
    ModelConfig,
    OptimConfig,
    SFTConfig,
    TrainerConfig,
)
from verl_config.validation import check_choice, check_parallel_layout, check_positive

__version__ = "0.1.0.dev0"

__all__ = [
    "DTYPES",
    "MODEL_PRESETS",
    "ConfigError",
    "ConfigKeyError",
    "ConfigTypeError",
    "ConfigValueError",
    "DataConfig",
    "MegatronEngineConfig",
    "ModelConfig",
    "OptimConfig",
    "SFTConfig",
    "TrainerConfig",
    "check_choice",
    "check_parallel_layout",
    "check_positive",
    "load_config",
    "parse_overrides",
    "to_yaml",
]
