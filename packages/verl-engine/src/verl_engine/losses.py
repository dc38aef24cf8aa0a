"""RL losses of the engine (actor PPO family, critic, SFT) in plain torch, with verl's global normalisation.

Why this module exists: the engine runs one loss call per micro-batch and must produce the gradient of the
*global* mini-batch objective however the batch is cut into micro-batches and data-parallel ranks. verl
reaches that by dividing every micro-batch by global counts; this module does the same, so a loss written
for verl's engine workers can be bound here unchanged (``functools.partial(ppo_loss, config=actor_cfg)``).

Call contract (verl's shape): ``loss, metrics = loss_fn(model_output=..., data=..., dp_group=...)``.

``model_output`` (Mapping) holds float tensors of shape ``[mb, R]``, response-aligned: ``[i, t]`` belongs to
response token ``t`` of sequence ``i``.

- ``"log_probs"``: log p(response token t | everything before it); carries autograd when training.
- ``"entropy"`` (optional): the policy entropy at the same positions.
- ``"values"`` (critic): the value head's output at the position that predicts response token t.

``data`` (a dict or a ``tensordict.TensorDict``; read only through ``data[key]``, ``key in data`` and
``data.get(key)``) holds ``[mb, R]`` tensors and python scalars:

- ``"response_mask"`` (bool or 0/1), ``"old_log_probs"``, ``"advantages"``, optional ``"ref_log_prob"`` and
  ``"rollout_is_weights"``; for the critic ``"values"`` (old values) and ``"returns"``.
- ``"dp_size"`` (int): number of ranks whose gradients are averaged.
- ``"batch_num_tokens"`` (int): response-mask tokens of the whole global mini-batch (all micro-batches,
  all ranks); ``None`` means "this call sees the whole batch" and is refused when ``dp_size > 1``.
- ``"global_batch_size"`` (int): sequences of the whole global mini-batch (same ``None`` rule).
- ``"loss_scale_factor"`` (optional int or None): divisor of ``seq-mean-token-sum-norm``; when absent or
  None, ``config.loss_scale_factor`` is used (verl keeps it in the config), then the response length.

``dp_group`` (a process group or None) is accepted and unused: the global counts above make every
normalisation local, so no collective is needed.

Each loss returns ``(scalar loss tensor, {metric name: python float})``. Normalisation is global: summing
the returned loss over all micro-batches of a rank and averaging gradients over ``dp_size`` ranks gives
the gradient of the global mean, NOT a mean of per-micro-batch means. Loss-valued metrics (``pg_loss``,
``entropy``, ``kl_loss``, ``vf_loss``) are therefore this micro-batch's *share* (sum them over micro-batches,
average over ranks); ratio metrics (``pg_clipfrac``, ``ppo_kl``, ...) are means over this micro-batch.

Failure rules: a key a loss needs is missing -> ``ValueError`` naming the key and the loss; two tensors of
different shapes -> ``ValueError`` naming both keys and shapes; an all-zero ``response_mask`` -> loss exactly
0 with a valid graph and finite metrics. Positions outside the mask are replaced by 0 before any
arithmetic, so padding holding NaN or inf cannot leak into the loss or the gradient.

Where these losses deliberately differ from verl's (empty sequences, zero counts, metric names): see the
README's design notes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

__all__ = [
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PolicyLossFn",
    "agg_loss",
    "get_policy_loss_fn",
    "gpg_policy_loss",
    "gspo_policy_loss",
    "kl_penalty",
    "kl_reward_penalty",
    "ppo_loss",
    "register_policy_loss",
    "sapo_policy_loss",
    "sft_loss",
    "value_loss",
    "vanilla_policy_loss",
]

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)
"""Aggregation modes of :func:`agg_loss` (verl's, including ``token-sum`` of verl's HEAD)."""

KL_PENALTIES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""KL estimators of :func:`kl_penalty`; each also accepts a trailing ``+`` (straight-through k2 gradient)."""

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
"""``fn(*, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, agg_kwargs,
rollout_is_weights=None) -> (pg_loss, metrics)``."""

_RATIO_LOG_CLAMP = 20.0  # verl clamps log(pi/pi_old) to +-20 before exp()
_GSPO_LOG_RATIO_MAX = 10.0  # verl's GSPO clamps the log of the sequence ratio from above
_MISSING = object()


# ---------------------------------------------------------------------------------------- small helpers
def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values * mask`` with masked-out entries forced to 0 first, so NaN/inf padding cannot leak (verl too)."""
    return torch.where(mask.bool(), values, 0.0) * mask.to(values.dtype)


def _nonzero(count: Any) -> Any:
    """A divisor that is ``count`` unless it is 0 (then 1): an all-empty batch gives 0, not NaN."""
    if isinstance(count, torch.Tensor):
        return torch.where(count == 0, torch.ones_like(count), count)
    return count if count != 0 else 1


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` over the mask as a python float; 0.0 for an empty mask (metrics stay finite)."""
    mask = mask.bool()
    total = torch.where(mask, values.detach().double(), 0.0).sum()
    return float(total / max(int(mask.sum()), 1))


def _config_value(config: Any, key: str, *, loss: str, default: Any = _MISSING) -> Any:
    """``config.key`` for dataclasses, namespaces, DictConfig or plain dicts; a clear error names what is missing."""
    if isinstance(config, Mapping):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    if value is _MISSING:
        raise ValueError(f"{loss} needs config.{key}; the config given ({type(config).__name__}) has none")
    return value


def _required_tensor(source: Mapping[str, Any], key: str, *, loss: str, where: str) -> torch.Tensor:
    """``source[key]`` as a tensor; missing (or None) raises a ValueError naming key and loss."""
    value = source[key] if key in source else None
    if value is None:
        raise ValueError(
            f"{loss} needs {where}[{key!r}] (a [micro_batch, response_len] tensor); it is missing"
        )
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{loss} needs {where}[{key!r}] to be a torch.Tensor, got {type(value).__name__}")
    return value


def _optional_tensor(source: Mapping[str, Any], key: str) -> torch.Tensor | None:
    """``source[key]`` when present and not None (TensorDicts may hold a None as non-tensor data)."""
    value = source[key] if key in source else None
    return value if isinstance(value, torch.Tensor) else None


def _check_shapes(*, loss: str, mask: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every response-aligned tensor must have the mask's [mb, R] shape; name both sides when one does not."""
    if mask.dim() != 2:
        raise ValueError(
            f"{loss}: data['response_mask'] must be [micro_batch, response_len]; got shape {tuple(mask.shape)}"
        )
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{loss}: {name} has shape {tuple(tensor.shape)} but data['response_mask'] has shape "
                f"{tuple(mask.shape)}; both must be [micro_batch, response_len], aligned to response tokens"
            )


def _scalar(data: Mapping[str, Any], key: str, *, loss: str, required: bool) -> Any:
    """A python scalar of ``data`` (0-dim tensors allowed); a required key that is absent raises ValueError."""
    if key not in data:
        if required:
            raise ValueError(
                f"{loss} needs data[{key!r}] (global normalisation: dp_size, batch_num_tokens, "
                "global_batch_size); it is missing"
            )
        return None
    return data[key]


def _global_batch_info(data: Mapping[str, Any], *, loss: str, config: Any) -> dict[str, Any]:
    """The ``agg_kwargs`` of one call: global counts from ``data``, loss_scale_factor from data or config."""
    dp_size = _scalar(data, "dp_size", loss=loss, required=True)
    scale = _scalar(data, "loss_scale_factor", loss=loss, required=False)
    if scale is None and config is not None:
        scale = _config_value(config, "loss_scale_factor", loss=loss, default=None)
    return {
        "dp_size": int(dp_size),
        "batch_num_tokens": _scalar(data, "batch_num_tokens", loss=loss, required=True),
        "global_batch_size": _scalar(data, "global_batch_size", loss=loss, required=True),
        "loss_scale_factor": scale,
    }


# ------------------------------------------------------------------------------------------ aggregation
def _global_count(value: Any, *, local: Any, key: str, mode: str, dp_size: int) -> Any:
    """The global count, or the local one when None; None with several ranks would silently mis-normalise."""
    if value is None:
        if dp_size != 1:
            raise ValueError(
                f"agg_loss({mode!r}) needs {key} (the global count) when dp_size={dp_size} > 1: "
                "local counts would give each rank a different normalisation"
            )
        value = local
    return _nonzero(value)


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
    seq_sums = _masked(loss_mat, loss_mask).sum(dim=-1)
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
        return (seq_sums / _nonzero(seq_tokens)).sum() / sequences * dp_size
    loss = seq_sums.sum() / sequences * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
    return loss


# -------------------------------------------------------------------------------------------------- KL
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL to the reference as a reward penalty (verl's ``algorithm.use_kl_in_reward``), not as a loss.

    ``rewards = scores - kl_coef * KL`` per response token (``[B, R]``, zero outside ``response_mask``);
    metric ``kl`` is the masked mean KL. No gradient flows: rewards are data for the advantage estimator.
    """
    mask = response_mask.to(torch.bool)
    _check_shapes(
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
    return rewards, {"kl": _masked_mean(kl, mask), "kl_coef": float(kl_coef)}


# ---------------------------------------------------------------------------------------- policy losses
_POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}
POLICY_LOSSES: Mapping[str, PolicyLossFn] = MappingProxyType(_POLICY_LOSS_REGISTRY)
"""Read-only view of the registered policy losses (name -> function)."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` so ``config.policy_loss.loss_mode`` can select it.

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


def _clip_range(config: Any, *, loss: str) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high), each falling back to clip_ratio when None (verl's rule)."""
    low = _config_value(config, "clip_ratio_low", loss=loss, default=None)
    high = _config_value(config, "clip_ratio_high", loss=loss, default=None)
    if low is None or high is None:
        clip_ratio = _config_value(config, "clip_ratio", loss=loss)
        low = clip_ratio if low is None else low
        high = clip_ratio if high is None else high
    return float(low), float(high)


def _log_ratio(*, log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) clamped to +-20 as verl does, so exp() cannot overflow."""
    return torch.clamp(log_prob - old_log_prob, min=-_RATIO_LOG_CLAMP, max=_RATIO_LOG_CLAMP)


def _weighted(losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token loss times the rollout-correction importance weights when given."""
    return losses if rollout_is_weights is None else losses * rollout_is_weights


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    agg_kwargs: Mapping[str, Any],
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip (verl's ``compute_policy_loss_vanilla``, same formulas).

    Why dual clip: for A < 0 the plain PPO loss ``-A * r`` grows without bound in r; capping it at
    ``-A * clip_ratio_c`` keeps stale, very unlikely tokens from dominating the update.
    """
    name = "vanilla policy loss"
    low, high = _clip_range(config, loss=name)
    clip_ratio_c = float(_config_value(config, "clip_ratio_c", loss=name, default=3.0))
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1; got {clip_ratio_c}")
    log_ratio = _log_ratio(log_prob=log_prob, old_log_prob=old_log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    ppo = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(ppo, dual_bound), ppo)
    pg_loss = agg_loss(
        loss_mat=_weighted(losses, rollout_is_weights),
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        **agg_kwargs,
    )
    metrics = {
        "pg_clipfrac": _masked_mean((clipped > unclipped).double(), response_mask),
        "pg_clipfrac_lower": _masked_mean(((ppo > dual_bound) & (advantages < 0)).double(), response_mask),
        "ppo_kl": _masked_mean(-log_ratio, response_mask),
    }
    return pg_loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    agg_kwargs: Mapping[str, Any],
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (https://arxiv.org/abs/2507.18071): PPO clip on the sequence-level ratio, per token.

    The token ratio ``exp(logp - sg(logp) + sg(log s_i))`` has the value of the sequence ratio
    ``s_i = exp(mean_t(logp - old))`` but the gradient of the token's own log-prob. As in verl, the
    aggregation is always ``seq-mean-token-mean`` (``loss_agg_mode`` is ignored), the log ratio is
    clamped from above at 10 and not clamped at +-20, and ``pg_clipfrac_lower`` is 0.
    """
    low, high = _clip_range(config, loss="gspo policy loss")
    log_ratio = log_prob - old_log_prob
    seq_tokens = response_mask.to(log_ratio.dtype).sum(dim=-1).clamp(min=1.0)
    seq_log_ratio = _masked(log_ratio, response_mask).sum(dim=-1) / seq_tokens
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_seq_ratio, max=_GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)
    pg_loss = agg_loss(
        loss_mat=_weighted(losses, rollout_is_weights),
        loss_mask=response_mask,
        loss_agg_mode="seq-mean-token-mean",
        **agg_kwargs,
    )
    metrics = {
        "pg_clipfrac": _masked_mean((clipped > unclipped).double(), response_mask),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _masked_mean(-log_ratio, response_mask),
    }
    return pg_loss, metrics


@register_policy_loss("gpg")
def gpg_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    agg_kwargs: Mapping[str, Any],
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG: plain policy gradient ``-logp * A`` (no ratio, no clip); old log-probs only feed ``ppo_kl``."""
    losses = -log_prob * advantages
    pg_loss = agg_loss(
        loss_mat=_weighted(losses, rollout_is_weights),
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        **agg_kwargs,
    )
    log_ratio = _log_ratio(log_prob=log_prob, old_log_prob=old_log_prob)
    metrics = {
        "pg_clipfrac": 0.0,
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _masked_mean(-log_ratio, response_mask),
    }
    return pg_loss, metrics


@register_policy_loss("sapo")
def sapo_policy_loss(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    agg_kwargs: Mapping[str, Any],
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (https://arxiv.org/abs/2511.20347): a smooth sigmoid gate instead of the hard PPO clip.

    Loss ``-(4/tau) * sigmoid(tau * (r - 1)) * A`` with ``tau = tau_pos`` where A > 0 else ``tau_neg``;
    its gradient at r = 1 equals the unclipped PPO gradient and fades away from it. As in verl the
    aggregation is always ``seq-mean-token-mean`` (``loss_agg_mode`` is ignored) and both clip fractions
    are 0.
    """
    name = "sapo policy loss"
    tau_pos = float(_config_value(config, "tau_pos", loss=name))
    tau_neg = float(_config_value(config, "tau_neg", loss=name))
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo needs tau_pos > 0 and tau_neg > 0; got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio = _log_ratio(log_prob=log_prob, old_log_prob=old_log_prob)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.tensor(tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_loss = agg_loss(
        loss_mat=_weighted(-gate * advantages, rollout_is_weights),
        loss_mask=response_mask,
        loss_agg_mode="seq-mean-token-mean",
        **agg_kwargs,
    )
    metrics = {
        "pg_clipfrac": 0.0,
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _masked_mean(-log_ratio, response_mask),
    }
    return pg_loss, metrics


# ---------------------------------------------------------------------------------- engine loss functions
def _loss_mode(config: Any) -> str:
    """``config.policy_loss.loss_mode`` (object or dict); verl's default ``vanilla`` when unset."""
    policy_loss = _config_value(config, "policy_loss", loss="ppo_loss", default=None)
    if policy_loss is None:
        return "vanilla"
    return str(_config_value(policy_loss, "loss_mode", loss="ppo_loss", default="vanilla"))


def ppo_loss(
    *, config: Any, model_output: Mapping[str, Any], data: Mapping[str, Any], dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Actor loss: registered policy loss - entropy_coeff * entropy + kl_loss_coef * KL(pi || pi_ref).

    ``config`` is verl's actor config (``loss_agg_mode``, ``entropy_coeff``, ``use_kl_loss``,
    ``kl_loss_coef``, ``kl_loss_type``, ``policy_loss.loss_mode`` and the policy loss's own keys); bind it
    with ``functools.partial(ppo_loss, config=cfg)``. Metrics: ``pg_loss`` and the policy loss's own
    (``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` for the built-ins), ``entropy`` when the model
    returned it, ``kl_loss`` and ``kl_coef`` when ``use_kl_loss``.
    """
    del dp_group  # the global counts in `data` make the normalisation local
    name = "ppo_loss"
    mask = _required_tensor(data, "response_mask", loss=name, where="data")
    log_prob = _required_tensor(model_output, "log_probs", loss=name, where="model_output")
    old_log_prob = _required_tensor(data, "old_log_probs", loss=name, where="data")
    advantages = _required_tensor(data, "advantages", loss=name, where="data")
    weights = _optional_tensor(data, "rollout_is_weights")
    entropy = _optional_tensor(model_output, "entropy")
    loss_agg_mode = _config_value(config, "loss_agg_mode", loss=name)
    entropy_coeff = float(_config_value(config, "entropy_coeff", loss=name))
    use_kl_loss = bool(_config_value(config, "use_kl_loss", loss=name))
    if entropy_coeff != 0 and entropy is None:
        raise ValueError(
            f"{name} needs model_output['entropy'] because config.entropy_coeff={entropy_coeff} != 0; "
            "compute the entropy in the forward pass or set entropy_coeff=0"
        )
    ref_log_prob = _required_tensor(data, "ref_log_prob", loss=name, where="data") if use_kl_loss else None
    named = {
        "model_output['log_probs']": log_prob,
        "data['old_log_probs']": old_log_prob,
        "data['advantages']": advantages,
        "model_output['entropy']": entropy,
        "data['ref_log_prob']": ref_log_prob,
        "data['rollout_is_weights']": weights,
    }
    _check_shapes(loss=name, mask=mask, tensors={k: v for k, v in named.items() if v is not None})
    agg_kwargs = _global_batch_info(data, loss=name, config=config)
    mask = mask.bool()

    pg_loss, pg_metrics = get_policy_loss_fn(_loss_mode(config))(
        old_log_prob=_masked(old_log_prob, mask),
        log_prob=_masked(log_prob, mask),
        advantages=_masked(advantages, mask),
        response_mask=mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        agg_kwargs=agg_kwargs,
        rollout_is_weights=None if weights is None else _masked(weights, mask),
    )
    metrics: dict[str, float] = {**pg_metrics, "pg_loss": float(pg_loss.detach())}
    loss = pg_loss
    if entropy is not None:
        entropy_loss = agg_loss(
            loss_mat=_masked(entropy, mask), loss_mask=mask, loss_agg_mode=loss_agg_mode, **agg_kwargs
        )
        metrics["entropy"] = float(entropy_loss.detach())
        if entropy_coeff != 0:
            loss = loss - entropy_coeff * entropy_loss
    if ref_log_prob is not None:
        kl_coef = float(_config_value(config, "kl_loss_coef", loss=name))
        kld = kl_penalty(
            log_prob=_masked(log_prob, mask),
            ref_log_prob=_masked(ref_log_prob, mask),
            kl_penalty=_config_value(config, "kl_loss_type", loss=name),
        )
        kl_loss = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=loss_agg_mode, **agg_kwargs)
        loss = loss + kl_coef * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach())
        metrics["kl_coef"] = kl_coef
    return loss, metrics


def value_loss(
    *, config: Any, model_output: Mapping[str, Any], data: Mapping[str, Any], dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic loss: 0.5 * agg(max((vpred - R)^2, (vclip - R)^2)), vclip = vpred kept within v_old +- c.

    Why the clip: like PPO's ratio clip, it keeps one update from moving the value far from the value
    the advantages were computed with. ``config`` needs ``cliprange_value`` and ``loss_agg_mode`` (verl's
    critic config). Metrics: ``vf_loss`` (this micro-batch's share), ``vf_clipfrac``, ``vpred_mean``.
    """
    del dp_group  # the global counts in `data` make the normalisation local
    name = "value_loss"
    mask = _required_tensor(data, "response_mask", loss=name, where="data")
    vpred = _required_tensor(model_output, "values", loss=name, where="model_output")
    old_values = _required_tensor(data, "values", loss=name, where="data")
    returns = _required_tensor(data, "returns", loss=name, where="data")
    cliprange = float(_config_value(config, "cliprange_value", loss=name))
    loss_agg_mode = _config_value(config, "loss_agg_mode", loss=name)
    named = {"model_output['values']": vpred, "data['values']": old_values, "data['returns']": returns}
    _check_shapes(loss=name, mask=mask, tensors=named)
    agg_kwargs = _global_batch_info(data, loss=name, config=config)
    mask = mask.bool()
    vpred, old_values, returns = (_masked(t, mask) for t in (vpred, old_values, returns))

    vclip = torch.maximum(torch.minimum(vpred, old_values + cliprange), old_values - cliprange)
    unclipped = (vpred - returns).square()
    clipped = (vclip - returns).square()
    loss = 0.5 * agg_loss(
        loss_mat=torch.maximum(unclipped, clipped), loss_mask=mask, loss_agg_mode=loss_agg_mode, **agg_kwargs
    )
    metrics = {
        "vf_loss": float(loss.detach()),
        "vf_clipfrac": _masked_mean((clipped > unclipped).double(), mask),
        "vpred_mean": _masked_mean(vpred, mask),
    }
    return loss, metrics


def sft_loss(
    *, config: Any = None, model_output: Mapping[str, Any], data: Mapping[str, Any], dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised fine-tuning: mean negative log-likelihood of the response tokens over the global batch.

    Needs ``data['dp_size']`` and ``data['batch_num_tokens']`` (token-mean); ``config`` is unused.
    """
    del config, dp_group
    name = "sft_loss"
    mask = _required_tensor(data, "response_mask", loss=name, where="data")
    log_prob = _required_tensor(model_output, "log_probs", loss=name, where="model_output")
    _check_shapes(loss=name, mask=mask, tensors={"model_output['log_probs']": log_prob})
    dp_size = int(_scalar(data, "dp_size", loss=name, required=True))
    batch_num_tokens = _scalar(data, "batch_num_tokens", loss=name, required=True)
    mask = mask.bool()
    nll = agg_loss(
        loss_mat=_masked(log_prob, mask),
        loss_mask=mask,
        loss_agg_mode="token-mean",
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
    )
    return -nll, {}
