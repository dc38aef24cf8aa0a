"""Exceptions raised for bad configuration.

Every error names the full dotted key it is about, so a user who typed a command-line override
can find the offending token without reading a traceback.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ConfigKeyError", "ConfigTypeError", "ConfigValueError"]


class ConfigError(ValueError):
    """Base class of every configuration error raised by verl_config."""


class ConfigKeyError(ConfigError, KeyError):
    """A key that the schema does not know (with the closest valid key, when there is one)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ConfigTypeError(ConfigError, TypeError):
    """A value that cannot be converted to the type the schema declares for its key."""


class ConfigValueError(ConfigError):
    """A value of the right type that is not allowed (alone or together with other keys).

    ``key`` is relative to the dataclass that raised it; the loader prefixes the section path,
    so the final message reads e.g. ``megatron.tensor_model_parallel_size: must be >= 1, got 0``.
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")

    def with_prefix(self, prefix: str) -> ConfigValueError:
        """Return the same error with ``prefix.`` put in front of its key."""
        if not prefix:
            return self
        return ConfigValueError(f"{prefix}.{self.key}", self.message)
