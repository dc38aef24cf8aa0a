"""verl_mfsdp: Megatron-FSDP as a training backend (DDP settings, wrapping, param sync, offload, export, checkpoints).

Every name below is importable from the package root; the submodules say why each piece exists.
"""

from importlib import metadata as _metadata

from verl_mfsdp.checkpoint import (
    CHECKPOINT_INFO_FILE,
    load_megatron_fsdp_checkpoint,
    read_megatron_fsdp_checkpoint_info,
    save_megatron_fsdp_checkpoint,
)
from verl_mfsdp.export import export_megatron_fsdp_hf_weights
from verl_mfsdp.local_state import load_megatron_fsdp_local_state, megatron_fsdp_local_state
from verl_mfsdp.offload import (
    megatron_fsdp_chunks,
    offload_megatron_fsdp_model,
    offload_megatron_fsdp_optimizer,
    onload_megatron_fsdp_model,
    onload_megatron_fsdp_optimizer,
)
from verl_mfsdp.settings import (
    SHARDING_STRATEGIES,
    fsdp_communication_unit_size,
    megatron_fsdp_ddp_config,
    megatron_fsdp_defaults,
    with_communication_unit_size,
)
from verl_mfsdp.wrap import (
    make_megatron_fsdp_module,
    make_megatron_fsdp_optimizer,
    restart_megatron_fsdp_param_sync,
    synchronize_megatron_fsdp_params,
)

__version__ = _metadata.version("verl-mfsdp")  # single source: pyproject.toml

__all__ = [
    "CHECKPOINT_INFO_FILE",
    "SHARDING_STRATEGIES",
    "export_megatron_fsdp_hf_weights",
    "fsdp_communication_unit_size",
    "load_megatron_fsdp_checkpoint",
    "load_megatron_fsdp_local_state",
    "make_megatron_fsdp_module",
    "make_megatron_fsdp_optimizer",
    "megatron_fsdp_chunks",
    "megatron_fsdp_ddp_config",
    "megatron_fsdp_defaults",
    "megatron_fsdp_local_state",
    "offload_megatron_fsdp_model",
    "offload_megatron_fsdp_optimizer",
    "onload_megatron_fsdp_model",
    "onload_megatron_fsdp_optimizer",
    "read_megatron_fsdp_checkpoint_info",
    "restart_megatron_fsdp_param_sync",
    "save_megatron_fsdp_checkpoint",
    "synchronize_megatron_fsdp_params",
    "with_communication_unit_size",
]
