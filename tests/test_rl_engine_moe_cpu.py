"""Mixture-of-experts (Qwen3-MoE) through the RL engine on CPU, fp32, gloo: the load-balancing loss is the
micro-batch's whatever the layout.

verl #6609: with context parallelism the router's aux-loss gradient came out wrong (grad norm ~3168 at CP 2).
Here, before the fix, one PPO step of a tiny Qwen3-MoE gave grad norm 0.872 at CP 1 and 1.139 at CP 2 with
``router_aux_loss_coef=0.1`` (equal with 0). The engine now computes the router statistics over every rank that
holds a piece of the micro-batch, excludes padding, and scales the aux-loss backward per call
(:mod:`verl_engine.moe`). The regression test: one PPO step (PPO + entropy + KL) at DP 2, static CP 2 and
dynamic CP on 2 ranks gives the gradients and updated weights of the same step on one rank, fp32, 1e-5
relative (the dense engine's bound). A second test shows the aux loss is live: the gradient with coefficient
0.1 differs from the one with 0 on the routers.
"""

from __future__ import annotations

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
    # static CP 2 on 2 ranks is one data-parallel rank: its micro-batch size is the whole 4 (DP 2 and dynamic
    # CP share the pool's micro-batch of 2 per rank)
    "cp2": [f"{AM}.context_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4"],
    "dynamic_cp": [f"{AM}.dynamic_context_parallel=true", f"{AM}.max_seqlen_per_dp_cp_rank=8"],
}


def _tiny_moe(path, coef: float) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen3_moe", path, seed=3, router_aux_loss_coef=coef))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return _tiny_moe(tmp_path_factory.mktemp("qwen3_moe") / "model", 0.1)


def _steps(world: int, model_dir: str, layouts: dict[str, list[str]]) -> list[dict[str, dict]]:
    from rl_engine_workers import ppo_step_layouts

    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    # one micro-batch of the 4 sequences: 4 per rank on one rank, 2 per DP rank (the pool's 4) on two
    micro = f"{A}.ppo_micro_batch_size_per_gpu={4 // world}"
    args = [[f"trainer.n_gpus_per_node={world}", micro, *STEP, *v] for v in layouts.values()]
    per_rank = run_distributed(ppo_step_layouts, world_size=world, args=(model_dir, args, batch))
    return [dict(zip(layouts, results, strict=True)) for results in per_rank]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(_rel(a[n], b[n]) for n in b)


def _supports_padding_mask() -> bool:
    from verl_engine.moe import padding_mask_supported

    return padding_mask_supported()


def test_aux_loss_gradient_at_dp2_cp2_and_dynamic_cp_equals_one_rank(moe_dir: str) -> None:
    if not _supports_padding_mask():  # megatron-core < 0.16: refused by name, before any model is built
        from rl_engine_workers import build_error

        overrides = ["trainer.n_gpus_per_node=2", *TWO_RANK_LAYOUTS["cp2"]]
        for message in run_distributed(build_error, world_size=2, args=(moe_dir, overrides)):
            assert "router_aux_loss_coef=0.1" in message and "megatron-core >= 0.16" in message, message
        return
    one = _steps(1, moe_dir, {"one": []})[0]["one"]
    assert one["grads"] and one["metrics"]["grad_norm"] > 0
    for rank, got in enumerate(_steps(2, moe_dir, TWO_RANK_LAYOUTS)):
        for name, result in got.items():
            assert abs(result["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]) + 1e-7, (name, rank)
            assert result["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5), (
                name
            )
            for key in ("grads", "params"):
                worst = _worst(result[key], one[key])
                assert worst < 1e-5, (name, rank, key, worst)


def test_the_aux_loss_reaches_the_router_gradients_only(tmp_path) -> None:
    """Coefficient 0.1 vs 0 on one rank (packed, no padding: any megatron-core): the routers' gradients differ."""
    with_aux = _steps(1, _tiny_moe(tmp_path / "aux", 0.1), {"one": []})[0]["one"]["grads"]
    no_aux = _steps(1, _tiny_moe(tmp_path / "no_aux", 0.0), {"one": []})[0]["one"]["grads"]
    routers = [n for n in with_aux if n.endswith("mlp.router.weight")]
    assert routers
    for name in routers:
        assert _rel(with_aux[name], no_aux[name]) > 1e-3, name
    # the aux loss enters through the routers' probabilities: the last layer's experts (nothing after them
    # routes) get the same gradient; earlier layers differ through the hidden states later routers see
    last = max(int(n.split(".")[2]) for n in routers)
    experts = [n for n in with_aux if n.startswith(f"decoder.layers.{last}.mlp.experts.")]
    assert experts and all(_rel(with_aux[n], no_aux[n]) < 1e-6 for n in experts)


def test_z_loss_over_several_ranks_is_refused_before_any_work(moe_dir: str) -> None:
    """megatron-core's z-loss is a per-rank mean: not the micro-batch's when ranks hold different token counts."""
    from rl_engine_workers import build_error

    z = f"+{AM}.override_transformer_config.moe_z_loss_coeff=0.001"
    for message in run_distributed(
        build_error, world_size=2, args=(moe_dir, ["trainer.n_gpus_per_node=2", z])
    ):
        assert "moe_z_loss_coeff=0.001" in message and "2 ranks" in message, message


def test_a_sequence_wise_load_balancing_loss_is_refused_before_any_work(moe_dir: str) -> None:
    """DeepSeek-V3's sequence-wise balance (``seq_aux_loss``): megatron-core takes each row of its [s, b] input as
    one sequence, and the engine's packed micro-batch is one row of many sequences, so it would balance the
    packing, not the sequences: refused by name, even on one rank, rather than train a different loss."""
    from rl_engine_workers import build_error

    seq = f"+{AM}.override_transformer_config.moe_router_load_balancing_type=seq_aux_loss"
    (message,) = run_distributed(
        build_error, world_size=1, args=(moe_dir, ["trainer.n_gpus_per_node=1", seq])
    )
    assert "moe_router_load_balancing_type=seq_aux_loss" in message and "=aux_loss" in message, message
