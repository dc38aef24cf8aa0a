"""Per-rank functions of tests/test_rl_engine_settings_cpu.py (picklable: module level), CPU and gloo.

Each builds a role's engine with ``rl_engine_from_config`` (through rl_engine_workers._engine) and reports
what a setting changed: the micro-batches a call ran, the initial weights, the optimizer, the trainable
parameters.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from rl_engine_workers import _engine


def _params(engine: Any) -> dict[str, torch.Tensor]:
    from verl_mcore_utils.module import unwrap_model

    return {n: p.detach().float().cpu().clone() for n, p in unwrap_model(engine.model).named_parameters()}


def _count(tokens: list[int], module: Any, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the tokens of one model forward (one micro-batch)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    tokens.append(int(ids.numel()))


def ref_micro_batches(
    rank: int, world_size: int, model_dir: str, layouts: list[list[str]], batch: dict[str, Any]
) -> list[dict[str, Any]]:
    """The reference policy's compute_log_prob (infer_batch) per layout: the tokens of every model forward
    (one forward per micro-batch, seen by a forward pre-hook on the model) and the log-probs."""
    out = []
    for overrides in layouts:
        engine, _ = _engine(overrides, "ref", model_dir, "cpu")
        tokens: list[int] = []
        handle = engine.chunks[0].register_forward_pre_hook(partial(_count, tokens), with_kwargs=True)
        with engine.eval_mode():
            result = engine.infer_batch({**batch, "calculate_entropy": True})
        handle.remove()
        micro = engine.micro_batching
        out.append(
            {
                "tokens": tokens,
                "log_probs": result["model_output"]["log_probs"].float().cpu(),
                "entropy": result["model_output"]["entropy"].float().cpu(),
                "setting": (
                    micro.use_dynamic_bsz,
                    micro.max_token_len_per_gpu,
                    micro.micro_batch_size_per_gpu,
                ),
            }
        )
    return out


def seeded_builds(
    rank: int,
    world_size: int,
    model_dir: str,
    role: str,
    layouts: list[list[str]],
    batch: dict[str, Any],
    hf_config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The freshly built engine's parameters and its output on ``batch`` per layout (no step taken)."""
    out = []
    for overrides in layouts:
        engine, _ = _engine(overrides, role, model_dir, "cpu", hf_config=hf_config)
        with engine.eval_mode():
            result = engine.infer_batch(batch)["model_output"]
        key = "values" if role == "critic" else "log_probs"
        out.append({"params": _params(engine), "output": result[key].float().cpu()})
    return out


def forward_only_engines(
    rank: int, world_size: int, model_dir: str, role: str, layouts: list[list[str]], batch: dict[str, Any]
) -> list[dict[str, Any]]:
    """Per layout: the optimizer and schedule the engine holds, its trainable parameters, its output, and what
    train_batch does (the error's text, or None when it stepped)."""
    from verl_engine import losses

    out = []
    for overrides in layouts:
        engine, cfg = _engine(overrides, role, model_dir, "cpu")
        section = cfg.critic if role == "critic" else cfg.actor_rollout_ref.actor
        loss = partial(losses.value_loss if role == "critic" else losses.ppo_loss, config=section)
        with engine.eval_mode():
            result = engine.infer_batch(batch)["model_output"]
        output = result["values" if role == "critic" else "log_probs"].float().cpu()
        got: dict[str, Any] = {
            "optimizer": engine.optimizer is not None,
            "lr_schedule": engine.lr_schedule is not None,
            "trainable": sum(p.requires_grad for p in engine.model.parameters()),
            "output": output,
        }
        before = _params(engine)
        try:
            with engine.train_mode():
                engine.train_batch(batch, loss)
            got["train_error"] = None
        except RuntimeError as e:
            got["train_error"] = str(e)
        after = _params(engine)
        got["changed"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
        out.append(got)
    return out


def critic_lora_step(
    rank: int, world_size: int, model_dir: str, overrides: list[str], batch: dict[str, Any]
) -> dict[str, Any]:
    """The critic built with ``overrides`` before and after one value-loss train_batch: trainable parameter
    names, the parameters that changed, the values before and after, the actor's LoRA state."""
    from verl_engine import losses

    engine, cfg = _engine(overrides, "critic", model_dir, "cpu")
    trainable = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    before = _params(engine)
    with engine.eval_mode():
        values = engine.infer_batch(batch)["model_output"]["values"].float().cpu()
    with engine.train_mode():
        engine.train_batch(batch, partial(losses.value_loss, config=cfg.critic))
    after = _params(engine)
    with engine.eval_mode():
        values_after = engine.infer_batch(batch)["model_output"]["values"].float().cpu()
    return {
        "trainable": trainable,
        "all": sorted(before),
        "changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
        "values": values,
        "values_after": values_after,
        "lora": None if engine.lora is None else (int(engine.lora.rank), float(engine.lora.alpha)),
        "actor_lora_rank": int(cfg.actor_rollout_ref.model.lora.rank),
    }


def gradient_reduction_dtypes(
    rank: int, world_size: int, model_dir: str, layouts: list[list[str]]
) -> list[bool]:
    """Per layout: ``grad_reduce_in_fp32`` of the DDP config the actor's chunks get on GPUs. The CPU debug
    backend takes bare chunks, so the provider and settings the build hands to ``make_megatron_module`` are
    captured and turned into the DDP config as on a GPU (``wrap_with_ddp`` set)."""
    import dataclasses

    import verl_mcore_utils.module as module
    from verl_mcore_utils.ddp import build_ddp_config

    real = module.make_megatron_module
    seen: list[Any] = []

    def capture(provider: Any, *, wrap_config: Any, override_ddp_config: Any = None, **kwargs: Any) -> Any:
        seen.append(
            build_ddp_config(
                wrap_config=dataclasses.replace(wrap_config, wrap_with_ddp=True),
                override_ddp_config=override_ddp_config,
                path_defaults=provider.ddp_defaults,
            )
        )
        return real(provider, wrap_config=wrap_config, override_ddp_config=override_ddp_config, **kwargs)

    module.make_megatron_module = capture
    try:
        for overrides in layouts:
            _engine(overrides, "actor", model_dir, "cpu")
    finally:
        module.make_megatron_module = real
    return [ddp.grad_reduce_in_fp32 for ddp in seen]
