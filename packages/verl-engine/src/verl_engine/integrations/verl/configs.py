"""verl's per-role config objects -> the arguments of :func:`verl_engine.build.build_rl_engine`.

verl's ``TrainingWorker`` hands an engine four dataclasses (``HFModelConfig``, ``McoreEngineConfig``,
``McoreOptimizerConfig``, ``McoreCheckpointConfig``). verl-config's engine and optimizer sections carry the same
keys with the same meaning (they mirror verl's YAML), so the translation copies every shared field and refuses the
settings this engine does not implement, naming the key and the fix: a setting silently dropped would train
something other than what the launch script asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from verl_engine.integrations.verl.lora_config import lora_config

__all__ = ["BuildArgs", "build_args"]

# verl-only engine keys and why they need no translation
_ENGINE_HANDLED = {
    "_target_": "the dataclass path verl's config loader uses",
    "strategy": "always 'megatron' on this path (verl asserts it)",
    "use_fused_kernels": "read from the model config (model.use_fused_kernels), as verl's worker copies it",
    "infer_micro_batch_size_per_gpu": "verl's worker passes it per call in the batch (micro_batch_size_per_gpu)",
    "infer_max_token_len_per_gpu": "verl's worker passes it per call in the batch (max_token_len_per_gpu)",
    "full_determinism": "refused when true (_refusals_engine); false is our behaviour",
}
_OPTIM_HANDLED = {
    "_target_": "the dataclass path verl's config loader uses",
    "grad_clip": "verl's older spelling of clip_grad; a different value is refused (_refusals_optim)",
}


@dataclasses.dataclass(frozen=True)
class BuildArgs:
    """What :func:`verl_engine.build.build_rl_engine` takes, from verl's configs."""

    engine: Any
    optim: Any | None
    model_path: str
    override_model_config: dict[str, Any]
    fused_lm_head: bool
    value_model: bool
    total_training_steps: int | None
    lora: Any | None = None


def build_args(
    *, model_config: Any, engine_config: Any, optimizer_config: Any | None, value_model: bool
) -> BuildArgs:
    """Translate verl's configs of one role; every unsupported setting is one line of the raised error."""
    from verl_config.engines import McoreEngineConfig
    from verl_config.optim import McoreOptimConfig

    problems: list[str] = []
    problems += _refusals_engine(engine_config)
    problems += _refusals_model(model_config, value_model=value_model)
    lora, lora_problems = lora_config(model_config)
    problems += lora_problems
    optim = None
    if optimizer_config is not None and not engine_config.forward_only:
        problems += _refusals_optim(optimizer_config)
    if problems:
        raise ValueError("verl-engine's verl backend cannot build this role: " + "; ".join(problems))
    engine = _convert(McoreEngineConfig, engine_config, skip=_ENGINE_HANDLED)
    if optimizer_config is not None and not engine_config.forward_only:
        optim = _convert(McoreOptimConfig, optimizer_config, skip=_OPTIM_HANDLED)
    override = _plain(getattr(model_config, "override_config", None) or {})
    steps = getattr(optimizer_config, "total_training_steps", None) if optimizer_config is not None else None
    return BuildArgs(
        engine=engine,
        optim=optim,
        model_path=str(model_config.local_path or model_config.path),
        override_model_config=dict(override.get("model_config", {}) or {}),
        fused_lm_head=bool(getattr(model_config, "use_fused_kernels", False)) and not value_model,
        value_model=value_model,
        total_training_steps=steps if steps and steps > 0 else None,
        lora=lora,
    )


def _refusals_engine(cfg: Any) -> list[str]:
    out = []
    if getattr(cfg, "strategy", "megatron") != "megatron":
        out.append(f"engine strategy={cfg.strategy!r}: this backend registers under 'megatron' only")
    if getattr(cfg, "full_determinism", False):
        out.append(
            "megatron.full_determinism=true is not implemented by verl-engine (it would be ignored);"
            " set it to false"
        )
    if cfg.pipeline_model_parallel_size > 1:
        out.append(
            f"megatron.pipeline_model_parallel_size={cfg.pipeline_model_parallel_size}: the verl backend returns"
            " outputs from global rank 0, which holds no loss under pipeline parallelism yet; use"
            " pipeline_model_parallel_size=1 (TP, CP, DP are supported)"
        )
    return out


def _refusals_model(cfg: Any, *, value_model: bool) -> list[str]:
    out = []
    mtp = getattr(cfg, "mtp", None)
    if mtp is not None and getattr(mtp, "enable", False) and not value_model:
        out.append(
            "model.mtp.enable=true is not wired through the verl backend yet; set model.mtp.enable=false"
        )
    if getattr(cfg, "use_fused_kernels", False):
        impl = (_plain(getattr(cfg, "fused_kernel_options", None) or {})).get("impl_backend", "torch")
        if impl != "torch":
            out.append(
                f"model.fused_kernel_options.impl_backend={impl!r}: verl-engine's fused LM head is the chunked torch"
                " implementation; set impl_backend=torch or use_fused_kernels=false"
            )
    if getattr(cfg, "tiled_mlp", None) and _plain(cfg.tiled_mlp).get("enabled", False):
        out.append("model.tiled_mlp.enabled=true is an FSDP feature; set it to false for the Megatron engine")
    return out


def _refusals_optim(cfg: Any) -> list[str]:
    grad_clip = getattr(cfg, "grad_clip", None)
    if grad_clip is not None and grad_clip != cfg.clip_grad:
        return [
            f"optim.grad_clip={grad_clip} differs from optim.clip_grad={cfg.clip_grad}: set clip_grad only"
        ]
    return []


def _convert(target: type, source: Any, *, skip: Mapping[str, str]) -> Any:
    """``target`` (a verl-config dataclass) from ``source`` (verl's dataclass of the same keys); nested
    dataclasses recursively, OmegaConf containers as plain ones. A key of ``source`` that ``target`` lacks and
    ``skip`` does not explain is an error (a new verl key must be looked at, not dropped)."""
    fields = {f.name: f for f in dataclasses.fields(target)}
    unknown = [f.name for f in dataclasses.fields(source) if f.name not in fields and f.name not in skip]
    if unknown:
        raise ValueError(
            f"{type(source).__name__} has keys verl-engine does not know: {', '.join(unknown)}; this verl is newer"
            " than the backend supports (verl>=0.9.1,<0.10)"
        )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if not field.init or not hasattr(source, name):
            continue
        value = getattr(source, name)
        default = _default(field)
        if dataclasses.is_dataclass(default) and dataclasses.is_dataclass(value):
            value = _convert(type(default), value, skip={"_target_": ""})
        else:
            value = _plain(value)
        kwargs[name] = value
    return target(**kwargs)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return None


def _plain(value: Any) -> Any:
    """OmegaConf containers -> dict / list (verl keeps some sections as DictConfig)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        return value
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value
