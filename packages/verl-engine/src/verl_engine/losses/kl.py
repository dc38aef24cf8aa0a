"""KL estimators: as a loss term (``kl_penalty``) and as a reward penalty (``kl_reward_penalty``)."""

from __future__ import annotations

import torch

from verl_engine.losses.common import check_shapes, masked_mean
from verl_engine.metrics import Metric

__all__ = ["KL_PENALTIES", "kl_penalty", "kl_reward_penalty"]

KL_PENALTIES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""KL estimators of :func:`kl_penalty`; each also accepts a trailing ``+`` (straight-through k2 gradient)."""


def _kl_value(*, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    """One of Schulman's KL estimators (http://joschu.net/blog/kl-approx.html), per token."""
    if estimator in ("kl", "k1"):
        return log_prob - ref_log_prob
    if estimator == "abs":
        return (log_prob - ref_log_prob).abs()
    if estimator in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()
    # low_var_kl / k3: unbiased and always >= 0; both clamps are verl's, for numerical safety
    k = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(k) - k - 1.0, min=-10.0, max=10.0)


def kl_penalty(*, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate; a trailing ``+`` keeps the value but takes the gradient of k2.

    Why the ``+``: k1 and k3 are unbiased for the KL *value* but their expected gradient is not the
    KL's gradient; k2's is. ``k3+`` therefore reports k3 and trains with k2's gradient (straight-through).
    """
    straight_through = kl_penalty.endswith("+")
    estimator = kl_penalty[:-1] if straight_through else kl_penalty
    if estimator == "full":
        raise NotImplementedError(
            f"kl_penalty={kl_penalty!r} needs the full vocabulary distributions, which a loss on per-token "
            f"log-probs does not have; use one of {', '.join(KL_PENALTIES)} (optionally with a trailing '+')"
        )
    if estimator not in KL_PENALTIES:
        raise ValueError(
            f"unknown kl_penalty {kl_penalty!r}; valid: {', '.join(KL_PENALTIES)}, each optionally with a "
            "trailing '+' (straight-through k2 gradient)"
        )
    value = _kl_value(log_prob=log_prob, ref_log_prob=ref_log_prob, estimator=estimator)
    if not straight_through:
        return value
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return value.detach() + (k2 - k2.detach())


def kl_reward_penalty(
    *,
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty_type: str = "kl",
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """KL to the reference as a reward penalty (verl's ``algorithm.use_kl_in_reward``), not as a loss.

    ``rewards = scores - kl_coef * KL`` per response token (``[B, R]``, zero outside ``response_mask``);
    metric ``kl`` is the masked mean KL (a device tensor, MEAN). No gradient flows: rewards are data for the advantage estimator.
    """
    mask = response_mask.to(torch.bool)
    check_shapes(
        loss="kl_reward_penalty",
        mask=response_mask,
        tensors={
            "token_level_scores": token_level_scores,
            "old_log_prob": old_log_prob,
            "ref_log_prob": ref_log_prob,
        },
    )
    with torch.no_grad():
        kl = kl_penalty(log_prob=old_log_prob, ref_log_prob=ref_log_prob, kl_penalty=kl_penalty_type)
        kl = torch.where(mask, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
        rewards = torch.where(mask, token_level_scores - kl_coef * kl, torch.zeros_like(token_level_scores))
    return rewards, {"kl": Metric(masked_mean(kl, mask)), "kl_coef": Metric(float(kl_coef))}
