"""Offload a Megatron-FSDP training state (parameters, gradients, optimizer state) to host memory and back.

In RL the trainer and the rollout engine take turns on the same GPUs. verl_mcore_utils.offload's mechanism
moves the storages behind Megatron-FSDP's flat buffers and the DTensors' local shards; this module says which
tensors belong to each group. Offload and onload are collectives. Details: the package README.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from verl_mcore_utils.offload import (
    OffloadStats,
    leaf_optimizers,
    model_offload_kinds,
    offload_tensors,
    onload_tensors,
    refuse_offloaded,
)
from verl_mfsdp.wrap import restart_megatron_fsdp_param_sync, synchronize_megatron_fsdp_params

__all__ = [
    "megatron_fsdp_chunks",
    "offload_megatron_fsdp_model",
    "offload_megatron_fsdp_optimizer",
    "onload_megatron_fsdp_model",
    "onload_megatron_fsdp_optimizer",
]

_WEIGHT_BUFFERS = (
    "model_weight_buffer",
    "transpose_weight_buffer",
    "main_weight_buffer",
    "hfsdp_helper_wbuf",
    "hfsdp_helper_wtbuf",
)
_GRAD_BUFFERS = ("main_grad_buffer", "hfsdp_helper_gbuf")
_WEIGHT_ALLOCATORS = ("weight_alloc", "transpose_weight_alloc")
_GRAD_ALLOCATORS = ("main_grad_alloc", "hsdp_grad_comm_alloc")


def megatron_fsdp_chunks(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The chunks as a list, each checked to be a Megatron-FSDP wrapper (clear error otherwise).

    Checked by the ``param_and_grad_buffer`` and ``ddp_config.use_megatron_fsdp`` attributes rather than
    isinstance, because the wrapper's name is a factory in some megatron-core releases.
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks:
        raise ValueError("model_chunks is empty")
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"model chunk {index} is a {type(chunk).__name__}, not an nn.Module")
        ddp_config = getattr(chunk, "ddp_config", None)
        if not getattr(ddp_config, "use_megatron_fsdp", False) or not hasattr(chunk, "param_and_grad_buffer"):
            raise TypeError(
                f"model chunk {index} ({type(chunk).__name__}) is not wrapped with Megatron-FSDP; build it with"
                " verl_mfsdp.make_megatron_fsdp_module (for DDP chunks use verl_mcore_utils.offload)"
            )
        for flag in ("nccl_ub", "fsdp_double_buffer"):
            if getattr(ddp_config, flag, False):
                raise NotImplementedError(
                    f"model chunk {index}: offloading with {flag}=True is not supported; its buffers come from"
                    " a fixed registered pool that cannot be released and reallocated"
                )
    return list({id(c): c for c in chunks}.values())


def _local(t: Any) -> torch.Tensor | None:
    """The plain tensor holding a DTensor's shard (the tensor itself when not a DTensor)."""
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "_local_tensor", None) if type(t).__name__ == "DTensor" else t
    return local if isinstance(local, torch.Tensor) else None


def _flat_buffers(
    pgb: Any, *, buffers: Iterable[str], allocators: Iterable[str]
) -> list[torch.Tensor | None]:
    """The named flat buffers of every parameter group and the buckets of the named allocators."""
    tensors: list[torch.Tensor | None] = []
    for group in pgb.parameter_groups:
        tensors.extend(getattr(getattr(group, name, None), "data", None) for name in buffers)
    for name in allocators:
        buckets = getattr(getattr(pgb, name, None), "buckets", None)
        if isinstance(buckets, dict):
            tensors.extend(getattr(b, "data", None) for b in buckets.values())
    return tensors


def _param_tensors(chunk: torch.nn.Module) -> list[torch.Tensor | None]:
    pgb: Any = chunk.param_and_grad_buffer  # megatron-fsdp's ParamAndGradBuffer (untyped)
    tensors = _flat_buffers(pgb, buffers=_WEIGHT_BUFFERS, allocators=_WEIGHT_ALLOCATORS)
    tensors.extend(_local(p) for _, p in pgb.optimizer_named_parameters)
    tensors.extend(_local(p) for p in chunk.parameters())
    return tensors


def _grad_tensors(chunk: torch.nn.Module) -> list[torch.Tensor | None]:
    pgb: Any = chunk.param_and_grad_buffer  # megatron-fsdp's ParamAndGradBuffer (untyped)
    tensors = _flat_buffers(pgb, buffers=_GRAD_BUFFERS, allocators=_GRAD_ALLOCATORS)
    flat = getattr(pgb, "buffer", None)  # the one flat main-grad tensor per dtype
    if isinstance(flat, dict):
        tensors.extend(flat.values())
    for _, p in pgb.optimizer_named_parameters:
        tensors.append(_local(p.grad))
        tensors.append(_local(getattr(p, "decoupled_grad", None)))
    tensors.extend(_local(p.grad) for p in chunk.parameters())
    return tensors


def offload_megatron_fsdp_model(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    params: bool = True,
    grads: bool = True,
    pin_memory: bool | None = None,
    empty_cache: bool = True,
) -> OffloadStats:
    """Offload the parameter shards and/or gradient buffers of every Megatron-FSDP chunk to host memory.

    Collective when ``params`` (waits for / releases the parameter all-gather): call on every rank.
    Raises OffloadStateError before anything moves if a selected group is already offloaded.
    """
    chunks = megatron_fsdp_chunks(model_chunks)
    kinds = model_offload_kinds(params=params, grads=grads)
    for chunk in chunks:
        refuse_offloaded(chunk, kinds)
    if params:
        synchronize_megatron_fsdp_params(chunks)
    groups = [
        (chunk, kind, _param_tensors(chunk) if kind == "params" else _grad_tensors(chunk))
        for chunk in chunks
        for kind in kinds
    ]
    return offload_tensors(groups, pin_memory=pin_memory, empty_cache=empty_cache)


def onload_megatron_fsdp_model(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    params: bool = True,
    grads: bool = True,
    restart_param_sync: bool = True,
) -> OffloadStats:
    """Bring back what :func:`offload_megatron_fsdp_model` moved, bit for bit, into the same storages.

    With ``params`` and ``restart_param_sync`` the parameter all-gather of every chunk is then run
    again synchronously (a collective: call on every rank), leaving the chunks as an optimizer step does.
    """
    chunks = megatron_fsdp_chunks(model_chunks)
    kinds = model_offload_kinds(params=params, grads=grads)
    stats = onload_tensors([(chunk, kind) for chunk in chunks for kind in kinds])
    if params and restart_param_sync:
        restart_megatron_fsdp_param_sync(chunks, force_sync=True)
    return stats


def _optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor | None]:
    tensors: list[torch.Tensor | None] = []
    for leaf in leaf_optimizers(optimizer):
        ddp_config = getattr(leaf, "ddp_config", None)
        if ddp_config is not None and not getattr(ddp_config, "use_megatron_fsdp", False):
            raise TypeError(
                f"{type(leaf).__name__} does not belong to a Megatron-FSDP model; use"
                " verl_mcore_utils.offload_megatron_optimizer for DDP optimizers"
            )
        inner = leaf if isinstance(leaf, torch.optim.Optimizer) else getattr(leaf, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(
                f"{type(leaf).__name__} is neither a torch optimizer nor a megatron optimizer wrapping one"
            )
        for per_param in inner.state.values():
            tensors.extend(_local(v) for v in per_param.values())
    return tensors


def offload_megatron_fsdp_optimizer(
    optimizer: Any, *, pin_memory: bool | None = None, empty_cache: bool = True
) -> OffloadStats:
    """Offload the optimizer state (local shards of the Adam moments) of a Megatron-FSDP optimizer.

    The fp32 main weights are the model's ``params`` group here (Megatron-FSDP owns them), so they move
    with :func:`offload_megatron_fsdp_model`. Local, no collective.
    """
    refuse_offloaded(optimizer, ["optimizer"])
    tensors = _optimizer_state_tensors(optimizer)
    return offload_tensors(
        [(optimizer, "optimizer", tensors)], pin_memory=pin_memory, empty_cache=empty_cache
    )


def onload_megatron_fsdp_optimizer(optimizer: Any) -> OffloadStats:
    """Bring back what :func:`offload_megatron_fsdp_optimizer` moved, bit for bit."""
    return onload_tensors([(optimizer, "optimizer")])
