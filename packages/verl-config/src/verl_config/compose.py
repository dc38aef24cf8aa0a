"""Compose the PPO trainer config for an engine and load it: defaults <- YAML <- overrides -> typed.

verl composes its config with Hydra defaults lists; we do the same composition directly on
OmegaConf (no Hydra dependency): :func:`default_tree` starts from the typed schema and, for
``model_engine=megatron``, swaps in the Megatron role sections and the Megatron-specific defaults
that verl's unification lost (``rollout.layer_name_map``, ``model.override_config.model_config`` /
``moe_config``, ``model.use_remove_padding: false``). Every value that differs between the engines
is set in this one function, and a test pins the full list.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from verl_config.actor import ActorRolloutRefConfig, McoreActorConfig, McoreRefConfig
from verl_config.critic import McoreCriticConfig
from verl_config.errors import ConfigError, ConfigKeyError, ConfigValueError, ErrorCollector
from verl_config.loader import (
    EXPLICIT_ATTR,
    KeyHint,
    apply_override,
    build_typed,
    explicit_keys,
    is_given,
    merge_layer,
    read_yaml,
)
from verl_config.lora import (
    DEFAULT_LORA_ALPHA,
    LEGACY_FLAT_LORA_ALPHA,
    flat_target_modules,
    translate_target_modules,
)
from verl_config.notes import defaults_only, warn_once
from verl_config.overrides import Override, parse_override
from verl_config.ppo import MODEL_ENGINES, TrainerConfig
from verl_config.rollout import McoreRolloutConfig
from verl_config.tree_cache import cached_bytes

__all__ = ["ENTRIES", "check_critic_model", "compose_config", "default_tree", "load_config", "resolve_entry"]

T = TypeVar("T")

# Entry config names. ppo_megatron_trainer is the deprecated spelling of ppo_trainer + model_engine=megatron.
ENTRIES: dict[str, str | None] = {"ppo_trainer": None, "ppo_megatron_trainer": "megatron"}
_ABSENT = object()
_MODEL_PATHS = ("actor_rollout_ref.model", "critic.model")
# verl's mandatory keys (???) that only a consumer needs: a config without them loads (null in the typed config)
_NAMED_AT_USE = ("actor_rollout_ref.rollout.name", "reward.reward_model.rollout.name")
# verl's defaults of the deprecated flat LoRA keys (a flat key goes back to it once moved into model.lora)
_FLAT_LORA_DEFAULTS: dict[str, Any] = {
    "lora_rank": 0,
    "lora_alpha": 16,
    "target_modules": "all-linear",
    "exclude_modules": None,
}
# Keys of the megatron reference section that follow the actor's (same model, same layout): verl's
# list, then our packed-sequence keys.
_REF_FOLLOWS_ACTOR = (
    "param_offload",
    "tensor_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "seed",
    "override_transformer_config",
    "use_mbridge",
    "vanilla_mbridge",
    "use_remove_padding",
    "dynamic_context_parallel",
    "max_seqlen_per_dp_cp_rank",
    "packed_attention_backend",
    "pad_to_length",
    "pad_to_length_bucket",
)


def default_tree(model_engine: str) -> DictConfig:
    """The default PPO config tree of ``model_engine`` (typed nodes, interpolations unresolved).

    Returns a fresh copy the caller may change: building the tree from the dataclasses takes
    ~10x longer than copying it, so each engine's tree is built once per process.
    """
    if model_engine not in MODEL_ENGINES:
        raise ConfigValueError(
            "model_engine", f"must be one of {', '.join(MODEL_ENGINES)}; got {model_engine!r}"
        )
    return pickle.loads(_built_tree(model_engine))


@functools.cache
def _built_tree(model_engine: str) -> bytes:
    """The tree of ``model_engine``, pickled (unpickling is ~3x faster than a deep copy), cached on disk."""
    return cached_bytes(f"ppo-{model_engine}", functools.partial(_build_tree, model_engine))


def _build_tree(model_engine: str) -> bytes:
    with defaults_only():
        if model_engine == "megatron":
            root = TrainerConfig(
                model_engine="megatron",
                actor_rollout_ref=ActorRolloutRefConfig(
                    actor=McoreActorConfig(), ref=McoreRefConfig(), rollout=McoreRolloutConfig()
                ),
                critic=McoreCriticConfig(),
            )
            cfg = OmegaConf.structured(root)
            _select_megatron(cfg)
        else:
            cfg = OmegaConf.structured(TrainerConfig)
    return pickle.dumps(cfg)


def _select_megatron(cfg: DictConfig) -> None:
    """Set every Megatron-specific default that is not a class default of the Megatron role sections."""
    arr = cfg.actor_rollout_ref
    for model in (arr.model, cfg.critic.model):
        model.override_config = {"model_config": {}, "moe_config": {"freeze_moe_router": False}}
    arr.ref.megatron.forward_only = True  # the reference policy never trains: no DDP wrapper
    for key in _REF_FOLLOWS_ACTOR:
        arr.ref.megatron[key] = f"${{actor_rollout_ref.actor.megatron.{key}}}"
    for key in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size"):
        for role in (arr.actor, arr.ref):  # both follow the actor's key (verl)
            role.megatron[key] = f"${{actor_rollout_ref.actor.{key}}}"
    for section, prefix in ((arr.actor, "ppo_"), (cfg.critic, "ppo_"), (arr.ref, "log_prob_")):
        engine = section.megatron
        engine.use_dynamic_bsz = (
            "${..log_prob_use_dynamic_bsz}" if prefix == "log_prob_" else "${..use_dynamic_bsz}"
        )
        engine.max_token_len_per_gpu = f"${{..{prefix}max_token_len_per_gpu}}"
        engine.micro_batch_size_per_gpu = f"${{..{prefix}micro_batch_size_per_gpu}}"


def resolve_entry(entry: str, *, yaml_layer: DictConfig | None, overrides: Sequence[Override]) -> str:
    """The model engine selected by the entry name, the YAML's ``model_engine`` and the overrides."""
    if entry not in ENTRIES:
        raise ConfigKeyError(f"unknown entry config {entry!r}; choose one of {', '.join(ENTRIES)}")
    forced = ENTRIES[entry]
    if forced is not None:
        warn_once(
            f"entry config {entry!r} is deprecated: it means 'ppo_trainer model_engine={forced}'; use that instead"
        )
    engine = forced or "fsdp"
    source = f"entry {entry!r}" if forced else "the default"
    if yaml_layer is not None and "model_engine" in yaml_layer:
        engine, source = str(yaml_layer.model_engine), "the config file"
    for ov in overrides:
        if ov.key == "model_engine" and ov.kind != "delete":
            engine, source = str(ov.value), f"override {ov.text!r}"
    if engine not in MODEL_ENGINES:
        raise ConfigValueError(
            "model_engine", f"must be one of {', '.join(MODEL_ENGINES)}; got {engine!r} (from {source})"
        )
    if forced is not None and engine != forced:
        raise ConfigValueError(
            "model_engine",
            f"is {engine!r} (from {source}) but entry {entry!r} means model_engine={forced}; use entry 'ppo_trainer'"
            f" with model_engine={engine}",
        )
    return engine


def _engine_hint(engine: str) -> KeyHint:
    """Explain keys that exist only under the other engine (e.g. ``actor.megatron`` with fsdp)."""
    other = next(e for e in MODEL_ENGINES if e != engine)

    def hint(full_key: str) -> str | None:  # only runs on the error path: trees are built lazily
        current, other_tree = default_tree(engine), default_tree(other)
        parts = full_key.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if OmegaConf.select(current, prefix, default=_ABSENT) is not _ABSENT:
                continue
            if OmegaConf.select(other_tree, prefix, default=_ABSENT) is not _ABSENT:
                return f"'{prefix}' exists only with model_engine={other} (this config has model_engine={engine})"
            return None
        return None

    return hint


def _migrate_lora(cfg: DictConfig, *, engine: str, explicit: set[str]) -> None:
    """Move the deprecated flat LoRA keys into the ``lora`` block; translate module names for ``engine``."""
    for model_path in _MODEL_PATHS:
        model = OmegaConf.select(cfg, model_path)
        lora = model.lora
        # given = written by the user (the flat keys hold verl's defaults otherwise); a null is "not given". As in
        # verl, the flat keys configure LoRA only with a flat lora_rank > 0: with rank 0 a value equal to verl's
        # default says nothing (a full dumped config writes them all) and is left alone.
        given = {
            k
            for k in _FLAT_LORA_DEFAULTS
            if k in model and is_given(explicit, f"{model_path}.{k}") and model[k] is not None
        }
        flat_on = "lora_rank" in given and model.lora_rank != 0
        flat_given = {k for k in given if flat_on or not _is_flat_default(model, k)}
        for flat_key, block_key in (
            ("lora_rank", "rank"),
            ("lora_alpha", "alpha"),
            ("target_modules", "target_modules"),
            ("exclude_modules", "exclude_modules"),
        ):
            if flat_key not in flat_given:
                continue
            flat_value: Any = model[flat_key]
            if block_key in ("target_modules", "exclude_modules"):
                flat_value = flat_target_modules(flat_value)
            block_full = f"{model_path}.lora.{block_key}"
            block_explicit = is_given(explicit, block_full)
            if block_explicit and _lora_value(lora[block_key], block_key, engine) != _lora_value(
                flat_value, block_key, engine
            ):
                raise ConfigValueError(
                    f"{model_path}.{flat_key}",
                    f"is {_show(model[flat_key])} but {block_full} is {_show(lora[block_key])}: two spellings of one"
                    f" setting with different values; keep {block_full} only (the flat key is deprecated)",
                )
            warn_once(
                f"{model_path}.{flat_key} is deprecated; write {block_full} (the structured lora block is canonical)"
            )
            lora[block_key] = flat_value
            model[flat_key] = _FLAT_LORA_DEFAULTS[flat_key]  # one source of truth: the block
            explicit.add(block_full)
        alpha_full = f"{model_path}.lora.alpha"
        if "lora_rank" in flat_given and "lora_alpha" not in flat_given and alpha_full not in explicit:
            warn_once(
                f"{model_path}.lora_rank is set without lora_alpha: alpha is now {DEFAULT_LORA_ALPHA} for every"
                f" spelling (the flat keys used to default to {LEGACY_FLAT_LORA_ALPHA}); set {alpha_full}="
                f"{LEGACY_FLAT_LORA_ALPHA} to keep the old scaling"
            )
        for block_key in ("target_modules", "exclude_modules"):
            try:
                lora[block_key] = translate_target_modules(
                    list(lora[block_key]), engine=engine, key=block_key
                )
            except ConfigValueError as err:
                raise err.with_prefix(f"{model_path}.lora") from None


def _is_flat_default(model: DictConfig, key: str) -> bool:
    value = model[key]
    if isinstance(value, DictConfig) or OmegaConf.is_list(value):
        value = OmegaConf.to_container(value)
    return bool(value == _FLAT_LORA_DEFAULTS[key])


def _lora_value(value: Any, key: str, engine: str) -> Any:
    if key in ("target_modules", "exclude_modules"):
        return translate_target_modules(list(value), engine=engine, key=key)
    return value


def _show(value: Any) -> str:
    return repr(
        OmegaConf.to_container(value) if isinstance(value, DictConfig) or OmegaConf.is_list(value) else value
    )


def _migrate_legacy_spellings(cfg: DictConfig, *, explicit: set[str]) -> None:
    """verl's deprecated spellings: ``grad_clip`` -> ``optim.clip_grad``, ``optim.warmup_style`` ->
    ``optim.lr_scheduler_type`` (of the actor and the critic).

    The pre-0.9 reward sections (``reward_model``, ``custom_reward_function``, ``sandbox_fusion``) are not
    moved: verl 0.9's main_ppo keeps them but reads only ``reward`` (see :mod:`verl_config.reward`)."""
    for role in ("actor_rollout_ref.actor", "critic"):
        # grad_clip defaults to 1.0 like clip_grad, so its default must not overwrite a given clip_grad
        _move_spelling(
            cfg, legacy=f"{role}.grad_clip", canonical=f"{role}.optim.clip_grad", explicit=explicit
        )
        _move_spelling(
            cfg,
            legacy=f"{role}.optim.warmup_style",
            canonical=f"{role}.optim.lr_scheduler_type",
            explicit=explicit,
            clear=True,
        )


def _move_spelling(
    cfg: DictConfig, *, legacy: str, canonical: str, explicit: set[str], clear: bool = False
) -> None:
    """Move a value the user wrote under ``legacy`` to ``canonical`` (warns once); both given and different
    is an error naming both. ``clear``: set the legacy key back to null ("not given") afterwards."""
    parent, _, leaf = legacy.rpartition(".")
    section = OmegaConf.select(cfg, parent)
    if leaf not in section or legacy not in explicit or section[leaf] is None:
        return
    value, current = section[leaf], OmegaConf.select(cfg, canonical)
    if canonical in explicit and current != value:
        raise ConfigValueError(
            legacy,
            f"is {value!r} but {canonical} is {current!r}: two spellings of one setting; keep {canonical} only",
        )
    warn_once(f"{legacy} is deprecated; write {canonical}")
    OmegaConf.update(cfg, canonical, value, merge=False)
    explicit.add(canonical)
    if clear:
        section[leaf] = None


def load_config(
    entry: str | type[T] = "ppo_trainer",
    *,
    yaml_path: str | Path | None = None,
    yaml_text: str | None = None,
    overrides: Sequence[str] = (),
) -> Any:
    """Load, validate and type a config: defaults <- YAML (file or text) <- command-line overrides.

    ``entry`` is an entry config name (``ppo_trainer``; ``ppo_megatron_trainer`` is the deprecated
    alias of ``ppo_trainer model_engine=megatron``) and gives a :class:`TrainerConfig`, or any
    config dataclass (e.g. ``SFTConfig``) to load that schema instead. Raises ConfigKeyError
    (unknown key, with the closest valid one), ConfigTypeError (value of the wrong type) or
    ConfigValueError (a rule, naming every key involved). Notes about adjusted values are on the
    result, see :func:`verl_config.config_notes`.
    """
    errors = ErrorCollector()
    cfg, hint, explicit = _compose(
        entry, yaml_path=yaml_path, yaml_text=yaml_text, overrides=overrides, errors=errors
    )
    config, notes = build_typed(cfg, hint=hint, errors=errors, missing_as_none=_NAMED_AT_USE)
    object.__setattr__(config, "_verl_config_notes", notes)
    object.__setattr__(config, EXPLICIT_ATTR, frozenset(explicit))
    if isinstance(config, TrainerConfig):
        check_critic_model(config, explicit)
    return config


def check_critic_model(config: TrainerConfig, explicit: set[str] | frozenset[str]) -> None:
    """A used critic needs ``critic.model.path`` from the user: verl's default is a placeholder model."""
    if not config.uses_critic or is_given(explicit, "critic.model.path"):
        return
    why = (
        "critic.enable is true"
        if config.critic.enable
        else f"algorithm.adv_estimator={config.algorithm.adv_estimator} needs a value model"
    )
    raise ConfigValueError(
        "critic.model.path",
        f"is not set but the critic is used ({why}); verl 0.9.1 would load its placeholder default"
        f" {config.critic.model.path!r}, not the actor's model. Set critic.model.path (e.g."
        " critic.model.path=${actor_rollout_ref.model.path} to start the critic from the actor's model)",
    )


def compose_config(
    entry: str | type[Any] = "ppo_trainer",
    *,
    yaml_path: str | Path | None = None,
    yaml_text: str | None = None,
    overrides: Sequence[str] = (),
) -> DictConfig:
    """The composed config tree (defaults <- YAML <- overrides, legacy keys migrated), not yet validated.

    Unknown keys and values of the wrong type are refused as in :func:`load_config`; the rules between
    keys (micro-batch sizes a run must set, layouts against the world size ...) are not applied, so a
    partial config can be shown and completed. :func:`load_config` is this plus the typed, validated build.
    Every bad override is reported, together (:class:`~verl_config.errors.ConfigErrors` when several).
    """
    errors = ErrorCollector()
    cfg = _compose(entry, yaml_path=yaml_path, yaml_text=yaml_text, overrides=overrides, errors=errors)[0]
    errors.raise_if_any()
    return cfg


def _compose(
    entry: str | type[Any],
    *,
    yaml_path: str | Path | None,
    yaml_text: str | None,
    overrides: Sequence[str],
    errors: ErrorCollector,
) -> tuple[DictConfig, KeyHint | None, set[str]]:
    """Compose the tree; a bad override is recorded in ``errors`` and skipped, so every one is reported.

    Also returns the keys the user gave (YAML and overrides, plus the canonical keys of moved legacy ones)."""
    parsed: list[Override] = []
    for text in overrides:
        with errors:
            parsed.append(parse_override(text))
    try:  # without an entry, an engine and a readable YAML layer there is nothing to check further
        layer = read_yaml(yaml_path=yaml_path, yaml_text=yaml_text)
        if isinstance(entry, str):
            engine = resolve_entry(entry, yaml_layer=layer[1] if layer else None, overrides=parsed)
            cfg = default_tree(engine)
            hint: KeyHint | None = _engine_hint(engine)
        else:
            engine = None
            with defaults_only():  # no validation-time adjustment may be baked into the defaults
                cfg = OmegaConf.structured(entry)
            hint = None
        if layer is not None:
            cfg = merge_layer(cfg, layer[1], origin=layer[0], hint=hint)
    except ConfigError as err:
        errors.add(err)
        errors.raise_if_any()
        raise  # unreachable: raise_if_any raised
    for ov in parsed:
        with errors:
            apply_override(cfg, ov, hint=hint)
    explicit = explicit_keys(layer[1] if layer else None, parsed)
    if engine is not None:
        with errors:
            _migrate_lora(cfg, engine=engine, explicit=explicit)
        with errors:
            _migrate_legacy_spellings(cfg, explicit=explicit)
    return cfg, hint, explicit
