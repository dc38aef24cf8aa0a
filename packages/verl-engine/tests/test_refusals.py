"""Valid verl settings the engine does not implement are refused when an engine is built, before any model."""

from __future__ import annotations

import pytest
import torch

from verl_config import ConfigValueError, load_config
from verl_engine import rl_engine_from_config
from verl_engine.loss_binding import loss_config
from verl_engine.losses import POLICY_LOSSES
from verl_engine.refusals import NOT_IMPLEMENTED_POLICY_LOSSES, check_supported

BASE = [
    "model_engine=megatron",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "critic.enable=false",
]
KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
RC = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    ("mode", "not_implemented", "why"),
    [
        ("my_own_loss", None, "is not a registered policy loss"),
        ("clip_cov_v2", None, "is not a registered policy loss"),
        (
            "my_own_loss",
            "it needs a reward model",
            "is valid verl but not implemented by verl-engine: it needs a reward model",
        ),
    ],
)
def test_a_policy_loss_the_engine_lacks_is_refused_at_build(
    mode: str, not_implemented: str | None, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name nobody registered is refused; one listed in NOT_IMPLEMENTED_POLICY_LOSSES (a loss of verl's that
    verl-engine lacks: none since clip_cov and kl_cov are implemented) is refused with its reason."""
    if not_implemented:
        monkeypatch.setitem(NOT_IMPLEMENTED_POLICY_LOSSES, mode, not_implemented)
    cfg = load_config(overrides=[*BASE, f"{KEY}={mode}"])  # valid verl: the config loads
    with pytest.raises(
        ValueError, match=rf"cannot build the actor: {KEY}='{mode}' .*{why}.*implemented: bypass_mode, cispo,"
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
    assert set(NOT_IMPLEMENTED_POLICY_LOSSES) <= verl_091  # a refusal names a loss of verl's


def test_bypass_mode_is_the_actor_loss_as_verls_trainer_sets_it() -> None:
    """algorithm.rollout_correction.bypass_mode=true: the actor's loss is bypass_mode with that section (verl's
    apply_bypass_mode), the loaded config is left as it is, and the engine builds past the refusals."""
    cfg = load_config(
        overrides=[
            *BASE,
            f"{RC}.bypass_mode=true",
            f"{RC}.rollout_rs=token_k1",
            f"{RC}.rollout_rs_threshold=2.0",
        ]
    )
    actor = loss_config(cfg, role="actor")
    assert actor.policy_loss.loss_mode == "bypass_mode"
    assert actor.policy_loss.rollout_correction is cfg.algorithm.rollout_correction
    assert actor.clip_ratio_high == cfg.actor_rollout_ref.actor.clip_ratio_high
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
    assert loss_config(cfg, role="critic") is cfg.critic
    check_supported(cfg, role="actor")
    plain = load_config(overrides=BASE)
    assert loss_config(plain, role="actor") is plain.actor_rollout_ref.actor


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (
            [f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true"],
            rf"{RC}.rollout_is_batch_normalize=true with bypass_mode=true and loss_type='reinforce' is valid verl but not"
            r" implemented by verl-engine: .* over each micro-batch",
        ),
        (
            [f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=0.5_2.0"],
            rf"{RC}.rollout_rs_threshold \(option token_k2\) takes one upper bound, not a range; got '0.5_2.0'",
        ),
        (
            [f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=0.5"],
            rf"{RC}.rollout_rs_threshold \(option seq_mean_k1\): one number u means the ratio range 1/u..u, so it"
            r" must be >= 1; got '0.5'",
        ),
    ],
)
def test_bypass_mode_settings_verl_engine_cannot_honour_are_refused_at_build(
    overrides: list[str], why: str
) -> None:
    cfg = load_config(overrides=[*BASE, f"{RC}.bypass_mode=true", *overrides])
    with pytest.raises(ValueError, match=rf"cannot build the actor: {why}"):
        rl_engine_from_config(cfg, role="actor", device=torch.device("cpu"))


def test_bypass_mode_batch_normalize_with_ppo_clip_is_built() -> None:
    """With ppo_clip the weights only feed metrics: their micro-batch normalisation cannot change a step."""
    cfg = load_config(
        overrides=[
            *BASE,
            f"{RC}.bypass_mode=true",
            f"{RC}.rollout_is=token",
            f"{RC}.rollout_is_batch_normalize=true",
        ]
    )
    check_supported(cfg, role="actor")


def test_bypass_mode_as_a_loss_mode_alone_is_refused() -> None:
    """verl's loss would read PolicyLossConfig's defaults, not algorithm.rollout_correction, with recomputed old
    log-probs; the flag that makes verl's trainer select the loss is the supported spelling."""
    cfg = load_config(overrides=[*BASE, f"{KEY}=bypass_mode"])
    with pytest.raises(
        ValueError,
        match=rf"{KEY}='bypass_mode' without {RC}.bypass_mode=true is valid verl but not implemented",
    ):
        rl_engine_from_config(cfg, role="actor", device=torch.device("cpu"))
