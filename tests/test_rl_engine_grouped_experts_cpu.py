"""Grouped experts through the RL engine on CPU, fp32, gloo: one PPO step equals the sequential experts' step.

verl sets ``moe_grouped_gemm=True`` for Qwen3-MoE (``verl/models/mcore/config_converter.py``) and users turn it
off with ``actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=false``; verl-engine
honours the same key with the same default: on, the MoE layers compute their experts with
:class:`verl_mcore_utils.grouped_experts.GroupedExperts` (torch's grouped GEMM), off with megatron-core's
``SequentialMLP``. One PPO step (PPO + entropy + KL, aux loss on) of a tiny Qwen3-MoE gives the same loss,
gradient norm, gradients and updated weights either way (1e-5 relative; expert tensors compared slice by
slice: the grouped model stacks expert ``e``'s weight at index ``e``).
"""

from __future__ import annotations

import re

import pytest
import torch
from rl_engine_workers import verl_batch

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
GROUPED = f"+{A}.megatron.override_transformer_config.moe_grouped_gemm"
STEP = [
    "+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-3",
    f"{A}.use_kl_loss=true",
    f"{A}.kl_loss_type=low_var_kl",
    f"{A}.entropy_coeff=0.01",
    f"{A}.ppo_micro_batch_size_per_gpu=2",
]
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sequential experts' per-expert tensors stacked under the grouped module's names."""
    out: dict[str, torch.Tensor] = {}
    slices: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            slices.setdefault(f"{match.group(1)}.{match.group(3)}_weight", {})[int(match.group(2))] = tensor
    for name, by_expert in slices.items():
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_ppo_step_with_grouped_experts_equals_sequential_experts(tmp_path) -> None:
    from rl_engine_workers import ppo_step_layouts

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    model_dir = str(save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1))
    batch = verl_batch(seed=6, prompt_lens=[3, 6, 1, 5], response_lens=[7, 2, 5, 4])
    layouts = [["trainer.n_gpus_per_node=1", *STEP, *extra] for extra in ([], [f"{GROUPED}=false"])]
    ((default, sequential),) = run_distributed(
        ppo_step_layouts, world_size=1, args=(model_dir, layouts, batch)
    )
    assert any(n.endswith("mlp.experts.linear_fc1_weight") for n in default["grads"]), (
        "default: grouped experts"
    )
    assert any(".local_experts." in n for n in sequential["grads"]), "moe_grouped_gemm=false: sequential"
    assert default["metrics"]["grad_norm"] > 0
    assert default["loss"] == pytest.approx(sequential["loss"], rel=1e-5)
    assert default["metrics"]["grad_norm"] == pytest.approx(sequential["metrics"]["grad_norm"], rel=1e-5)
    for key in ("grads", "params"):
        ref = _stacked(sequential[key])
        assert default[key].keys() == ref.keys(), key
        worst = max(_rel(default[key][n], ref[n]) for n in ref)
        print(f"\ngrouped vs sequential experts, one PPO step: worst {key} rel. error {worst:.2e}")
        assert worst <= 1e-5, (key, worst)
