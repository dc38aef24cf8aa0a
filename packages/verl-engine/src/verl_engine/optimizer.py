"""The engine's optimizer, one path for every backend: megatron-core's ``OptimizerConfig`` numbers from the
role's optimizer section, megatron-core's parameter groups (no weight decay on biases and 1-D parameters).

Why one path: the CPU debug backend (torch AdamW) and the GPU backend (megatron-core's optimizer) must
decay the same parameters by the same amount, or a CPU test proves nothing about a GPU run. megatron-core
marks its no-decay groups with ``wd_mult = 0`` and leaves applying it to its ``OptimizerParamScheduler``;
the engine has its own LR schedule, so the group's ``weight_decay`` is set here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["build_optimizer", "decays", "optimizer_settings"]


def decays(name: str, param: torch.nn.Parameter) -> bool:
    """megatron-core's default rule: biases and 1-D parameters (norm weights) take no weight decay."""
    return not (name.endswith(".bias") or param.ndim == 1)


def optimizer_settings(*, optim: Any, engine: Any, use_distributed_optimizer: bool) -> dict[str, Any]:
    """megatron-core ``OptimizerConfig`` keywords of the section (``override_optimizer_config`` applied)."""
    return optim.optimizer_config_kwargs(
        dtype=engine.dtype, use_distributed_optimizer=use_distributed_optimizer
    )


def build_optimizer(
    chunks: Sequence[torch.nn.Module], *, settings: dict[str, Any], debug: bool, params_dtype: torch.dtype
) -> Any:
    """The optimizer over the chunks' trainable parameters: torch AdamW on the CPU debug backend, else
    megatron-core's (``Megatron-FSDP``'s when the chunks are wrapped by it)."""
    if debug:
        return _debug_adamw(chunks, settings)
    from megatron.core.optimizer import OptimizerConfig

    from verl_mcore_utils.compat import make_megatron_optimizer
    from verl_mcore_utils.module import attach_training_hooks

    config = OptimizerConfig(**{**settings, "params_dtype": params_dtype})
    if getattr(getattr(chunks[0], "ddp_config", None), "use_megatron_fsdp", False):
        from verl_mfsdp.wrap import make_megatron_fsdp_optimizer

        optimizer = make_megatron_fsdp_optimizer(config, list(chunks))
    else:
        optimizer = make_megatron_optimizer(config, list(chunks))
    for group in optimizer.param_groups:
        group["weight_decay"] = float(settings["weight_decay"]) * float(group.get("wd_mult", 1.0))
    attach_training_hooks(list(chunks), optimizer)
    return optimizer


def _debug_adamw(chunks: Sequence[torch.nn.Module], settings: dict[str, Any]) -> torch.optim.AdamW:
    """torch AdamW with megatron-core's two groups and the same lr, betas, eps and weight decay."""
    if settings.get("optimizer", "adam") != "adam":
        raise ValueError(
            f"optim.optimizer={settings['optimizer']!r}: the CPU debug backend runs Adam only; use optimizer=adam"
            " or run on GPUs"
        )
    decay, no_decay = [], []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                (decay if decays(name, p) else no_decay).append(p)
    weight_decay = float(settings["weight_decay"])
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
        ],
        lr=float(settings["lr"]),
        betas=(float(settings["adam_beta1"]), float(settings["adam_beta2"])),
        eps=float(settings.get("adam_eps", 1e-8)),
    )
