"""GPU, 2 ranks: every construction path honours use_distributed_optimizer, seen in the collective used.

verl's bug (PR #5775): one path dropped the setting, so gradients were reduce-scattered into
distributed-optimizer shards although the user asked for all-reduce. For each path and both values
(and for an explicit override_ddp_config value, which must win), this checks the DDP wrapper's
config AND which NCCL collective the gradient sync actually launches (profiler): reduce-scatter
with the distributed optimizer, all-reduce without.
"""

from __future__ import annotations

import pytest

from construction_workers import MBRIDGE, build_and_reduce
from verl_mcore_utils.testing import run_distributed

PATHS = ["provider", "plain", MBRIDGE]
_CKPT: dict[str, str] = {}


def _checkpoint(factory: pytest.TempPathFactory) -> str:
    if "qwen2" not in _CKPT:
        from verl_mcore_utils.hf_testing import save_tiny_hf_model

        _CKPT["qwen2"] = str(save_tiny_hf_model("qwen2", factory.mktemp("ckpt") / "qwen2"))
    return _CKPT["qwen2"]


@pytest.mark.num_gpus(2)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("use_dist_opt", [True, False])
@pytest.mark.parametrize("flip_with_override", [False, True])
def test_gradient_reduction_matches_the_setting(
    path: str, use_dist_opt: bool, flip_with_override: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    override = {"use_distributed_optimizer": not use_dist_opt} if flip_with_override else None
    expected = (not use_dist_opt) if flip_with_override else use_dist_opt
    results = run_distributed(
        build_and_reduce,
        world_size=2,
        backend="nccl",
        args=(path, use_dist_opt, override, _checkpoint(tmp_path_factory) if path == "mbridge" else None),
        timeout_s=300,
    )
    for out in results:
        assert out["wrapper"] == "DistributedDataParallel"
        assert out["ddp_use_distributed_optimizer"] is expected
        if expected:
            assert "reducescatter" in out["collectives"] and "allreduce" not in out["collectives"], out
        else:
            assert "allreduce" in out["collectives"] and "reducescatter" not in out["collectives"], out
    if path == "mbridge":  # mbridge's own default survives below the wrap config
        assert results[0]["grad_reduce_in_fp32"] is True


@pytest.mark.num_gpus(2)
@pytest.mark.parametrize("overlap", [False, True])
def test_training_hooks_drive_megatrons_schedule(overlap: bool) -> None:
    from construction_workers import train_with_hooks

    results = run_distributed(train_with_hooks, world_size=2, backend="nccl", args=(overlap,), timeout_s=300)
    for out in results:
        assert out["grad_scale_is_optimizer"] and out["finalize_set"] and out["step_ok"], out
        assert (out["no_sync_set"], out["param_sync_set"]) == (overlap, overlap), out
        assert out["grad_norm"] > 0 and out["losses"][-1] < out["losses"][0], out
