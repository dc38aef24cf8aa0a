"""Offload / onload of optimizer state (fp32 masters, Adam moments); walkers of megatron optimizers."""

from __future__ import annotations

from typing import Any

import torch

from verl_mcore_utils.offload.state import (
    OffloadStats,
    get_offload_state,
    offload_jobs,
    offloaded_state,
    onload_jobs,
    refuse_offloaded,
)

# Master copies that megatron's mixed-precision optimizers own (all supported releases):
# Float16OptimizerWithFloat16Params and DistributedOptimizer respectively. The fp32 parameters they
# train directly (fp32_from_fp32_groups, shard_fp32_groups) are the model's own tensors or views into
# the DDP param buffer, so they belong to the model's "params" group and are not listed here.
_MASTER_PARAM_ATTRS = ("fp32_from_float16_groups", "shard_fp32_from_float16_groups")


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The leaf optimizers: ChainedOptimizer's members (recursively), skipping stub optimizers.

    Public because every walker of megatron optimizer state (verl_mfsdp's offload and checkpoints) needs it.
    """
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [leaf for member in chained for leaf in leaf_optimizers(member)]
    if getattr(optimizer, "is_stub_optimizer", False):
        return []
    return [optimizer]


def inner_torch_optimizer(leaf: Any) -> torch.optim.Optimizer:
    """The torch optimizer a leaf of :func:`leaf_optimizers` holds its state in (the leaf itself if it is one).

    Public because offload, verl_engine's checkpoints and verl_mfsdp's local state all read that state.
    A leaf wrapping something else (optimizer_cpu_offload's hybrid optimizer) is a TypeError naming it.
    """
    if isinstance(leaf, torch.optim.Optimizer):
        return leaf
    inner = getattr(leaf, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"{type(leaf).__name__} wraps a {type(inner).__name__}, not a torch optimizer: its state cannot be"
            " offloaded or checkpointed here (megatron-core's optimizer_cpu_offload hybrid optimizer is not supported)"
        )
    return inner


def master_params(optimizer: Any) -> list[torch.Tensor]:
    """The fp32 master copies of megatron-core's mixed-precision optimizers, in a fixed order (none for torch's).

    Public because checkpoints (verl_engine) must save exactly these tensors too.
    """
    out: list[torch.Tensor] = []
    for leaf in leaf_optimizers(optimizer):
        for attr in _MASTER_PARAM_ATTRS:
            for group in getattr(leaf, attr, None) or ():
                out.extend(t for t in group if isinstance(t, torch.Tensor))
    return out


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Master copies (megatron mixed precision) and every tensor in the inner optimizer's state."""
    tensors = master_params(optimizer)
    for leaf in leaf_optimizers(optimizer):
        for per_param in inner_torch_optimizer(leaf).state.values():
            tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return tensors


def offload_megatron_optimizer(
    optimizer: Any,
    *,
    pin_memory: bool | None = None,
    empty_cache: bool = True,
    drop_master_grads: bool = True,
) -> OffloadStats:
    """Offload an optimizer's state: master fp32 copies and Adam moments (any torch state tensor).

    ``optimizer`` is a megatron MegatronOptimizer (Float16OptimizerWithFloat16Params,
    DistributedOptimizer, FP32Optimizer, ChainedOptimizer of those) or a plain torch optimizer. The
    model's own parameters are never moved here (offload them with the model).

    ``drop_master_grads``: megatron's mixed-precision optimizers leave an fp32 ``.grad`` on every master
    copy after a step, rebuilt from the DDP grad buffer by every ``step()``; it is set to None so that
    memory is freed too instead of staying on the device.
    """
    refuse_offloaded(optimizer, ["optimizer"])
    state = get_offload_state(optimizer, pin_memory=pin_memory)
    if drop_master_grads:
        for master in master_params(optimizer):
            master.grad = None
    return offload_jobs([(state, "optimizer", _optimizer_tensors(optimizer))], empty_cache)


def onload_megatron_optimizer(optimizer: Any) -> OffloadStats:
    """Bring back what :func:`offload_megatron_optimizer` moved, bit for bit."""
    state = offloaded_state(optimizer, what="optimizer")
    return onload_jobs([(state, "optimizer")])
