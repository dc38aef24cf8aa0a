"""What the installed megatron-core offers, in one place.

Every other module of the workspace asks this module instead of branching on megatron-core
versions itself. Supported: megatron-core 0.14 to 0.19.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
from typing import Any

from packaging.version import Version

__all__ = [
    "MAX_MCORE_EXCLUSIVE",
    "MIN_MCORE",
    "ddp_config_fields",
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
