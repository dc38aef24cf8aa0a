"""forward_backward_batch reads nothing on the host between its first and its last micro-batch.

Why: a host read waits for the GPU to finish the work queued so far, so the host cannot queue the next
micro-batch's forward meanwhile and the GPU runs dry. Losses and metrics therefore stay on the device
(:mod:`verl_engine.metrics`) and the engine reads them once per step, after the last micro-batch.
"""

from __future__ import annotations

import math

import pytest
from no_sync_workers import ppo_step_watched

from verl_mcore_utils.hf_testing import save_tiny_hf_model
from verl_mcore_utils.testing import run_distributed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("nosync") / "model", seed=1))


def _check(out: dict) -> None:
    assert out["calls"] == out["expected"] >= 2  # every micro-batch's loss ran inside the watch
    assert out["found"] == [], "host reads between the first and the last micro-batch:\n" + "\n".join(
        out["found"]
    )
    for name in ("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "actor/ppo_kl", "grad_norm"):
        assert math.isfinite(out["metrics"][name]), name


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_ppo_step_reads_nothing_on_the_host_between_micro_batches(model_dir: str, world: int) -> None:
    for out in run_distributed(ppo_step_watched, world_size=world, args=(model_dir, "cpu", [])):
        _check(out)


def test_cpu_bypass_mode_step_reads_nothing_on_the_host_between_micro_batches(model_dir: str) -> None:
    """The rollout correction (weights, chained rejection, its metrics) stays on the device too."""
    bypass = [
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0",
        "algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k3'",
        "algorithm.rollout_correction.rollout_rs_threshold=2.0",
    ]
    for out in run_distributed(ppo_step_watched, world_size=1, args=(model_dir, "cpu", bypass)):
        _check(out)
        assert math.isfinite(out["metrics"]["rollout_corr/rollout_rs_masked_fraction"])


@pytest.mark.num_gpus(1)
def test_gpu_ppo_step_has_no_host_sync_between_micro_batches(model_dir: str) -> None:
    """torch.cuda.set_sync_debug_mode("error") raises at any synchronising call inside the window."""
    (out,) = run_distributed(ppo_step_watched, world_size=1, backend="nccl", args=(model_dir, "cuda", []))
    _check(out)
