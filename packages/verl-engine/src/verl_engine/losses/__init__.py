"""RL and SFT losses of the engine in plain torch, with verl's global normalisation.

Why: the engine runs one loss call per micro-batch and must produce the gradient of the *global* mini-batch
objective however the batch is cut into micro-batches and ranks. Every micro-batch divides by global
counts (``data["dp_size"]``, ``data["batch_num_tokens"]``, ``data["global_batch_size"]``), as verl does, so
the sum over micro-batches and the gradient average over ranks give the global objective. Losses and
metrics stay on the device (:mod:`verl_engine.metrics`). Rollout correction (importance weights and rejection
sampling between the rollout's and the trainer's log-probs, verl's ``algorithm.rollout_correction``) is in
:mod:`verl_engine.losses.rollout_correction`. The contract in full: the package README.
"""

from verl_engine.losses.agg import LOSS_AGG_MODES, agg_loss
from verl_engine.losses.covariance import clip_cov_policy_loss, kl_cov_policy_loss
from verl_engine.losses.kl import KL_PENALTIES, kl_penalty, kl_reward_penalty
from verl_engine.losses.policy import (
    POLICY_LOSSES,
    PolicyLossFn,
    PolicyTerms,
    bypass_mode_policy_loss,
    cispo_policy_loss,
    dppo_kl_policy_loss,
    dppo_tv_policy_loss,
    dro_policy_loss,
    geo_mean_policy_loss,
    get_policy_loss_fn,
    gpg_policy_loss,
    gspo_policy_loss,
    policy_loss,
    register_policy_loss,
    sapo_policy_loss,
    vanilla_policy_loss,
)
from verl_engine.losses.roles import ppo_loss, sft_loss, value_loss
from verl_engine.losses.rollout_correction import (
    IS_LEVELS,
    LOSS_TYPES,
    REJECTION_OPTIONS,
    RejectionCriterion,
    RolloutCorrection,
    importance_weights,
    parse_is_threshold,
    parse_rejection,
    rejection_mask,
    rollout_correction,
)

__all__ = [
    "IS_LEVELS",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "LOSS_TYPES",
    "POLICY_LOSSES",
    "REJECTION_OPTIONS",
    "PolicyLossFn",
    "PolicyTerms",
    "RejectionCriterion",
    "RolloutCorrection",
    "agg_loss",
    "bypass_mode_policy_loss",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "dro_policy_loss",
    "geo_mean_policy_loss",
    "get_policy_loss_fn",
    "gpg_policy_loss",
    "gspo_policy_loss",
    "importance_weights",
    "kl_cov_policy_loss",
    "kl_penalty",
    "kl_reward_penalty",
    "parse_is_threshold",
    "parse_rejection",
    "policy_loss",
    "ppo_loss",
    "register_policy_loss",
    "rejection_mask",
    "rollout_correction",
    "sapo_policy_loss",
    "sft_loss",
    "value_loss",
    "vanilla_policy_loss",
]
