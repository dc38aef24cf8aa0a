"""Rank workers of ``test_rl_engine_moe_glm_cpu.py``: one PPO step of a GLM-4.5 (``glm4_moe``) actor per layout,
with the routers' expert bias (a buffer: not among the parameters the shared workers return) before and after."""

from __future__ import annotations

from typing import Any


def ppo_step_with_expert_bias(
    rank: int,
    world_size: int,
    model_dir: str,
    layouts: list[list[str]],
    batch: dict[str, Any],
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """One actor train_batch with the PPO loss per layout: gradients (the backend's reduced ones), updated
    parameters and expert biases, and the routers' token counts before and after the step (on the CPU)."""
    from functools import partial

    from rl_engine_workers import _engine

    from verl_engine.losses import ppo_loss
    from verl_mcore_utils.module import unwrap_model
    from verl_mcore_utils.weights.chunks import expert_bias_buffers

    out = []
    for overrides in layouts:
        engine, cfg = _engine(overrides, "actor", model_dir, device)
        model = unwrap_model(engine.model)
        bias_before = {n: b.detach().cpu().clone() for n, b in expert_bias_buffers(model)}
        loss_fn = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            result = engine.forward_backward_batch({**batch, "calculate_entropy": True}, loss_fn)
            grads = {
                n: g.detach().float().cpu().clone()
                for n, p in model.named_parameters()
                if (g := engine.backend.gradient(p)) is not None
            }
            counts = {
                n: m.local_tokens_per_expert.detach().cpu().clone()
                for n, m in model.named_modules()
                if getattr(m, "local_tokens_per_expert", None) is not None
            }
            result["metrics"]["grad_norm"] = engine.optimizer_step()
        params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        bias = {n: b.detach().cpu().clone() for n, b in expert_bias_buffers(model)}
        counts_after = {
            n: m.local_tokens_per_expert.detach().cpu().clone()
            for n, m in model.named_modules()
            if n in counts
        }
        out.append(
            {
                "metrics": result["metrics"],
                "loss": result["loss"],
                "params": params,
                "grads": grads,
                "bias_before": bias_before,
                "bias": bias,
                "counts": counts,
                "counts_after": counts_after,
            }
        )
    return out


def checkpoint_keeps_expert_bias(
    rank: int, world_size: int, model_dir: str, overrides: list[str], batch: dict[str, Any], root: str
) -> dict[str, Any]:
    """A step, a checkpoint, a fresh actor loading it: the expert biases before the save and after the load."""
    from functools import partial

    from rl_engine_workers import _engine

    from verl_engine.losses import ppo_loss
    from verl_mcore_utils.module import unwrap_model
    from verl_mcore_utils.weights.chunks import expert_bias_buffers

    engine, cfg = _engine(overrides, "actor", model_dir, "cpu")
    with engine.train_mode():
        engine.train_batch(
            {**batch, "calculate_entropy": True}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
        )
    saved = {n: b.clone() for n, b in expert_bias_buffers(unwrap_model(engine.model))}
    engine.save_checkpoint(root, global_step=1)
    fresh, _ = _engine(overrides, "actor", model_dir, "cpu")
    initial = {n: b.clone() for n, b in expert_bias_buffers(unwrap_model(fresh.model))}
    fresh.load_checkpoint(root)
    loaded = {n: b.clone() for n, b in expert_bias_buffers(unwrap_model(fresh.model))}
    return {"saved": saved, "initial": initial, "loaded": loaded}
