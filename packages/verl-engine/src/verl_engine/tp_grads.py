"""Gradients of parameters replicated over tensor parallelism that each TP rank computes from other data.

On GPUs megatron-core's ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) sums two kinds
of replicated parameters' gradients over the TP group, because each TP rank's copy saw only part of the work:

* parameters marked ``sequence_parallel = True`` when the config has sequence parallelism on (norms and
  routers: each TP rank applies them to its own shard of the tokens);
* q / k layernorm weights (``q_layernorm`` / ``k_layernorm`` in the name), SP or not: they act on attention
  heads, which TP splits, and every head shares the weight.

The CPU backend (:class:`verl_engine.backends.DebugBackend`) has no ``finalize_model_grads``; it calls
:func:`sum_tp_shared_grads` after the backward of every call, the same rule with gloo all-reduces.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["sum_tp_shared_grads", "tp_shared"]


def tp_shared(name: str, param: torch.nn.Parameter) -> bool:
    """Whether ``param``'s gradient is summed over TP (megatron-core's rule, see the module doc)."""
    return bool(getattr(param, "sequence_parallel", False)) or "q_layernorm" in name or "k_layernorm" in name


def sum_tp_shared_grads(chunks: Iterable[torch.nn.Module]) -> int:
    """SUM all-reduce over the TP group of every :func:`tp_shared` gradient of ``chunks`` (a missing gradient
    joins as zeros: every TP rank must join every all-reduce). Returns the number reduced (0 at TP 1)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return 0
    group = ps.get_tensor_model_parallel_group()
    count = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or not tp_shared(name, param):
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)
            count += 1
    return count
