"""GPU, NCCL: router replay (R2) through megatron-core's schedule, DDP and CUDA routers (megatron-core's own
fp32 routing, not the CPU's PortableTopKRouter). The CPU tests (``tests/test_rl_engine_router_replay_cpu.py``)
cover the engine's own loop; here the same checks run on the megatron backend: replaying the routes just recorded
changes nothing, after the routers are perturbed every router uses exactly the recorded experts (with the current
logits' probabilities), and DP 2 / static CP 2 / dynamic CP replay what one GPU replays (fp32, 1e-4 relative).
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import verl_batch

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
PROMPTS, RESPONSES = [3, 6, 1, 5], [7, 2, 5, 4]
COMMON = [f"{AM}.dtype=float32", f"{AM}.use_distributed_optimizer=false"]
LAYOUTS = {
    "dp2": [f"{A}.ppo_micro_batch_size_per_gpu=2"],
    "cp2": [f"{AM}.context_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4"],
    "dynamic_cp": [
        f"{A}.ppo_micro_batch_size_per_gpu=2",
        f"{AM}.dynamic_context_parallel=true",
        f"{AM}.max_seqlen_per_dp_cp_rank=8",
    ],
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _run(
    world: int, model_dir: str, layouts: list[list[str]], batch: dict, scale: float, probe: bool = False
):
    from router_replay_workers import replay_run

    return run_distributed(
        replay_run,
        world_size=world,
        backend="nccl",
        args=(model_dir, layouts, batch, scale, probe, "cuda"),
        timeout_s=300,
    )


def _sorted(routes: torch.Tensor, batch: dict) -> torch.Tensor:
    return routes[batch["attention_mask"].bool()].long().sort(dim=-1).values


@pytest.mark.num_gpus(2)
def test_router_replay_on_gpus(tmp_path) -> None:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    model_dir = str(save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1))
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    one_gpu = [["trainer.n_gpus_per_node=1", f"{A}.ppo_micro_batch_size_per_gpu=4", *COMMON]]
    ((same,),) = _run(1, model_dir, one_gpu, batch, 0.0)
    assert float((same["replayed"]["log_probs"] - same["recorded"]["log_probs"]).abs().max()) <= 1e-6
    assert abs(same["replay_train"]["loss"] - same["native_train"]["loss"]) <= 1e-6 * abs(
        same["native_train"]["loss"]
    )
    for name, grad in same["native_train"]["grads"].items():
        assert _rel(same["replay_train"]["grads"][name], grad) <= 1e-6, name
    ((ref,),) = _run(1, model_dir, one_gpu, batch, 0.3, probe=True)
    recorded = _sorted(ref["recorded"]["routed_experts"], batch)
    assert bool((_sorted(ref["native"]["routed_experts"], batch) != recorded).any())
    seen = torch.stack([torch.cat(calls) for calls in ref["seen_train"]], dim=1).sort(dim=-1).values
    assert torch.equal(seen, recorded)
    assert all(p["per_token"] == 2 and p["prob_error"] <= 1e-6 for p in ref["probe"]), ref["probe"]
    two = [["trainer.n_gpus_per_node=2", *COMMON, *v] for v in LAYOUTS.values()]
    for rank, results in enumerate(_run(2, model_dir, two, batch, 0.3)):
        for name, got in zip(LAYOUTS, results, strict=True):
            assert torch.equal(got["recorded"]["routed_experts"], ref["recorded"]["routed_experts"]), (
                name,
                rank,
            )
            assert _rel(got["replayed"]["log_probs"], ref["replayed"]["log_probs"]) < 1e-4, (name, rank)
            assert abs(got["replay_train"]["loss"] - ref["replay_train"]["loss"]) <= 1e-4 * abs(
                ref["replay_train"]["loss"]
            )
            for n, grad in ref["replay_train"]["grads"].items():
                assert _rel(got["replay_train"]["grads"][n], grad) < 1e-4, (name, rank, n)


RECOMPUTE = [
    f"+{AM}.override_transformer_config.recompute_granularity=full",
    f"+{AM}.override_transformer_config.recompute_method=uniform",
    f"+{AM}.override_transformer_config.recompute_num_layers=1",
]


@pytest.mark.num_gpus(1)
def test_router_replay_holds_through_the_backward_recompute(tmp_path) -> None:
    """Full activation recompute: the backward re-runs every router; it must replay the same recorded experts
    (the engine keeps a micro-batch's targets until the next micro-batch; activation recompute needs CUDA)."""
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    model_dir = str(save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1))
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    layout = ["trainer.n_gpus_per_node=1", f"{A}.ppo_micro_batch_size_per_gpu=4", *COMMON, *RECOMPUTE]
    ((got,),) = _run(1, model_dir, [layout], batch, 0.3)
    recorded = _sorted(got["recorded"]["routed_experts"], batch)
    for layer, calls in enumerate(got["seen_train"]):
        assert len(calls) == 2, (layer, len(calls))  # the forward and the backward's recompute
        for call in calls:
            assert torch.equal(call.long().sort(dim=-1).values, recorded[:, layer]), layer
