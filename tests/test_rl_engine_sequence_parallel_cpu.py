"""Tensor parallelism with sequence parallelism (SP) without Transformer Engine, through the RL engine on CPU.

megatron-core needs SP for mixture-of-experts models at TP > 1; its torch norm asserts SP off, so the local spec
uses :class:`verl_mcore_utils.sp_norm.SequenceParallelNorm` (per-token norms, weights marked
``sequence_parallel``) and the CPU backend sums the TP-shared gradients as megatron-core's
``finalize_model_grads`` does (:mod:`verl_engine.tp_grads`: SP-marked norms and routers, q / k norms).
A tiny Qwen3 (q / k norms, head_dim != hidden / heads): one PPO step (PPO + entropy + KL) at TP 2 + SP, at
TP 2 without SP (the q / k norm sum alone), and on 4 ranks at TP 2 + SP with DP 2, static CP 2 and dynamic CP,
gives, TP shards joined, the gradients and updated weights of one rank (fp32, gloo, 1e-5 relative); log-probs
equal one rank's.
"""

from __future__ import annotations

import pytest
from rl_engine_workers import infer_layouts, verl_batch
from sp_workers import tp_joined
from test_rl_engine_moe_cpu import _worst

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
TP2 = f"{AM}.tensor_model_parallel_size=2"
TWO = {"tp2_sp": [TP2, f"{AM}.sequence_parallel=true"], "tp2": [TP2, f"{AM}.sequence_parallel=false"]}
FOUR = {
    "tp2_sp_dp2": [TP2],
    "tp2_sp_cp2": [TP2, f"{AM}.context_parallel_size=2", f"{A}.ppo_micro_batch_size_per_gpu=4"],
    "tp2_sp_dynamic_cp": [TP2, f"{AM}.dynamic_context_parallel=true", f"{AM}.max_seqlen_per_dp_cp_rank=8"],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_sp") / "model", seed=3))


def steps(world: int, model_dir: str, layouts: dict[str, list[str]], *, pool: int) -> list[dict[str, dict]]:
    """One PPO step per layout on ``world`` ranks (a DP x CP pool of ``pool``); per rank {layout: result}."""
    from rl_engine_workers import ppo_step_layouts

    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    micro = f"{A}.ppo_micro_batch_size_per_gpu={4 // pool}"  # the 4 sequences in one micro-batch of the pool
    critic = f"critic.ppo_micro_batch_size_per_gpu={max(4 // world, 1)}"  # validated at DP = world (TP 1)
    args = [[f"trainer.n_gpus_per_node={world}", micro, critic, *STEP, *v] for v in layouts.values()]
    per_rank = run_distributed(
        ppo_step_layouts, world_size=world, args=(model_dir, args, batch), timeout_s=600
    )
    return [dict(zip(layouts, results, strict=True)) for results in per_rank]


def check_against_one_rank(
    one: dict, per_rank: list[dict[str, dict]], *, model_type: str, expected=lambda named: named
) -> dict[str, float]:
    """Every layout's loss, grad norm, joined gradients and updated weights against ``one``; the worst errors."""
    worst_seen = {}
    for name in per_rank[0]:
        results = [ranks[name] for ranks in per_rank]
        for result in results:
            assert abs(result["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]) + 1e-7, name
            assert result["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5), (
                name
            )
        for key in ("grads", "params"):
            got = tp_joined(results, key, model_type=model_type)
            worst = _worst(got, expected(one[key]))
            print(f"{name} {key}: worst relative error {worst:.2e}")
            assert worst < 1e-5, (name, key, worst)
            worst_seen[f"{name}/{key}"] = worst
    return worst_seen


def test_tp2_with_and_without_sp_equals_one_rank(model_dir: str) -> None:
    one = steps(1, model_dir, {"one": []}, pool=1)[0]["one"]
    norms = [n for n in one["grads"] if "layernorm" in n]
    assert norms and all(float(one["grads"][n].abs().max()) > 0 for n in norms)
    check_against_one_rank(one, steps(2, model_dir, TWO, pool=1), model_type="qwen3")


def test_tp2_sp_with_dp2_cp2_and_dynamic_cp_equals_one_rank(model_dir: str) -> None:
    one = steps(1, model_dir, {"one": []}, pool=1)[0]["one"]
    check_against_one_rank(one, steps(4, model_dir, FOUR, pool=2), model_type="qwen3")


def test_log_probs_at_tp2_sp_equal_one_rank(model_dir: str) -> None:
    batch = verl_batch(seed=1, prompt_lens=PROMPTS, response_lens=RESPONSES)
    ((ref,),) = run_distributed(
        infer_layouts, world_size=1, args=(model_dir, [["trainer.n_gpus_per_node=1"]], batch)
    )
    layouts = [["trainer.n_gpus_per_node=2", *TWO["tp2_sp"]]]
    for (got,) in run_distributed(infer_layouts, world_size=2, args=(model_dir, layouts, batch)):
        for key in ("log_probs", "entropy"):
            err = float((got[key] - ref[key]).abs().max() / ref[key].abs().max())
            print(f"TP 2 + SP {key}: relative error {err:.2e}")
            assert err < 1e-5, (key, err)
