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
    from verl_mcore_utils.module import unwrap_model

    out: dict[str, torch.Tensor] = {}
    for c, chunk in enumerate(engine.chunks):
        named = {
            n: (p.grad if what == "grads" else p).detach().float().cpu().clone()
            for n, p in unwrap_model(chunk).named_parameters()
            if what != "grads" or p.grad is not None
        }
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
            }
        )
    return out
