"""Settings that are valid verl but that this engine does not implement: refused when an engine is built.

Why at build time: verl-config accepts every setting verl accepts (a config that is valid verl stays valid), but an
engine that silently ignored one would train something else than the user asked for. So the builder checks the
role's section before any model is built and names the key, its value and what is supported instead.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NOT_IMPLEMENTED_POLICY_LOSSES", "check_supported"]

# verl 0.9.1's registered policy losses that verl-engine does not implement, and why
NOT_IMPLEMENTED_POLICY_LOSSES = {
    "clip_cov": "it picks the tokens to clip at random from each micro-batch's covariance statistics, so a step would"
    " depend on the micro-batching and every rank would have to draw the same tokens",
    "kl_cov": "it penalises the top tokens of each micro-batch's covariance statistics, so a step would depend on the"
    " micro-batching",
    "bypass_mode": "it takes the rollout's log-probs as the old policy (algorithm.rollout_correction), which the engine"
    " does not consume yet",
}


def check_supported(cfg: Any, *, role: str) -> None:
    """Raise ValueError naming every setting of ``role``'s sections that is valid verl but not implemented here.

    The refused keys and what is supported instead: :data:`verl_engine.config_support.RULES`.
    """
    from verl_engine.config_support import refusal_problems

    problems = refusal_problems(cfg, role=role, describe={_LOSS_MODE: _policy_loss})
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
