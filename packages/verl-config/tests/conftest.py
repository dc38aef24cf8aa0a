"""Shared fixtures of the verl-config tests."""

from __future__ import annotations

import pytest

import verl_config.notes

# The keys verl requires a user to set (micro-batch sizes are null by default; the critic of the default GAE
# estimator needs its own model path, verl's default being a placeholder); most tests set them all.
MICRO_BATCHES = [
    "critic.model.path=${actor_rollout_ref.model.path}",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
]


@pytest.fixture(autouse=True)
def _fresh_warn_once() -> None:
    """Deprecations warn once per process; each test starts with none seen."""
    verl_config.notes._WARNED.clear()
