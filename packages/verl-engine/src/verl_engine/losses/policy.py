"""Policy losses: one skeleton (importance weights, aggregation, metrics) and a small part per ``loss_mode``.

A mode computes per-token terms only (:class:`PolicyTerms`): its loss, the log-ratio behind ``ppo_kl`` and
which tokens its clip touched. :func:`policy_loss` does the rest the same way for every mode, so a new
mode (``register_policy_loss``) is a few lines and cannot get the normalisation or the metrics wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch

from verl_engine.losses.agg import agg_loss
from verl_engine.losses.common import config_value, masked, masked_mean
from verl_engine.losses.rollout_correction import RolloutCorrection, rollout_correction
from verl_engine.metrics import Metric

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossFn",
    "PolicyTerms",
    "bypass_mode_policy_loss",
    "cispo_policy_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "dro_policy_loss",
    "geo_mean_policy_loss",
    "get_policy_loss_fn",
    "gpg_policy_loss",
    "gspo_policy_loss",
    "policy_loss",
    "register_policy_loss",
    "sapo_policy_loss",
    "vanilla_policy_loss",
]

_RATIO_LOG_CLAMP = 20.0  # verl clamps log(pi/pi_old) to +-20 before exp()
_GSPO_LOG_RATIO_MAX = 10.0  # verl's GSPO clamps the log of the sequence ratio from above


@dataclass(frozen=True)
class PolicyTerms:
    """Per-token ``[mb, R]`` results of one policy-loss mode.

    ``clipped`` / ``clipped_lower``: where the clip / the dual clip bound the loss (None: the mode has no
    such clip, its fraction is 0). ``loss_agg_mode``: set by a mode that fixes its own aggregation, else
    the config's applies. ``weighted``: the mode handled the rollout importance weights itself (a
    sequence-level mode weights whole sequences; ``bypass_mode`` computes its own instead of the batch's),
    so the skeleton must not multiply the batch's in.

    ``mask``: the tokens that count, when a mode drops some (``bypass_mode``'s rejection sampling); None is
    ``response_mask``. The skeleton aggregates the loss and takes the clip fractions and ``ppo_kl`` over it
    (intersected with ``response_mask``), while the global counts of ``agg_kwargs`` stay those of the batch:
    verl 0.9.1's engine counts ``batch_num_tokens`` from the loss mask before the loss runs, so a dropped token
    adds 0 to the numerator but still counts in the ``token-mean`` denominator, and a sequence with every token
    dropped still counts in ``global_batch_size``. ``metrics``: the mode's own (MEAN), added to the skeleton's.
    """

    losses: torch.Tensor
    log_ratio: torch.Tensor
    clipped: torch.Tensor | None = None
    clipped_lower: torch.Tensor | None = None
    loss_agg_mode: str | None = None
    weighted: bool = False
    mask: torch.Tensor | None = None
    metrics: Mapping[str, Metric] = field(default_factory=dict)


PolicyLossFn = Callable[..., PolicyTerms]
"""``fn(*, log_prob, old_log_prob, advantages, response_mask, config, rollout_is_weights) -> PolicyTerms``
(``rollout_is_weights`` may be None; a mode that does not use it takes ``**_``)."""

_POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}
POLICY_LOSSES: Mapping[str, PolicyLossFn] = MappingProxyType(_POLICY_LOSS_REGISTRY)
"""Read-only view of the registered policy losses (name -> function)."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy-loss mode under ``name`` (``config.policy_loss.loss_mode``).

    A later registration under the same name replaces the earlier one (verl does the same), which lets
    user code override a built-in.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_policy_loss needs a non-empty name; got {name!r}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        _POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``; an unknown name lists the registered ones."""
    if name not in _POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"unknown policy loss {name!r} (config.policy_loss.loss_mode); registered: "
            f"{', '.join(sorted(_POLICY_LOSS_REGISTRY))}"
        )
    return _POLICY_LOSS_REGISTRY[name]


def policy_loss(
    *,
    loss_mode: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    agg_kwargs: Mapping[str, Any],
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """The mode's per-token loss, times the rollout importance weights, aggregated over the tokens that count
    (``response_mask``, or the mode's :attr:`PolicyTerms.mask`); its metrics (MEAN)."""
    terms = get_policy_loss_fn(loss_mode)(
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    weighted = rollout_is_weights is None or terms.weighted
    losses = terms.losses if weighted else terms.losses * rollout_is_weights  # type: ignore[operator]  # not None here
    mask = response_mask if terms.mask is None else terms.mask.bool() & response_mask.bool()
    pg_loss = agg_loss(
        loss_mat=losses,
        loss_mask=mask,
        loss_agg_mode=terms.loss_agg_mode or loss_agg_mode,
        **agg_kwargs,
    )
    metrics = {
        "actor/pg_clipfrac": _fraction(terms.clipped, mask),
        "actor/pg_clipfrac_lower": _fraction(terms.clipped_lower, mask),
        "actor/ppo_kl": Metric(masked_mean(-terms.log_ratio, mask)),
        **terms.metrics,
    }
    return pg_loss, metrics


def _fraction(flags: torch.Tensor | None, mask: torch.Tensor) -> Metric:
    return Metric(0.0 if flags is None else masked_mean(flags.double(), mask))


def _clip_range(config: Any, *, loss: str) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high), each falling back to clip_ratio when None (verl's rule)."""
    low = config_value(config, "clip_ratio_low", loss=loss, default=None)
    high = config_value(config, "clip_ratio_high", loss=loss, default=None)
    if low is None or high is None:
        clip_ratio = config_value(config, "clip_ratio", loss=loss)
        low = clip_ratio if low is None else low
        high = clip_ratio if high is None else high
    return float(low), float(high)


def _log_ratio(*, log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) clamped to +-20 as verl does, so exp() cannot overflow."""
    return torch.clamp(log_prob - old_log_prob, min=-_RATIO_LOG_CLAMP, max=_RATIO_LOG_CLAMP)


def _ppo_clip(
    ratio: torch.Tensor, advantages: torch.Tensor, *, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token and where the clip is active."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    *, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, config: Any, **_: Any
) -> PolicyTerms:
    """PPO clipped surrogate with dual clip (verl's ``compute_policy_loss_vanilla``, same formulas).

    Why dual clip: for A < 0 the plain PPO loss ``-A * r`` grows without bound in r; capping it at
    ``-A * clip_ratio_c`` keeps stale, very unlikely tokens from dominating the update.
    """
    name = "vanilla policy loss"
    low, high = _clip_range(config, loss=name)
    clip_ratio_c = float(config_value(config, "clip_ratio_c", loss=name, default=3.0))
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1; got {clip_ratio_c}")
    log_ratio = _log_ratio(log_prob=log_prob, old_log_prob=old_log_prob)
    ppo, clipped = _ppo_clip(torch.exp(log_ratio), advantages, low=low, high=high)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    return PolicyTerms(
        losses=torch.where(negative, torch.minimum(ppo, dual_bound), ppo),
        log_ratio=log_ratio,
        clipped=clipped,
        clipped_lower=(ppo > dual_bound) & negative,
    )


@register_policy_loss("gspo")
def gspo_policy_loss(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
    **_: Any,
) -> PolicyTerms:
    """GSPO (https://arxiv.org/abs/2507.18071): PPO clip on the sequence-level ratio, per token.

    The token ratio ``exp(logp - sg(logp) + sg(log s_i))`` has the value of the sequence ratio
    ``s_i = exp(mean_t(logp - old))`` but the gradient of the token's own log-prob. The log ratio is
    clamped from above at 10 and not at +-20. Aggregated with the config's ``loss_agg_mode``, as verl 0.9.1
    does (the paper's ``seq-mean-token-mean`` is a choice of that key, not forced: verl before 0.9 forced it).
    """
    low, high = _clip_range(config, loss="gspo policy loss")
    log_ratio = log_prob - old_log_prob
    seq_tokens = response_mask.to(log_ratio.dtype).sum(dim=-1).clamp(min=1.0)
    seq_log_ratio = masked(log_ratio, response_mask).sum(dim=-1) / seq_tokens
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    losses, clipped = _ppo_clip(
        torch.exp(torch.clamp(log_seq_ratio, max=_GSPO_LOG_RATIO_MAX)), advantages, low=low, high=high
    )
    return PolicyTerms(losses=losses, log_ratio=log_ratio, clipped=clipped)


@register_policy_loss("gpg")
def gpg_policy_loss(
    *, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, **_: Any
) -> PolicyTerms:
    """GPG: plain policy gradient ``-logp * A`` (no ratio, no clip); old log-probs only feed ``ppo_kl``."""
    return PolicyTerms(
        losses=-log_prob * advantages, log_ratio=_log_ratio(log_prob=log_prob, old_log_prob=old_log_prob)
    )


@register_policy_loss("sapo")
def sapo_policy_loss(
    *, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, config: Any, **_: Any
) -> PolicyTerms:
    """SAPO (https://arxiv.org/abs/2511.20347): a smooth sigmoid gate instead of the hard PPO clip.

    Loss ``-(4/tau) * sigmoid(tau * (r - 1)) * A`` with ``tau = tau_pos`` where A > 0 else ``tau_neg``;
    its gradient at r = 1 equals the unclipped PPO gradient and fades away from it. Aggregation
    ``seq-mean-token-mean``; no clip fractions.
    """
    name = "sapo policy loss"
    tau_pos = float(config_value(config, "tau_pos", loss=name))
    tau_neg = float(config_value(config, "tau_neg", loss=name))
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo needs tau_pos > 0 and tau_neg > 0; got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio = _log_ratio(log_prob=log_prob, old_log_prob=old_log_prob)
    tau = torch.where(
        advantages > 0,
        torch.tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.tensor(tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    return PolicyTerms(losses=-gate * advantages, log_ratio=log_ratio, loss_agg_mode="seq-mean-token-mean")


@register_policy_loss("cispo")
def cispo_policy_loss(
    *, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, config: Any, **_: Any
) -> PolicyTerms:
    """CISPO (https://arxiv.org/abs/2506.13585): ``-sg(clip(r)) * A * logp``, verl 0.9.1's formula.

    Why: PPO's clip zeroes the gradient of clipped tokens, which are often the rare reasoning tokens; CISPO
    clips the importance weight instead (stopped gradient) so every token keeps a policy-gradient term.
    """
    low, high = _clip_range(config, loss="cispo policy loss")
    log_ratio = _log_ratio(log_prob=log_prob, old_log_prob=old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return PolicyTerms(
        losses=-clipped_ratio.detach() * advantages * log_prob,
        log_ratio=log_ratio,
        clipped=ratio != clipped_ratio,
    )


def _dppo_terms(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    config: Any,
    valid: Callable,
    **_: Any,
) -> PolicyTerms:
    """DPPO's shared part (https://arxiv.org/abs/2602.04879): ``-A * sg(min(r, c)) * logp`` on the tokens
    whose probability moved less than the divergence bound (``valid(p, p_old, logp, logp_old, low=, high=)``:
    the masks for A > 0 and A <= 0), 0 elsewhere. ``c`` is ``clip_ratio_c`` (verl: 20 when the config has none)."""
    name = "dppo policy loss"
    low, high = _clip_range(config, loss=name)
    clip_ratio_c = float(config_value(config, "clip_ratio_c", loss=name, default=20.0))
    log_ratio = _log_ratio(log_prob=log_prob, old_log_prob=old_log_prob)
    ratio = torch.exp(log_ratio)
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    positive, negative = valid(prob, old_prob, log_prob, old_log_prob, low=low, high=high)
    keep = torch.where(advantages > 0, positive, negative).detach()
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    return PolicyTerms(
        losses=-advantages * truncated * log_prob * keep.to(log_prob.dtype),
        log_ratio=log_ratio,
        clipped=~keep,
        clipped_lower=(ratio > clip_ratio_c) & keep,
    )


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(**kwargs: Any) -> PolicyTerms:
    """DPPO with the binary total-variation bound: a token counts while ``p - p_old <= clip_ratio_high`` (A > 0)
    or ``p - p_old >= -clip_ratio_low`` (A <= 0), the trust region on probabilities rather than ratios."""

    def valid(
        p: torch.Tensor, p_old: torch.Tensor, *_: torch.Tensor, low: float, high: float
    ) -> tuple[Any, Any]:
        return (p - p_old) <= high, (p - p_old) >= -low

    return _dppo_terms(valid=valid, **kwargs)


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(**kwargs: Any) -> PolicyTerms:
    """DPPO with the binary KL bound: the KL between the Bernoulli(p_old) and Bernoulli(p) of the sampled token
    must stay under ``clip_ratio_high`` / ``clip_ratio_low``, unless p moved against A's direction."""

    def valid(
        p: torch.Tensor,
        p_old: torch.Tensor,
        logp: torch.Tensor,
        logp_old: torch.Tensor,
        *,
        low: float,
        high: float,
    ) -> tuple[Any, Any]:
        binary_kl = p_old * (logp_old - logp) + (1 - p_old) * torch.log(
            (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
        )
        return (binary_kl <= high) | (p <= p_old), (binary_kl <= low) | (p >= p_old)

    return _dppo_terms(valid=valid, **kwargs)


@register_policy_loss("dro")
def dro_policy_loss(
    *, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, config: Any, **_: Any
) -> PolicyTerms:
    """DRO (direct reward optimisation): ``-(logp * A - beta/2 * log(pi/pi_old)^2)``, verl 0.9.1's formula.

    Why a quadratic penalty instead of a clip: it pulls the policy back toward the old one smoothly and never
    zeroes a token's gradient. ``beta`` is ``policy_loss.dro_beta`` (verl-config requires it > 0 for dro); the
    log ratio is not clamped, as in verl.
    """
    policy = config_value(config, "policy_loss", loss="dro policy loss")
    beta = config_value(policy, "dro_beta", loss="dro policy loss", default=None)
    if beta is None or not float(beta) > 0:
        raise ValueError(f"dro needs actor.policy_loss.dro_beta > 0; got {beta!r}")
    log_ratio = log_prob - old_log_prob
    return PolicyTerms(
        losses=-(log_prob * advantages - 0.5 * float(beta) * log_ratio.square()), log_ratio=log_ratio
    )


@register_policy_loss("geo_mean")
def geo_mean_policy_loss(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
    rollout_is_weights: torch.Tensor | None = None,
    **_: Any,
) -> PolicyTerms:
    """GMPO (https://arxiv.org/abs/2507.20673): the geometric mean of the token ratios per sequence, clipped per
    token in log space, times the sequence's mean advantage: ``L_s = -mean_t(A) * exp(mean_t(clip(log r)))``.

    Why geometric: one outlier token moves an arithmetic mean of ratios a lot and a geometric one little. The
    loss is a sequence's, so it is one value per sequence: each token carries ``L_s`` and the aggregation is
    ``seq-mean-token-mean`` (``sum_s L_s / B``), globally normalised. verl 0.9.1 takes ``torch.mean`` over the
    micro-batch's sequences instead, which equals this for a whole batch on one rank but changes with the
    micro-batching; here a step does not. Rollout weights apply per sequence, as their geometric mean.
    """
    low, high = _clip_range(config, loss="geo_mean policy loss")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -low, high)
    chosen = sign * torch.min(sign * log_ratio, sign * clamped)
    # verl writes tokens + 1e-8 with its boolean mask: an int count plus 1e-8 in float32, which is the count
    # itself for any non-empty sequence; an empty one has a zero numerator either way
    tokens = mask.sum(dim=-1).clamp(min=1.0)
    seq_ratio = torch.exp((chosen * mask).sum(dim=-1) / tokens)
    seq_advantage = (advantages * mask).sum(dim=-1) / tokens
    seq_loss = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        seq_loss = seq_loss * torch.exp((torch.log(rollout_is_weights + 1e-10) * mask).sum(dim=-1) / tokens)
    clipped = log_ratio != clamped
    return PolicyTerms(
        losses=seq_loss.unsqueeze(-1).expand_as(log_prob),
        log_ratio=log_ratio,
        clipped=clipped & (advantages > 0),
        clipped_lower=clipped & (advantages < 0),
        loss_agg_mode="seq-mean-token-mean",
        weighted=True,
    )


@register_policy_loss("bypass_mode")
def bypass_mode_policy_loss(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
    **_: Any,
) -> PolicyTerms:
    """verl 0.9.1's bypass mode: the old policy *is* the rollout's, corrected by ``policy_loss.rollout_correction``.

    Why: recomputing the old log-probs costs a forward pass over the batch; bypass mode takes the rollout's
    (the trainer sets ``old_log_probs = rollout_log_probs``) and handles their mismatch with pi_train here:
    importance weights and rejection from ``log r = sg(logp) - old_log_prob``
    (:mod:`~verl_engine.losses.rollout_correction`, with verl's trainer copying ``algorithm.rollout_correction``
    to ``policy_loss.rollout_correction``). ``loss_type`` ``ppo_clip``: the vanilla PPO loss (its ratio already
    is pi / pi_rollout, so the weights only feed metrics); ``reinforce``: ``-A * logp * w``, with ``ppo_kl``
    of the unclamped log ratio. Either way over the tokens the rejection kept (:attr:`PolicyTerms.mask`: a
    rejected token still counts in ``batch_num_tokens``, as in verl), and the batch's ``rollout_is_weights`` are
    ignored, as in verl. Every part is per sequence, so a step does not depend on
    the micro-batching, except ``rollout_is_batch_normalize`` with ``reinforce`` (refused at build).
    """
    name = "bypass_mode policy loss"
    policy = config_value(config, "policy_loss", loss=name)
    section = config_value(policy, "rollout_correction", loss=name, default=None)
    if section is None:
        raise ValueError(
            f"{name} needs config.policy_loss.rollout_correction (verl's trainer copies algorithm.rollout_correction"
            " there when algorithm.rollout_correction.bypass_mode=true; verl_engine.loss_config(cfg, role='actor')"
            " does the same for a verl-config config)"
        )
    settings = RolloutCorrection.from_config(section)
    weights, keep, metrics = rollout_correction(
        log_ratio=log_prob.detach() - old_log_prob, response_mask=response_mask, settings=settings
    )
    if settings.loss_type == "ppo_clip":
        terms = vanilla_policy_loss(
            log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, config=config
        )
    else:
        losses = -advantages * log_prob
        terms = PolicyTerms(
            losses=losses if weights is None else losses * weights, log_ratio=log_prob - old_log_prob
        )
    return replace(terms, weighted=True, mask=keep, metrics=metrics)
