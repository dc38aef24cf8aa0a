"""Keep third-party start-up notices out of the ``verl-engine`` command's output.

megatron-core, torch and transformers print notices while they are imported or a model is built: a
SyntaxWarning when Python first compiles megatron-core's sources, "GPTModel IS DEPRECATED", torch's "No
CUDA runtime is found" on a CPU machine. They concern those libraries, not the user's run, and they bury
the lines that do. Each filter below names its source (module, logger, message); warnings from our own
packages and every error still show. Only command-line entry points call this: a library must not change
the warning filters of the program that imports it beyond the narrow set of fallback notices that
``verl_mcore_utils.notices`` mutes (those about running without Transformer Engine / Apex, by message).
"""

from __future__ import annotations

import logging
import warnings

from verl_mcore_utils.notices import DropMessagePrefixes

__all__ = ["quiet_third_party_notices"]

# Logger name -> message prefixes to drop (all other records of that logger still pass).
_DROPPED_LOG_MESSAGES = {
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    "transformers.configuration_utils": ("`torch_dtype` is deprecated",),
    "transformers.modeling_utils": ("`torch_dtype` is deprecated",),
}


def quiet_third_party_notices() -> None:
    """Install the filters; call before megatron-core is imported (its notices come at import time)."""
    # megatron-core's own warnings (apex / Transformer Engine not installed, deprecations), any category
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    # invalid escape sequences in megatron-core's docstrings, reported when Python compiles the files
    # (the warning's module is then the file path)
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[\\/]megatron[\\/]")
    # megatron-core logs notices (GPTModel's deprecation, fallbacks) at WARNING; its errors still show
    logging.getLogger("megatron").setLevel(logging.ERROR)
    for name, prefixes in _DROPPED_LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessagePrefixes) for f in logger.filters):
            logger.addFilter(DropMessagePrefixes(prefixes))
