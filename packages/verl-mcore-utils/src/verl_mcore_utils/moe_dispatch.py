"""megatron-core's all-gather token dispatcher for CPU models: gloo collectives and ranks of unequal token counts.

With expert parallelism (EP > 1) megatron-core's ``MoEAllGatherTokenDispatcher`` gathers every rank's tokens
over the TP x EP group, lets each rank run its local experts on all of them, and reduce-scatters the expert
output back. Its collectives (``gather_from_sequence_parallel_region`` / ``reduce_scatter_to_sequence_parallel_region``)
allocate on ``torch.cuda.current_device()``, use ``reduce_scatter_tensor`` (gloo has none) and assume every rank
holds the same number of tokens, which packed micro-batches break: data-parallel ranks hold different sequences,
and dynamic context parallelism different pieces of them. :class:`PortableAllGatherTokenDispatcher` does the same
exchange with collectives that work on gloo and with per-rank row counts: the gather pads to the longest rank and
strips the padding; the reduce-scatter is an all-reduce followed by this rank's rows (the fallback verl-dyncp
uses for K/V gradients). Only CPU models get it (:func:`verl_mcore_utils.moe.make_moe_portable`); CUDA models
keep megatron-core's dispatchers unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

__all__ = ["PortableAllGatherTokenDispatcher"]


def _row_counts(rows: int, group: Any, device: torch.device) -> list[int]:
    """Every rank's number of rows in ``group`` (rank order)."""
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(counts, mine, group=group)
    return [int(c.item()) for c in counts]


def gather_rows(x: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:
    """Concatenate every rank's rows (``counts[r]`` rows on rank r) along dim 0; all ranks get the result."""
    longest = max(counts)
    x = x.contiguous()
    if x.shape[0] < longest:
        x = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])])
    parts = [torch.empty_like(x) for _ in counts]
    dist.all_gather(parts, x, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])


def own_rows(total: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:
    """The sum of ``total`` over ``group``, this rank's rows only (reduce-scatter as all-reduce + slice)."""
    total = total.contiguous().clone()
    dist.all_reduce(total, group=group)
    start = sum(counts[: dist.get_rank(group=group)])
    return total[start : start + counts[dist.get_rank(group=group)]].contiguous()


class _GatherRows(torch.autograd.Function):
    """Forward: gather rows; backward: the summed gradient of this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.counts = group, counts
        return gather_rows(x, group, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return own_rows(grad, ctx.group, ctx.counts), None, None


class _ReduceScatterRows(torch.autograd.Function):
    """Forward: the sum over ranks, this rank's rows; backward: gather the rows' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.counts = group, counts
        return own_rows(x, group, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return gather_rows(grad, ctx.group, ctx.counts), None, None


class PortableAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron-core's all-gather dispatcher with gloo-capable collectives and unequal token counts per rank.

    Only the two communication steps differ; permutation, local-expert selection and unpermutation are
    megatron-core's own.
    """

    routing_map: torch.Tensor  # set by megatron-core's dispatch_preprocess, before token_dispatch

    def token_dispatch(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp_size > 1 or self.ep_size > 1:
            group = self.tp_ep_group
            self._row_counts = _row_counts(hidden_states.shape[0], group, hidden_states.device)
            with torch.no_grad():  # gloo gathers no bool tensors
                routing = gather_rows(self.routing_map.to(torch.uint8), group, self._row_counts)
                self.routing_map = routing.to(self.routing_map.dtype)
            probs = _GatherRows.apply(probs, group, self._row_counts)
            hidden_states = _GatherRows.apply(hidden_states, group, self._row_counts)
        return hidden_states, probs

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1 or self.ep_size > 1:
            dtype = hidden_states.dtype
            hidden_states = _ReduceScatterRows.apply(
                hidden_states.to(self.local_probs.dtype), self.tp_ep_group, self._row_counts
            ).to(dtype)
        return hidden_states
