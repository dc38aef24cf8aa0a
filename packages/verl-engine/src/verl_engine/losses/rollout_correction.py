"""Rollout correction (verl 0.9.1's ``algorithm.rollout_correction``): importance weights and rejection sampling.

Why: the rollout engine samples with other kernels, precision or an older checkpoint than the trainer, so the
tokens come from pi_rollout while the loss wants pi_train. Importance weights ``pi_train / pi_rollout`` correct
the gradient's expectation; rejection drops the tokens or sequences whose divergence says the sample is useless.
Everything is computed from ``log_ratio = log pi_train - log pi_rollout`` of each sequence alone (only
``rollout_is_batch_normalize`` looks at the whole tensor), in verl's definitions: the same thresholds, the
same clamps, the same metrics' names. Means divide by exact counts (verl adds 1e-8 to an integer count of a bool
mask, which float32 rounds away). Nothing here reads a value on the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verl_engine.losses.common import config_value, masked, masked_mean
from verl_engine.metrics import Metric

__all__ = [
    "IS_LEVELS",
    "LOSS_TYPES",
    "REJECTION_OPTIONS",
    "RejectionCriterion",
    "RolloutCorrection",
    "importance_weights",
    "parse_is_threshold",
    "parse_rejection",
    "rejection_mask",
    "rollout_correction",
]

KEY = "algorithm.rollout_correction"
_SAFETY_BOUND = 20.0  # verl clamps every log ratio to +-20 before exp(): weights stay within e^20
_PREFIX = "rollout_corr/"

IS_LEVELS: tuple[str, ...] = ("token", "sequence")
"""``rollout_is``: one weight per token, or per sequence (the product of its tokens' ratios)."""

LOSS_TYPES: tuple[str, ...] = ("ppo_clip", "reinforce")
"""``loss_type`` of the ``bypass_mode`` policy loss."""

REJECTION_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""``rollout_rs`` options (verl's): a divergence estimator ``k1 = -log r``, ``k2 = (log r)^2 / 2`` or
``k3 = r - 1 - log r`` per token, or its sum / mean / max over the sequence."""

_IS_FORM = (
    'a positive number (truncated IS: weights clamped to it) or a "lower_upper" string such as "0.5_2.0"'
)
_RS_FORM = (
    'one threshold for all options or one per option, comma-separated: for a *_k1 option a "lower_upper" ratio'
    ' range such as "0.5_2.0" (or one number u >= 1 for the range 1/u..u), for the others one positive upper bound'
)


@dataclass(frozen=True, kw_only=True)
class RejectionCriterion:
    """One ``rollout_rs`` option and its bounds: ``lower`` (``*_k1`` options only) and ``upper``."""

    option: str
    upper: float
    lower: float | None = None


@dataclass(frozen=True, kw_only=True)
class RolloutCorrection:
    """The parsed ``rollout_correction`` section: :meth:`from_config` checks every key once.

    ``is_level`` None: no importance weights (verl also computes none when ``rollout_is_threshold`` is null).
    ``is_lower`` None: truncated IS (TIS, weights clamped to ``is_upper``); else IcePop (weights outside
    ``[is_lower, is_upper]`` zeroed). ``rejection``: every criterion must pass for a token to stay.
    """

    is_level: str | None = None
    is_upper: float = 2.0
    is_lower: float | None = None
    is_batch_normalize: bool = False
    rejection: tuple[RejectionCriterion, ...] = ()
    loss_type: str = "ppo_clip"

    @classmethod
    def from_config(cls, section: Any) -> RolloutCorrection:
        """From verl's ``RolloutCorrectionConfig`` (dataclass, DictConfig or dict), with verl's defaults."""

        def get(key: str, default: Any) -> Any:
            return config_value(section, key, loss="rollout correction", default=default)

        loss_type = get("loss_type", "ppo_clip")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"{KEY}.loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
        level, threshold = get("rollout_is", None), get("rollout_is_threshold", 2.0)
        if level is not None and level not in IS_LEVELS:
            raise ValueError(
                f"{KEY}.rollout_is must be null (no importance weights) or one of {', '.join(IS_LEVELS)};"
                f" got {level!r}"
            )
        lower, upper = (None, 2.0) if threshold is None else parse_is_threshold(threshold)
        return cls(
            is_level=level if threshold is not None else None,
            is_upper=upper,
            is_lower=lower,
            is_batch_normalize=bool(get("rollout_is_batch_normalize", False)),
            rejection=parse_rejection(get("rollout_rs", None), get("rollout_rs_threshold", None)),
            loss_type=loss_type,
        )


def _number(spec: Any, *, key: str, form: str) -> float:
    try:
        return float(spec)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be {form}; got {spec!r}") from None


def _bounds(spec: str, *, key: str, form: str) -> tuple[float, float]:
    """``"lower_upper"`` -> (lower, upper), both positive and ordered."""
    lower_text, _, upper_text = spec.partition("_")
    lower, upper = _number(lower_text, key=key, form=form), _number(upper_text, key=key, form=form)
    if not (lower > 0 and upper > 0):
        raise ValueError(f"{key}: both bounds must be positive; got {spec!r} ({form})")
    if lower > upper:
        raise ValueError(f'{key}: the lower bound is above the upper one in {spec!r}; write "lower_upper"')
    return lower, upper


def parse_is_threshold(spec: Any) -> tuple[float | None, float]:
    """``rollout_is_threshold`` -> (lower, upper): a number (lower None: TIS) or ``"lower_upper"`` (IcePop)."""
    key = f"{KEY}.rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"{key} must be {_IS_FORM}; got {spec!r}")
    text = str(spec).strip()
    if "_" in text:
        return _bounds(text, key=key, form=_IS_FORM)
    upper = _number(text, key=key, form=_IS_FORM)
    if not upper > 0:
        raise ValueError(f"{key} must be {_IS_FORM}; got {spec!r}")
    return None, upper


def parse_rejection(options: Any, thresholds: Any) -> tuple[RejectionCriterion, ...]:
    """``rollout_rs`` (comma-separated options, repeats dropped) and ``rollout_rs_threshold`` -> criteria.

    verl's grammar: one threshold shared by every option or exactly one per option; a ``*_k1`` option takes
    ``"lower_upper"`` or one number ``u`` (then ``lower = 1/u``), the others one upper bound. None: no rejection.
    """
    if options is None:
        return ()
    rs_key, th_key = f"{KEY}.rollout_rs", f"{KEY}.rollout_rs_threshold"
    valid = ", ".join(REJECTION_OPTIONS)
    if not isinstance(options, str):
        raise ValueError(
            f"{rs_key} must be null or a comma-separated string of options ({valid}); got {options!r}"
        )
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))
    if not names:
        raise ValueError(f"{rs_key} names no option; give one or more of {valid}, comma-separated")
    unknown = [name for name in names if name not in REJECTION_OPTIONS]
    if unknown:
        raise ValueError(f"{rs_key} has unknown option(s) {', '.join(unknown)}; valid: {valid}")
    if thresholds is None:
        raise ValueError(f"{th_key} is null but {rs_key}={options!r}: rejection sampling needs {_RS_FORM}")
    if isinstance(thresholds, bool) or not isinstance(thresholds, int | float | str):
        raise ValueError(f"{th_key} must be {_RS_FORM}; got {thresholds!r}")
    specs = [part.strip() for part in str(thresholds).split(",") if part.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"{th_key}={thresholds!r} gives {len(specs)} thresholds for {len(names)} {rs_key} options"
            f" ({', '.join(names)}): {_RS_FORM}"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_criterion(name, spec, key=th_key) for name, spec in zip(names, specs, strict=True))


def _criterion(option: str, spec: str, *, key: str) -> RejectionCriterion:
    where = f"{key} (option {option})"
    if option.endswith("k1"):
        if "_" in spec:
            lower, upper = _bounds(spec, key=where, form=_RS_FORM)
            return RejectionCriterion(option=option, lower=lower, upper=upper)
        upper = _number(spec, key=where, form=_RS_FORM)
        if not upper >= 1:
            raise ValueError(
                f"{where}: one number u means the ratio range 1/u..u, so it must be >= 1; got {spec!r}"
                f" ({_RS_FORM})"
            )
        return RejectionCriterion(option=option, lower=1.0 / upper, upper=upper)
    if "_" in spec:
        raise ValueError(f"{where} takes one upper bound, not a range; got {spec!r} ({_RS_FORM})")
    upper = _number(spec, key=where, form=_RS_FORM)
    if not upper > 0:
        raise ValueError(f"{where} must be positive; got {spec!r} ({_RS_FORM})")
    return RejectionCriterion(option=option, upper=upper)


def _safe(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_ratio, min=-_SAFETY_BOUND, max=_SAFETY_BOUND)


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """Max (or min) of ``values`` over the mask as a float64 0-dim tensor; 0 for an empty mask."""
    fill = float("-inf") if largest else float("inf")
    filled = values.detach().double().masked_fill(~mask, fill)
    extreme = filled.max() if largest else filled.min()
    return torch.where(mask.any(), extreme, 0.0)


def _row_mean(values: torch.Tensor) -> torch.Tensor:
    return values.detach().double().mean()


def importance_weights(
    *,
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None = None,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Detached importance weights ``[B, R]`` (0 on padding) and their metrics (verl's
    ``compute_rollout_correction_weights``).

    ``level`` token: ``exp(log r)`` per token; sequence: ``exp(sum_t log r)`` on every token of the sequence,
    both with ``log r`` clamped to +-20. ``lower`` None: truncated to ``upper`` (TIS); else zeroed outside
    ``[lower, upper]`` (IcePop). ``batch_normalize``: divided by their mean over the valid tokens (token) or
    the non-empty sequences (sequence) of *this call's* tensors, when that mean is above 1e-8; metrics are
    of the weights before it. verl's metrics: ``rollout_is_mean`` / ``_max`` / ``_min``,
    ``rollout_is_ratio_fraction_high`` / ``_low`` (raw weights outside the bounds, ``1/upper`` as the lower
    one for TIS), ``rollout_is_oob_ratio`` (IcePop), ``rollout_is_batch_norm_factor`` (normalised).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"{KEY}.rollout_is must be one of {', '.join(IS_LEVELS)}; got {level!r}")
    mask = response_mask.bool()
    dtype_mask = mask.to(log_ratio.dtype)
    seq_log_ratio = masked(log_ratio, mask).sum(dim=-1, keepdim=True)
    if level == "token":
        raw = torch.exp(_safe(masked(log_ratio, mask))) * dtype_mask
    else:
        raw = torch.exp(_safe(seq_log_ratio)).expand_as(log_ratio) * dtype_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    weights = weights.detach()
    low_bound = 1.0 / upper if lower is None else lower
    metrics = {"rollout_is_mean": masked_mean(weights, mask)}
    if level == "token":
        metrics["rollout_is_max"] = _masked_extreme(weights, mask, largest=True)
        metrics["rollout_is_min"] = _masked_extreme(weights, mask, largest=False)
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).double(), mask)
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw < low_bound).double(), mask)
    else:  # verl: of every row's unclamped sum, empty rows (sum 0, weight 1) included
        seq = seq_log_ratio.detach().double()
        metrics["rollout_is_max"] = torch.exp(torch.clamp(seq.max(), max=_SAFETY_BOUND))
        metrics["rollout_is_min"] = torch.exp(seq.min())
        metrics["rollout_is_ratio_fraction_high"] = _row_mean(seq > math.log(upper))
        metrics["rollout_is_ratio_fraction_low"] = _row_mean(seq < math.log(low_bound))
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).double(), mask)
    if batch_normalize:
        mean = _weights_mean(weights, mask, level=level)
        normalise = mean > 1e-8
        weights = torch.where(normalise, weights / mean, weights)
        metrics["rollout_is_batch_norm_factor"] = torch.where(normalise, mean.double(), 1.0)
    return weights, {_PREFIX + name: Metric(value) for name, value in metrics.items()}


def _weights_mean(weights: torch.Tensor, mask: torch.Tensor, *, level: str) -> torch.Tensor:
    """Mean weight over valid tokens (token) or over non-empty sequences (sequence); 0 when there are none."""
    if level == "token":
        return masked(weights, mask).sum() / mask.sum().clamp(min=1)
    tokens = mask.sum(dim=-1)
    seq_weights = masked(weights, mask).sum(dim=-1) / tokens.clamp(min=1)
    valid = tokens > 0
    return masked(seq_weights, valid).sum() / valid.sum().clamp(min=1)


def rejection_mask(
    *, log_ratio: torch.Tensor, response_mask: torch.Tensor, criteria: tuple[RejectionCriterion, ...]
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """The response mask without the rejected tokens (bool ``[B, R]``) and verl's rejection metrics.

    Per option (verl's compute_rollout_rejection_mask; ``log r`` clamped to +-20): ``token_*`` keeps a token
    whose own estimator passes; ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*`` keep or reject a whole sequence
    by the sum / mean / max of its valid tokens' estimator (an empty sequence's statistic is 0). ``k2`` / ``k3``
    pass at or below ``upper``; ``k1`` (``-log r``) passes within ``[log(lower), log(upper)]``: the ratio range
    bounds ``pi_rollout / pi_train``. A token stays when every option passes. Metrics:
    ``rollout_rs_<option>_masked_fraction`` (of valid tokens), ``rollout_rs_<option>_seq_masked_fraction`` (of
    non-empty sequences), and over all options ``rollout_rs_masked_fraction`` and
    ``rollout_rs_seq_masked_fraction`` (of all rows, as verl counts it).
    """
    mask = response_mask.bool()
    if not criteria:
        return mask, {}
    safe = _safe(masked(log_ratio, mask))
    estimators = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    tokens = mask.sum(dim=-1)
    valid_rows = tokens > 0
    keep_all = torch.ones_like(mask)
    metrics: dict[str, torch.Tensor] = {}
    for criterion in criteria:
        keep = _passes(criterion, estimators, mask=mask, tokens=tokens)
        keep_all = keep_all & keep
        rejected_row = (~keep & mask).any(dim=-1)
        name = f"rollout_rs_{criterion.option}"
        metrics[f"{name}_masked_fraction"] = masked_mean((~keep).double(), mask)
        metrics[f"{name}_seq_masked_fraction"] = (
            rejected_row & valid_rows
        ).sum().double() / valid_rows.sum().clamp(min=1)
    metrics["rollout_rs_masked_fraction"] = masked_mean((~keep_all).double(), mask)
    metrics["rollout_rs_seq_masked_fraction"] = _row_mean((~keep_all & mask).any(dim=-1))
    return mask & keep_all, {_PREFIX + name: Metric(value) for name, value in metrics.items()}


def _passes(
    criterion: RejectionCriterion,
    estimators: Mapping[str, torch.Tensor],
    *,
    mask: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """Where ``criterion`` keeps the token (bool ``[B, R]``; a sequence criterion broadcast over its row)."""
    scope, _, estimator = criterion.option.rpartition("_")
    values = estimators[estimator]
    if scope == "token":
        stat = values
    elif scope == "seq_max":
        largest = values.masked_fill(~mask, float("-inf")).max(dim=-1, keepdim=True).values
        stat = torch.where(tokens[:, None] > 0, largest, 0.0)
    else:
        total = masked(values, mask).sum(dim=-1, keepdim=True)
        stat = total if scope == "seq_sum" else total / tokens[:, None].clamp(min=1)
    if criterion.lower is None:
        keep = stat <= criterion.upper
    else:
        keep = (stat >= math.log(criterion.lower)) & (stat <= math.log(criterion.upper))
    return keep.expand_as(mask)


def rollout_correction(
    *, log_ratio: torch.Tensor, response_mask: torch.Tensor, settings: RolloutCorrection
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, Metric]]:
    """(importance weights or None, the mask after rejection, metrics) for ``log_ratio = log pi_train - log
    pi_rollout`` (verl's compute_rollout_correction_and_rejection_mask).

    The weights are computed on the full response mask, the rejection does not change them. Metrics: those of
    :func:`importance_weights` and :func:`rejection_mask`, plus ``rollout_corr/kl`` (mean ``-log r``) and
    ``rollout_corr/k3_kl`` (mean ``r - 1 - log r``, unclamped) over the valid tokens.
    """
    log_ratio = log_ratio.detach()
    metrics: dict[str, Metric]
    weights, metrics = None, {}
    if settings.is_level is not None:
        weights, metrics = importance_weights(
            log_ratio=log_ratio,
            response_mask=response_mask,
            level=settings.is_level,
            upper=settings.is_upper,
            lower=settings.is_lower,
            batch_normalize=settings.is_batch_normalize,
        )
    keep, rs_metrics = rejection_mask(
        log_ratio=log_ratio, response_mask=response_mask, criteria=settings.rejection
    )
    metrics.update(rs_metrics)
    mask = response_mask.bool()
    safe_ratio = masked(log_ratio, mask)
    metrics[_PREFIX + "kl"] = Metric(masked_mean(-safe_ratio, mask))
    metrics[_PREFIX + "k3_kl"] = Metric(masked_mean(torch.exp(safe_ratio) - safe_ratio - 1.0, mask))
    return weights, keep, metrics
