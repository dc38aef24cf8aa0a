"""What the installed megatron-core offers, in one place.

Every other module of the workspace asks this module instead of branching on megatron-core
versions itself. Supported: megatron-core 0.14 to 0.19.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
from collections.abc import Mapping
from typing import Any

from packaging.version import Version

__all__ = [
    "MAX_MCORE_EXCLUSIVE",
    "MIN_MCORE",
    "ddp_config_fields",
    "hf_rope_parameters",
    "import_megatron_core",
    "mcore_version",
]

MIN_MCORE = Version("0.14.0")
MAX_MCORE_EXCLUSIVE = Version("0.20.0")


@functools.cache
def mcore_version() -> Version:
    """The installed megatron-core version (raises a clear error when absent or unsupported)."""
    try:
        version = Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("megatron-core is not installed; pip install 'megatron-core>=0.14,<0.20'") from None
    if not (MIN_MCORE <= Version(version.base_version) < MAX_MCORE_EXCLUSIVE):
        raise ImportError(
            f"megatron-core {version} is not supported; this package supports {MIN_MCORE} <= version < {MAX_MCORE_EXCLUSIVE}"
        )
    return version


def import_megatron_core() -> Any:
    """Import ``megatron.core`` safely on machines without a GPU.

    megatron-core 0.15 compiles a CUDA extension at import time (inference/unified_memory.py); on a CUDA
    build of torch with no visible GPU that raises IndexError unless TORCH_CUDA_ARCH_LIST is set, in
    which case the failure is caught inside megatron-core. We set it only when it is unset and no GPU
    is visible, so GPU hosts are untouched.
    """
    import torch

    if "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0"
    mcore_version()
    import megatron.core

    return megatron.core


@functools.cache
def ddp_config_fields() -> tuple[str, ...]:
    """Field names of DistributedDataParallelConfig in the installed megatron-core."""
    import_megatron_core()
    from megatron.core.distributed import DistributedDataParallelConfig

    return tuple(f.name for f in dataclasses.fields(DistributedDataParallelConfig))


def hf_rope_parameters(hf_config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """RoPE settings of a Hugging Face config: one dict with at least ``rope_theta`` and ``rope_type``.

    transformers >= 5 keeps them in ``config.rope_parameters`` (``rope_theta`` inside it, no top-level
    attribute); transformers 4 configs and older config.json files have a top-level ``rope_theta`` and
    an optional ``rope_scaling`` dict whose kind is under ``rope_type`` or ``type``. Accepts a
    PretrainedConfig or a config.json mapping. A missing theta is 10000.0 (the transformers default).
    """

    def get(key: str) -> Any:
        return hf_config.get(key) if isinstance(hf_config, Mapping) else getattr(hf_config, key, None)

    params = dict(get("rope_parameters") or get("rope_scaling") or {})
    theta = params.get("rope_theta", get("rope_theta"))
    params["rope_theta"] = float(theta) if theta is not None else 10000.0
    params["rope_type"] = params.get("rope_type", params.pop("type", None)) or "default"
    return params
