"""verl 0.9.1's covariance-selected policy losses, ``clip_cov`` and ``kl_cov`` (https://arxiv.org/abs/2505.22617).

Both pick tokens by the covariance of advantage and log-probability over the micro-batch they are given (verl's
definition): ``clip_cov`` zeroes the loss of a random share of tokens inside a covariance window, ``kl_cov`` adds
a KL penalty on the tokens of largest covariance. So a step depends on how the batch is cut into micro-batches and
data-parallel ranks, and ``clip_cov`` draws per rank. Kept apart from :mod:`verl_engine.losses.policy` (the
skeleton and the per-token modes) because they are the two modes that read batch statistics and the host.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_engine.losses.common import config_value, masked, masked_mean
from verl_engine.losses.policy import PolicyTerms, _clip_range, _ppo_clip, register_policy_loss
from verl_engine.metrics import Metric

__all__ = ["clip_cov_policy_loss", "kl_cov_policy_loss"]


def _cov_setting(config: Any, key: str, *, fallback: float, loss: str) -> float:
    """``config.policy_loss.<key>``, or verl's fallback where it is None (verl's covariance losses do the same)."""
    policy = config_value(config, "policy_loss", loss=loss)
    value = config_value(policy, key, loss=loss, default=None)
    return float(fallback if value is None else value)


def _batch_covariance(
    advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Per token ``(A - mean A) * (logp - mean logp)``, the means over the micro-batch's response tokens.

    verl's ``masked_mean`` divides by ``mask.sum() + 1e-8``; written the same way so that a token sitting on a
    window bound is inside or outside exactly as in verl.
    """
    count = response_mask.sum() + 1e-8
    mean_advantage = masked(advantages, response_mask).sum() / count
    mean_log_prob = masked(log_prob, response_mask).sum() / count
    return (advantages - mean_advantage) * (log_prob - mean_log_prob)


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
    **_: Any,
) -> PolicyTerms:
    """Clip-Cov (https://arxiv.org/abs/2505.22617), verl 0.9.1's ``compute_policy_loss_clip_cov``.

    Why: tokens whose log-prob moves with the advantage (high covariance) drive the entropy collapse of RL on
    language models; detaching a few of them keeps entropy up. The loss is PPO's clipped surrogate (no dual clip,
    no +-20 clamp of the log ratio) with the gradient of some tokens zeroed: among the response tokens PPO does
    not already clip, those whose covariance ``(A - mean A) * (logp - mean logp)`` lies strictly inside
    ``(clip_cov_lb, clip_cov_ub)``, ``max(int(clip_cov_ratio * tokens), 1)`` are drawn at random, uniformly,
    with ``torch.randperm`` on torch's default CPU generator consumed exactly as verl consumes it (no draw when
    no token is in the window), so the same seed zeroes the same tokens. ``actor/pg_clipfrac`` is the fraction
    of zeroed tokens.

    The means, the token count and the draw are the micro-batch's, which is verl's definition: a step depends
    on how the batch is cut into micro-batches and data-parallel ranks, and each rank draws its own tokens
    from its own generator. Host reads: one per micro-batch (the number of tokens in the window and of response
    tokens, which set the size of the random permutation); the default losses read none.
    """
    name = "clip_cov policy loss"
    low, high = _clip_range(config, loss=name)
    fraction = _cov_setting(config, "clip_cov_ratio", fallback=0.0002, loss=name)
    lower = _cov_setting(config, "clip_cov_lb", fallback=1.0, loss=name)
    upper = _cov_setting(config, "clip_cov_ub", fallback=5.0, loss=name)
    if not fraction > 0:
        raise ValueError(f"clip_cov needs policy_loss.clip_cov_ratio > 0; got {fraction}")
    log_ratio = log_prob - old_log_prob
    ppo, clipped = _ppo_clip(torch.exp(log_ratio), advantages, low=low, high=high)
    cov = _batch_covariance(advantages, log_prob.detach(), response_mask)
    window = (response_mask > 0) & ~clipped & (cov > lower) & (cov < upper)
    counts = torch.stack([window.sum().double(), response_mask.sum().double()]).tolist()  # the host read
    found, tokens = int(counts[0]), counts[1]
    zeroed = torch.zeros_like(window)
    if found:
        draw = torch.randperm(found)[: min(max(int(fraction * tokens), 1), found)]
        chosen = torch.zeros(found, dtype=torch.bool, device=window.device)
        chosen[draw.to(window.device)] = True
        # the window's tokens in row-major order (verl's torch.nonzero order), numbered without a host read
        rank = torch.cumsum(window.flatten().long(), dim=0).sub(1).clamp(min=0).view_as(window)
        zeroed = window & chosen[rank]
    return PolicyTerms(losses=ppo * (~zeroed).to(ppo.dtype), log_ratio=log_ratio, clipped=zeroed)


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
    **_: Any,
) -> PolicyTerms:
    """KL-Cov (https://arxiv.org/abs/2505.22617), verl 0.9.1's ``compute_policy_loss_kl_cov``.

    Why: as Clip-Cov, it restrains the high-covariance tokens that collapse entropy, with a penalty instead of
    a zeroed gradient. The loss is the unclipped ``-A * r``; on the ``max(1, int(kl_cov_ratio * tokens))``
    response tokens of largest covariance ``(A - mean A) * (logp - mean logp)`` (``torch.topk`` on the response
    tokens' values in row-major order, as verl, so ties fall the same way on the same device) it adds
    ``ppo_kl_coef * |log r|``. ``actor/ppo_kl`` is the mean of ``|log r|``, as verl reports it; there is no
    clip, so the clip fractions are 0.

    The means, the token count and the top-k are the micro-batch's, which is verl's definition: a step depends
    on how the batch is cut into micro-batches and data-parallel ranks. verl copies the statistics to the CPU;
    here they stay on the device, and the one host read per micro-batch is the count of response tokens,
    which sets k (the default losses read none).
    """
    name = "kl_cov policy loss"
    fraction = _cov_setting(config, "kl_cov_ratio", fallback=0.0002, loss=name)
    coef = _cov_setting(config, "ppo_kl_coef", fallback=1.0, loss=name)
    if not fraction > 0:
        raise ValueError(f"kl_cov needs policy_loss.kl_cov_ratio > 0; got {fraction}")
    log_ratio = log_prob - old_log_prob
    surrogate = -advantages * torch.exp(log_ratio)
    valid = response_mask > 0
    valid_advantages = advantages.detach()[valid]  # boolean indexing: the host read (the count)
    valid_log_probs = log_prob.detach()[valid]
    selected = torch.zeros_like(valid)
    tokens = valid_advantages.numel()
    if tokens:
        cov = (valid_advantages - valid_advantages.mean()) * (valid_log_probs - valid_log_probs.mean())
        top = torch.topk(cov, max(1, int(tokens * fraction)), largest=True).indices
        picked = torch.zeros(tokens, dtype=torch.bool, device=valid.device)
        picked[top] = True
        selected = selected.masked_scatter(valid, picked)
    return PolicyTerms(
        losses=torch.where(selected, surrogate + coef * log_ratio.abs(), surrogate),
        log_ratio=log_ratio,
        metrics={"actor/ppo_kl": Metric(masked_mean(log_ratio.abs(), response_mask))},
    )
