"""The cross-section rules of :class:`verl_config.ppo.TrainerConfig`: layouts against the world size, batch sizes.

Each rule names every key involved; TrainerConfig collects their errors so that all are reported in one pass.
"""

from __future__ import annotations

from typing import Any

from verl_config.actor import ActorRolloutRefConfig
from verl_config.critic import CriticConfig
from verl_config.data import DataConfig
from verl_config.errors import ConfigValueError, ErrorCollector
from verl_config.notes import note
from verl_config.validation import check_parallel_layout

__all__ = [
    "check_batches",
    "check_engine_ties",
    "check_micro",
    "check_remove_padding",
    "check_role_layout",
    "check_router_replay",
]


def check_role_layout(*, path: str, role: Any, world: int) -> int:
    """Validate a role's parallel layout against the world size and return its data-parallel size."""
    engine = getattr(role, "megatron", None)
    if engine is not None:
        try:
            dp = check_parallel_layout(
                world_size=world,
                tensor_model_parallel_size=engine.tensor_model_parallel_size,
                pipeline_model_parallel_size=engine.pipeline_model_parallel_size,
                context_parallel_size=engine.context_parallel_size,
            )
        except ConfigValueError as err:
            raise ConfigValueError(
                f"{path}.megatron",
                f"{err.message} (world size = trainer.nnodes x trainer.n_gpus_per_node)",
            ) from None
        etp = engine.expert_tensor_parallel_size or engine.tensor_model_parallel_size
        expert_mp = etp * engine.expert_model_parallel_size * engine.pipeline_model_parallel_size
        if world % expert_mp:
            raise ConfigValueError(
                f"{path}.megatron.expert_model_parallel_size",
                f"world size {world} is not divisible by expert_tensor_parallel_size ({etp}) x"
                f" expert_model_parallel_size ({engine.expert_model_parallel_size}) x pipeline_model_parallel_size"
                f" ({engine.pipeline_model_parallel_size}) = {expert_mp}",
            )
        return dp
    sp = getattr(role, "ulysses_sequence_parallel_size", 1)
    if world % sp:
        raise ConfigValueError(
            f"{path}.ulysses_sequence_parallel_size", f"({sp}) does not divide the world size {world}"
        )
    fsdp_path, fsdp = f"{path}.fsdp_config", getattr(role, "fsdp_config", None)
    if fsdp is None and hasattr(role, "fsdp"):  # the FSDP critic's section is ``critic.fsdp``
        fsdp_path, fsdp = f"{path}.fsdp", role.fsdp
    if fsdp is not None and fsdp.fsdp_size != -1 and world % fsdp.fsdp_size:
        raise ConfigValueError(
            f"{fsdp_path}.fsdp_size", f"({fsdp.fsdp_size}) does not divide the world size {world}"
        )
    return world // sp


def check_batches(*, cfg: Any, actor_dp: int, critic_dp: int, errors: ErrorCollector) -> None:
    """The batch rules of each role of ``cfg`` (a TrainerConfig), checked independently (each error goes to ``errors``)."""
    data, arr, critic = cfg.data, cfg.actor_rollout_ref, cfg.critic
    _check_actor_batches(data=data, arr=arr, world=cfg.trainer.world_size, actor_dp=actor_dp, errors=errors)
    log_prob_roles = [("actor_rollout_ref.rollout", arr.rollout)]
    if cfg.uses_reference_policy:
        log_prob_roles.insert(0, ("actor_rollout_ref.ref", arr.ref))
    for role, section in log_prob_roles:
        with errors:
            check_micro(role=role, section=section, kind="log_prob", mini=None, dp=actor_dp)
    if cfg.uses_critic:
        if not critic.use_dynamic_bsz and data.train_batch_size < critic.ppo_mini_batch_size:
            errors.add(
                ConfigValueError(
                    "critic.ppo_mini_batch_size",
                    f"({critic.ppo_mini_batch_size}) is larger than data.train_batch_size"
                    f" ({data.train_batch_size})",
                )
            )
        with errors:
            mini = critic.ppo_mini_batch_size * arr.rollout.n
            check_micro(role="critic", section=critic, kind="ppo", mini=mini, dp=critic_dp)
    actor = arr.actor
    longest = data.max_prompt_length + data.max_response_length
    if actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu < longest:
        errors.add(
            ConfigValueError(
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                f"({actor.ppo_max_token_len_per_gpu}) is smaller than one sequence of data.max_prompt_length +"
                f" data.max_response_length = {longest}; with use_dynamic_bsz a micro-batch must hold at least"
                " one",
            )
        )


def _check_actor_batches(
    *, data: DataConfig, arr: ActorRolloutRefConfig, world: int, actor_dp: int, errors: ErrorCollector
) -> None:
    """The actor's mini- and micro-batch, then (with a valid micro-batch) the step's batch."""
    actor = arr.actor
    if data.train_batch_size < actor.ppo_mini_batch_size:
        message = (
            f"({actor.ppo_mini_batch_size}) is larger than data.train_batch_size ({data.train_batch_size});"
            " a mini-batch is a part of the step's batch"
        )
        if not actor.use_dynamic_bsz:
            errors.add(ConfigValueError("actor_rollout_ref.actor.ppo_mini_batch_size", message))
        else:
            note("actor_rollout_ref.actor.ppo_mini_batch_size", message)
    found = len(errors.errors)
    with errors:
        mini = actor.ppo_mini_batch_size * arr.rollout.n
        check_micro(role="actor_rollout_ref.actor", section=actor, kind="ppo", mini=mini, dp=actor_dp)
    if not actor.use_dynamic_bsz and len(errors.errors) == found:  # needs a valid micro-batch size
        with errors:
            _check_step_batch(data=data, arr=arr, world=world, actor_dp=actor_dp)


def _check_step_batch(*, data: DataConfig, arr: ActorRolloutRefConfig, world: int, actor_dp: int) -> None:
    """verl's first check: the step's sequences split evenly over the smallest possible batch."""
    sequences = data.train_batch_size * arr.rollout.n
    engine = getattr(arr.actor, "megatron", None)
    micro = arr.actor.ppo_micro_batch_size_per_gpu
    # check_micro refused a null one without dynamic batch sizes (the caller's guard)
    assert micro is not None
    if engine is not None:
        minimal, how = (
            actor_dp * micro,
            f"megatron DP {actor_dp} x actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu {micro}",
        )
    else:
        minimal, how = world, f"the world size {world}"
    if sequences % minimal:
        raise ConfigValueError(
            "data.train_batch_size",
            f"x actor_rollout_ref.rollout.n = {sequences} sequences is not divisible by {how} = {minimal}",
        )
    global_micro = arr.actor.ppo_micro_batch_size
    sp = getattr(arr.actor, "ulysses_sequence_parallel_size", 1)
    if engine is None and global_micro is not None and global_micro * sp < world:
        raise ConfigValueError(
            "actor_rollout_ref.actor.ppo_micro_batch_size",
            f"({global_micro}) x ulysses_sequence_parallel_size ({sp}) is smaller than the world size {world}",
        )


def check_engine_ties(*, arr: ActorRolloutRefConfig, critic: CriticConfig) -> None:
    """The megatron section's batch keys follow the role's; a different value is a contradiction."""
    ties = {
        "actor_rollout_ref.actor": (
            arr.actor,
            (
                ("use_dynamic_bsz", "use_dynamic_bsz"),
                ("max_token_len_per_gpu", "ppo_max_token_len_per_gpu"),
                ("micro_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu"),
            ),
        ),
        "actor_rollout_ref.ref": (
            arr.ref,
            (
                ("use_dynamic_bsz", "log_prob_use_dynamic_bsz"),
                ("max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"),
                ("micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu"),
            ),
        ),
        "critic": (
            critic,
            (
                ("use_dynamic_bsz", "use_dynamic_bsz"),
                ("max_token_len_per_gpu", "ppo_max_token_len_per_gpu"),
                ("micro_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu"),
            ),
        ),
    }
    for path, (role, pairs) in ties.items():
        engine = getattr(role, "megatron", None)
        if engine is None:
            continue
        for engine_key, role_key in pairs:
            if getattr(engine, engine_key) != getattr(role, role_key):
                raise ConfigValueError(
                    f"{path}.megatron.{engine_key}",
                    f"is {getattr(engine, engine_key)!r} but {path}.{role_key} is {getattr(role, role_key)!r};"
                    f" they are one setting: set {path}.{role_key} only",
                )


def check_remove_padding(*, arr: ActorRolloutRefConfig, critic: CriticConfig, uses_critic: bool) -> None:
    """Ulysses sequence parallel and dynamic CP split packed sequences: padding removal must be on."""
    for path, role, model_path, model in (
        (
            "actor_rollout_ref.actor",
            arr.actor,
            "actor_rollout_ref.model",
            arr.model,
        ),
        ("critic", critic, "critic.model", critic.model),
    ):
        if role is critic and not uses_critic:
            continue
        padded = getattr(model, "use_remove_padding", True) is False  # megatron critic: the engine's key
        sp = getattr(role, "ulysses_sequence_parallel_size", 1)
        if sp > 1 and padded:
            raise ConfigValueError(
                f"{model_path}.use_remove_padding",
                f"is false but {path}.ulysses_sequence_parallel_size is {sp}; Ulysses sequence parallel splits"
                f" packed sequences: set {model_path}.use_remove_padding=true",
            )
        engine = getattr(role, "megatron", None)
        if engine is not None and engine.dynamic_context_parallel and padded:
            raise ConfigValueError(
                f"{model_path}.use_remove_padding",
                f"is false but {path}.megatron.dynamic_context_parallel is true; dynamic context parallelism"
                f" runs on packed (THD) sequences: set {model_path}.use_remove_padding=true",
            )


def check_router_replay(*, arr: ActorRolloutRefConfig, algorithm: Any) -> None:
    """verl 0.9.1 (``_validate_router_replay_config``): R2 records the routes in the actor's old-log-prob pass,
    which ``rollout_correction.bypass_mode`` skips."""
    engine = getattr(arr.actor, "megatron", None)
    replay = getattr(engine, "router_replay", None)
    correction = getattr(algorithm, "rollout_correction", None)
    if getattr(replay, "mode", "disabled") == "R2" and correction is not None and correction.bypass_mode:
        raise ConfigValueError(
            "actor_rollout_ref.actor.megatron.router_replay.mode",
            "is R2 but algorithm.rollout_correction.bypass_mode is true: R2 records routes while recomputing the"
            " actor's old log-probs, and bypass mode skips that forward; set bypass_mode=false or use R3",
        )


# A role's micro-batch keys: (deprecated global size, per-GPU size, dynamic batch size switch).
_MICRO_KEYS = {
    "ppo": ("ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz"),  # actor, critic
    "log_prob": (  # ref, rollout
        "log_prob_micro_batch_size",
        "log_prob_micro_batch_size_per_gpu",
        "log_prob_use_dynamic_bsz",
    ),
}


def check_micro(*, role: str, section: Any, kind: str, mini: int | None, dp: int) -> None:
    """verl's micro-batch rules: one spelling at a time, set unless dynamic, and dividing the mini-batch.

    ``kind`` picks the keys (``ppo`` for a training role, ``log_prob`` for ref and rollout). ``mini`` is
    the role's mini-batch in sequences (prompts x rollout.n) over all DP ranks; the deprecated global
    micro-batch size is converted to the per-GPU one (must divide by DP).
    """
    global_key, per_gpu_key, dynamic_key = _MICRO_KEYS[kind]
    dynamic = getattr(section, dynamic_key)
    global_value = getattr(section, global_key)
    per_gpu = getattr(section, per_gpu_key)
    if global_value is not None and per_gpu is not None:
        if role == "critic":
            if dynamic:  # verl checks the two keys only without dynamic batch sizes
                return
            raise ConfigValueError(
                f"{role}.{global_key}",
                f"is set ({global_value}) and {role}.{per_gpu_key} is {per_gpu}: verl's default of"
                f" {role}.{per_gpu_key} follows {role}.{global_key}, so giving the deprecated global size sets both,"
                f" and verl 0.9.1 refuses both being set; remove {role}.{global_key} and set {role}.{per_gpu_key}"
                f" (sequences per GPU per forward = global size / data-parallel size {dp})",
            )
        raise ConfigValueError(
            f"{role}.{global_key}",
            f"and {role}.{per_gpu_key} are both set ({global_value}, {per_gpu}); {global_key} is the deprecated"
            f" global spelling, keep {per_gpu_key} only",
        )
    if global_value is not None:
        if global_value % dp:
            raise ConfigValueError(
                f"{role}.{global_key}",
                f"({global_value}) is not divisible by the data-parallel size {dp}; set {role}.{per_gpu_key} instead",
            )
        per_gpu = global_value // dp
        setattr(section, per_gpu_key, per_gpu)
        setattr(section, global_key, None)
        engine = getattr(section, "megatron", None)
        if engine is not None and engine.micro_batch_size_per_gpu is None:  # it follows the role's key
            engine.micro_batch_size_per_gpu = per_gpu
        note(
            f"{role}.{per_gpu_key}",
            f"set to {per_gpu} from the deprecated {role}.{global_key}={global_value} / DP {dp}",
        )
    if per_gpu is None:
        if not dynamic:
            raise ConfigValueError(
                f"{role}.{per_gpu_key}",
                f"is null and {role}.{dynamic_key} is false; set {role}.{per_gpu_key} (sequences per GPU per forward)"
                f" or {role}.{dynamic_key}=true",
            )
        return
    if mini is None or dynamic:
        return
    if mini % dp:
        raise ConfigValueError(
            f"{role}.ppo_mini_batch_size",
            f"x actor_rollout_ref.rollout.n = {mini} sequences is not divisible by the data-parallel size {dp}",
        )
    per_rank = mini // dp
    if per_rank % per_gpu:
        raise ConfigValueError(
            f"{role}.{per_gpu_key}",
            f"({per_gpu}) does not divide the mini-batch per data-parallel rank: ppo_mini_batch_size x rollout.n /"
            f" DP = {mini} / {dp} = {per_rank}; choose a divisor of {per_rank}",
        )
