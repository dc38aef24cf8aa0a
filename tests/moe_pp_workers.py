"""Worker functions of tests/test_rl_engine_moe_pp_cpu.py (module level: run_distributed pickles them).

Pipeline stages and expert-parallel ranks each hold a part of the model under local names (``decoder.layers.0``
of the second stage is global layer 1; local expert ``i`` of EP rank ``r`` is global expert ``r * E / EP + i``).
The workers return gradients and updated weights under global megatron names, grouped experts split into
SequentialMLP's per-expert names, so that a test can join every rank's part and compare it with one rank.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch
from rl_engine_workers import _engine

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL = re.compile(r"^(.*\.local_experts\.)(\d+)(\..+)$")
_STACKED = re.compile(r"^(.*\.mlp\.experts\.)linear_fc([12])_weight$")


def global_names(engine: Any, named: dict[str, torch.Tensor], *, chunk: int = 0) -> dict[str, torch.Tensor]:
    """``named`` (one model chunk's local names) under global layer and expert numbers."""
    from megatron.core import parallel_state as ps

    from verl_mcore_utils.module import unwrap_model

    gpt = unwrap_model(engine.chunks[chunk])
    ep_rank = ps.get_expert_model_parallel_rank()
    out: dict[str, torch.Tensor] = {}
    for name, value in named.items():
        m = _LAYER.match(name)
        if m is not None:
            name = f"decoder.layers.{gpt.decoder.layers[int(m[1])].layer_number - 1}.{m[2]}"
        stacked = _STACKED.match(name)
        pieces = (
            {
                f"{stacked[1]}local_experts.{e}.linear_fc{stacked[2]}.weight": value[e]
                for e in range(value.shape[0])
            }
            if stacked
            else {name: value}
        )
        for piece, tensor in pieces.items():
            local = _LOCAL.match(piece)
            if local is not None:
                experts = gpt.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
                piece = f"{local[1]}{ep_rank * experts + int(local[2])}{local[3]}"
            out[piece] = tensor
    return out


def _chunk_tensors(engine: Any, what: str) -> dict[str, torch.Tensor]:
    """This rank's reduced gradients (the backend's: main_grad under megatron-core's DDP) or weights."""
    from verl_mcore_utils.module import unwrap_model

    out: dict[str, torch.Tensor] = {}
    for c, chunk in enumerate(engine.chunks):
        params = dict(unwrap_model(chunk).named_parameters())
        tensors = {n: engine.backend.gradient(p) if what == "grads" else p for n, p in params.items()}
        named = {n: t.detach().float().cpu().clone() for n, t in tensors.items() if t is not None}
        out.update(global_names(engine, named, chunk=c))
    return out


def moe_ppo_steps(
    rank: int,
    world_size: int,
    model_dir: str,
    layouts: list[list[str]],
    batch: dict[str, Any],
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Per layout: one actor PPO step; loss, metrics, this rank's gradients and updated weights (global names)."""
    from verl_engine.losses import ppo_loss

    out = []
    for overrides in layouts:
        engine, cfg = _engine(overrides, "actor", model_dir, device)
        loss_fn = partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            result = engine.forward_backward_batch({**batch, "calculate_entropy": True}, loss_fn)
            grads = _chunk_tensors(engine, "grads")
            result["metrics"]["grad_norm"] = engine.optimizer_step()
        out.append(
            {
                "metrics": result["metrics"],
                "loss": float(result["loss"]),
                "log_probs": result["model_output"]["log_probs"].float().cpu(),
                "grads": grads,
                "params": _chunk_tensors(engine, "params"),
                "expert_bias": _expert_biases(engine),
            }
        )
    return out


def _expert_biases(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's routers' expert biases (buffers, DeepSeek-V3-style routers) under global layer numbers."""
    from verl_mcore_utils.module import unwrap_model
    from verl_mcore_utils.weights.chunks import expert_bias_buffers

    out: dict[str, torch.Tensor] = {}
    for c, chunk in enumerate(engine.chunks):
        named = {n: b.detach().cpu().clone() for n, b in expert_bias_buffers(unwrap_model(chunk))}
        out.update(global_names(engine, named, chunk=c))
    return out


def _train_step(engine: Any, cfg: Any, data: dict[str, Any]) -> dict[str, Any]:
    """forward_backward_batch with the PPO loss: loss, log-probs, gradients under global names (no update)."""
    from verl_engine.losses import ppo_loss

    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(
            {**data, "calculate_entropy": True}, partial(ppo_loss, config=cfg.actor_rollout_ref.actor)
        )
        grads = _chunk_tensors(engine, "grads")
        engine.optimizer_zero_grad()
    return {"loss": float(out["loss"]), "grads": grads, "log_probs": out["model_output"]["log_probs"].float()}


def _perturb_routers(engine: Any, *, scale: float) -> None:
    """Noise on every router weight, drawn per global layer number: the same on every layout."""
    from verl_engine.router_replay import decoder_routers

    with torch.no_grad():
        for router in decoder_routers(engine.chunks):
            g = torch.Generator().manual_seed(11 + int(router.layer_number))
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=g).to(router.weight))


def _infer(engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
    with engine.eval_mode():
        out = engine.infer_batch(data)["model_output"]
    return {k: v.cpu() for k, v in out.items()}


def replay_across_stages(
    rank: int, world_size: int, model_dir: str, layouts: list[list[str]], batch: dict[str, Any], scale: float
) -> list[dict[str, Any]]:
    """Per layout (R2): record; the update without replay and with the just-recorded routes; perturb the
    routers by ``scale``; native and replayed forwards; the replayed update. Gradients under global names; the
    experts this rank's routers used in the replayed forward, with the routers' columns in the routes."""
    from verl_engine.router_replay import keep_seen

    keep_seen(True)
    out = []
    for overrides in layouts:
        engine, cfg = _engine(
            [*overrides, "actor_rollout_ref.actor.megatron.router_replay.mode=R2"], "actor", model_dir, "cpu"
        )
        result: dict[str, Any] = {"recorded": _infer(engine, batch)}
        routes = result["recorded"]["routed_experts"]
        result["native_train"] = _train_step(engine, cfg, {**batch, "enable_routing_replay": False})
        result["same_train"] = _train_step(engine, cfg, {**batch, "routed_experts": routes})
        _perturb_routers(engine, scale=scale)
        result["native"] = _infer(engine, batch)
        result["replayed"] = _infer(engine, {**batch, "routed_experts": routes})
        result["seen"] = [[t.cpu() for t in per] for per in engine.router_replay.seen_routes()]
        result["columns"] = [s.column for s in engine.router_replay.states]
        result["replay_train"] = _train_step(engine, cfg, {**batch, "routed_experts": routes})
        out.append(result)
    return out
