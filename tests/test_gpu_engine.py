"""GPU: the megatron backend (megatron-core DDP + optimizer) against the CPU reference.

Run on a GPU host with ``python -m pytest -m gpu tests``; skipped where CUDA is missing.
Parity runs in fp32 (TF32 off, torch's default for matmul): CPU and GPU differ only by reduction
order, so 1e-4 of the largest entry is a safe bound while any scaling bug (1/dp, 1/num_microbatches)
is off by >= 50%.
"""

from __future__ import annotations

import pytest

from engine_workers import engine_step, max_rel_err
from train_workers import run_train
from verl_mcore_utils.testing import run_distributed

TOL = 1e-4
BATCH = ["data.train_batch_size=8", "data.micro_batch_size_per_gpu=2"]
GPU_FP32 = [*BATCH, "trainer.device=cuda", "megatron.dtype=float32"]


@pytest.fixture(scope="module")
def cpu_reference() -> dict:
    (ref,) = run_distributed(engine_step, world_size=1, args=("cpu", [*BATCH, "trainer.device=cpu"]))
    return ref


def _check_against(out: dict, ref: dict, *, full_grads: bool) -> None:
    assert abs(out["loss"] - ref["loss"]) <= TOL * ref["loss"], (out["loss"], ref["loss"])
    assert out["tokens"] == ref["tokens"]
    assert abs(out["grad_norm"] - ref["grad_norm"]) <= TOL * ref["grad_norm"], (
        out["grad_norm"],
        ref["grad_norm"],
    )
    if full_grads:
        assert out["grads"].keys() == ref["grads"].keys()
        for name, g in out["grads"].items():
            assert max_rel_err(g, ref["grads"][name]) <= TOL, name


@pytest.mark.gpu
@pytest.mark.parametrize("dist_opt", [True, False])
def test_single_gpu_megatron_backend_matches_cpu(cpu_reference: dict, dist_opt: bool) -> None:
    (out,) = run_distributed(
        engine_step,
        world_size=1,
        backend="nccl",
        args=("cuda", [*GPU_FP32, f"megatron.use_distributed_optimizer={dist_opt}"]),
    )
    assert out["engine"]["model_wrapper"] == "DistributedDataParallel"
    assert out["engine"]["ddp_config"]["use_distributed_optimizer"] is dist_opt
    _check_against(out, cpu_reference, full_grads=True)  # DP=1: every main_grad is complete


@pytest.mark.num_gpus(2)
@pytest.mark.parametrize("dist_opt", [True, False])
def test_two_gpu_data_parallel_matches_cpu(cpu_reference: dict, dist_opt: bool) -> None:
    results = run_distributed(
        engine_step,
        world_size=2,
        backend="nccl",
        args=("cuda", [*GPU_FP32, f"megatron.use_distributed_optimizer={dist_opt}"]),
    )
    for out in results:
        assert out["dp"] == 2
        assert out["engine"]["ddp_config"]["use_distributed_optimizer"] is dist_opt
        assert ("DistributedOptimizer" in out["engine"]["optimizer"]) is dist_opt
        # With the distributed optimizer gradients are reduce-scattered: each rank holds only its
        # shard fully reduced, so only the loss and the (all-reduced) grad norm are comparable.
        _check_against(out, cpu_reference, full_grads=not dist_opt)


@pytest.mark.gpu
@pytest.mark.slow
def test_bf16_training_on_gpu_reduces_loss(tmp_path) -> None:
    overrides = [
        "model.preset=small",
        "trainer.total_training_steps=40",
        "trainer.device=cuda",
        "trainer.progress_bar=false",
        f"trainer.default_local_dir={tmp_path}",
    ]
    (out,) = run_distributed(run_train, world_size=1, backend="nccl", args=(overrides,))
    assert out["backend"].startswith("megatron")
    assert out["last_loss"] < 0.6 * out["first_loss"], out
