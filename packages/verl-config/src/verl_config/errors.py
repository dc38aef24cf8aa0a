"""Exceptions raised for bad configuration.

Every error names the full dotted key it is about, so a user who typed a command-line override
can find the offending token without reading a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType

__all__ = [
    "ConfigError",
    "ConfigErrors",
    "ConfigKeyError",
    "ConfigTypeError",
    "ConfigValueError",
    "ErrorCollector",
    "errors_of",
]


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


class ConfigErrors(ConfigError):
    """Several independent configuration errors, found in one pass and reported together.

    A user fixing a config by trial and error should see every problem at once, not one per run.
    ``errors`` holds the single errors (each names its key and the fix); ``str()`` lists them one a line.
    """

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors: list[ConfigError] = list(errors)
        lines = "\n".join(f"  {err}" for err in self.errors)
        super().__init__(f"{len(self.errors)} config errors:\n{lines}")

    def with_prefix(self, prefix: str) -> ConfigErrors:
        """Return the same errors with ``prefix.`` put in front of each key that is relative."""
        return ConfigErrors([_prefixed(err, prefix) for err in self.errors])


def errors_of(err: ConfigError) -> list[ConfigError]:
    """The single errors inside ``err`` (itself when it is one)."""
    return list(err.errors) if isinstance(err, ConfigErrors) else [err]


def _prefixed(err: ConfigError, prefix: str) -> ConfigError:
    return err.with_prefix(prefix) if isinstance(err, ConfigValueError | ConfigErrors) else err


class ErrorCollector:
    """Run independent checks and keep going after a failed one; raise everything at the end.

    Use the collector as a context manager around each independent check (``with errors: ...``): a
    ConfigError raised inside is recorded and swallowed, anything else propagates. One mistake is
    reported once: a second error for a key already reported is dropped, and so are, when raising, an
    error whose key copies a reported key (``source_of``: a follower such as the reference policy's layout,
    which is the actor's through an interpolation) and an error about a section that holds a reported key.
    """

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []
        self._sources: dict[int, str] = {}

    def __enter__(self) -> ErrorCollector:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if isinstance(exc, ConfigError):
            self.add(exc)
            return True
        return False

    def add(
        self, err: ConfigError, *, prefix: str = "", source_of: Callable[[str], str | None] | None = None
    ) -> None:
        """Record ``err`` (every error inside it), keys relative to ``prefix``.

        ``source_of(key)``: the key whose value ``key`` copies, or None.
        """
        seen = {getattr(e, "key", None) for e in self.errors} - {None}
        for single in errors_of(_prefixed(err, prefix) if prefix else err):
            key = getattr(single, "key", None)
            if key is not None and key in seen:
                continue
            seen.add(key)
            self.errors.append(single)
            source = source_of(key) if key is not None and source_of is not None else None
            if source is not None:
                self._sources[id(single)] = source

    def raise_if_any(self) -> None:
        """Raise the one error found as itself, several as :class:`ConfigErrors`; nothing when none."""
        keys = {e.key for e in self.errors if isinstance(e, ConfigValueError)}

        def derived(err: ConfigError) -> bool:
            key = getattr(err, "key", None)
            if key is None:
                return False
            return self._sources.get(id(err)) in keys or any(k.startswith(f"{key}.") for k in keys)

        found = [e for e in self.errors if not derived(e)]
        if len(found) == 1:
            raise found[0]
        if found:
            raise ConfigErrors(found)
