"""megatron-core's sequence-parallel collectives for CPU tensors (gloo), for fp32 parity tests without a GPU.

With sequence parallelism (SP) megatron-core moves activations between the sequence-sharded layout (norms,
residual stream) and the full sequence (inside attention and MLP) with all-gathers and reduce-scatters along
the first dimension: ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` in
``tensor_parallel/mappings.py`` (behind the embedding's scatter, the row-parallel linears' reduce-scatter and
``gather_from_sequence_parallel_region``), ``_gather_along_last_dim`` (``gather_from_tensor_model_parallel_region``,
used by the MTP layers at TP > 1 with or without SP), and the column-parallel linears' own all-gather of their input in
``LinearWithGradAccumulationAndAsyncCommunication`` (``tensor_parallel/layers.py``). All of them allocate on
``torch.cuda.current_device()`` and use ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (gloo has no
reduce-scatter). :func:`install_portable_sequence_parallel` wraps these three functions once per process: a CUDA
tensor goes to megatron-core's own code unchanged; a CPU tensor gets the same exchange with gloo collectives
(all-gather into a list; reduce-scatter as all-reduce and this rank's rows, the fallback
:mod:`verl_mcore_utils.moe_dispatch` uses), and a column-parallel linear gathers its input through
``gather_from_sequence_parallel_region`` (backward: the reduce-scatter of the input gradient) before megatron-core's
linear runs without SP. The embedding forks megatron-core's CUDA RNG tracker around its dropout under SP
(``CudaRNGStatesTracker.fork``, which reads and sets the CUDA RNG state); in a process without CUDA there is no
such state to fork, and the fork becomes a no-op (the dropout draws from the CPU generator). Called by
:func:`verl_mcore_utils.model.build_gpt_model` for CPU models with SP and by
:func:`verl_mcore_utils.mtp.build_mtp_block` for CPU MTP layers at TP > 1.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from verl_mcore_utils.moe_dispatch import gather_rows, own_rows

__all__ = ["install_portable_sequence_parallel"]

_INSTALLED = "_verl_portable_sp"


def _split(input_: torch.Tensor, sizes: Any, world: int) -> list[int]:
    return list(sizes) if sizes is not None else [input_.shape[0] // world] * world


def _gather_rows(
    input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False
):
    """Concatenate every rank's rows along dim 0 (``output_split_sizes``: each rank's row count; default equal)."""
    world = group.size()
    if world == 1:
        return input_
    counts = list(output_split_sizes) if output_split_sizes is not None else [input_.shape[0]] * world
    return gather_rows(input_, group, counts)


def _reduce_scatter_rows(
    input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False
):
    """The sum over ranks, this rank's rows (all-reduce, then the slice)."""
    world = group.size()
    if world == 1:
        return input_
    if input_split_sizes is None and input_.shape[0] % world:
        raise ValueError(f"first dimension {input_.shape[0]} is not divisible by the TP size {world}")
    return own_rows(input_, group, _split(input_, input_split_sizes, world))


def _gather_columns(input_: torch.Tensor, group: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Concatenate every rank's tensor along the last dim (megatron-core's ``_gather_along_last_dim``, behind
    ``gather_from_tensor_model_parallel_region``: the MTP layers' projection output at TP > 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    world = group.size()
    if world == 1:
        return input_
    parts = [torch.empty_like(input_) for _ in range(world)]
    dist.all_gather(parts, input_.contiguous(), group=group)
    return torch.cat(parts, dim=-1).contiguous()


def _by_device(original: Any, portable: Any) -> Any:
    @functools.wraps(original)
    def dispatch(input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (original if input_.is_cuda else portable)(input_, *args, **kwargs)

    setattr(dispatch, _INSTALLED, True)
    return dispatch


def _portable_linear(original: Any) -> Any:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    @functools.wraps(original)
    def linear(input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.is_cuda or not kwargs.get("sequence_parallel", False):
            return original(input, weight, *args, **kwargs)
        group = kwargs.get("tp_group") or parallel_state.get_tensor_model_parallel_group()
        full = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        return original(
            full, weight, *args, **{**kwargs, "sequence_parallel": False, "allreduce_dgrad": False}
        )

    setattr(linear, _INSTALLED, True)
    return linear


def install_portable_sequence_parallel() -> bool:
    """Wrap megatron-core's SP collectives (see the module doc) once per process; False if already done."""
    from megatron.core.tensor_parallel import layers, mappings, random

    if getattr(mappings._gather_along_first_dim, _INSTALLED, False):
        return False
    mappings._gather_along_first_dim = _by_device(mappings._gather_along_first_dim, _gather_rows)
    mappings._reduce_scatter_along_first_dim = _by_device(
        mappings._reduce_scatter_along_first_dim, _reduce_scatter_rows
    )
    mappings._gather_along_last_dim = _by_device(mappings._gather_along_last_dim, _gather_columns)
    layers.linear_with_grad_accumulation_and_async_allreduce = _portable_linear(
        layers.linear_with_grad_accumulation_and_async_allreduce
    )
    random.CudaRNGStatesTracker.fork = _fork_without_cuda(random.CudaRNGStatesTracker.fork)
    return True


def _fork_without_cuda(original: Any) -> Any:
    @functools.wraps(original)
    def fork(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_available():
            return original(self, *args, **kwargs)
        return contextlib.nullcontext()

    return fork
