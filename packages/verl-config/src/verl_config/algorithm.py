"""The ``algorithm`` section and verl's registries of estimators, policy losses and KL estimators.

verl looks estimators and policy losses up in registries that user code can extend, so an unknown
name there is a note, not an error.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from verl_config.errors import ConfigValueError
from verl_config.notes import adjusting, note
from verl_config.validation import check_choice, check_unit_interval

__all__ = [
    "ADV_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "AlgorithmConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "RolloutCorrectionConfig",
    "check_kl_type",
    "registry_note",
]

# verl's built-in advantage estimators (verl/trainer/ppo/core_algos.py AdvantageEstimator). verl
# looks names up in a registry that user code can extend, so an unknown name is a note, not an error.
ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "opo",
    "grpo_passk",
    "gpg",
    "rloo_vectorized",
    "grpo_vectorized",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
)
# verl's registered policy losses (register_policy_loss); extendable like the estimators.
POLICY_LOSS_MODES = (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
)
# Estimators that compare several responses to the same prompt: meaningless with rollout.n == 1.
GROUP_ESTIMATORS = (
    "grpo",
    "rloo",
    "opo",
    "gpg",
    "grpo_passk",
    "reinforce_plus_plus_baseline",
    "rloo_vectorized",
    "grpo_vectorized",
)
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# KL estimators of verl's kl_penalty; a trailing '+' selects the straight-through k2 gradient.
_KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def check_kl_type(key: str, value: str) -> None:
    """A KL estimator name as verl's kl_penalty takes it (``low_var_kl``, ``k3+`` ...)."""
    check_choice(key, value[:-1] if isinstance(value, str) and value.endswith("+") else value, _KL_TYPES)


def registry_note(key: str, value: str, known: tuple[str, ...]) -> None:
    """An unknown name of an extensible verl registry: accepted (user code may register it), noted."""
    if isinstance(value, str) and "${" not in value and value not in known and adjusting():
        close = difflib.get_close_matches(value, known, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        note(
            key,
            f"{value!r} is not one of verl's built-ins ({', '.join(known)}); {guess}"
            "it must be registered by your code",
        )


@dataclass
class KLControlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1

    def __post_init__(self) -> None:
        check_choice("type", self.type, ("fixed", "adaptive"))


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (``algorithm.filter_groups``): drop groups whose ``metric`` does not vary."""

    enable: bool = False
    metric: str | None = "reward"
    max_num_gen_batches: int = 0
    max_inflight_gen_batches: int = 1

    def __post_init__(self) -> None:
        if self.enable and self.metric is None:
            raise ConfigValueError(
                "metric", "is null but enable is true; name the metric groups are filtered on (e.g. acc)"
            )


def _threshold_bounds(key: str, spec: Any) -> tuple[float | None, float]:
    """(lower, upper) of one threshold: a number (upper bound) or a ``"lower_upper"`` string such as ``"0.5_4.0"``."""
    form = 'a positive number (upper bound) or a "lower_upper" string such as "0.5_4.0"'
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ConfigValueError(key, f"must be {form}; got {spec!r}")
    text = str(spec).strip()
    lower_text, sep, upper_text = text.partition("_")
    try:
        lower, upper = (float(lower_text), float(upper_text)) if sep else (None, float(text))
    except ValueError:
        raise ConfigValueError(key, f"must be {form}; got {spec!r}") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ConfigValueError(key, f"bounds must be positive; got {spec!r}")
    if lower is not None and lower > upper:
        raise ConfigValueError(key, f'lower bound above the upper one in {spec!r}; write it as "lower_upper"')
    return lower, upper


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between rollout and training log-probs (``algorithm.rollout_correction``).

    ``rollout_is_threshold`` is a number (truncated IS: clamp weights to it) or ``"lower_upper"`` (IcePop:
    zero weights outside the range). ``rollout_rs`` may list several rejection options separated by commas;
    ``rollout_rs_threshold`` then gives one threshold for all or one per option, each a number or
    ``"lower_upper"``.
    """

    rollout_is: str | None = None
    rollout_is_threshold: Any = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    rollout_is_batch_normalize: bool = False

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, ("ppo_clip", "reinforce"))
        if self.rollout_is is not None:
            check_choice("rollout_is", self.rollout_is, ("token", "sequence"))
        _threshold_bounds("rollout_is_threshold", self.rollout_is_threshold)
        if self.rollout_rs_threshold is not None:
            specs = [part.strip() for part in str(self.rollout_rs_threshold).split(",") if part.strip()]
            if not specs:
                raise ConfigValueError(
                    "rollout_rs_threshold", "is empty; give one threshold or one per rollout_rs option"
                )
            for spec in specs:
                _threshold_bounds(
                    "rollout_rs_threshold",
                    spec if isinstance(self.rollout_rs_threshold, str) else self.rollout_rs_threshold,
                )
            options = [o.strip() for o in (self.rollout_rs or "").split(",") if o.strip()]
            if options and len(specs) not in (1, len(options)):
                raise ConfigValueError(
                    "rollout_rs_threshold",
                    f"has {len(specs)} thresholds for {len(options)} rollout_rs options ({self.rollout_rs});"
                    " give one threshold for all or exactly one per option",
                )
        elif self.rollout_rs is not None:
            raise ConfigValueError(
                "rollout_rs_threshold",
                f"is null but rollout_rs is {self.rollout_rs!r}; rejection sampling needs a threshold",
            )


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    use_pf_ppo: bool = False
    pf_ppo: dict[str, Any] = field(default_factory=lambda: {"reweight_method": "pow", "weight_pow": 2.0})
    filter_groups: FilterGroupsConfig | None = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig | None = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        registry_note("adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        check_kl_type("kl_penalty", self.kl_penalty)
        for key in ("gamma", "lam"):
            check_unit_interval(key, getattr(self, key))
        method = (self.pf_ppo or {}).get("reweight_method")
        if method is not None:
            check_choice("pf_ppo.reweight_method", method, ("pow", "max_min", "max_random"))
