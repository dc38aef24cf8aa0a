"""verl 0.9.1's own defaults where ours used to differ (issue 33), and the rules that keep users safe with them.

rollout.name is verl's ``???`` (mandatory only for what starts a rollout), critic.model has verl's literal
defaults (a used critic must be given its path), critic.ppo_micro_batch_size_per_gpu follows the deprecated
global key (verl refuses both set), the flat LoRA keys hold verl's values (moved into model.lora only when given).
"""

from __future__ import annotations

import warnings

import pytest
from omegaconf import OmegaConf

from conftest import MICRO_BATCHES
from verl_config import ConfigValueError, compose_config, default_tree, explicit_keys_of, load_config

CRITIC_PATH = "critic.model.path=${actor_rollout_ref.model.path}"
NO_CRITIC_PATH = [o for o in MICRO_BATCHES if o != CRITIC_PATH]


def _load(*overrides: str, engine: str = "megatron", yaml_text: str | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(overrides=[f"model_engine={engine}", *overrides], yaml_text=yaml_text)


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_defaults_are_verls(engine: str) -> None:
    tree = default_tree(engine)
    for key in ("actor_rollout_ref.rollout.name", "reward.reward_model.rollout.name"):
        parent, _, leaf = key.rpartition(".")
        assert OmegaConf.is_missing(OmegaConf.select(tree, parent), leaf)
    model = tree.critic.model
    assert (model.path, model.tokenizer_path, model.trust_remote_code, model.external_lib) == (
        "~/models/deepseek-llm-7b-chat",
        None,
        False,
        None,
    )
    for section in (tree.actor_rollout_ref.model, model):
        assert (section.lora_rank, section.lora_alpha, section.target_modules) == (0, 16, "all-linear")
    assert OmegaConf.to_container(tree.critic, resolve=False)["ppo_micro_batch_size_per_gpu"] == (
        "${oc.select:.ppo_micro_batch_size,null}"
    )


def test_a_config_without_a_rollout_name_loads_and_the_consumer_gets_a_precise_error() -> None:
    cfg = _load(*MICRO_BATCHES)
    assert cfg.actor_rollout_ref.rollout.name is None
    assert cfg.reward.reward_model.rollout.name is None
    with pytest.raises(
        ConfigValueError, match=r"actor_rollout_ref.rollout.name: is not set .* set actor_rollout_ref"
    ):
        cfg.actor_rollout_ref.rollout.require_name()
    assert _load(
        *MICRO_BATCHES, "actor_rollout_ref.rollout.name=sglang"
    ).actor_rollout_ref.rollout.require_name() == ("sglang")
    assert (
        _load(
            *MICRO_BATCHES, yaml_text="actor_rollout_ref:\n  rollout:\n    name: vllm\n"
        ).actor_rollout_ref.rollout.name
        == "vllm"
    )
    plus = _load(*MICRO_BATCHES, "+actor_rollout_ref.rollout.name=sglang")  # Hydra's '+' sets a ??? key
    assert plus.actor_rollout_ref.rollout.name == "sglang"
    composed = compose_config(overrides=[])  # the composed tree keeps verl's ??? (shown as verl shows it)
    assert OmegaConf.is_missing(composed.actor_rollout_ref.rollout, "name")
    with pytest.raises(
        ConfigValueError, match=r"reward.reward_model.rollout.name: is not set .* enable is true"
    ):
        _load(*MICRO_BATCHES, "reward.reward_model.enable=true", "reward.reward_model.model_path=m")
    _load(
        *MICRO_BATCHES,
        "reward.reward_model.enable=true",
        "reward.reward_model.model_path=m",
        "reward.reward_model.rollout.name=vllm",
    )


def test_a_used_critic_needs_its_model_path() -> None:
    with pytest.raises(ConfigValueError) as err:
        _load(*NO_CRITIC_PATH)  # gae: the critic is used
    msg = str(err.value)
    assert msg.startswith("critic.model.path: is not set but the critic is used (algorithm.adv_estimator=gae")
    assert "'~/models/deepseek-llm-7b-chat'" in msg and "Set critic.model.path" in msg
    with pytest.raises(ConfigValueError, match=r"critic.model.path: .*\(critic.enable is true\)"):
        _load(
            *NO_CRITIC_PATH,
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4",
            "critic.enable=true",
        )
    _load(*NO_CRITIC_PATH, "critic.enable=false")
    _load(*NO_CRITIC_PATH, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4")
    cfg = _load(*NO_CRITIC_PATH, "actor_rollout_ref.model.path=Qwen/Qwen3-8B", CRITIC_PATH)
    assert cfg.critic.model.path == "Qwen/Qwen3-8B"
    assert cfg.critic.model.tokenizer_path is None and cfg.critic.model.trust_remote_code is False
    cfg = _load(*NO_CRITIC_PATH, yaml_text="critic:\n  model:\n    path: /models/critic\n")
    assert cfg.critic.model.path == "/models/critic" and "critic.model.path" in explicit_keys_of(cfg)


def test_critic_micro_batch_keys_as_verl() -> None:
    per_gpu = [o for o in MICRO_BATCHES if not o.startswith("critic.ppo_micro")]
    assert _load(*MICRO_BATCHES).critic.ppo_micro_batch_size_per_gpu == 4
    # the deprecated global key alone sets both keys in verl, which refuses it without dynamic batch sizes
    with pytest.raises(ConfigValueError) as err:
        _load(*per_gpu, "critic.ppo_micro_batch_size=8")
    msg = str(err.value)
    assert msg.startswith(
        "critic.ppo_micro_batch_size: is set (8) and critic.ppo_micro_batch_size_per_gpu is 8"
    )
    assert "remove critic.ppo_micro_batch_size and set critic.ppo_micro_batch_size_per_gpu" in msg
    with pytest.raises(ConfigValueError, match=r"critic.ppo_micro_batch_size: is set \(8\) and .* is 4"):
        _load(*MICRO_BATCHES, "critic.ppo_micro_batch_size=8")
    # with dynamic batch sizes verl does not check them: accepted
    _load(*per_gpu, "critic.ppo_micro_batch_size=8", "critic.use_dynamic_bsz=true")
