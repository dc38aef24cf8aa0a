"""The routers' expert bias (DeepSeek-V3 / GLM-4.5 aux-loss-free balancing) after each optimizer step, CPU backend.

The expert bias is no parameter: megatron-core's routers count the tokens each expert received
(``local_tokens_per_expert``, training forwards only, padding excluded with ``padding_mask``), and after the
step's backward its ``finalize_model_grads`` sums those counts over TP x DP x CP and moves every bias by
``moe_router_bias_update_rate`` towards balance: ``bias += rate * sign(mean count - count)``
(``get_updated_expert_bias``), then zeroes the counts. The megatron backend runs that inside megatron-core's
schedule; its data-parallel group is the engine's DP x CP pool (the model is built at CP 1), so the sum covers
every token of the step. The CPU backend has no schedule: :func:`update_expert_bias` does the same over the same
group (TP x pool), so DP, static CP and dynamic CP move the bias as one rank does (every rank counts only its own
tokens, or its own pieces of a sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter

__all__ = ["biased_routers", "update_expert_bias"]


def biased_routers(chunks: Sequence[torch.nn.Module]) -> list[TopKRouter]:
    """The routers whose expert bias the step moves (training mode, bias not frozen), in a fixed order."""
    from verl_engine.moe import moe_routers

    return [
        r
        for r in moe_routers(chunks)
        if getattr(r, "expert_bias", None) is not None
        and r.training
        and not getattr(r, "frozen_expert_bias", False)
    ]


@torch.no_grad()
def update_expert_bias(chunks: Sequence[torch.nn.Module]) -> int:
    """Move every router's expert bias by the step's token counts summed over TP x the DP x CP pool, then zero
    the counts (megatron-core's ``_update_router_expert_bias``). Returns the number of routers moved."""
    routers = biased_routers(chunks)
    if not routers:
        return 0
    from megatron.core import parallel_state

    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        dist.all_reduce(counts, group=parallel_state.get_tensor_and_data_parallel_group())
    mean = counts.sum(dim=-1, keepdim=True) / counts.shape[-1]
    rate = routers[0].config.moe_router_bias_update_rate
    for router, offset in zip(routers, mean - counts, strict=True):
        router.expert_bias.copy_(router.expert_bias + torch.sign(offset) * rate)
        router.local_tokens_per_expert.zero_()
    return len(routers)
