"""Loss normalisation that makes gradients independent of micro-batching and data parallelism.

The training objective is the mean token loss over the GLOBAL batch: sum of masked per-token
losses over every micro-batch of every DP rank, divided by the global count of loss tokens. Each
micro-batch contributes ``masked_sum / global_tokens``, times the DP size because both backends average
gradients over DP (:mod:`verl_engine.backends`; the megatron one also undoes its schedule's
1 / num_microbatches).
"""

from __future__ import annotations

import torch

__all__ = ["masked_loss_sum"]


def masked_loss_sum(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``per_token_loss`` where ``loss_mask`` is 1, in float32."""
    if per_token_loss.shape != loss_mask.shape:
        raise ValueError(
            f"per-token loss shape {tuple(per_token_loss.shape)} != loss mask shape {tuple(loss_mask.shape)}"
        )
    return (per_token_loss.float() * loss_mask.float()).sum()
