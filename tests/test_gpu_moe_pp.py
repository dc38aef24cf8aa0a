"""GPU, NCCL: Qwen3-MoE with pipeline stages through megatron-core's schedules (1F1B, interleaved 1F1B), its
all-to-all token dispatcher with ``variable_seq_lengths`` (megatron-core refuses only the all-gather one) and its
DDP; PP 2, PP 2 x VPP 2, PP 2 x DP 2 and EP 2 x PP 2 equal one GPU.

megatron-core's schedule sets the aux-loss scale (``loss_scale / num_microbatches``) in every stage's forward
step, before that stage's backward, and the engine multiplies it by the pool (:func:`verl_engine.moe.aux_loss_scale`),
so each stage's routers get the scale they get without stages. fp32 without the distributed optimizer, TF32 off
by the engine's fp32 path: loss within 1e-4 relative, every gradient (global layer and expert names, joined over
stages and EP ranks) and every updated weight within 1e-4 relative of one GPU (reduction order only). bf16 (the
production dtype) at PP 2: loss within 2e-2 relative, and the joined gradient's cosine similarity with one GPU's
bf16 gradient >= 0.99 (bf16 rounding of activations differs with the send / receive between stages only through
the order of reductions; a wrong aux-loss scale or a lost stage is far outside either bound). The CPU twin
(fp32, gloo, the engine's own pipeline loop, 1e-5) is tests/test_rl_engine_moe_pp_cpu.py.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import verl_batch
from test_rl_engine_moe_pp_cpu import joined, rel

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
PP2 = f"{AM}.pipeline_model_parallel_size=2"
EP2 = f"{AM}.expert_model_parallel_size=2"
PROMPTS, RESPONSES = [3, 6, 1, 5], [7, 2, 5, 4]
FP32 = [
    "+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-3",
    f"{AM}.dtype=float32",
    f"{AM}.use_distributed_optimizer=false",
    f"{A}.use_kl_loss=true",
    f"{A}.entropy_coeff=0.01",
]
BF16 = [*FP32[:1], f"{AM}.dtype=bfloat16", *FP32[2:]]


def _micro(n: int) -> str:
    return f"{A}.ppo_micro_batch_size_per_gpu={n}"


def _model(tmp_path) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    path = tmp_path / "model"
    return str(save_tiny_hf_model("qwen3_moe", path, seed=3, num_hidden_layers=4, router_aux_loss_coef=0.1))


def _steps(world: int, model_dir: str, layouts: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Per layout, every rank's step (moe_pp_workers.moe_ppo_steps on CUDA)."""
    from moe_pp_workers import moe_ppo_steps

    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    critic = "critic.ppo_micro_batch_size_per_gpu=1"
    args = [[f"trainer.n_gpus_per_node={world}", critic, *v] for v in layouts.values()]
    per_rank = run_distributed(
        moe_ppo_steps, world_size=world, backend="nccl", args=(model_dir, args, batch, "cuda"), timeout_s=400
    )
    return {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(layouts)}


def _check(results: list[dict], ref: dict, what: str, *, bound: float = 1e-4) -> None:
    for key in ("grads", "params"):
        got, want = joined(results, key), ref[key]
        assert got.keys() == want.keys(), (what, key, sorted(set(got) ^ set(want)))
        worst = max(rel(got[n], want[n]) for n in want)
        print(f"{what} {key}: worst relative error {worst:.2e}")
        assert worst < bound, (what, key, worst)
    for result in results:
        assert abs(result["loss"] - ref["loss"]) <= bound * abs(ref["loss"]), (
            what,
            result["loss"],
            ref["loss"],
        )


@pytest.mark.num_gpus(2)
def test_moe_at_pp2_and_vpp2_on_two_gpus_matches_one_gpu(tmp_path) -> None:
    """PP 2 (1F1B) and PP 2 x VPP 2 (interleaved; the engine halves the one micro-batch of 4 into 2 of 2, so its
    reference is one GPU with 2 micro-batches: the aux loss is a statistic of each micro-batch), fp32, 1e-4;
    PP 2 in bf16 against one GPU in bf16 (loss 2e-2, gradient cosine >= 0.99)."""
    model_dir = _model(tmp_path)
    one = _steps(
        1,
        model_dir,
        {"mb4": [*FP32, _micro(4)], "mb2": [*FP32, _micro(2)], "bf16": [*BF16, _micro(4)]},
    )
    two = _steps(
        2,
        model_dir,
        {
            "pp2": [*FP32, _micro(4), PP2],
            "pp2_vpp2": [*FP32, _micro(4), PP2, f"{AM}.virtual_pipeline_model_parallel_size=2"],
            "pp2_bf16": [*BF16, _micro(4), PP2],
        },
    )
    _check(two["pp2"], one["mb4"][0], "pp2")
    _check(two["pp2_vpp2"], one["mb2"][0], "pp2_vpp2")
    ref = one["bf16"][0]
    got = joined(two["pp2_bf16"], "grads")
    assert got.keys() == ref["grads"].keys()
    flat_got = torch.cat([got[n].flatten().double() for n in ref["grads"]])
    flat_ref = torch.cat([ref["grads"][n].flatten().double() for n in ref["grads"]])
    cosine = float(torch.nn.functional.cosine_similarity(flat_got, flat_ref, dim=0))
    print(f"pp2 bf16: gradient cosine similarity {cosine:.6f}")
    assert cosine >= 0.99, cosine
    for result in two["pp2_bf16"]:
        assert abs(result["loss"] - ref["loss"]) <= 2e-2 * abs(ref["loss"]), (result["loss"], ref["loss"])


@pytest.mark.num_gpus(4)
def test_moe_at_pp2_dp2_and_ep2_pp2_on_four_gpus_matches_one_gpu(tmp_path) -> None:
    """PP 2 x DP 2 and EP 2 x PP 2 (all-to-all dispatcher between the 2 ranks of each stage's EP group, experts
    reduced over the expert-DP group) on 4 GPUs, fp32: gradients and updated weights within 1e-4 of one GPU.
    ETP 2 x PP 2 (sequential experts split over each stage's 2 ranks; megatron-core >= 0.19): the same, ETP
    slices joined."""
    from test_rl_engine_moe_ep_cpu import _mcore_minor, _per_expert
    from test_rl_engine_moe_pp_cpu import ETP2, etp_joined

    model_dir = _model(tmp_path)
    ref = _steps(1, model_dir, {"mb4": [*FP32, _micro(4)]})["mb4"][0]
    layouts = {"pp2_dp2": [*FP32, _micro(2), PP2], "pp2_ep2": [*FP32, _micro(2), PP2, EP2]}
    if _mcore_minor() >= (0, 19):
        layouts["pp2_etp2"] = [*FP32, _micro(2), PP2, *ETP2]
    four = _steps(4, model_dir, layouts)
    for name, results in four.items():
        if name != "pp2_etp2":
            _check(results, ref, name)
            continue
        for key in ("grads", "params"):
            got, want = etp_joined(results, key), _per_expert(ref[key])
            assert got.keys() == want.keys(), (key, sorted(set(got) ^ set(want)))
            worst = max(rel(got[n], want[n]) for n in want)
            assert worst < 1e-4, (name, key, worst)
