"""Torch's fused Adam kernel for megatron-core's optimizer when neither Transformer Engine nor Apex is installed.

Without TE or Apex, megatron-core builds its Adam from ``torch.optim.Adam`` / ``AdamW`` with the default
implementation, which on CUDA is the *foreach* one: about ten multi-tensor kernels per step, each reading
and writing the fp32 master weights, gradients and both moments again. ``fused=True`` does the whole
update in one kernel per dtype/device group, same math in fp32. megatron-core wraps the torch optimizer
(mixed precision, distributed optimizer, chained) and calls its ``step()``; the flag lives in each param
group, so switching it after construction keeps every megatron feature (master weights, DP sharding, LR
scheduling by group) as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_mcore_utils.offload import inner_torch_optimizer, leaf_optimizers

__all__ = ["use_fused_torch_adam"]


def _fusable(optimizer: torch.optim.Optimizer) -> bool:
    """torch's own Adam / AdamW over floating CUDA tensors: plain, or DTensors (Megatron-FSDP's sharded main
    weights; torch's fused kernel has a DTensor rule, so each rank updates its local shard in one kernel)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False  # TE / Apex FusedAdam (already fused), SGD, a hybrid CPU optimizer, ...
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without torch.distributed has no DTensors either
        dtensor: tuple[type, ...] = ()
    else:
        dtensor = (DTensor,)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return (
        bool(params)
        and all(type(p) in (torch.nn.Parameter, torch.Tensor) or isinstance(p, dtensor) for p in params)
        and all(p.is_cuda and p.is_floating_point() for p in params)
    )


def use_fused_torch_adam(optimizer: Any) -> int:
    """Switch every torch Adam / AdamW inside ``optimizer`` (megatron's or torch's) to the fused kernel.

    Returns how many torch optimizers were switched (0: nothing to do, e.g. TE's FusedAdam is in use or the
    parameters are on the CPU). Megatron-FSDP's DTensor parameters are switched too: there torch's foreach
    Adam also allocates an fp32 temporary the size of the rank's whole shard (the peak of a Megatron-FSDP step at
    DP 2, benchmarks/issue36_gpu_l.sh), the fused kernel none. Existing
    ``step`` counters move to the parameters' device as float32 tensors, which the fused kernel requires.
    """
    switched = 0
    for leaf in leaf_optimizers(optimizer):
        try:
            inner = inner_torch_optimizer(leaf)
        except TypeError:
            continue  # not a torch optimizer inside (megatron's CPU-offload hybrid optimizer)
        if not _fusable(inner):
            continue
        for group in inner.param_groups:
            if group.get("fused"):
                continue
            group["fused"], group["foreach"] = True, False
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    inner.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
        inner.defaults["fused"], inner.defaults["foreach"] = True, False
        switched += 1
    return switched
