"""GPU, NCCL: GLM-4.5 (DeepSeek-V3 router with expert bias, shared experts, a dense first layer) through
megatron-core's schedule, DDP and all-to-all dispatcher: one PPO step at DP 2, static CP 2, dynamic CP and EP 2
on two GPUs equals one GPU.

On the megatron backend megatron-core itself moves the expert bias (``finalize_model_grads``, counts summed over
TP x DP with its DP group being the engine's DP x CP pool), and the routers count tokens with the padding mask on
the token axis (:mod:`verl_mcore_utils.moe_layers`; megatron-core 0.19.2's own mask does not broadcast). fp32, no
distributed optimizer: loss, grad norm, gradients and updated weights within 1e-4 relative of one GPU, the
expert biases equal and moved by the step.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import verl_batch

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
PROMPTS, RESPONSES = [3, 6, 1, 5], [7, 2, 5, 4]
COMMON = [
    "+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-3",
    f"{AM}.dtype=float32",
    f"{AM}.use_distributed_optimizer=false",
    f"{A}.use_kl_loss=true",
    f"{A}.entropy_coeff=0.01",
]
LAYOUTS = {
    "dp2": [f"{A}.ppo_micro_batch_size_per_gpu=2"],
    "cp2": [f"{AM}.context_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4"],
    "dynamic_cp": [
        f"{A}.ppo_micro_batch_size_per_gpu=2",
        f"{AM}.dynamic_context_parallel=true",
        f"{AM}.max_seqlen_per_dp_cp_rank=8",
    ],
    "ep2": [f"{A}.ppo_micro_batch_size_per_gpu=2", f"{AM}.expert_model_parallel_size=2"],
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.num_gpus(2)
def test_glm_moe_step_on_two_gpus_matches_one_gpu(tmp_path) -> None:
    from moe_glm_workers import ppo_step_with_expert_bias
    from test_rl_engine_moe_ep_cpu import _per_expert
    from test_rl_engine_moe_glm_cpu import _gathered_ep2

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    model_dir = str(save_tiny_hf_model("glm4_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1))
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    one = [["trainer.n_gpus_per_node=1", f"{A}.ppo_micro_batch_size_per_gpu=4", *COMMON]]
    ((ref,),) = run_distributed(
        ppo_step_with_expert_bias,
        world_size=1,
        backend="nccl",
        args=(model_dir, one, batch, "cuda"),
        timeout_s=300,
    )
    assert ref["bias"] and all(not torch.equal(ref["bias"][n], ref["bias_before"][n]) for n in ref["bias"])
    two = [["trainer.n_gpus_per_node=2", *COMMON, *v] for v in LAYOUTS.values()]
    per_rank = run_distributed(
        ppo_step_with_expert_bias,
        world_size=2,
        backend="nccl",
        args=(model_dir, two, batch, "cuda"),
        timeout_s=300,
    )
    for index, name in enumerate(LAYOUTS):
        results = [ranks[index] for ranks in per_rank]
        for got in results:
            assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]) + 1e-6, name
            assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-4), name
            for bias_name, bias in got["bias"].items():
                assert torch.equal(bias, ref["bias"][bias_name]), (name, bias_name)
        for key in ("grads", "params"):
            got = _gathered_ep2(results, key) if name == "ep2" else results[0][key]
            want = _per_expert(ref[key]) if name == "ep2" else ref[key]
            worst = max(_rel(got[n], want[n]) for n in want)
            print(f"GLM-4.5 {name} {key}: worst relative error {worst:.2e}")
            assert worst < 1e-4, (name, key, worst)
