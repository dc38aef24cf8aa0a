"""Settings that are valid verl but that this engine does not implement: refused when an engine is built.

Why at build time: verl-config accepts every setting verl accepts (a config that is valid verl stays valid), but an
engine that silently ignored one would train something else than the user asked for. So the builder checks the
role's section before any model is built and names the key, its value and what is supported instead.
"""

from __future__ import annotations

from typing import Any

from verl_engine.loss_binding import loss_config

__all__ = ["NOT_IMPLEMENTED_POLICY_LOSSES", "check_supported"]

# verl 0.9.1's registered policy losses that verl-engine does not implement, and why (none: every one is)
NOT_IMPLEMENTED_POLICY_LOSSES: dict[str, str] = {}


def check_supported(cfg: Any, *, role: str) -> None:
    """Raise ValueError naming every setting of ``role``'s sections that is valid verl but not implemented here.

    The refused keys and what is supported instead: :data:`verl_engine.config_support.RULES`; for the actor, also
    the loss as verl's trainer configures it (:func:`~verl_engine.loss_binding.loss_config`): a ``loss_mode`` that
    nobody registered, and ``bypass_mode`` with ``algorithm.rollout_correction``.
    """
    from verl_engine.config_support import refusal_problems
    from verl_engine.losses import POLICY_LOSSES, bypass_mode_policy_loss

    problems = refusal_problems(cfg, role=role)
    if role == "actor":
        policy = loss_config(cfg, role="actor").policy_loss
        if policy.loss_mode not in POLICY_LOSSES:
            problems.insert(0, f"{_LOSS_MODE}={policy.loss_mode!r} {_policy_loss(policy.loss_mode)}")
        elif policy.loss_mode == "bypass_mode" and POLICY_LOSSES["bypass_mode"] is bypass_mode_policy_loss:
            problems += _bypass_mode(policy)
    if problems:
        raise ValueError(f"verl-engine cannot build the {role}: " + "; ".join(problems))


_LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"


def _policy_loss(mode: Any) -> str:
    from verl_engine.losses import POLICY_LOSSES

    implemented = ", ".join(sorted(POLICY_LOSSES))
    why = NOT_IMPLEMENTED_POLICY_LOSSES.get(mode)
    what = (
        f"is valid verl but not implemented by verl-engine: {why}"
        if why
        else "is not a registered policy loss"
    )
    return (
        f"{what}; implemented: {implemented} (or register your own with"
        " verl_engine.losses.register_policy_loss before building the engine)"
    )


def _bypass_mode(policy: Any) -> list[str]:
    """bypass_mode needs algorithm.rollout_correction (parsed here, so a bad spec fails before any model) and must
    not depend on the micro-batching."""
    from verl_engine.losses import RolloutCorrection

    key = "algorithm.rollout_correction"
    section = getattr(policy, "rollout_correction", None)
    if section is None:
        return [
            "actor_rollout_ref.actor.policy_loss.loss_mode='bypass_mode' without"
            f" {key}.bypass_mode=true is valid verl but not implemented by verl-engine: verl's trainer then"
            " recomputes the old log-probs and its loss reads PolicyLossConfig's default rollout_correction, not"
            f" {key}; set {key}.bypass_mode=true, which selects this loss, the rollout's log-probs and {key}"
        ]
    try:
        settings = RolloutCorrection.from_config(section)
    except ValueError as error:
        return [str(error)]
    if settings.loss_type == "reinforce" and settings.is_level is not None and settings.is_batch_normalize:
        return [
            f"{key}.rollout_is_batch_normalize=true with bypass_mode=true and loss_type='reinforce' is valid verl"
            " but not implemented by verl-engine: verl divides the importance weights by their mean over each"
            " micro-batch inside the loss, so a step would depend on the micro-batching; set"
            " rollout_is_batch_normalize=false (or loss_type='ppo_clip', where the weights only feed metrics)"
        ]
    return []
