"""CPU, gloo: data-parallel forward/backward on 2 processes equals a single-process run (fp32).

The global batch, the loss normalisation (global token count) and the gradient all-reduce must give
every rank exactly the gradient of the single-process run on the whole batch; tolerance 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

from engine_workers import engine_step, max_rel_err
from verl_mcore_utils.testing import run_distributed

TOL = 1e-5
COMMON = ["data.train_batch_size=8", "trainer.device=cpu"]


@pytest.fixture(scope="module")
def single_process() -> dict:
    (ref,) = run_distributed(
        engine_step, world_size=1, args=("cpu", [*COMMON, "data.micro_batch_size_per_gpu=4"])
    )
    return ref


@pytest.mark.parametrize("micro_batch", [1, 4])
def test_two_gloo_ranks_match_single_process(single_process: dict, micro_batch: int) -> None:
    results = run_distributed(
        engine_step, world_size=2, args=("cpu", [*COMMON, f"data.micro_batch_size_per_gpu={micro_batch}"])
    )
    ref = single_process
    for rank, out in enumerate(results):
        assert out["dp"] == 2
        assert out["tokens"] == ref["tokens"]
        assert abs(out["loss"] - ref["loss"]) <= TOL * abs(ref["loss"]), (rank, out["loss"], ref["loss"])
        assert out["grads"].keys() == ref["grads"].keys()
        for name, g in out["grads"].items():
            assert max_rel_err(g, ref["grads"][name]) <= TOL, (rank, name)
        assert abs(out["grad_norm"] - ref["grad_norm"]) <= TOL * ref["grad_norm"]
    assert ref["engine"]["backend"].startswith("debug")


def test_gradients_are_not_trivially_equal(single_process: dict) -> None:
    """Guard against a vacuous parity: gradients of the full batch differ from those of half of it."""
    (half,) = run_distributed(
        engine_step,
        world_size=1,
        args=("cpu", ["data.train_batch_size=4", "trainer.device=cpu", "data.micro_batch_size_per_gpu=4"]),
    )
    name = next(iter(single_process["grads"]))
    assert not torch.allclose(half["grads"][name], single_process["grads"][name], rtol=1e-3)


@pytest.mark.parametrize("world", [1, 2])
def test_the_fused_lm_head_matches_megatrons_cross_entropy(single_process: dict, world: int) -> None:
    """model.use_fused_kernels: the same loss and gradients (LM head included) as megatron-core's output
    layer + cross-entropy, on one process and on two DP ranks."""
    results = run_distributed(
        engine_step,
        world_size=world,
        args=("cpu", [*COMMON, "data.micro_batch_size_per_gpu=2", "model.use_fused_kernels=true"]),
    )
    ref = single_process
    for out in results:
        assert abs(out["loss"] - ref["loss"]) <= TOL * abs(ref["loss"]), (out["loss"], ref["loss"])
        assert out["grads"].keys() == ref["grads"].keys() and "output_layer.weight" in ref["grads"]
        for name, g in out["grads"].items():
            assert max_rel_err(g, ref["grads"][name]) <= TOL, name
