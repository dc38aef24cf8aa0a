"""Process groups: ParallelDims' checks, init_parallel's layout errors, and the CUDA RNG tracker seeding.

The tracker test runs on one GPU (it holds CUDA generator states); the sequence-parallel engine test on two
(``tests/test_gpu_moe_tp.py``) fails without the seeding with "cuda rng state model-parallel-rng is not added".
"""

from __future__ import annotations

import pytest
import torch

from verl_mcore_utils.parallel import ParallelDims, init_parallel, seed_cuda_rng_tracker
from verl_mcore_utils.testing import run_distributed


def test_dims_derive_data_parallel_size() -> None:
    assert ParallelDims(world_size=8, tp=2, pp=2).dp == 2
    assert ParallelDims(world_size=8, tp=2, cp=2).dp == 2


@pytest.mark.parametrize(
    ("dims", "named"),
    [({"world_size": 6, "tp": 4}, "tensor_model_parallel_size"), ({"world_size": 4, "pp": 3}, "pipeline")],
)
def test_dims_that_do_not_divide_the_world_name_the_key(dims: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ParallelDims(**dims)


def _init(rank: int, world_size: int, kwargs: dict[str, object]) -> None:
    init_parallel(device="cpu", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expert_model_parallel_size": 3}, r"expert_model_parallel_size=3 .* must divide the 2 ranks"),
        ({"virtual_pipeline_model_parallel_size": 2}, r"needs pipeline_model_parallel_size > 1"),
    ],
)
def test_layout_errors_name_the_key_before_any_group_exists(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(Exception, match=message):
        run_distributed(_init, world_size=2, args=(kwargs,), timeout_s=120)


def test_a_cpu_device_leaves_the_tracker_alone() -> None:
    from megatron.core import tensor_parallel

    assert not seed_cuda_rng_tracker(seed=0, device="cpu")
    assert not tensor_parallel.get_cuda_rng_tracker().is_initialized()


def _seed_on_gpu(rank: int, world_size: int) -> dict[str, object]:
    from megatron.core import tensor_parallel

    init_parallel(device="cuda")
    torch.cuda.manual_seed(99)
    default = torch.cuda.get_rng_state()
    first = seed_cuda_rng_tracker(seed=5, device="cuda")
    states = {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    second = seed_cuda_rng_tracker(seed=6, device="cuda")  # the first seeding (a trainer's) is kept
    kept = all(
        torch.equal(v, states[k]) for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()
    )
    with tensor_parallel.get_cuda_rng_tracker().fork():  # what SP's embedding dropout does in every forward
        torch.rand(4, device="cuda")
    return {
        "first": first,
        "second": second,
        "names": sorted(states),
        "kept": kept,
        "default_untouched": torch.equal(torch.cuda.get_rng_state(), default),
    }


@pytest.mark.gpu
def test_the_tracker_is_seeded_once_and_the_default_generator_left_alone() -> None:
    (out,) = run_distributed(_seed_on_gpu, world_size=1, backend="nccl", timeout_s=120)
    assert out["first"] and not out["second"]
    assert "model-parallel-rng" in out["names"] and "expert-parallel-rng" in out["names"]
    assert out["kept"] and out["default_untouched"]
