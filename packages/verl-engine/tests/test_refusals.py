"""Valid verl settings the engine does not implement are refused when an engine is built, before any model."""

from __future__ import annotations

import pytest
import torch

from verl_config import ConfigValueError, load_config
from verl_engine import rl_engine_from_config
from verl_engine.losses import POLICY_LOSSES
from verl_engine.refusals import NOT_IMPLEMENTED_POLICY_LOSSES

BASE = [
    "model_engine=megatron",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "critic.enable=false",
]
KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"


@pytest.mark.parametrize(
    ("mode", "extra", "why"),
    [
        (
            "clip_cov",
            [],
            "is valid verl but not implemented by verl-engine: it picks the tokens to clip at random",
        ),
        ("kl_cov", [], "is valid verl but not implemented by verl-engine"),
        ("bypass_mode", [], "rollout's log-probs as the old policy"),
        ("my_own_loss", [], "is not a registered policy loss"),
    ],
)
def test_a_policy_loss_the_engine_lacks_is_refused_at_build(mode: str, extra: list[str], why: str) -> None:
    cfg = load_config(overrides=[*BASE, f"{KEY}={mode}", *extra])  # valid verl: the config loads
    with pytest.raises(
        ValueError, match=rf"cannot build the actor: {KEY}='{mode}' .*{why}.*implemented: cispo,"
    ):
        # model.path is verl's default (a hub name): the refusal comes first, no model is looked up or built
        rl_engine_from_config(cfg, role="actor", device=torch.device("cpu"))


def test_dro_without_its_beta_is_a_config_error() -> None:
    """verl 0.9.1's dro loss raises without a positive dro_beta; verl-config refuses that config when loading."""
    with pytest.raises(ConfigValueError, match=r"actor_rollout_ref.actor.policy_loss.dro_beta: is null"):
        load_config(overrides=[*BASE, f"{KEY}=dro"])


def test_every_policy_loss_of_verl_0_9_1_is_implemented_or_refused_with_a_reason() -> None:
    verl_091 = {"vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
                "cispo", "bypass_mode"}  # fmt: skip
    assert verl_091 <= set(POLICY_LOSSES) | set(NOT_IMPLEMENTED_POLICY_LOSSES)
    assert not set(POLICY_LOSSES) & set(NOT_IMPLEMENTED_POLICY_LOSSES)
