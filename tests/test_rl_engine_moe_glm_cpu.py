"""GLM-4.5 (DeepSeek-V3's sigmoid, group-limited router with expert bias; shared experts; a dense first layer)
through the RL engine on CPU, fp32, gloo.

One PPO step (PPO + entropy + KL, aux loss on) of a tiny random ``Glm4MoeForCausalLM`` at DP 2, static CP 2 and
dynamic CP on 2 ranks gives the gradients, the updated weights and the updated expert biases of the same step
on one rank (1e-5 relative; the biases bit for bit). The expert bias is not trained by gradients: after the
step it moves by ``moe_router_bias_update_rate`` x sign(mean load - load), the loads summed over the whole DP x CP
pool (:mod:`verl_engine.expert_bias`, megatron-core's ``finalize_model_grads`` rule); the test checks that it
moved, by exactly the rate, and that the token counts were zeroed after the update. Expert parallelism: EP 2
(4 experts per rank, grouped experts) at DP 2, static CP 2 and dynamic CP equals the same one-rank step, and the
weight export at EP 2 is the checkpoint, bitwise (expert bias and shared experts included). megatron-core < 0.16
refuses two ranks by name (no padding mask for the expert-bias counts). The engine checkpoint stores the expert
bias (a buffer) and restores it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from rl_engine_workers import verl_batch

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
STEP = [
    "+actor_rollout_ref.actor.optim.override_optimizer_config.adam_eps=1e-3",
    f"{A}.use_kl_loss=true",
    f"{A}.kl_loss_type=low_var_kl",
    f"{A}.entropy_coeff=0.01",
]
PROMPTS, RESPONSES = [3, 6, 1, 5], [7, 2, 5, 4]
TWO_RANK_LAYOUTS = {
    "dp2": [],
    "cp2": [f"{AM}.context_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4"],
    "dynamic_cp": [f"{AM}.dynamic_context_parallel=true", f"{AM}.max_seqlen_per_dp_cp_rank=8"],
}
RATE = 1e-3  # megatron-core's default moe_router_bias_update_rate, verl's DeepSeek-V3 choice


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    path = tmp_path_factory.mktemp("glm4_moe") / "model"
    return str(save_tiny_hf_model("glm4_moe", path, seed=3, router_aux_loss_coef=0.1))


def _steps(world: int, model_dir: str, layouts: dict[str, list[str]]) -> list[dict[str, dict]]:
    from moe_glm_workers import ppo_step_with_expert_bias

    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    micro = f"{A}.ppo_micro_batch_size_per_gpu={4 // world}"
    args = [[f"trainer.n_gpus_per_node={world}", micro, *STEP, *v] for v in layouts.values()]
    per_rank = run_distributed(ppo_step_with_expert_bias, world_size=world, args=(model_dir, args, batch))
    return [dict(zip(layouts, results, strict=True)) for results in per_rank]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(_rel(a[n], b[n]) for n in b)


def _equal_to_one_rank(one: dict, per_rank: list[dict[str, dict]], join: Any = None) -> None:
    """Per layout: every rank's loss, grad norm and expert biases (bitwise) against the one-rank step ``one``;
    gradients and updated weights within 1e-5: each rank's own (``join`` None: DP / CP replicas), or all ranks'
    joined by ``join(results, key)`` (EP ranks' experts, TP shards), experts compared per global expert."""
    from test_rl_engine_moe_ep_cpu import _per_expert

    for name in per_rank[0]:
        results = [ranks[name] for ranks in per_rank]
        for rank, result in enumerate(results):
            assert abs(result["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]) + 1e-7, (name, rank)
            assert result["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5), (
                name,
                rank,
            )
            for bias_name, bias in result["bias"].items():
                assert torch.equal(bias, one["bias"][bias_name]), (name, rank, bias_name)
        for key in ("grads", "params"):
            joined = [r[key] for r in results] if join is None else [join(results, key)]
            for got in joined:
                worst = _worst(_per_expert(got), _per_expert(one[key]))
                print(f"\n{name} {key}: worst rel. error {worst:.2e}")
                assert worst < 1e-5, (name, key, worst)


def _padding_mask_supported() -> bool:
    from verl_engine.moe import padding_mask_supported

    return padding_mask_supported()


def test_one_rank_step_moves_the_expert_bias_by_the_rate(glm_dir: str) -> None:
    """After the step each bias moved by rate x sign(mean load - load) of the step's routed tokens, and the
    counts were zeroed; the shared experts train."""
    one = _steps(1, glm_dir, {"one": []})[0]["one"]
    assert one["grads"] and one["metrics"]["grad_norm"] > 0
    assert sorted(one["counts"]) == [
        "decoder.layers.1.mlp.router",
        "decoder.layers.2.mlp.router",
    ]  # layer 0: dense
    tokens = sum(PROMPTS) + sum(RESPONSES)
    for router, counts in one["counts"].items():
        assert float(counts.sum()) == tokens * 2, (router, counts)  # top-2, padding not counted
        name = f"{router}.expert_bias"
        expected = one["bias_before"][name] + torch.sign(counts.mean() - counts) * RATE
        assert torch.equal(one["bias"][name], expected), (name, one["bias"][name] - one["bias_before"][name])
        assert not torch.equal(one["bias"][name], one["bias_before"][name]), name
        assert float(one["counts_after"][router].abs().sum()) == 0, router
    shared = [n for n in one["grads"] if ".mlp.shared_experts." in n]
    assert shared and all(float(one["grads"][n].abs().max()) > 0 for n in shared)


def test_ppo_step_at_dp2_cp2_and_dynamic_cp_equals_one_rank(glm_dir: str) -> None:
    if not _supports_two_ranks():
        from rl_engine_workers import build_error

        overrides = ["trainer.n_gpus_per_node=2", *TWO_RANK_LAYOUTS["cp2"]]
        for message in run_distributed(build_error, world_size=2, args=(glm_dir, overrides)):
            assert "megatron-core >= 0.16" in message and "expert bias" in message, message
        return
    one = _steps(1, glm_dir, {"one": []})[0]["one"]
    _equal_to_one_rank(one, _steps(2, glm_dir, TWO_RANK_LAYOUTS))


def _supports_two_ranks() -> bool:
    return _padding_mask_supported()


EP2 = f"{AM}.expert_model_parallel_size=2"


def _gathered_ep2(per_rank: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Both EP ranks' ``key`` tensors by global expert name (4 of the 8 experts each); the rest (router, expert
    bias, shared experts, attention) is replicated and must agree bitwise."""
    from test_rl_engine_moe_ep_cpu import _global

    out: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(per_rank):
        for name, value in _global(result[key], ep_rank=rank, local=4).items():
            if name in out:
                assert ".local_experts." not in name and torch.equal(out[name], value), (key, name, rank)
            out.setdefault(name, value)
    return out


def test_expert_parallel_step_equals_one_rank(glm_dir: str) -> None:
    """EP 2 (grouped experts, 4 per rank) at DP 2, static CP 2 and dynamic CP: the step of one rank at EP 1."""
    if not _supports_two_ranks():
        return  # refused as in test_ppo_step_at_dp2_cp2_and_dynamic_cp_equals_one_rank
    layouts = {name: [EP2, *overrides] for name, overrides in TWO_RANK_LAYOUTS.items()}
    one = _steps(1, glm_dir, {"one": []})[0]["one"]
    _equal_to_one_rank(one, _steps(2, glm_dir, layouts), join=_gathered_ep2)


def test_export_at_ep2_is_the_checkpoint_bitwise(glm_dir: str) -> None:
    """Experts broadcast from their EP rank, expert bias and shared experts included: the checkpoint, bitwise."""
    if not _supports_two_ranks():
        return  # the actor is refused on two ranks (test_ppo_step_at_dp2_cp2_and_dynamic_cp_equals_one_rank)
    from pathlib import Path

    from moe_ep_workers import export_state
    from safetensors.torch import load_file

    overrides = ["trainer.n_gpus_per_node=2", EP2]
    exported = run_distributed(export_state, world_size=2, args=(glm_dir, overrides))[0]
    checkpoint = load_file(str(Path(glm_dir) / "model.safetensors"))
    assert sorted(exported) == sorted(checkpoint)
    assert all(torch.equal(exported[n], checkpoint[n]) for n in checkpoint)


def test_engine_checkpoint_keeps_the_expert_bias(glm_dir: str, tmp_path) -> None:
    """The expert bias is a buffer, not a parameter: the engine's checkpoint stores and restores it all the same."""
    from moe_glm_workers import checkpoint_keeps_expert_bias

    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    overrides = ["trainer.n_gpus_per_node=1", f"{A}.ppo_micro_batch_size_per_gpu=4", *STEP]
    (got,) = run_distributed(
        checkpoint_keeps_expert_bias, world_size=1, args=(glm_dir, overrides, batch, str(tmp_path / "ckpt"))
    )
    assert got["saved"] and got["saved"].keys() == got["loaded"].keys()
    for name, bias in got["saved"].items():
        assert not torch.equal(got["initial"][name], bias), name  # the step moved it: the load is seen
        assert torch.equal(got["loaded"][name], bias), name


def test_glm_at_pp2_equals_one_rank(tmp_path) -> None:
    """GLM-4.5 over two pipeline stages (4 layers: the dense first layer and an MoE layer on stage 0, two MoE
    layers on stage 1): gradients, updated weights and the moved expert biases equal one rank's (each stage
    moves its own routers' biases from its own token counts)."""
    from moe_pp_workers import moe_ppo_steps

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    path = str(
        save_tiny_hf_model(
            "glm4_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1, num_hidden_layers=4
        )
    )
    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    common = [f"{A}.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=1", *STEP]
    ((one,),) = run_distributed(
        moe_ppo_steps, world_size=1, args=(path, [["trainer.n_gpus_per_node=1", *common]], batch)
    )
    assert len(one["expert_bias"]) == 3, sorted(one["expert_bias"])  # layers 1-3 route
    pp = ["trainer.n_gpus_per_node=2", *common, f"{AM}.pipeline_model_parallel_size=2"]
    per_rank = run_distributed(moe_ppo_steps, world_size=2, args=(path, [pp], batch))
    got = {key: {} for key in ("grads", "params", "expert_bias")}
    for (result,) in per_rank:
        assert abs(result["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]) + 1e-7, result["loss"]
        assert result["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
        for key in got:
            got[key].update(result[key])
    for key in ("grads", "params"):
        worst = _worst(got[key], one[key])
        print(f"\npp2 {key}: worst rel. error {worst:.2e}")
        assert worst < 1e-5, (key, worst)
    assert got["expert_bias"].keys() == one["expert_bias"].keys()
    for name, bias in got["expert_bias"].items():
        assert torch.equal(bias, one["expert_bias"][name]), name


def test_glm_mtp_layer_moves_its_expert_bias_and_equals_one_rank(tmp_path) -> None:
    """GLM-4.5 with its MTP layer (``num_nextn_predict_layers=1``, an MoE layer with expert bias and shared
    experts; the MTP loss on): the MTP router counts every routed token of the step (top-2, padding not counted)
    and moves its bias by the rate like the decoder's; DP 2, static CP 2 and dynamic CP equal one rank (gradients
    and weights 1e-5, the MTP router's bias bitwise)."""
    from rl_engine_workers import MTP_ON

    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    path = str(
        save_tiny_hf_model(
            "glm4_moe", tmp_path / "model", seed=3, router_aux_loss_coef=0.1, num_nextn_predict_layers=1
        )
    )
    layouts = {k: [*MTP_ON, *v] for k, v in TWO_RANK_LAYOUTS.items()}
    one = _steps(1, path, {"one": MTP_ON})[0]["one"]
    mtp = [r for r in one["counts"] if r.startswith("mtp.")]
    assert len(mtp) == 1, sorted(one["counts"])
    counts = one["counts"][mtp[0]]
    assert float(counts.sum()) == (sum(PROMPTS) + sum(RESPONSES)) * 2, counts
    name = f"{mtp[0]}.expert_bias"
    expected = one["bias_before"][name] + torch.sign(counts.mean() - counts) * RATE
    assert torch.equal(one["bias"][name], expected) and not torch.equal(expected, one["bias_before"][name])
    assert any(n.startswith("mtp.") and ".shared_experts." in n for n in one["grads"])
    if not _supports_two_ranks():
        return  # two ranks are refused by name on megatron-core < 0.16 (the test above)
    _equal_to_one_rank(one, _steps(2, path, layouts))


def test_glm_mtp_at_tp2_with_sequence_parallelism_equals_one_rank(tmp_path) -> None:
    """GLM-4.5 with its MTP layer loaded from the checkpoint, at TP 2 + SP (MoE at TP > 1 needs SP, and MTP layers
    refused SP before: their norms were megatron-core's torch norms). The MTP layer's enorm / hnorm / final norm
    act on the sequence shard, its eh_proj and decoder layer are split over TP and its router sees this shard's
    padding mask: gradients and updated weights (TP shards joined, the MTP layer's included) 1e-5, the expert
    biases (MTP router's included) bitwise against one rank."""
    from rl_engine_workers import MTP_ON
    from sp_workers import tp_joined
    from test_rl_engine_mtp_cpu import _glm_checkpoint_with_mtp_layer

    path, _, _, _ = _glm_checkpoint_with_mtp_layer(tmp_path)
    tp2 = [*MTP_ON, f"{AM}.tensor_model_parallel_size=2", f"{AM}.expert_tensor_parallel_size=1"]
    if not _supports_two_ranks():
        from rl_engine_workers import build_error

        for message in run_distributed(
            build_error, world_size=2, args=(path, ["trainer.n_gpus_per_node=2", *tp2])
        ):
            assert "megatron-core >= 0.1" in message, message  # ETP 1 needs 0.19, the expert bias 0.16
        return
    one = _steps(1, path, {"one": MTP_ON})[0]["one"]
    assert any(n.startswith("mtp.") and n.endswith("eh_proj.weight") for n in one["grads"])
    assert any(n.startswith("mtp.") for n in one["bias"]), sorted(one["bias"])
    _equal_to_one_rank(one, _steps(2, path, {"tp2": tp2}), join=partial(tp_joined, model_type="glm4_moe"))


def test_glm_at_tp2_with_sequence_parallelism_equals_one_rank(glm_dir: str) -> None:
    """TP 2 + SP (the block of dense and MoE layers gets the sequence-parallel final norm): experts at ETP 1
    (grouped, whole experts per TP rank) and at ETP = TP (sequential, split): gradients and updated weights, TP
    shards joined, 1e-5; the expert biases (moved from token counts summed over TP x the pool) bitwise. TP pads
    the packed sequences: megatron-core < 0.16 refuses by name (no padding mask for the expert-bias counts)."""
    from sp_workers import tp_joined

    tp2 = [f"{AM}.tensor_model_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4"]
    layouts = {
        "tp2_etp1": [*tp2, f"{AM}.expert_tensor_parallel_size=1"],
        "tp2_etp2": [*tp2, f"+{AM}.override_transformer_config.moe_grouped_gemm=false"],
    }
    if not _supports_two_ranks():
        from rl_engine_workers import build_error

        overrides = ["trainer.n_gpus_per_node=2", *layouts["tp2_etp2"]]  # ETP 1 is refused for 0.14 itself
        for message in run_distributed(build_error, world_size=2, args=(glm_dir, overrides)):
            assert "megatron-core >= 0.16" in message and "expert bias" in message, message
        return
    one = _steps(1, glm_dir, {"one": []})[0]["one"]
    _equal_to_one_rank(one, _steps(2, glm_dir, layouts), join=partial(tp_joined, model_type="glm4_moe"))
