"""Mute megatron-core's start-up notices about the fallbacks this workspace chose on purpose.

Importing megatron-core without Transformer Engine, Apex or absl prints about twenty lines ("Transformer Engine
and Apex are not installed. Falling back to ...", "Apex is not installed", "absl.logging is not installed", a
SyntaxWarning per docstring with an invalid escape when Python first compiles its sources), building a model logs
"GPTModel IS DEPRECATED", and torch logs "No CUDA runtime is found" on a CPU machine. Running without those
libraries is this workspace's design (every feature works without them), so the notices tell a user nothing and
bury their own output.

Only these notices are muted, each matched by its message (or, for the SyntaxWarnings, by coming from a
megatron file): any other warning of megatron-core, and every warning of the program that imports us, still
shows. ``VERL_MEGATRON_NOTICES=1`` keeps them all.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["ENV_SHOW_NOTICES", "DropMessagePrefixes", "mute_fallback_notices"]

ENV_SHOW_NOTICES = "VERL_MEGATRON_NOTICES"

# (message regex, module regex) of megatron-core's import-time fallback warnings
_WARNINGS = (
    (r"Transformer Engine and Apex are not installed", r"megatron(\.|$)"),
    (r"Apex is not installed", r"megatron(\.|$)"),
    (r"absl\.logging is not installed", r"megatron(\.|$)"),
)
# logger name -> message prefixes dropped (that logger's other records pass)
_LOG_MESSAGES = {
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
}
_installed = False


class DropMessagePrefixes(logging.Filter):
    """A logging filter that drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def mute_fallback_notices() -> bool:
    """Install the filters once (before megatron-core is imported); False when ``VERL_MEGATRON_NOTICES=1``
    asks to keep the notices or they are installed already."""
    global _installed
    if _installed or os.environ.get(ENV_SHOW_NOTICES, "") not in ("", "0"):
        return False
    for message, module in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    # invalid escape sequences in megatron-core's docstrings: the warning's "module" is then the file path
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[\\/]megatron[\\/]")
    for name, prefixes in _LOG_MESSAGES.items():
        logging.getLogger(name).addFilter(DropMessagePrefixes(prefixes))
    _installed = True
    return True
