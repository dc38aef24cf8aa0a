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

__all__ = ["build_optimizer", "decays", "optimizer_settings", "role_optimizer", "training_state"]


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
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
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


def training_state(
    chunks: list[torch.nn.Module],
    *,
    engine: Any,
    optim: Any | None,
    mtp_pipeline: bool,
    debug: bool,
    tf_config: Any,
    total_training_steps: int | None,
) -> tuple[Any, Any]:
    """The optimizer and LR schedule of a role that trains (``optim`` given); a forward-only role's parameters
    are frozen and it gets neither. ``mtp_pipeline``: MTP layers on pipeline stages (the embedding pair's
    gradients are summed after megatron-core's finalize)."""
    if optim is None:
        for chunk in chunks:
            for p in chunk.parameters():
                p.requires_grad_(False)
        return None, None
    optimizer = role_optimizer(chunks, engine=engine, optim=optim, debug=debug, tf_config=tf_config)
    if mtp_pipeline and not debug:
        _sum_mtp_embedding_grads_in_finalize(chunks)
    from verl_engine.lr_schedule import lr_schedule_from_config

    lr_schedule = lr_schedule_from_config(optim, total_training_steps=total_training_steps)
    lr_schedule.apply(optimizer)  # step 0's learning rate (warm-up starts below optim.lr)
    return optimizer, lr_schedule


def role_optimizer(
    chunks: list[torch.nn.Module], *, engine: Any, optim: Any, debug: bool, tf_config: Any
) -> Any:
    """The optimizer with the DDP config's ``use_distributed_optimizer`` (the one the buffers were laid out
    for); a wrapped model that disagrees with the section is an error naming both keys."""
    use_distributed = bool(engine.use_distributed_optimizer)
    ddp_config = getattr(chunks[0], "ddp_config", None)
    if ddp_config is not None and bool(ddp_config.use_distributed_optimizer) != use_distributed:
        raise ValueError(
            f"megatron.use_distributed_optimizer={engine.use_distributed_optimizer} but the model was wrapped with"
            f" override_ddp_config.use_distributed_optimizer={ddp_config.use_distributed_optimizer}; set one of"
            " them (megatron.use_distributed_optimizer) so that DDP and the optimizer agree"
        )
    settings = optimizer_settings(optim=optim, engine=engine, use_distributed_optimizer=use_distributed)
    return build_optimizer(chunks, settings=settings, debug=debug, params_dtype=tf_config.params_dtype)


def _sum_mtp_embedding_grads_in_finalize(chunks: list[torch.nn.Module]) -> None:
    """megatron-core's finalize_model_grads, then the MTP embedding pair's gradients summed (pipeline stages)."""
    from verl_mcore_utils.module import get_model_config
    from verl_mcore_utils.mtp import sync_mtp_embedding

    config = get_model_config(chunks)
    finalize = config.finalize_model_grads_func

    def finalize_with_mtp_embedding(*args: Any, **kwargs: Any) -> Any:
        out = finalize(*args, **kwargs)
        sync_mtp_embedding(chunks, grads=True)
        return out

    config.finalize_model_grads_func = finalize_with_mtp_embedding
