"""megatron-core's mixture-of-experts layers on any device: the router without its move to CUDA.

megatron-core's ``TopKRouter.gating`` moves a router weight that sits on the CPU to the current CUDA device
before every call (it assumes CPU initialisation followed by a GPU run). On a host without CUDA that is an
error, so a model built on the CPU for the CPU (fp32 parity tests, gloo) could not route a single token.
:class:`PortableTopKRouter` computes the same logits where the weight is; :func:`make_moe_portable` turns
the routers of a built model into it when the model lives on the CPU, and leaves CUDA models untouched
(megatron-core's own fp32 routing function runs there). With expert parallelism the CPU model's all-gather
token dispatchers become :class:`~verl_mcore_utils.moe_dispatch.PortableAllGatherTokenDispatcher` (gloo
collectives, unequal token counts per rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.router import TopKRouter

__all__ = ["PortableTopKRouter", "make_moe_portable"]

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class PortableTopKRouter(TopKRouter):
    """A TopKRouter whose gating runs on the device of its weight (megatron-core's moves it to CUDA)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        bias = getattr(self, "bias", None)  # megatron-core < 0.15 routers have no bias
        bias = None if bias is None else bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)


def make_moe_portable(model: torch.nn.Module, device: torch.device | str) -> int:
    """Make every TopKRouter of ``model`` a :class:`PortableTopKRouter` and every all-gather token
    dispatcher a portable one when ``device`` is the CPU.

    Returns the number of routers changed (0 for dense models and for CUDA devices).
    """
    if torch.device(device).type != "cpu":
        return 0
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from verl_mcore_utils.moe_dispatch import PortableAllGatherTokenDispatcher

    count = 0
    for module in model.modules():
        if type(module) is TopKRouter:
            module.__class__ = PortableTopKRouter
            count += 1
        dispatcher = getattr(module, "token_dispatcher", None)
        if type(dispatcher) is MoEAllGatherTokenDispatcher:
            dispatcher.__class__ = PortableAllGatherTokenDispatcher
    return count
