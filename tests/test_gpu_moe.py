"""GPU, NCCL: Qwen3-MoE through megatron-core's schedule, DDP and token dispatcher; the aux loss at DP 2, CP 2
and dynamic CP equals one GPU (the verl #6609 regression on the megatron backend).

The CPU test (``tests/test_rl_engine_moe_cpu.py``) covers the engine's own loop; here megatron-core's schedule
sets the aux-loss scale before every backward and the engine multiplies it by the pool size
(:func:`verl_engine.moe.aux_loss_scale`), and megatron-core's DDP averages the gradients. fp32 without the
distributed optimizer (every rank holds the whole reduced gradient), TF32 off by the engine's fp32 path:
loss, metrics and every gradient within 1e-4 relative of one GPU (reduction order only; a missing pool
factor is off by 2x, the #6609 bug by more). Expert parallelism: EP 2 on 2 GPUs (all-to-all dispatcher) at the
same layouts, gradients gathered per global expert, equals EP 1 on one GPU within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import mtp_step_layouts, verl_batch

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
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.num_gpus(2)
@pytest.mark.parametrize("mtp", [False, True], ids=["no_mtp", "mtp"])
def test_moe_aux_loss_on_two_gpus_matches_one_gpu(tmp_path, mtp: bool) -> None:
    """``mtp``: two MTP layers (MoE layers, their routers' aux loss and padding mask included) and the MTP loss."""
    from rl_engine_workers import MTP_ON

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    extra = {"num_nextn_predict_layers": 2} if mtp else {}
    model_dir = str(
        save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1, **extra)
    )
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    common = [*COMMON, *MTP_ON] if mtp else COMMON
    one = [["trainer.n_gpus_per_node=1", f"{A}.ppo_micro_batch_size_per_gpu=4", *common]]
    ((ref,),) = run_distributed(
        mtp_step_layouts, world_size=1, backend="nccl", args=(model_dir, one, batch, 0, "cuda"), timeout_s=300
    )
    routers = [n for n in ref["grads"] if n.endswith("mlp.router.weight")]
    assert routers and all(float(ref["grads"][n].abs().max()) > 0 for n in routers)
    if mtp:
        assert any(n.startswith("mtp.") for n in routers)
    two = [["trainer.n_gpus_per_node=2", *common, *v] for v in LAYOUTS.values()]
    results = run_distributed(
        mtp_step_layouts, world_size=2, backend="nccl", args=(model_dir, two, batch, 0, "cuda"), timeout_s=300
    )
    for rank_results in results:
        for name, got in zip(LAYOUTS, rank_results, strict=True):
            assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (name, got["loss"], ref["loss"])
            for key in (k for k in ref["metrics"] if k.startswith("mtp_losses/")):
                assert abs(got["metrics"][key] - ref["metrics"][key]) <= 1e-4 * ref["metrics"][key], (
                    name,
                    key,
                )
            assert got["grads"].keys() == ref["grads"].keys(), name
            worst = max(_rel(got["grads"][n], ref["grads"][n]) for n in ref["grads"])
            assert worst < 1e-4, (name, worst)


def _per_expert(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Grouped experts' stacked ``mlp.experts.linear_fc{1,2}_weight`` as SequentialMLP's per-expert names."""
    import re

    out = {}
    for name, value in grads.items():
        m = re.match(r"^(.*\.mlp\.experts\.)linear_fc([12])_weight$", name)
        if m is None:
            out[name] = value
            continue
        for e in range(value.shape[0]):
            out[f"{m[1]}local_experts.{e}.linear_fc{m[2]}.weight"] = value[e]
    return out


def _global_experts(grads: dict[str, torch.Tensor], *, ep_rank: int, local: int) -> dict[str, torch.Tensor]:
    """Local expert indices turned global: EP rank ``r`` holds experts ``r * local ...``."""
    import re

    out = {}
    for name, value in _per_expert(grads).items():
        m = re.match(r"^(.*\.local_experts\.)(\d+)(\..+)$", name)
        out[f"{m[1]}{ep_rank * local + int(m[2])}{m[3]}" if m else name] = value
    return out


@pytest.mark.num_gpus(2)
def test_expert_parallel_on_two_gpus_matches_one_gpu(tmp_path) -> None:
    """EP 2 (megatron-core's all-to-all dispatcher on NCCL, its DDP reducing experts over the expert-DP group)
    at DP 2, CP 2 and dynamic CP: the gradients gathered per global expert equal EP 1 on one GPU, 1e-4."""
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    model_dir = str(save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1))
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    one = [["trainer.n_gpus_per_node=1", f"{A}.ppo_micro_batch_size_per_gpu=4", *COMMON]]
    ((ref,),) = run_distributed(
        mtp_step_layouts, world_size=1, backend="nccl", args=(model_dir, one, batch, 0, "cuda"), timeout_s=300
    )
    ep2 = f"{AM}.expert_model_parallel_size=2"
    two = [["trainer.n_gpus_per_node=2", ep2, *COMMON, *v] for v in LAYOUTS.values()]
    results = run_distributed(
        mtp_step_layouts, world_size=2, backend="nccl", args=(model_dir, two, batch, 0, "cuda"), timeout_s=300
    )
    for i, name in enumerate(LAYOUTS):
        gathered: dict[str, torch.Tensor] = {}
        for rank, rank_results in enumerate(results):
            got = rank_results[i]
            assert abs(got["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (name, got["loss"], ref["loss"])
            for n, g in _global_experts(got["grads"], ep_rank=rank, local=2).items():
                gathered.setdefault(n, g)
        expected = _per_expert(ref["grads"])
        assert gathered.keys() == expected.keys(), name
        worst = max(_rel(gathered[n], expected[n]) for n in expected)
        print(f"EP 2 on NCCL, {name}: worst gradient relative error {worst:.2e}")
        assert worst < 1e-4, (name, worst)


@pytest.mark.num_gpus(2)
def test_expert_tensor_parallel_on_two_gpus_matches_one_gpu(tmp_path) -> None:
    """ETP 2 at TP 1 (each expert's fc1 / fc2 split over the 2 GPUs, all-to-all dispatcher) at DP 2: the
    gradients, expert slices joined, equal one GPU, 1e-4. Needs megatron-core >= 0.19 (refused below)."""
    from verl_mcore_utils.compat import mcore_version
    from verl_mcore_utils.hf_testing import save_tiny_hf_model, tiny_hf_config
    from verl_mcore_utils.weights.fused import tp_unshard
    from verl_mcore_utils.weights.names import param_mappings

    if (mcore_version().major, mcore_version().minor) < (0, 19):
        pytest.skip("expert_tensor_parallel_size is refused on megatron-core < 0.19")
    model_dir = str(save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1))
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    one = [["trainer.n_gpus_per_node=1", f"{A}.ppo_micro_batch_size_per_gpu=4", *COMMON]]
    ((ref,),) = run_distributed(
        mtp_step_layouts, world_size=1, backend="nccl", args=(model_dir, one, batch, 0, "cuda"), timeout_s=300
    )
    etp2 = [
        f"{AM}.expert_tensor_parallel_size=2",
        f"+{AM}.override_transformer_config.moe_grouped_gemm=false",
    ]
    two = [["trainer.n_gpus_per_node=2", *etp2, *COMMON, *LAYOUTS["dp2"]]]
    results = run_distributed(
        mtp_step_layouts, world_size=2, backend="nccl", args=(model_dir, two, batch, 0, "cuda"), timeout_s=300
    )
    mappings = {m.megatron_name: m for m in param_mappings(hf_config=tiny_hf_config("qwen3_moe"))}
    got = dict(results[0][0]["grads"])
    for name in got:
        if ".local_experts." in name:  # ETP rank r = rank r (ETP is the innermost expert dimension)
            got[name] = tp_unshard(
                [results[0][0]["grads"][name], results[1][0]["grads"][name]], mappings[name]
            )
    expected = _per_expert(ref["grads"])  # one GPU: grouped experts (the default), stacked
    assert got.keys() == expected.keys()
    worst = max(_rel(got[n], expected[n]) for n in expected)
    print(f"ETP 2 on NCCL: worst gradient relative error {worst:.2e}")
    assert worst < 1e-4, worst
