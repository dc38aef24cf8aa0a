"""Offload / onload of megatron model chunks: parameters and gradients, DDP's flat buffers included."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from verl_mcore_utils.offload.state import (
    OffloadStats,
    get_offload_state,
    offload_jobs,
    offloaded_state,
    onload_jobs,
)

if TYPE_CHECKING:
    from verl_mcore_utils.offload.state import OffloadState


def _ddp_buffers(chunk: torch.nn.Module) -> list[Any]:
    """megatron DDP's ``_ParamAndGradBuffer``s (``buffers`` + ``expert_parallel_buffers``), else [].

    megatron's DistributedDataParallel assigns a list to ``self.buffers``, shadowing
    ``nn.Module.buffers()``; a plain module has the method there.
    """
    found: list[Any] = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, (list, tuple)):
            found.extend(value)
    return found


def _check_model_supported(chunk: torch.nn.Module) -> None:
    ddp_config = getattr(chunk, "ddp_config", None)
    if ddp_config is not None:
        if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(ddp_config, "use_custom_fsdp", False):
            raise NotImplementedError(
                "offloading a Megatron-FSDP model is not supported here: its sharded parameters and buffers"
                " are managed by Megatron-FSDP (verl had the same gap: 'invalid python storage'); use"
                " verl_mfsdp.offload_megatron_fsdp_model / offload_megatron_fsdp_optimizer"
            )
        if getattr(ddp_config, "nccl_ub", False):
            raise NotImplementedError(
                "offloading with nccl_ub=True is not supported: the DDP buffers are registered with NCCL"
                " and reallocating them would invalidate the registration"
            )


def _model_params(chunk: torch.nn.Module) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = list(chunk.parameters())
    # With the distributed optimizer every param.data is a view into buffer.param_data; the buffer
    # itself is listed too so padding between buckets moves with it (one copy per buffer).
    tensors.extend(b.param_data for b in _ddp_buffers(chunk) if getattr(b, "param_data", None) is not None)
    return tensors


def _model_grads(chunk: torch.nn.Module) -> list[torch.Tensor | None]:
    tensors: list[torch.Tensor | None] = [b.grad_data for b in _ddp_buffers(chunk)]
    for p in chunk.parameters():
        # main_grad: a view into grad_data, or (megatron-core 0.17+, fp32 accumulation of selected
        # params) a separate fp32 tensor; .grad: unwrapped modules (DDP leaves it None).
        tensors.append(getattr(p, "main_grad", None))
        tensors.append(p.grad)
    return tensors


def _as_chunks(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError("model_chunks must be an nn.Module or a non-empty sequence of nn.Modules")
    return list({id(c): c for c in chunks}.values())  # the same chunk twice is one chunk


def model_offload_kinds(*, params: bool, grads: bool) -> list[str]:
    """The offload groups a params / grads selection names (at least one; shared with verl_mfsdp)."""
    kinds = [k for k, on in (("params", params), ("grads", grads)) if on]
    if not kinds:
        raise ValueError("nothing selected: pass params=True and/or grads=True")
    return kinds


def offload_megatron_model(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    params: bool = True,
    grads: bool = True,
    pin_memory: bool | None = None,
    empty_cache: bool = True,
) -> OffloadStats:
    """Offload the parameters and/or gradients of every model chunk to host memory.

    Works on megatron DDP-wrapped chunks (the flat param/grad buffers move as a whole, views stay
    valid) and on unwrapped modules (parameters and ``.grad`` / ``.main_grad``). All chunks are copied
    with one synchronize. ``pin_memory`` defaults to ``torch.cuda.is_available()``; ``empty_cache``
    returns the freed memory to the driver so another process (a rollout engine) can use it.
    Raises :class:`OffloadStateError` if a selected group is already offloaded (nothing moves then).
    """
    chunks = _as_chunks(model_chunks)
    kinds = model_offload_kinds(params=params, grads=grads)
    jobs = []
    for chunk in chunks:
        _check_model_supported(chunk)
        state = get_offload_state(chunk, pin_memory=pin_memory)
        for kind in kinds:
            jobs.append((state, kind, _model_params(chunk) if kind == "params" else _model_grads(chunk)))
    return offload_jobs(jobs, empty_cache)


def onload_megatron_model(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], *, params: bool = True, grads: bool = True
) -> OffloadStats:
    """Bring back what :func:`offload_megatron_model` moved, bit for bit, into the same storages.

    Raises :class:`OffloadStateError` if a selected group is not offloaded (nothing moves then).
    """
    chunks = _as_chunks(model_chunks)
    kinds = model_offload_kinds(params=params, grads=grads)
    jobs: list[tuple[OffloadState, str]] = []
    for chunk in chunks:
        state = offloaded_state(chunk, what=str(kinds), plural=True)
        jobs.extend((state, kind) for kind in kinds)
    return onload_jobs(jobs)
