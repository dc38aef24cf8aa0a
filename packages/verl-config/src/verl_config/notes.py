"""Notes (a value the config changed for you) and once-only deprecation warnings.

A note is not an error: e.g. ``sequence_parallel`` is forced off when tensor parallel size is 1.
Dataclasses emit notes from ``__post_init__`` with :func:`note`; the loader captures them, puts
the section path in front of the key and keeps them on the loaded config (:func:`config_notes`),
so ``verl-config validate`` can print them and a trainer can log them, instead of the change
happening silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["ConfigNote", "adjusting", "config_notes", "defaults_only", "note", "warn_once"]

_ADJUST = contextvars.ContextVar("verl_config_adjust", default=True)

_WARNED: set[str] = set()


class ConfigNote(UserWarning):
    """A value that validation adjusted; ``key`` is relative to the section that emitted it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@contextlib.contextmanager
def defaults_only() -> Iterator[None]:
    """Instantiate schema defaults without validation-time adjustments or cross-section rules.

    OmegaConf instantiates nested dataclasses to read their defaults. An adjustment such as
    "sequence_parallel forced off at TP 1" must not be baked into the default tree there: a user
    who later sets TP 2 would silently get sequence_parallel false instead of verl's default true.
    """
    token = _ADJUST.set(False)
    try:
        yield
    finally:
        _ADJUST.reset(token)


def adjusting() -> bool:
    """False while :func:`defaults_only` is active (``__post_init__`` must then not change values)."""
    return _ADJUST.get()


def note(key: str, message: str) -> None:
    """Record that the value of ``key`` was adjusted (captured by the loader, see module doc)."""
    warnings.warn(ConfigNote(key, message), stacklevel=2)


def warn_once(message: str, *, category: type[Warning] = FutureWarning) -> None:
    """Warn with ``message`` the first time it is seen in this process.

    FutureWarning rather than DeprecationWarning: Python hides the latter outside ``__main__``,
    and a deprecation nobody sees is a silent behaviour change waiting to happen.
    """
    if message in _WARNED:
        return
    _WARNED.add(message)
    warnings.warn(message, category, stacklevel=3)


def config_notes(config: Any) -> list[str]:
    """The notes collected while loading ``config`` (empty when there were none)."""
    return list(getattr(config, "_verl_config_notes", []))
