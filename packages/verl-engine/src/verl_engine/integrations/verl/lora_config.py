"""verl 0.9.1's LoRA settings of ``HFModelConfig`` -> verl-config's :class:`~verl_config.lora.LoraConfig`.

verl's Megatron engine reads the ``model.lora`` block (Megatron-Bridge's keys: ``rank``, ``alpha``, ``merge``,
``target_modules`` ...); verl-config's ``LoraConfig`` has the same keys with the same meaning, so the block is
copied key by key. The flat FSDP spelling (``lora_rank``, ``lora_alpha``, ``target_modules``,
``exclude_modules``, ``lora_adapter_path``) is moved into the block as verl-config does when it loads a config.
Settings this engine cannot honour are refused naming the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

__all__ = ["lora_config"]

# block values verl-engine implements (config_support.py's rules for the same keys)
_ONLY = {
    "type": ("lora",),
    "a2a_experimental": (False,),
    "freeze_vision_model": (True,),
    "freeze_vision_projection": (True,),
    "freeze_language_model": (True,),
}


def lora_config(cfg: Any) -> tuple[Any | None, list[str]]:
    """``(LoraConfig or None, problems)`` of verl's model config ``cfg``; None when LoRA is off (rank 0)."""
    from omegaconf import DictConfig, OmegaConf

    from verl_config.errors import ConfigValueError
    from verl_config.lora import LoraConfig, flat_target_modules, translate_target_modules

    block = getattr(cfg, "lora", None) or {}
    # a DictConfig's container is a dict (OmegaConf.to_container is typed for every node kind)
    block = dict(
        cast(dict[str, Any], OmegaConf.to_container(block, resolve=True))
        if isinstance(block, DictConfig)
        else block
    )
    flat_rank = int(getattr(cfg, "lora_rank", 0) or 0)
    problems: list[str] = []
    if getattr(cfg, "target_parameters", None):
        problems.append(
            "model.target_parameters: LoRA on bare nn.Parameters is an FSDP feature; verl-engine adapts the"
            " linear layers only (leave target_parameters null)"
        )
    if int(block.get("rank", 0) or 0) > 0 and flat_rank > 0:
        problems.append(
            f"model.lora_rank={flat_rank} and model.lora.rank={block['rank']}: two LoRA spellings at once; set"
            " model.lora.* only (the Megatron engine's block)"
        )
        return None, problems
    if flat_rank > 0:
        block = {
            "rank": flat_rank,
            "alpha": getattr(cfg, "lora_alpha", 16),
            "target_modules": flat_target_modules(getattr(cfg, "target_modules", None) or "all-linear"),
            "exclude_modules": flat_target_modules(getattr(cfg, "exclude_modules", None) or []),
            "adapter_path": getattr(cfg, "lora_adapter_path", None),
        }
    elif getattr(cfg, "lora_adapter_path", None) and not block.get("adapter_path"):
        block["adapter_path"] = cfg.lora_adapter_path
    if int(block.get("rank", 0) or 0) <= 0:
        return None, problems
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    for key in sorted(set(block) - known):
        problems.append(f"model.lora.{key}: not a LoRA setting verl-engine knows (it would be ignored)")
    for key, allowed in _ONLY.items():
        if key in block and block[key] not in allowed:
            problems.append(
                f"model.lora.{key}={block[key]!r} is not implemented by verl-engine; supported: {allowed[0]!r}"
            )
    if problems:
        return None, problems
    try:
        for key in ("target_modules", "exclude_modules"):
            if block.get(key):
                block[key] = translate_target_modules(
                    flat_target_modules(block[key]), engine="megatron", key=f"model.lora.{key}"
                )
        return LoraConfig(**block), []
    except ConfigValueError as error:
        return None, [f"model.lora: {error}"]
