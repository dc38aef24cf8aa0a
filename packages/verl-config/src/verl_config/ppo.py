"""Typed schema of the PPO trainer config (``ppo_trainer``): the root section, both engines.

The tree and key names are verl's (``actor_rollout_ref.actor.megatron.override_ddp_config...``), so
existing command lines keep working. Each section lives in its own module (actor, critic, algorithm,
data, run, ...) and is importable from here too; rules that involve several sections are checked in
:meth:`TrainerConfig.__post_init__` (:mod:`verl_config.ppo_rules`) and name every key involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_config.actor import (
    ActorConfig,
    ActorRolloutRefConfig,
    CheckpointConfig,
    FSDPActorConfig,
    FSDPRefConfig,
    McoreActorConfig,
    McoreRefConfig,
    PolicyLossConfig,
    RefConfig,
)
from verl_config.algorithm import (
    ADV_ESTIMATORS,
    GROUP_ESTIMATORS,
    POLICY_LOSS_MODES,
    AlgorithmConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
    check_kl_type,
)
from verl_config.critic import CriticConfig, FSDPCriticConfig, McoreCriticConfig
from verl_config.data import DataConfig
from verl_config.distillation import DistillationConfig
from verl_config.engines import RouterReplayConfig
from verl_config.errors import ConfigValueError, ErrorCollector
from verl_config.model import ModelConfig
from verl_config.notes import adjusting, note
from verl_config.ppo_rules import (
    check_batches,
    check_engine_ties,
    check_remove_padding,
    check_role_layout,
    check_router_replay,
)
from verl_config.profiler import GlobalProfilerConfig
from verl_config.reward import (
    LegacyCustomRewardFunctionConfig,
    LegacyRewardModelConfig,
    LegacySandboxFusionConfig,
    RewardConfig,
)
from verl_config.rollout import RolloutConfig
from verl_config.run import RayKwargsConfig, RunConfig, TransferQueueConfig
from verl_config.skip import SkipConfig
from verl_config.validation import check_choice

__all__ = [
    "ADV_ESTIMATORS",
    "ENGINE_STRATEGIES",
    "MODEL_ENGINES",
    "POLICY_LOSS_MODES",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "DataConfig",
    "FSDPActorConfig",
    "FSDPCriticConfig",
    "FSDPRefConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "McoreActorConfig",
    "McoreCriticConfig",
    "McoreRefConfig",
    "ModelConfig",
    "PolicyLossConfig",
    "RayKwargsConfig",
    "RefConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RouterReplayConfig",
    "RunConfig",
    "TrainerConfig",
    "TransferQueueConfig",
    "check_kl_type",
]

MODEL_ENGINES = ("fsdp", "megatron")
# The actor/ref/critic strategies each engine accepts (verl's FSDP roles take fsdp or fsdp2).
ENGINE_STRATEGIES = {"fsdp": ("fsdp", "fsdp2"), "megatron": ("megatron",)}


@dataclass
class TrainerConfig:
    """The whole PPO trainer config (entry ``ppo_trainer``); ``model_engine`` picks the engine sections.

    Cross-section rules follow verl's ``validate_config`` and apply only where verl applies them:
    reference micro-batches only when a reference policy is used (a KL term), critic rules only
    when the critic is (``critic.enable``, or GAE when it is null), micro-batch rules only without
    dynamic batch sizes. A few rules of ours add safety where verl would fail later on a cluster;
    where verl accepts a value we would reject, the rule is a note instead.
    """

    model_engine: str = "fsdp"
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=FSDPCriticConfig)
    custom_reward_function: LegacyCustomRewardFunctionConfig = field(
        default_factory=LegacyCustomRewardFunctionConfig
    )
    reward_model: LegacyRewardModelConfig = field(default_factory=LegacyRewardModelConfig)
    sandbox_fusion: LegacySandboxFusionConfig = field(default_factory=LegacySandboxFusionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    transfer_queue: TransferQueueConfig = field(default_factory=TransferQueueConfig)
    trainer: RunConfig = field(default_factory=RunConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    skip: SkipConfig = field(default_factory=SkipConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)

    @property
    def uses_reference_policy(self) -> bool:
        """verl builds the reference policy only for a KL term (in the reward or in the loss)."""
        return bool(self.algorithm.use_kl_in_reward or self.actor_rollout_ref.actor.use_kl_loss)

    @property
    def uses_critic(self) -> bool:
        """``critic.enable`` when set, else whether the estimator is GAE (verl's need_critic)."""
        if self.critic.enable is not None:
            return bool(self.critic.enable)
        return self.algorithm.adv_estimator == "gae"

    def __post_init__(self) -> None:
        check_choice("model_engine", self.model_engine, MODEL_ENGINES)
        if not adjusting():  # a default tree being built: cross-section rules apply to loaded configs only
            return
        arr = self.actor_rollout_ref
        errors = ErrorCollector()  # independent rules: every broken one is reported, not just the first
        allowed = ENGINE_STRATEGIES[self.model_engine]
        for path, role in (
            ("actor_rollout_ref.actor", arr.actor),
            ("actor_rollout_ref.ref", arr.ref),
            ("critic", self.critic),
        ):
            if role.strategy not in allowed:
                errors.add(
                    ConfigValueError(
                        f"{path}.strategy",
                        f"is {role.strategy!r} but model_engine is {self.model_engine!r} (strategies"
                        f" {', '.join(allowed)}); the engine is chosen once with model_engine=fsdp|megatron (the"
                        " role sections follow it)",
                    )
                )
        world = self.trainer.world_size
        actor_dp = critic_dp = None
        with errors:
            actor_dp = check_role_layout(path="actor_rollout_ref.actor", role=arr.actor, world=world)
        with errors:
            if self.uses_reference_policy:
                check_role_layout(path="actor_rollout_ref.ref", role=arr.ref, world=world)
        with errors:
            critic_dp = (
                check_role_layout(path="critic", role=self.critic, world=world)
                if self.uses_critic
                else actor_dp
            )
        if world % arr.rollout.tensor_model_parallel_size:
            errors.add(
                ConfigValueError(
                    "actor_rollout_ref.rollout.tensor_model_parallel_size",
                    f"({arr.rollout.tensor_model_parallel_size}) does not divide the world size {world}"
                    " (trainer.nnodes x trainer.n_gpus_per_node)",
                )
            )
        if actor_dp is not None and critic_dp is not None:  # the batch rules need the DP sizes
            check_batches(cfg=self, actor_dp=actor_dp, critic_dp=critic_dp, errors=errors)
        with errors:
            check_engine_ties(arr=arr, critic=self.critic)
        with errors:
            check_remove_padding(arr=arr, critic=self.critic, uses_critic=self.uses_critic)
        with errors:
            check_router_replay(arr=arr, algorithm=self.algorithm)
        if arr.rollout.val_kwargs.do_sample and arr.rollout.temperature <= 0:
            errors.add(
                ConfigValueError(
                    "actor_rollout_ref.rollout.temperature",
                    f"is {arr.rollout.temperature} but actor_rollout_ref.rollout.val_kwargs.do_sample is true;"
                    " sampling needs a temperature > 0",
                )
            )
        errors.raise_if_any()
        if self.algorithm.adv_estimator in GROUP_ESTIMATORS and arr.rollout.n < 2:
            note(
                "actor_rollout_ref.rollout.n",
                f"is {arr.rollout.n} but algorithm.adv_estimator={self.algorithm.adv_estimator} compares several"
                " responses per prompt: every advantage will be 0 (set actor_rollout_ref.rollout.n >= 2)",
            )
        if self.algorithm.use_kl_in_reward and arr.actor.use_kl_loss:
            note(
                "algorithm.use_kl_in_reward",
                "and actor_rollout_ref.actor.use_kl_loss are both on: KL is applied twice",
            )
