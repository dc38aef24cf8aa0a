"""The config a role's loss is bound with, from a loaded verl config: the section verl's trainer hands the loss.

Why: verl's trainer changes the actor's loss config at run time: with ``algorithm.rollout_correction.bypass_mode``
it sets ``policy_loss.loss_mode = "bypass_mode"`` and copies ``algorithm.rollout_correction`` into
``policy_loss.rollout_correction`` (``apply_bypass_mode``). Binding ``ppo_loss`` to the plain
``actor_rollout_ref.actor`` section would train plain PPO instead; :func:`loss_config` gives the section as
verl's trainer makes it, and :func:`~verl_engine.refusals.check_supported` judges that one.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["loss_config"]


def loss_config(cfg: Any, *, role: str) -> Any:
    """The ``config`` of ``role``'s loss (``functools.partial(ppo_loss, config=loss_config(cfg, role="actor"))``).

    ``critic``: ``cfg.critic``. ``actor`` / ``ref``: ``actor_rollout_ref.actor``, or with
    ``algorithm.rollout_correction.bypass_mode`` a copy whose ``policy_loss`` has ``loss_mode="bypass_mode"`` and
    ``rollout_correction`` (``cfg`` is not changed). Bypass mode also takes the rollout's log-probs as the old
    policy's: the trainer must put them in the batch as ``old_log_probs`` (verl's trainer sets
    ``old_log_probs = rollout_log_probs``), as the engine only ever sees ``old_log_probs``.
    """
    if role not in ("actor", "ref", "critic"):
        raise ValueError(f"role must be one of actor, ref, critic; got {role!r}")
    if role == "critic":
        return cfg.critic
    actor = cfg.actor_rollout_ref.actor
    correction = getattr(cfg.algorithm, "rollout_correction", None)
    if correction is None or not correction.bypass_mode:
        return actor
    policy = copy.copy(actor.policy_loss)
    policy.loss_mode = "bypass_mode"
    # verl's PolicyLossConfig has this field, verl-config's does not: its one source is algorithm.rollout_correction
    policy.rollout_correction = correction
    bound = copy.copy(actor)
    bound.policy_loss = policy
    return bound
