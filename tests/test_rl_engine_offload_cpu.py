"""RL engine offload / onload on CPU (the debug backend: parameters, ``.grad`` and torch AdamW state).

verl-mcore-utils' offload runs the same code path on a CPU-only machine (host buffers instead of pinned
memory). After a PPO step with gradients present: offload everything, onload everything, and every
parameter, gradient and optimizer-state tensor is bitwise what it was; the next step after the round trip
equals the next step without it. Offloading twice is an error. On GPUs (DDP, distributed optimizer) the same
round trip plus memory and bandwidth are measured by ``benchmarks/rl_offload_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from rl_engine_workers import offload_round_trip, verl_batch

from verl_mcore_utils.testing import run_distributed

PROMPTS, RESPONSES = [3, 6, 1, 5, 2, 4, 2, 3], [7, 2, 5, 4, 6, 3, 5, 2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_mcore_utils.hf_testing import save_tiny_hf_model

    return str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2_offload") / "model", seed=19))


def test_offload_round_trip_is_bitwise(model_dir: str) -> None:
    batch = verl_batch(seed=40, prompt_lens=PROMPTS, response_lens=RESPONSES)
    overrides = [
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "critic.ppo_micro_batch_size_per_gpu=2",
    ]
    results = run_distributed(offload_round_trip, world_size=2, args=(model_dir, overrides, batch))
    plain = run_distributed(offload_round_trip, world_size=2, args=(model_dir, overrides, batch, False))
    for got, ref in zip(results, plain, strict=True):
        assert "already offloaded" in got["twice"]
        assert got["loss_after"] == ref["loss_after"]
        assert all(torch.equal(got["params_after"][k], v) for k, v in ref["params_after"].items())
        assert any(k.startswith("grad/") for k in got["keys"]) and any(
            k.startswith("optim/") for k in got["keys"]
        )
        assert got["mismatched"] == []
        moved = got["moved"]
        assert (
            set(moved["model"]["bytes_by_kind"]) == {"params", "grads"}
            and moved["optimizer"]["total_bytes"] > 0
        )
        assert got["back"]["model"]["total_bytes"] == moved["model"]["total_bytes"]
    assert results[0]["loss_after"] == results[1]["loss_after"]
