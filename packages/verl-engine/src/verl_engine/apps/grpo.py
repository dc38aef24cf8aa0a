"""GRPO's pieces that are not the engine: group-normalised advantages and verl's batch layout of a rollout.

* :func:`grpo_outcome_advantage`: one scalar score per response, normalised within the group of responses to
  the same prompt: ``(score - mean) / (std + eps)`` (unbiased std, as ``torch.std``), or ``score - mean``
  without the std (Dr. GRPO, ``norm_adv_by_std_in_grpo=false``). verl's rule for a group of ONE response is
  kept: mean 0 and std 1, so a lone response's advantage is its score (not 0).
* :func:`rollout_batch`: prompts and responses (token-id lists) as verl's padded batch -- prompts left-padded
  to the longest, responses right-padded -- the layout :class:`verl_engine.engine.RLEngine` consumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["grpo_outcome_advantage", "rollout_batch"]


def grpo_outcome_advantage(
    scores: torch.Tensor,
    *,
    group_ids: Sequence[Any] | torch.Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Per-response advantages [b] from per-response scores [b]; ``group_ids[i]`` names response i's prompt.

    Groups need not be contiguous. Computed in float64 and returned in the scores' dtype.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be one value per response, shape [b]; got {tuple(scores.shape)}")
    ids = list(group_ids.tolist() if isinstance(group_ids, torch.Tensor) else group_ids)
    if len(ids) != scores.shape[0]:
        raise ValueError(f"{len(ids)} group ids for {scores.shape[0]} scores")
    index = {g: i for i, g in enumerate(dict.fromkeys(ids))}
    groups = torch.tensor([index[g] for g in ids], dtype=torch.long)
    values = scores.double()
    count = torch.zeros(len(index), dtype=torch.float64).index_add_(0, groups, torch.ones_like(values))
    mean = torch.zeros(len(index), dtype=torch.float64).index_add_(0, groups, values) / count
    centred = values - mean[groups]
    sq = torch.zeros(len(index), dtype=torch.float64).index_add_(0, groups, centred**2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count == 1  # verl: a one-response group has mean 0 and std 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    advantage = values - mean[groups]
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std[groups] + epsilon)
    return advantage.to(scores.dtype)


def rollout_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """verl's padded batch of (prompt, response) pairs: ``input_ids`` / ``attention_mask`` / ``position_ids``
    [b, P + R] (prompt left-padded to P, response right-padded to R), ``prompts`` [b, P], ``responses`` and
    ``response_mask`` [b, R]. An empty response is allowed (its mask row is all zero)."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(
            f"need one response per prompt, got {len(prompts)} prompts and {len(responses)} responses"
        )
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    b = len(prompts)
    p_len = max(len(p) for p in prompts)
    r_len = max(1, max(len(r) for r in responses))
    ids = torch.full((b, p_len + r_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, p_len + r_len), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(list(p), dtype=torch.long)
        mask[i, p_len - len(p) : p_len] = 1
        if r:
            ids[i, p_len : p_len + len(r)] = torch.tensor(list(r), dtype=torch.long)
            mask[i, p_len : p_len + len(r)] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
        "prompts": ids[:, :p_len].clone(),
        "responses": ids[:, p_len:].clone(),
        "response_mask": mask[:, p_len:].clone(),
    }
