"""Move a Megatron training state (parameters, gradients, optimizer state) to host memory and back.

In RL the trainer and the rollout engine take turns on the same GPUs: while rollout runs, the trainer's state
leaves the GPU and comes back bit for bit, through one reused host buffer per device storage. The rules
(what is refused, what must not be touched while offloaded) and the design are in the package README.
"""

from verl_mcore_utils.offload.model import model_offload_kinds, offload_megatron_model, onload_megatron_model
from verl_mcore_utils.offload.optimizer import (
    inner_torch_optimizer,
    leaf_optimizers,
    master_params,
    offload_megatron_optimizer,
    onload_megatron_optimizer,
)
from verl_mcore_utils.offload.state import (
    KINDS,
    OffloadState,
    OffloadStateError,
    OffloadStats,
    get_offload_state,
    is_offloaded,
    offload_tensors,
    onload_tensors,
    refuse_offloaded,
)

__all__ = [
    "KINDS",
    "OffloadState",
    "OffloadStateError",
    "OffloadStats",
    "get_offload_state",
    "inner_torch_optimizer",
    "is_offloaded",
    "leaf_optimizers",
    "master_params",
    "model_offload_kinds",
    "offload_megatron_model",
    "offload_megatron_optimizer",
    "offload_tensors",
    "onload_megatron_model",
    "onload_megatron_optimizer",
    "onload_tensors",
    "refuse_offloaded",
]
