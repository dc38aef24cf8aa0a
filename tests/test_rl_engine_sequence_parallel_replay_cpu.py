"""Router replay (R2) at TP 2 with sequence parallelism: each TP rank's routers see their own shard of the tokens.

:mod:`verl_engine.sp_routes` cuts the replay targets to the TP rank's rows and gathers the recorded routes over
TP. Tiny Qwen3-MoE (sequential experts, ETP = TP = 2), fp32, CPU, gloo. Replaying the routes just recorded gives
the gradients of the native step (1e-6); after the routers are perturbed, the recorded and native routes are one
rank's exactly, the recorded / native / replayed log-probs and the replayed step's loss and gradients (TP shards
joined) equal one rank's (1e-5): the replayed experts are the forced ones on every shard.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import verl_batch
from sp_workers import tp_joined
from test_rl_engine_moe_cpu import _worst
from test_rl_engine_moe_ep_cpu import _per_expert

from verl_mcore_utils.testing import run_distributed

A = "actor_rollout_ref.actor"
AM = f"{A}.megatron"
PROMPTS, RESPONSES = [3, 6, 1, 5], [7, 2, 5, 4]
SCALE = 0.3
TP2_SP = [
    f"{AM}.tensor_model_parallel_size=2",
    f"{AM}.sequence_parallel=true",
    f"+{AM}.override_transformer_config.moe_grouped_gemm=false",
]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from verl_engine.moe import padding_mask_supported
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    coef = 0.1 if padding_mask_supported() else 0.0  # < 0.16: the aux loss with padding is refused
    path = tmp_path_factory.mktemp("qwen3_moe_replay_tp") / "model"
    return str(save_tiny_hf_model("qwen3_moe", path, seed=3, router_aux_loss_coef=coef))


def _run(world: int, model_dir: str, overrides: list[str], scale: float) -> list[dict]:
    from router_replay_workers import replay_run

    batch = verl_batch(seed=6, prompt_lens=PROMPTS, response_lens=RESPONSES)
    args = [[f"trainer.n_gpus_per_node={world}", f"{A}.ppo_micro_batch_size_per_gpu=4", *overrides]]
    return [r[0] for r in run_distributed(replay_run, world_size=world, args=(model_dir, args, batch, scale))]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _joined_grads(per_rank: list[dict], call: str) -> dict[str, torch.Tensor]:
    return _per_expert(tp_joined([r[call] for r in per_rank], "grads", model_type="qwen3_moe"))


def test_replaying_the_routes_just_recorded_at_tp2_sp_changes_nothing(moe_dir: str) -> None:
    per_rank = _run(2, moe_dir, TP2_SP, 0.0)
    native, replay = _joined_grads(per_rank, "native_train"), _joined_grads(per_rank, "replay_train")
    for r in per_rank:
        assert abs(r["replay_train"]["loss"] - r["native_train"]["loss"]) <= 1e-6 * abs(
            r["native_train"]["loss"]
        )
    worst = max(_rel(replay[n], native[n]) for n in native)
    print(f"TP 2 + SP replay of the just-recorded routes: worst gradient relative error {worst:.2e}")
    assert worst <= 1e-6


def test_forced_routes_at_tp2_sp_equal_one_rank(moe_dir: str) -> None:
    (one,) = _run(1, moe_dir, [], SCALE)
    changed = (one["native"]["routed_experts"] != one["recorded"]["routed_experts"]).any()
    assert changed, "the perturbation changed no route: the test would prove nothing"
    per_rank = _run(2, moe_dir, TP2_SP, SCALE)
    for rank, got in enumerate(per_rank):
        for call in ("recorded", "native"):
            assert torch.equal(got[call]["routed_experts"], one[call]["routed_experts"]), (rank, call)
        for call in ("recorded", "native", "replayed"):
            assert _rel(got[call]["log_probs"], one[call]["log_probs"]) < 1e-5, (rank, call)
        assert abs(got["replay_train"]["loss"] - one["replay_train"]["loss"]) <= 1e-5 * abs(
            one["replay_train"]["loss"]
        )
    worst = _worst(_joined_grads(per_rank, "replay_train"), _per_expert(one["replay_train"]["grads"]))
    print(f"TP 2 + SP forced routes: worst gradient relative error vs one rank {worst:.2e}")
    assert worst < 1e-5
