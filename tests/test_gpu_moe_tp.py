"""GPU, NCCL: tensor parallelism with sequence parallelism (SP) without Transformer Engine, Qwen3-MoE and Qwen3.

The CPU tests (``tests/test_rl_engine_sequence_parallel*_cpu.py``) run the engine's own loop with gloo
collectives (:mod:`verl_mcore_utils.sp_portable`); here megatron-core's own SP collectives, schedule, DDP and
``finalize_model_grads`` (which sums the ``sequence_parallel`` norms' and routers' gradients over TP) run on
2 GPUs at TP 2 + SP, norms from :mod:`verl_mcore_utils.sp_norm`. fp32 without the distributed optimizer,
TF32 off by the engine's fp32 path: loss and every gradient, TP shards joined, within 1e-4 relative of one GPU.
MoE: experts at ETP = TP = 2 (sequential experts; all-to-all dispatcher over TP) and at ETP 1 (grouped experts,
each TP rank runs whole experts on its own shard); GLM-4.5 (dense first layer, expert bias) at ETP 1, also with
its MTP layer loaded from the checkpoint and trained (MTP layers with SP).
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import mtp_step_layouts, verl_batch
from sp_workers import tp_joined

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
    f"{A}.ppo_micro_batch_size_per_gpu=4",
]
TP2_SP = [f"{AM}.tensor_model_parallel_size=2", f"{AM}.sequence_parallel=true"]
LAYOUTS = {
    "qwen3_moe": {
        "etp2_sequential": [*TP2_SP, f"+{AM}.override_transformer_config.moe_grouped_gemm=false"],
        "etp1_grouped": [*TP2_SP, f"{AM}.expert_tensor_parallel_size=1"],
    },
    "qwen3": {"dense": TP2_SP},
    # GLM-4.5: dense first layer and MoE layers in one block (its final norm sequence-parallel), expert bias
    "glm4_moe": {"etp1_grouped": [*TP2_SP, f"{AM}.expert_tensor_parallel_size=1"]},
    # GLM-4.5 with its MTP layer loaded from the checkpoint and the MTP loss on: the MTP layer at TP 2 + SP
    "glm4_moe_mtp": {"etp1_grouped_mtp": [*TP2_SP, f"{AM}.expert_tensor_parallel_size=1"]},
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _per_expert(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from test_gpu_moe import _per_expert as per_expert

    return per_expert(grads)


@pytest.mark.num_gpus(2)
@pytest.mark.parametrize("model_type", list(LAYOUTS))
def test_tp2_sequence_parallel_on_two_gpus_matches_one_gpu(tmp_path, model_type: str) -> None:
    from rl_engine_workers import MTP_ON

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    mtp = model_type == "glm4_moe_mtp"
    if mtp:
        from test_rl_engine_mtp_cpu import _glm_checkpoint_with_mtp_layer

        model_dir = _glm_checkpoint_with_mtp_layer(tmp_path)[0]
    else:
        extra = {"router_aux_loss_coef": 0.1} if model_type != "qwen3" else {}
        model_dir = str(save_tiny_hf_model(model_type, tmp_path / "model", seed=3, **extra))
    common = [*COMMON, *MTP_ON] if mtp else COMMON
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    one = [["trainer.n_gpus_per_node=1", *common]]
    ((ref,),) = run_distributed(
        mtp_step_layouts, world_size=1, backend="nccl", args=(model_dir, one, batch, 0, "cuda"), timeout_s=300
    )
    layouts = LAYOUTS[model_type]
    two = [["trainer.n_gpus_per_node=2", *common, *v] for v in layouts.values()]
    results = run_distributed(
        mtp_step_layouts, world_size=2, backend="nccl", args=(model_dir, two, batch, 0, "cuda"), timeout_s=300
    )
    expected = _per_expert(ref["grads"])
    for i, name in enumerate(layouts):
        per_rank = [rank_results[i] for rank_results in results]
        for got in per_rank:
            assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (name, got["loss"], ref["loss"])
        joined = _per_expert(
            tp_joined(per_rank, "grads", model_type=model_type.removesuffix("_mtp"), rtol=1e-6)
        )
        assert joined.keys() == expected.keys(), name
        worst = max(_rel(joined[n], expected[n]) for n in expected)
        print(f"TP 2 + SP on NCCL, {model_type} {name}: worst gradient relative error {worst:.2e}")
        assert worst < 1e-4, (name, worst)
