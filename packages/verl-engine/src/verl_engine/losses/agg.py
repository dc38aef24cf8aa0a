"""Aggregation of a per-token loss into a micro-batch's share of the global mini-batch loss (verl's modes)."""

from __future__ import annotations

import math
from typing import Any

import torch

from verl_engine.losses.common import masked, nonzero

__all__ = ["LOSS_AGG_MODES", "agg_loss"]

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
"""Aggregation modes of :func:`agg_loss` (verl's, including ``token-sum`` of verl's HEAD)."""


def _global_count(value: Any, *, local: Any, key: str, mode: str, dp_size: int) -> Any:
    """The global count, or the local one when None; None with several ranks would silently mis-normalise."""
    if value is None:
        if dp_size != 1:
            raise ValueError(
                f"agg_loss({mode!r}) needs {key} (the global count) when dp_size={dp_size} > 1: "
                "local counts would give each rank a different normalisation"
            )
        value = local
    return nonzero(value)


def agg_loss(
    *,
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into this micro-batch's share of the global mini-batch loss.

    Why global counts: dividing each micro-batch by the *global* token / sequence count and multiplying
    by ``dp_size`` (undone by the data-parallel gradient average) makes the sum over micro-batches and
    ranks the exact global objective, whatever the split. ``None`` counts fall back to this call's own
    (whole-batch, single-rank use): ``loss_mask.sum()`` tokens and ``rows`` sequences.

    Modes (``m`` the mask, ``n_s`` the tokens of sequence s, ``B`` sequences, ``N`` tokens):
    ``token-mean`` sum(L*m)/N*dp; ``token-sum`` sum(L*m)*dp; ``seq-mean-token-sum`` sum_s(sum_t L*m)/B*dp;
    ``seq-mean-token-sum-norm`` the previous / loss_scale_factor (default: response length);
    ``seq-mean-token-mean`` sum_s(sum_t L*m / n_s)/B*dp, empty sequences contributing 0.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"agg_loss: loss_mat has shape {tuple(loss_mat.shape)} but loss_mask has shape {tuple(loss_mask.shape)}"
        )
    if loss_mat.dim() < 1:
        raise ValueError("agg_loss: loss_mat must have a token dimension (shape [..., response_len])")
    if int(dp_size) < 1:
        raise ValueError(f"agg_loss: dp_size must be >= 1; got {dp_size}")
    seq_sums = masked(loss_mat, loss_mask).sum(dim=-1)
    if loss_agg_mode == "token-sum":
        return seq_sums.sum() * dp_size
    if loss_agg_mode == "token-mean":
        local_tokens = loss_mask.to(loss_mat.dtype).sum()
        tokens = _global_count(
            batch_num_tokens, local=local_tokens, key="batch_num_tokens", mode=loss_agg_mode, dp_size=dp_size
        )
        return seq_sums.sum() / tokens * dp_size
    rows = math.prod(loss_mask.shape[:-1])
    sequences = _global_count(
        global_batch_size, local=rows, key="global_batch_size", mode=loss_agg_mode, dp_size=dp_size
    )
    if loss_agg_mode == "seq-mean-token-mean":
        seq_tokens = loss_mask.to(loss_mat.dtype).sum(dim=-1)
        return (seq_sums / nonzero(seq_tokens)).sum() / sequences * dp_size
    loss = seq_sums.sum() / sequences * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
    return loss
